"""Adapters that put ``vpce.linear_cross_entropy`` into third-party model code.

Each adapter is its own submodule and imports its library only when it is imported itself, e.g.
``import vpce.integrations.transformers``. Nothing here imports an optional dependency.
"""
