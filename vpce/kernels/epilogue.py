"""The CuTe statistics epilogue of the fast route's logits GEMM (quack's epilogue DSL, sm_90): the GEMM that writes
the logits ``P`` also reduces, per row, the online log-sum-exp of what ``P`` holds and picks the target's fp32
logit, so the statistics need no second read of ``P``. Its launcher, with the pinned tile and the operands, is
``vpce.backends.gemm.logits_with_stats``; ``kernels.target_out_of_lse`` then turns these into the statistics pass's.

Built on first use and cached per variant (plain or soft-capped, with or without the label-smoothing sum); quack
and cutlass are imported only then, so this module loads without the ``hopper`` extra.
"""

from __future__ import annotations

import functools

__all__ = ["stats_epilogue"]


@functools.cache
def stats_epilogue(capped: bool = False, sum_z: bool = False):
    """The epilogue (quack's epilogue DSL), per element of the fp32 accumulator ``acc``: ``D`` the logits; ``lse``
    the per-row online log-sum-exp of the logits as ``D`` holds them (bf16-rounded, so that ``exp(z - lse)`` over
    ``P`` sums to 1), every column's; ``target_logit`` the raw fp32 accumulator at the target column
    (``kernels.target_out_of_lse`` then takes the target's rounded logit out of the LSE and puts its exact one in,
    as the statistics pass leaves the target column out and ``kernels.target_logits`` adds it). Nothing per element
    but the rounding (and the cap): the target column is picked by quack's select, not by a compare per element.
    ``capped``: the LSE of the soft-capped and scaled logit ``(r 2c - c) t``, ``r = 1 / (1 + 2^(kz))``, ``k = -2
    log2(e) / c``, with the hardware's approximate ``exp2`` and reciprocal, as ``kernels.common._softcap_value``
    takes it in the statistics pass. ``sum_z`` (label smoothing): also ``sumz``, the per-row sum of those logits
    times the class weights ``cw`` (ones without them), the target's included, as the statistics pass sums them."""
    import cutlass.cute as cute
    from cutlass import BFloat16, Float32
    from quack.epilogue.frontend import gemm_epilogue
    from quack.epilogue.math import pexp2
    from quack.epilogue.ops import ColVecLoad, ColVecReduce, ColVecSelect, OnlineLSEReduce, RowVecLoad, Scalar

    target = ColVecLoad("target")
    ops = dict(k=Scalar("k"), cap=Scalar("cap"), scale=Scalar("scale")) if capped else {}
    if sum_z:
        ops["cw"] = RowVecLoad("cw")
    spec = dict(ops=ops, outs={"lse": OnlineLSEReduce("lse"),
                               "target_logit": ColVecSelect("target_logit", idx_op=target)},
                reduces={"sumz": ColVecReduce("sumz")} if sum_z else {}, extra_ops=(target,))

    if not capped and not sum_z:
        @gemm_epilogue(**spec)
        def vpce_stats(acc):
            return {"D": acc, "lse": acc.to(BFloat16).to(Float32), "target_logit": acc}
    elif not capped:
        @gemm_epilogue(**spec)
        def vpce_stats(acc, cw):
            z = acc.to(BFloat16).to(Float32)
            return {"D": acc, "lse": z, "target_logit": acc, "sumz": z * cw}
    elif not sum_z:
        @gemm_epilogue(**spec)
        def vpce_stats(acc, k, cap, scale):
            r = cute.arch.rcp_approx(Float32(1.0) + pexp2(acc.to(BFloat16).to(Float32) * k))
            return {"D": acc, "lse": (r * (cap + cap) - cap) * scale, "target_logit": acc}
    else:
        @gemm_epilogue(**spec)
        def vpce_stats(acc, k, cap, scale, cw):
            r = cute.arch.rcp_approx(Float32(1.0) + pexp2(acc.to(BFloat16).to(Float32) * k))
            z = (r * (cap + cap) - cap) * scale
            return {"D": acc, "lse": z, "target_logit": acc, "sumz": z * cw}
    return vpce_stats
