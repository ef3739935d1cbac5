"""The LeapQuant flush as one Triton kernel (SPEC §3), and its launcher.

One program per (row ``n`` of ``idx``, head ``h``): grid ``(N, HV)``. A program that is not due (SPEC §2) returns
after reading ``idx[n]`` and ``hcnt[idx[n], h]``; a due program keeps the state ``S [V, K]`` in registers from the
rebuild to the quantisation and writes the new checkpoint and the ring resets in place.

Legend of the kernel's block values (``b_`` prefix), shapes in SPEC letters, ``BR`` = rank padded to 16 and ``BL`` =
ring padded to 16 (``tl.dot`` needs every dimension >= 16; padded rows and columns are zero):

    b_s    [V, K]  fp32  the rebuilt state S, then the residual E, then X = E / s_k
    b_sh   [V, K]  fp16  the normalised state Sn = c S (c a power of two, max|Sn| in [0.5, 1)), subspace operand
    b_q    [V, BR] fp32  the subspace basis Q; b_q16 = fp16(Q) is what is stored
    b_ut16 [BR, K] fp16  U^T = (S^T q16)^T saturated at +-65504, the layout of uq's rows

Precision of each product (SPEC §4 asks for <= 1.02 x the fp32 reference's error per program):
    ring       tl.dot tf32x3 (fp32 accumulate): ubuf is bf16, exact in tf32; the decayed keys w_j kbuf[j] d_j are
               split into tf32 big + small parts, 22 bits. (A bf16 hi + lo split gives 16 bits; the interpreter of
               Triton 3.6 also miscomputes bf16 dots, so the CI could not check that path.)
    P, Y       tl.dot fp16 x fp16 -> fp32 on Sn, P rounded to fp16 between the products: the seed's numerics (mean
               ratio 1.0005 to the reference; bf16 here measured 1.04 on states with a few large columns, a fail)
    U          fp32 FMA, one masked column reduction per rank: exact products, fp32 sums, as the reference
    q16 u16^T  tl.dot fp16 x fp16 -> fp32: exact products of the stored factors, R <= 4 terms
    Gram, Cholesky, triangular solve: fp32 in registers, masked sums over [V, BR] and [BR, BR] tiles

Every ``tl.dot`` is compiled to ``mma.sync`` (:func:`mma_sync_only`; Hopper's ``wgmma`` build of this kernel is
wrong on the H200). Resources (``python -m leapquant_triton.portability``): at 128 x 128 with 8 warps the kernel takes
all 255 registers (one program per SM at a time), 40 KiB (KDA) / 64 KiB (GDN) of shared memory, no spills. Where the
time goes (one program's latency, ~60 us on the H200) is in bench/NOTES.md.
"""

from __future__ import annotations

import contextlib
import os
import threading

import torch
import triton
import triton.language as tl

from leapquant import constants

# the SPEC's constants as compile-time values (a @triton.jit function can read only constexpr globals)
QMAX = tl.constexpr(constants.QMAX)
EPS = tl.constexpr(constants.EPS)
FLOOR = tl.constexpr(constants.FLOOR)
TINY = tl.constexpr(constants.TINY)
PNMIN = tl.constexpr(constants.PNMIN)
FP16_MAX = tl.constexpr(constants.FP16_MAX)
# 1.5 * 2^23: adding and subtracting it rounds an fp32 |x| <= 2^22 to an integer, half to even, on the GPU and in
# the interpreter alike (libdevice's rint has no interpreter counterpart)
RINT_MAGIC = tl.constexpr(12582912.0)


@triton.jit
def _column(b_x, i, BR: tl.constexpr):
    """Column ``i`` of ``b_x [M, BR]`` as an ``[M]`` vector (a masked sum: Triton has no register indexing)."""
    o_r = tl.arange(0, BR)
    return tl.sum(tl.where(o_r[None, :] == i, b_x, 0.0), axis=1)


@triton.jit
def _row(b_x, i, BR: tl.constexpr):
    """Row ``i`` of ``b_x [BR, M]`` as an ``[M]`` vector."""
    o_r = tl.arange(0, BR)
    return tl.sum(tl.where(o_r[:, None] == i, b_x, 0.0), axis=0)


