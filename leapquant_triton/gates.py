"""The gates of ``leapquant.step_packed`` (docs/SPEC.md §6.2) as a Triton kernel launched right before the step: from
the raw inputs ``a``, ``b``, ``A_log``, ``dt_bias`` to the log decay ``g`` and ``beta``, one program per (row, value
head), grid ``(B, HV)``, written into the caller's workspace. No host synchronisation, no allocation:
graph-capturable. ``leapquant.step_packed`` itself computes the gates inside the step kernel (its prologue, the
same functions): this kernel is the gates apart, ``step_packed(..., fused=False)``, which the tests and
``bench.decode`` hold the fused path against.

The formulas are :mod:`.gate_math`'s (``leapquant.packed``'s, FLA's naive gates, evaluated as torch's kernels
evaluate them: bit for bit on a GPU, within a few ulps through the interpreter).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .gate_math import gate_values
from .launcher import Launcher
from .step_kernel import _store_out
from .targets import interpreting


@triton.jit
def leapquant_gates_kernel(a, b, A_log, dt_bias, g, beta, lower_bound, sa_n, sa_h, sb_n, HV: tl.constexpr,
                           K: tl.constexpr, IS_KDA: tl.constexpr, USE_LOWER_BOUND: tl.constexpr,
                           NATIVE: tl.constexpr):
    """Program (row n, value head hv): ``g[n, hv]`` (KDA ``[K]``) and ``beta[n, hv]``. ``a`` ``[B, HV, K]`` /
    ``[B, HV]`` with strides ``(sa_n, sa_h, 1)``, ``b`` ``[B, HV]`` with ``(sb_n, 1)``; ``g`` fp32 and ``beta``
    dense."""
    i_n, i_hv = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    b_g, b_beta = gate_values(a, b, A_log, dt_bias, lower_bound, i_n, i_hv, sa_n, sa_h, sb_n, K, IS_KDA,
                              USE_LOWER_BOUND, NATIVE)
    if IS_KDA:
        tl.store(g + (i_n * HV + i_hv) * K + tl.arange(0, K), b_g)
    else:
        tl.store(g + i_n * HV + i_hv, b_g)
    _store_out(beta + i_n * HV + i_hv, b_beta, NATIVE)


# one warp per program (at most K = 128 values); fusion off: torch's kernels contract nothing either
OPTIONS = dict(num_warps=1, num_stages=1, enable_fp_fusion=False)
_LAUNCHER = Launcher(leapquant_gates_kernel)


def gates_pool(pool, a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
               lower_bound: float | None, g: torch.Tensor, beta: torch.Tensor) -> None:
    """``g`` and ``beta`` (dense, ``[B, HV(, K)]``) from the raw inputs of ``pool``'s gate (``leapquant.packed``'s
    formulas), on the current stream; ``a`` ``[B, HV, K]`` (KDA) or ``[B, HV]`` with a unit last stride, ``b``
    ``[B, HV]`` likewise, ``A_log`` ``[HV]`` and ``dt_bias`` flat and dense."""
    B = a.shape[0]
    if B == 0:
        return
    args = dict(a=a, b=b, A_log=A_log, dt_bias=dt_bias, g=g, beta=beta,
                lower_bound=0.0 if lower_bound is None else float(lower_bound), sa_n=a.stride(0),
                sa_h=a.stride(1) if a.dim() == 3 else 1, sb_n=b.stride(0), HV=pool.heads, K=pool.head_k,
                IS_KDA=pool.gate == "kda", USE_LOWER_BOUND=lower_bound is not None,
                NATIVE=pool.device.type == "cuda" and not interpreting())
    _LAUNCHER((B, pool.heads), args, OPTIONS)
