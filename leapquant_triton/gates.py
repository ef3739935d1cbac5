"""The gates of ``leapquant.step_packed`` (docs/SPEC.md §6.2) as a Triton kernel launched right before the step: from
the raw inputs ``a``, ``b``, ``A_log``, ``dt_bias`` to the log decay ``g`` and ``beta``, one program per (row, value
head), grid ``(B, HV)``, written into the caller's workspace. No host synchronisation, no allocation:
graph-capturable. Fusing it into the step kernel's prologue is the next step (its launch and the workspace's round
trip would go).

The formulas are ``leapquant.packed``'s (FLA's naive gates), evaluated in the order torch's kernels evaluate them, so
that on a GPU the gates are torch's bit for bit: ``softplus(x) = x`` above 20, else ``log1p(exp(x))`` (torch's CUDA
``softplus``), ``sigmoid(x) = 1 / (1 + exp(-x))`` (its CUDA ``sigmoid``), with libdevice's ``expf`` and ``log1pf``
(what those kernels call) and a correctly rounded division; no FMA contraction. FLA's and vLLM's own Triton gates
take ``log(1 + exp(x))`` with the fast ``ex2``/``lg2``: within ~1e-7 of these absolutely, not bitwise. The
interpreter has no libdevice: there ``exp`` and ``log1p`` are computed in fp64 and rounded (correctly rounded fp32,
where torch's CPU kernels, Sleef's, are within an ulp of it), so on the CPU the gates differ from torch's by an ulp
or two.

Block values: ``b_x`` the gate's input ``a + dt_bias`` ([K] for KDA, a scalar for GDN), ``b_A`` ``exp(A_log)``,
``b_g`` the log decay, ``b_b`` beta's logit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from .launcher import Launcher
from .step_kernel import _store_out
from .targets import interpreting

SOFTPLUS_THRESHOLD = tl.constexpr(20.0)
# the fp64 values that round to an infinite fp32 (2^128 - 2^103, the midpoint above FLT_MAX: ties go to even, 2^128)
F32_OVERFLOW = tl.constexpr(3.4028235677973366e38)
# fp64 exp's argument clamped here in the interpreter (exp(100) ~ 2.7e43 is finite in fp64, infinite in fp32)
EXP_ARG_MAX = tl.constexpr(100.0)
F32_INF = tl.constexpr(float("inf"))


@triton.jit
def _exp(b_x, NATIVE: tl.constexpr):
    """fp32 ``exp``: libdevice's ``expf`` (torch's CUDA ``exp``); in the interpreter fp64's, rounded."""
    if NATIVE:
        return libdevice.exp(b_x)
    else:
        b_y = tl.exp(tl.where(b_x > EXP_ARG_MAX, EXP_ARG_MAX, b_x).to(tl.float64))
        return tl.where(b_y >= F32_OVERFLOW, F32_INF, b_y).to(tl.float32)


@triton.jit
def _log1p(b_y, NATIVE: tl.constexpr):
    """fp32 ``log1p`` of ``b_y >= 0``: libdevice's ``log1pf``; in the interpreter fp64's ``log(u) y / (u - 1)`` with
    ``u = 1 + y`` (exact where u rounds), rounded."""
    if NATIVE:
        return libdevice.log1p(b_y)
    else:
        b_y = b_y.to(tl.float64)
        b_u = 1.0 + b_y
        b_one = b_u == 1.0
        b_r = tl.log(b_u) * (b_y / tl.where(b_one, 1.0, b_u - 1.0))
        return tl.where(b_one, b_y, b_r).to(tl.float32)


@triton.jit
def _softplus(b_x, NATIVE: tl.constexpr):
    """``F.softplus(x)`` (beta 1, threshold 20): ``x`` above 20, else ``log1p(exp(x))``; exp's argument clamped to 20
    where it is not used (no overflow), a NaN kept."""
    b_big = b_x > SOFTPLUS_THRESHOLD
    return tl.where(b_big, b_x, _log1p(_exp(tl.where(b_big, SOFTPLUS_THRESHOLD, b_x), NATIVE), NATIVE))


@triton.jit
def _sigmoid(b_x, NATIVE: tl.constexpr):
    """``torch.sigmoid``: ``1 / (1 + exp(-x))``, the division correctly rounded."""
    return tl.math.div_rn(1.0, 1.0 + _exp(-b_x, NATIVE))


@triton.jit
def leapquant_gates_kernel(a, b, A_log, dt_bias, g, beta, lower_bound, sa_n, sa_h, sb_n, HV: tl.constexpr,
                           K: tl.constexpr, IS_KDA: tl.constexpr, USE_LOWER_BOUND: tl.constexpr,
                           NATIVE: tl.constexpr):
    """Program (row n, value head hv): ``g[n, hv]`` (KDA ``[K]``) and ``beta[n, hv]``. ``a`` ``[B, HV, K]`` /
    ``[B, HV]`` with strides ``(sa_n, sa_h, 1)``, ``b`` ``[B, HV]`` with ``(sb_n, 1)``; ``g`` fp32 and ``beta``
    dense."""
    i_n, i_hv = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    b_A = _exp(tl.load(A_log + i_hv).to(tl.float32), NATIVE)
    if IS_KDA:
        o_k = tl.arange(0, K)
        b_x = tl.load(a + i_n * sa_n + i_hv * sa_h + o_k).to(tl.float32) \
            + tl.load(dt_bias + i_hv * K + o_k).to(tl.float32)
    else:
        b_x = tl.load(a + i_n * sa_n + i_hv).to(tl.float32) + tl.load(dt_bias + i_hv).to(tl.float32)
    if USE_LOWER_BOUND:
        b_g = lower_bound * _sigmoid(b_A * b_x, NATIVE)
    else:
        b_g = -b_A * _softplus(b_x, NATIVE)
    if IS_KDA:
        tl.store(g + (i_n * HV + i_hv) * K + o_k, b_g)
    else:
        tl.store(g + i_n * HV + i_hv, b_g)
    b_b = tl.load(b + i_n * sb_n + i_hv).to(tl.float32)
    _store_out(beta + i_n * HV + i_hv, _sigmoid(b_b, NATIVE), NATIVE)


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
