"""The per-row formulas of every loss, one module per family, shared by both backends: the outputs formed from the
global per-token statistics and the per-row coefficients of the gradient. ``softmax``: cross-entropy, log-probs
and the loss of log-probs; ``distill``: the distillation's divergences, their statistics and exchange."""