@triton.jit
def _cholqr(b_y, R: tl.constexpr, BR: tl.constexpr):
    """One CholeskyQR step on ``b_y [V, BR]`` (columns >= R zero): ``Y L^{-T}`` with ``Y^T Y = L L^T`` and the
    relative pivot floor ``L_ii = sqrt(max(G_ii - sum_{j<i} L_ij^2, FLOOR G_ii, TINY))``, as the reference."""
    o_r = tl.arange(0, BR)
    # Gram matrix G = Y^T Y [BR, BR], one row per column of Y
    b_g = tl.zeros([BR, BR], dtype=tl.float32)
    for i in tl.static_range(R):
        b_gi = tl.sum(b_y * _column(b_y, i, BR)[:, None], axis=0)  # [BR]
        b_g = tl.where(o_r[:, None] == i, b_gi[None, :], b_g)
    # lower Cholesky factor, one column at a time; columns > i of b_l are still zero
    b_l = tl.zeros([BR, BR], dtype=tl.float32)
    for i in tl.static_range(R):
        b_gcol = _column(b_g, i, BR)  # G[:, i]
        b_lrow = _row(b_l, i, BR)  # L[i, :i]
        b_c = b_gcol - tl.sum(b_l * b_lrow[None, :], axis=1)  # G[:, i] - sum_{j<i} L[:, j] L[i, j]
        g_ii = tl.sum(tl.where(o_r == i, b_gcol, 0.0))
        c_ii = tl.sum(tl.where(o_r == i, b_c, 0.0))
        l_ii = tl.sqrt_rn(tl.maximum(tl.maximum(c_ii, FLOOR * g_ii), TINY))
        b_lcol = tl.where(o_r == i, l_ii, tl.where(o_r > i, tl.math.div_rn(b_c, tl.zeros_like(b_c) + l_ii), 0.0))
        b_l = tl.where(o_r[None, :] == i, b_lcol[:, None], b_l)
    # forward substitution Q L^T = Y, column by column; columns >= i of b_q are still zero
    b_q = tl.zeros_like(b_y)
    for i in tl.static_range(R):
        b_lrow = _row(b_l, i, BR)  # L[i, :]
        l_ii = tl.sum(tl.where(o_r == i, b_lrow, 0.0))
        b_qi = _column(b_y, i, BR) - tl.sum(b_q * b_lrow[None, :], axis=1)  # [V]
        b_qi = tl.math.div_rn(b_qi, tl.zeros_like(b_qi) + l_ii)
        b_q = tl.where(o_r[None, :] == i, b_qi[:, None], b_q)
    return b_q


