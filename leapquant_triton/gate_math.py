"""The gate formulas of ``leapquant.step_packed`` (docs/SPEC.md §6.2) as ``@triton.jit`` functions, shared by the
gate kernel (:mod:`.gates`) and the step kernels, which compute the gates in their prologue
(:mod:`.step_kernel`).

They are ``leapquant.packed``'s formulas (FLA's naive gates), evaluated in the order torch's kernels evaluate them,
so that on a GPU the gates are torch's bit for bit: ``softplus(x) = x`` above 20, else ``log1p(exp(x))`` (torch's
CUDA ``softplus``), ``sigmoid(x) = 1 / (1 + exp(-x))`` (its CUDA ``sigmoid``), with libdevice's ``expf`` and
``log1pf`` (what those kernels call) and a correctly rounded division. Every product and sum of the formulas is an
explicitly rounded one (``mul.rn.f32``, ``add.rn.f32`` in inline PTX) on a GPU: the step kernels are compiled
with FMA contraction on, and a gate's product contracted into the step's ``pcum + g`` would move the last bit;
libdevice's ``mul_rn`` / ``add_rn`` would not do, as Triton links them with denormals flushed to zero. The interpreter has no
libdevice: there ``exp`` and ``log1p`` are computed in fp64 and rounded (correctly rounded fp32, where torch's CPU
kernels, Sleef's, are within an ulp of it).

Block values: ``b_x`` the gate's input ``a + dt_bias`` ([K] for KDA, a scalar for GDN), ``b_A`` ``exp(A_log)``,
``b_g`` the log decay, ``b_b`` beta's logit.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice

from leapquant import constants

SOFTPLUS_THRESHOLD = tl.constexpr(constants.SOFTPLUS_THRESHOLD)
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
    return tl.math.div_rn(1.0, _add(1.0, _exp(-b_x, NATIVE), NATIVE))


@triton.jit
def _mul(b_x, b_y, NATIVE: tl.constexpr):
    """``x * y`` rounded on its own: ``mul.rn.f32``, which ptxas never contracts into an FMA with what follows, and
    which keeps subnormals (libdevice's ``fmul_rn`` is built flushing them, unlike torch)."""
    if NATIVE:
        return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=r,r,r", [b_x, b_y], dtype=tl.float32,
                                         is_pure=True, pack=1)
    else:
        return b_x * b_y


@triton.jit
def _add(b_x, b_y, NATIVE: tl.constexpr):
    """``x + y`` rounded on its own (``add.rn.f32``: never contracted with the product before it; subnormals
    kept)."""
    if NATIVE:
        return tl.inline_asm_elementwise("add.rn.f32 $0, $1, $2;", "=r,r,r", [b_x, b_y], dtype=tl.float32,
                                         is_pure=True, pack=1)
    else:
        return b_x + b_y


@triton.jit
def gate_values(a, b, A_log, dt_bias, lower_bound, i_n, i_hv, sa_n, sa_h, sb_n, K: tl.constexpr,
                IS_KDA: tl.constexpr, USE_LOWER_BOUND: tl.constexpr, NATIVE: tl.constexpr):
    """Row ``i_n``'s (int64) log decay of value head ``i_hv`` (KDA ``[K]``, GDN a scalar) and its fp32 beta, from
    ``a`` ``[B, HV, K]`` / ``[B, HV]`` with strides ``(sa_n, sa_h, 1)``, ``b`` ``[B, HV]`` with ``(sb_n, 1)``,
    ``A_log`` ``[HV]`` and ``dt_bias`` ``[HV K]`` / ``[HV]`` (SPEC §6.2)."""
    b_A = _exp(tl.load(A_log + i_hv).to(tl.float32), NATIVE)
    if IS_KDA:
        o_k = tl.arange(0, K)
        b_x = _add(tl.load(a + i_n * sa_n + i_hv * sa_h + o_k).to(tl.float32),
                   tl.load(dt_bias + i_hv * K + o_k).to(tl.float32), NATIVE)
    else:
        b_x = _add(tl.load(a + i_n * sa_n + i_hv * sa_h).to(tl.float32), tl.load(dt_bias + i_hv).to(tl.float32),
                   NATIVE)
    if USE_LOWER_BOUND:
        b_g = _mul(lower_bound, _sigmoid(_mul(b_A, b_x, NATIVE), NATIVE), NATIVE)
    else:
        b_g = _mul(-b_A, _softplus(b_x, NATIVE), NATIVE)
    return b_g, _sigmoid(tl.load(b + i_n * sb_n + i_hv).to(tl.float32), NATIVE)