@triton.jit
def leapquant_flush_kernel(
    idx,  # int32 [N]
    hcnt,  # int32 [NS, HV]
    codes,  # int8 view of the pool: region (n, h) at byte n * 4 SS + h * 4 V K
    skv,  # fp32 view: s_k [K] | s_v [V] at word n * SS + h * V K
    uq,  # fp16 view: uq [R, K + V] at half n * 2 SS + h * 2 V K
    kbuf,  # bf16 [NS, HV, L, K]
    ubuf,  # bf16 [NS, HV, L, V]
    w,  # fp32 [NS, HV, L]
    pcum,  # fp32 [NS, HV, K] (KDA) or [NS, HV, 1] (GDN)
    gbuf,  # fp16 [NS, HV, L, K] (KDA); any pointer for GDN, never read
    q0,  # fp32 [V, R]
    NS,
    HV,
    SS,  # slot stride of the pool in fp32 words, (HV + 1) V K
    FIRST: tl.constexpr,  # smallest real slot: 1 (vLLM) or 0 (SGLang)
    K: tl.constexpr,
    V: tl.constexpr,
    L: tl.constexpr,
    R: tl.constexpr,
    BL: tl.constexpr,
    BR: tl.constexpr,
    ITERS: tl.constexpr,
    IS_KDA: tl.constexpr,
):
    i_n, i_h = tl.program_id(0), tl.program_id(1)
    i_s = tl.load(idx + i_n).to(tl.int64)
    if (i_s < FIRST) | (i_s >= NS):
        return
    # (slot, head) row of the dense buffers; int64: NS * HV * L * K passes 2^31 at a few thousand slots
    i_sh = i_s * HV + i_h
    if tl.load(hcnt + i_sh) != L:
        return

    o_k = tl.arange(0, K)
    o_v = tl.arange(0, V)
    o_l = tl.arange(0, BL)
    o_r = tl.arange(0, BR)
    m_l = o_l < L
    m_r = o_r < R
    # region of (slot, head) in words; the pool passes 2^31 bytes at ~1000 slots of 32 heads
    o_reg = i_s * SS + i_h * (V * K)

    # --- 1-4. rebuild S = (Dq + Lo) * scale + Ring -------------------------------------------------------------
    p_c = codes + o_reg * 4 + o_v[:, None] * K + o_k[None, :]
    b_sk = tl.load(skv + o_reg + o_k)  # [K]
    b_sv = tl.load(skv + o_reg + K + o_v)  # [V]
    b_s = tl.load(p_c).to(tl.float32) * tl.math.div_rn(b_sv, tl.zeros_like(b_sv) + QMAX)[:, None] * b_sk[None, :]
    # old rank-R part from the fp16 factors: products are exact in fp32
    b_lo = tl.zeros([V, K], dtype=tl.float32)
    for r in tl.static_range(R):
        b_qr = tl.load(uq + o_reg * 2 + r * (K + V) + K + o_v).to(tl.float32)  # [V]
        b_ur = tl.load(uq + o_reg * 2 + r * (K + V) + o_k).to(tl.float32)  # [K]
        b_lo += b_qr[:, None] * b_ur[None, :]
    b_s += b_lo
    b_w = tl.load(w + i_sh * L + o_l, mask=m_l, other=0.0)  # [BL]
    b_k = tl.load(kbuf + i_sh * (L * K) + o_l[:, None] * K + o_k[None, :], mask=m_l[:, None], other=0.0)
    b_kd = b_k.to(tl.float32)  # [BL, K]
    if IS_KDA:
        b_s *= tl.exp(tl.load(pcum + i_sh * K + o_k))[None, :]
        # d_j = prod_{i>j} gbuf[i]: a reverse inclusive scan over the rows shifted up by one (last row and padding 1)
        m_g = (o_l[:, None] + 1) < L
        b_g = tl.load(gbuf + i_sh * (L * K) + (o_l[:, None] + 1) * K + o_k[None, :], mask=m_g, other=1.0)
        b_kd = b_kd * tl.cumprod(b_g.to(tl.float32), axis=0, reverse=True)
    else:
        b_s *= tl.maximum(tl.load(pcum + i_sh), PNMIN)
    b_kd = b_kd * b_w[:, None]
    # ubuf^T [V, BL], padded entries zero; bf16 values are exact in tf32, and tf32x3 splits the decayed keys into
    # tf32 big + small parts (22 bits)
    b_ut = tl.load(ubuf + i_sh * (L * V) + o_l[None, :] * V + o_v[:, None], mask=m_l[None, :], other=0.0)
    b_s = tl.dot(b_ut.to(tl.float32), b_kd, acc=b_s, input_precision="tf32x3")

    # --- 5. subspace iteration on Sn = c S, c = 2^(126 - e) from the fp32 exponent field e of max|S| -----------
    a_max = tl.max(tl.max(tl.abs(b_s), axis=1), axis=0)
    e_max = (a_max.to(tl.int32, bitcast=True) >> 23) & 0xFF
    e_max = tl.minimum(tl.maximum(e_max, 1), 252)
    c_norm = ((253 - e_max) << 23).to(tl.float32, bitcast=True)  # max|c S| in [0.5, 1)
    b_sh = (b_s * c_norm).to(tl.float16)
    b_q = tl.load(q0 + o_v[:, None] * R + o_r[None, :], mask=m_r[None, :], other=0.0)  # [V, BR]
    for _ in tl.static_range(ITERS):
        b_p = tl.dot(tl.trans(b_sh), b_q.to(tl.float16))  # [K, BR]
        b_y = tl.dot(b_sh, b_p.to(tl.float16))  # [V, BR]
        b_q = _cholqr(_cholqr(b_y, R, BR), R, BR)

    # --- 6-7. new factors U = S^T q16 and the residual E = S - q16 u16^T ----------------------------------------
    # U one column at a time on the fp32 state: exact products, fp32 sums (what the reference computes), no fp16
    # copy of S in shared memory for a product whose rounding would reach the stored factors
    b_q16 = b_q.to(tl.float16)  # [V, BR]
    b_q16f = b_q16.to(tl.float32)
    b_ut16 = tl.zeros([BR, K], dtype=tl.float16)  # U^T, the layout of uq's rows
    for r in tl.static_range(R):
        b_ur = tl.sum(b_s * _column(b_q16f, r, BR)[:, None], axis=0)  # [K]
        b_ur = tl.minimum(tl.maximum(b_ur, -FP16_MAX), FP16_MAX).to(tl.float16)
        b_ut16 = tl.where(o_r[:, None] == r, b_ur[None, :], b_ut16)
    # fp16 x fp16 products are exact in fp32 (R <= 4 terms, padding zero); as a dot the residual needs no extra
    # [V, K] tile of registers (255 -> 0 B of spill at sm_90 against a broadcast loop)
    b_s = b_s - tl.dot(b_q16, b_ut16)

    # --- 8-9. column scales, row scales, codes -----------------------------------------------------------------
    b_sk = tl.maximum(tl.sqrt_rn(tl.sum(tl.abs(b_s), axis=0) / V), EPS)  # [K]; V is a power of two: exact mean
    b_s = b_s * tl.math.div_rn(tl.zeros_like(b_sk) + 1.0, b_sk)[None, :]
    b_sv = tl.maximum(tl.max(tl.abs(b_s), axis=1), EPS)  # [V]
    b_x = b_s * tl.math.div_rn(tl.zeros_like(b_sv) + QMAX, b_sv)[:, None]
    b_x = (b_x + RINT_MAGIC) - RINT_MAGIC
    b_c = tl.minimum(tl.maximum(b_x, -QMAX), QMAX).to(tl.int8)

    # --- 10. store the checkpoint and reset the ring ----------------------------------------------------------
    tl.store(p_c, b_c)
    # stored as [1, K] and [V, 1] tiles in the state's layout: a 1-D store makes Triton move the whole |E| tile into
    # the store's layout before the reduction (a [V, K] layout conversion and its registers)
    tl.store(skv + o_reg + o_k[None, :], b_sk[None, :])
    tl.store(skv + o_reg + K + o_v[:, None], b_sv[:, None])
    tl.store(uq + o_reg * 2 + o_r[:, None] * (K + V) + o_k[None, :], b_ut16, mask=m_r[:, None])
    m_rv = m_r[None, :] & (o_v[:, None] < V)
    tl.store(uq + o_reg * 2 + o_r[None, :] * (K + V) + K + o_v[:, None], b_q16, mask=m_rv)
    tl.store(w + i_sh * L + o_l, tl.zeros([BL], dtype=tl.float32), mask=m_l)
    if IS_KDA:
        tl.store(pcum + i_sh * K + o_k, tl.zeros([K], dtype=tl.float32))
        p_g = gbuf + i_sh * (L * K) + o_l[:, None] * K + o_k[None, :]
        tl.store(p_g, tl.full([BL, K], 1.0, dtype=tl.float16), mask=m_l[:, None])
    else:
        tl.store(pcum + i_sh, 1.0)


def num_warps_for(head_k: int, head_v: int) -> int:
    """Warps per program. The [V, K] fp32 state costs V K / (32 num_warps) registers per thread: 64 at 128 x 128
    with 8 warps. 64 x 64 fits 4 warps (32 per thread); 128 x 64 at 4 warps spilled (sm_80, sm_90), so it takes 8."""
    return 4 if head_k * head_v <= 64 * 64 else 8


def kernel_constants(geometry, convention: str, iters: int) -> dict:
    """The constexpr arguments of :func:`leapquant_flush_kernel` for a pool (also what the AOT check compiles)."""
    g = geometry
    return dict(
        FIRST=1 if convention == "vllm" else 0,
        K=g.head_k,
        V=g.head_v,
        L=g.ring,
        R=g.rank,
        BL=max(16, g.ring),
        BR=16,
        ITERS=iters,
        IS_KDA=g.gate == "kda",
    )


_MMA_ENV = ("DISABLE_MMA_V3", "DISABLE_MMA_V5")
_mma_lock = threading.Lock()


@contextlib.contextmanager
def mma_sync_only():
    """Compile with Triton's ``mma.sync`` lowering of ``tl.dot`` instead of Hopper's ``wgmma`` (sm_90 only; no effect
    on other architectures).

    Measured on the H200 with Triton 3.6 (parity_tests/gpu_runs/2026-11-30_s2_diag.log): compiled with
    ``wgmma`` this kernel gives different bytes from run to run, non-finite outputs on ordinary states and illegal
    memory accesses on GDN pools; with ``mma.sync`` it is deterministic, graph replay equals eager, and every regime
    passes SPEC §4, at the same speed. Triton has open reports of the same kind for kernels with several ``tl.dot``
    on sm_90 (triton-lang/triton #10486, #11366). Triton reads the switch from the environment while it compiles and
    keys its caches on it, so it is set around each launch (a compile happens inside the first one) and restored.
    """
    with _mma_lock:
        old = {k: os.environ.get(k) for k in _MMA_ENV}
        os.environ.update({k: "1" for k in _MMA_ENV})
        try:
            yield
        finally:
            for k, v in old.items():
                if v is None:
                    del os.environ[k]
                else:
                    os.environ[k] = v


def flush_pool(pool, idx: torch.Tensor, num_warps: int | None = None) -> None:
    """Launch the flush over ``idx`` (int32 ``[N]``) on ``pool`` in place: grid ``(N, HV)``, no host synchronisation,
    the same launch for the same pool and ``N``."""
    g = pool.geometry
    N = idx.numel()
    if N == 0:
        return
    gbuf = pool.gbuf if pool.gbuf is not None else pool.w  # GDN never reads it
    with mma_sync_only():
        leapquant_flush_kernel[(N, g.heads)](
            idx=idx,
            hcnt=pool.hcnt,
            codes=pool.codes,
            skv=pool.s_kv,
            uq=pool.uq,
            kbuf=pool.kbuf,
            ubuf=pool.ubuf,
            w=pool.w,
            pcum=pool.pcum,
            gbuf=gbuf,
            q0=pool.q0,
            NS=g.num_slots,
            HV=g.heads,
            SS=g.slot_stride,
            **kernel_constants(g, pool.convention, pool.iters),
            num_warps=num_warps or num_warps_for(g.head_k, g.head_v),
            num_stages=1,
        )
