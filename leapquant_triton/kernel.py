"""The LeapQuant flush as Triton kernels (SPEC §3), and their launcher.

One program per due (slot, head), the state ``S [V, K]`` in registers from the rebuild to the quantisation; the new
checkpoint and the ring resets are written in place. Two schedules find the due pairs (:func:`flush_pool`):

    grid   :func:`leapquant_flush_kernel` (``LIST`` False), grid ``(N, HV)``: a program that is not due returns after
           reading ``idx[n]`` and ``hcnt[idx[n], h]`` (two dependent loads, while holding an SM slot)
    list   :func:`due_list_kernel` lists the due pairs, then :func:`leapquant_flush_kernel` (``LIST`` True), grid
           ``(N HV,)``: program p takes the p-th due pair, so the due programs are launched first; for large flushes.
           On sm_90 and later both launch as programmatic dependents (:func:`_pdl`): their programs start while the
           kernel before them drains; and each flush program prefetches into L2 the inputs of the pair one round of
           programs later in the list (:func:`prefetch_ahead`)

Legend of the block values (``b_`` prefix), shapes in SPEC letters, ``BR`` = rank padded to 16 and ``BL`` = ring
padded to 16 (``tl.dot`` needs every dimension >= 16; padded rows and columns are zero):

    b_s    [V, K]  fp32  the rebuilt state S, then the residual E, then X = E / s_k
    b_sh   [V, K]  fp16  the normalised state Sn = c S (c a power of two, max|Sn| in [0.5, 1)), subspace operand
    b_q16  [V, BR] fp16  the subspace basis fp16(Q), what the products take and the checkpoint stores
    b_ut16 [BR, K] fp16  U^T = (S^T q16)^T saturated at +-65504, the layout of uq's rows

Every product with a contraction over V, K or the ring is a ``tl.dot``; small values go through the program's
scratch words (global memory, L1/L2-resident), so that they are computed once rather than in every thread:

    Lo         fp16 x fp16 -> fp32 onto Dq: exact products of the stored factors
    ring       16 entries at a time, bf16 ubuf x the decayed keys as three bf16 pieces (8 + 8 + 8 bits, their sum
               exact): exact products, fp32 accumulation. The KDA decays are row products in the reference's order.
               (The interpreter of Triton 3.6 multiplies bf16 tiles as integers; there the same pieces go as fp32.)
    P, Y       fp16 x fp16 -> fp32 on Sn, P rounded to fp16 between the products: the seed's numerics (mean ratio
               1.0005 to the reference; bf16 here measured 1.04 on states with a few large columns, a fail)
    CholQR2    Y's 4 leading columns go to scratch; the 4 x 4 Gram matrix is a broadcast product summed over V in
               fp32; each thread reads it back as scalars and factorises it itself, with fast square roots and
               reciprocals (within 2 ulp of the reference's IEEE operations); the forward substitution runs on [V]
               columns, in the reference's order
    U          fp16 x fp16 on Sn, as the seed; the residual is taken against the fp32 S
    q16 u16^T  fp16 x fp16 -> fp32 onto S: exact products of the stored factors, R <= 4 terms
    s_k        the column sums of |E| as bf16 |E|^T x ones (as the seed takes them on the tensor cores): s_k moves
               by at most 2^-10 relative, which the codes absorb

Every ``tl.dot`` is compiled to ``mma.sync`` (:func:`mma_sync_only`; Hopper's ``wgmma`` build of this kernel is
wrong on the H200). Resources (``python -m leapquant_triton.portability``): at 128 x 128 a program is 8 warps capped
at 128 registers (two programs per SM; 0.2-0.55 KB of spills at ring 16), 36 KiB of shared memory. Measurements and
the way there are in bench/NOTES.md.
"""

from __future__ import annotations

import contextlib
import os
import threading

import torch
import triton
import triton.language as tl
from torch.utils.weak import WeakIdKeyDictionary
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from leapquant import constants

from .backend import _interpreting
from .launcher import Launcher

# the SPEC's constants as compile-time values (a @triton.jit function can read only constexpr globals)
QMAX = tl.constexpr(constants.QMAX)
EPS = tl.constexpr(constants.EPS)
FLOOR = tl.constexpr(constants.FLOOR)
TINY = tl.constexpr(constants.TINY)
PNMIN = tl.constexpr(constants.PNMIN)
FP16_MAX = tl.constexpr(constants.FP16_MAX)
# 1.5 * 2^23: adding it rounds an fp32 |x| <= 2^22 to an integer, half to even, on the GPU and in the interpreter
# alike (libdevice's rint has no interpreter counterpart)
RINT_MAGIC = tl.constexpr(12582912.0)


# thread 0 asks for one due pair's inputs in L2 (sm_90 bulk prefetches: 16-byte aligned addresses, sizes multiples
# of 16): the checkpoint region (codes, scales, factors), its kbuf, ubuf and gbuf rows, and w (L * 4 bytes); flag 0
# issues nothing
_PREFETCH_ASM = tl.constexpr("""{
.reg .pred p;
.reg .b32 t;
mov.u32 t, %tid.x;
setp.eq.u32 p, t, 0;
setp.ne.and.u32 p, $6, 0, p;
@p cp.async.bulk.prefetch.L2.global [$1], $7;
@p cp.async.bulk.prefetch.L2.global [$2], $8;
@p cp.async.bulk.prefetch.L2.global [$3], $8;
@p cp.async.bulk.prefetch.L2.global [$4], $8;
@p cp.async.bulk.prefetch.L2.global [$5], $9;
mov.u32 $0, 0;
}""")


@triton.jit
def _listed_pair(work, p, HV, live):
    """(slot, head, slot HV + head) of the due pair ``work[1 + p]`` of the list schedule (where ``live``; else pair
    0), the slot and row as int64. The entry is an int32 (slot HV + head < N HV): a 32-bit division, not a 64-bit
    one."""
    i_sh = tl.load(work + 1 + p, mask=live, other=0)
    i_s = i_sh // HV
    i_h = i_sh - i_s * HV
    return i_s.to(tl.int64), i_h, i_sh.to(tl.int64)


@triton.jit
def _prefetch(work, n_due, q, codes, kbuf, ubuf, w, gbuf, HV, SS, K: tl.constexpr, V: tl.constexpr,
              L: tl.constexpr, R: tl.constexpr, IS_KDA: tl.constexpr):
    """The inputs of the due pair ``work[1 + q]`` (if q < n_due) prefetched into L2: the program that takes it starts
    about one round of programs later, and its loads then hit L2."""
    live = q < n_due
    i_s, i_h, i_sh = _listed_pair(work, q, HV, live)
    a_reg = (codes + (i_s * SS + i_h * (V * K)) * 4).to(tl.int64, bitcast=True)
    a_k = (kbuf + i_sh * (L * K)).to(tl.int64, bitcast=True)
    a_u = (ubuf + i_sh * (L * V)).to(tl.int64, bitcast=True)
    a_w = (w + i_sh * L).to(tl.int64, bitcast=True)
    a_g = a_u
    if IS_KDA:
        a_g = (gbuf + i_sh * (L * K)).to(tl.int64, bitcast=True)
    tl.inline_asm_elementwise(_PREFETCH_ASM, "=r,l,l,l,l,l,r,r,r,r",
                              [a_reg, a_k, a_u, a_g, a_w, live.to(tl.int32), V * K + 4 * (K + V) + 2 * R * (K + V),
                               L * K * 2, L * 4], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _cholesky(p_y, p_g, V: tl.constexpr, R: tl.constexpr):
    """The lower Cholesky factor of ``G = Y^T Y`` for ``Y [V, 4]`` in the program's scratch words at ``p_y``, with
    the SPEC's relative pivot floor ``L_ii = sqrt(max(G_ii - sum_{j<i} L_ij^2, FLOOR G_ii, TINY))``, in the
    reference's order, as (the off-diagonal entries, the reciprocals of the pivots); entries of rows >= R are 1
    (never used).

    G is one broadcast product summed over V (fp32, as the reference's matmul); it goes through the scratch words at
    ``p_g`` so that every thread reads it as scalars and factorises it on its own (Triton has no register indexing:
    masked sums would cost a reduction and a barrier per entry). R <= 4, so the factorisation is written out. Every
    division by a pivot is a product with its reciprocal (fast square root and reciprocal, within 2 ulp of the
    reference's IEEE operations: the IEEE ones cost a slow-path branch each, in every thread)."""
    o_v = tl.arange(0, V)
    o_4 = tl.arange(0, 4)
    b_y = tl.load(p_y + o_v[:, None] * 4 + o_4[None, :])  # [V, 4]
    b_g = tl.sum(b_y[:, :, None] * b_y[:, None, :], axis=0)  # [4, 4]
    tl.store(p_g + o_4[:, None] * 4 + o_4[None, :], b_g)
    tl.debug_barrier()  # the Gram matrix is visible to every thread
    l10, l20, l21, l30, l31, l32 = 1.0, 1.0, 1.0, 1.0, 1.0, 1.0
    i11, i22, i33 = 1.0, 1.0, 1.0
    g00 = tl.load(p_g)
    # (the tensor before the constexpr in each product: the interpreters of Triton 3.7 and 3.8 fail on FLOOR * g)
    i00 = 1.0 / tl.sqrt(tl.maximum(tl.maximum(g00, g00 * FLOOR), TINY))
    if R > 1:
        l10 = tl.load(p_g + 4) * i00
        g11 = tl.load(p_g + 5)
        i11 = 1.0 / tl.sqrt(tl.maximum(tl.maximum(g11 - l10 * l10, g11 * FLOOR), TINY))
    if R > 2:
        l20 = tl.load(p_g + 8) * i00
        l21 = (tl.load(p_g + 9) - l20 * l10) * i11
        g22 = tl.load(p_g + 10)
        i22 = 1.0 / tl.sqrt(tl.maximum(tl.maximum(g22 - (l20 * l20 + l21 * l21), g22 * FLOOR), TINY))
    if R > 3:
        l30 = tl.load(p_g + 12) * i00
        l31 = (tl.load(p_g + 13) - l30 * l10) * i11
        l32 = (tl.load(p_g + 14) - (l30 * l20 + l31 * l21)) * i22
        g33 = tl.load(p_g + 15)
        i33 = 1.0 / tl.sqrt(tl.maximum(tl.maximum(g33 - (l30 * l30 + l31 * l31 + l32 * l32), g33 * FLOOR), TINY))
    return l10, l20, l21, l30, l31, l32, i00, i11, i22, i33


@triton.jit
def _store_columns(p, o_v, q0, q1, q2, q3, R: tl.constexpr):
    """The R leading columns of a [V, 4] row-major block at ``p``."""
    tl.store(p + o_v * 4, q0)
    if R > 1:
        tl.store(p + o_v * 4 + 1, q1)
    if R > 2:
        tl.store(p + o_v * 4 + 2, q2)
    if R > 3:
        tl.store(p + o_v * 4 + 3, q3)


@triton.jit
def _cholqr(p_y, p_g, p_q16, V: tl.constexpr, R: tl.constexpr, STORE16: tl.constexpr):
    """One CholeskyQR step on ``Y [V, 4]`` in the scratch words at ``p_y`` (columns >= R zero): ``Q = Y L^{-T}`` by
    forward substitution over the columns, as the reference computes it, stored over Y, or (``STORE16``, the last
    step) as fp16 at ``p_q16``."""
    l10, l20, l21, l30, l31, l32, i00, i11, i22, i33 = _cholesky(p_y, p_g, V, R)
    o_v = tl.arange(0, V)
    q0 = tl.load(p_y + o_v * 4) * i00
    q1, q2, q3 = q0, q0, q0
    if R > 1:
        q1 = (tl.load(p_y + o_v * 4 + 1) - l10 * q0) * i11
    if R > 2:
        q2 = ((tl.load(p_y + o_v * 4 + 2) - l20 * q0) - l21 * q1) * i22
    if R > 3:
        q3 = (((tl.load(p_y + o_v * 4 + 3) - l30 * q0) - l31 * q1) - l32 * q2) * i33
    tl.debug_barrier()  # every thread has read Y before Q overwrites it
    if STORE16:  # the last step: fp16(Q), what the products take and the checkpoint stores
        _store_columns(p_q16, o_v, q0.to(tl.float16), q1.to(tl.float16), q2.to(tl.float16), q3.to(tl.float16), R)
    else:  # Q in place of Y, for the next step
        _store_columns(p_y, o_v, q0, q1, q2, q3, R)
    tl.debug_barrier()  # Q is visible to every thread


@triton.jit
def _ranges(K: tl.constexpr, V: tl.constexpr, L: tl.constexpr, R: tl.constexpr, BL: tl.constexpr,
            BR: tl.constexpr):
    """Index vectors over K, V, the padded ring and the padded rank, and the masks of the live ring and rank."""
    o_l = tl.arange(0, BL)
    o_r = tl.arange(0, BR)
    return tl.arange(0, K), tl.arange(0, V), o_l, o_r, o_l < L, o_r < R


@triton.jit
def _q16_tile(p_q16, V: tl.constexpr, BR: tl.constexpr):
    """Pointers and mask of fp16(Q) ``[V, 4]`` in the program's scratch words at ``p_q16``, as the ``[V, BR]`` tile the
    products take (columns >= 4 masked: zero when loaded)."""
    o_v, o_r = tl.arange(0, V), tl.arange(0, BR)
    return p_q16 + o_v[:, None] * 4 + o_r[None, :], (o_r[None, :] < 4) & (o_v[:, None] < V)


@triton.jit
def _pin(b_x):
    """``b_x`` (bf16) through an opaque move, on the GPU only: Triton moves the layout conversion of a dot operand
    up through elementwise arithmetic to the loads it starts from, and then runs that arithmetic in the operand's
    layout, where every warp holds the whole [BL, K] tile (8 times the work of a blocked layout at 8 warps). The
    pinned value is converted where it is."""
    return tl.inline_asm_elementwise("mov.b16 $0, $1;", "=h,h", [b_x], dtype=tl.bfloat16, is_pure=False, pack=1)


@triton.jit
def _ring_chunk(p_k, p_u, p_w, p_g, c: tl.constexpr, K: tl.constexpr, V: tl.constexpr, L: tl.constexpr,
                IS_KDA: tl.constexpr):
    """Ring entries ``16 c .. 16 c + 15`` (zero past L) of one (slot, head), from its kbuf, ubuf, w and gbuf rows:
    ubuf^T ``[V, 16]`` (bf16) and the decayed keys ``[16, K]`` as the exact sum of three bf16 pieces (8 + 8 + 8
    significant bits, so that every product with the bf16 ubuf is exact in fp32), the largest piece first."""
    o_k = tl.arange(0, K)
    o_j = c * 16 + tl.arange(0, 16)
    m_j = o_j < L
    b_kd = tl.load(p_k + o_j[:, None] * K + o_k[None, :], mask=m_j[:, None], other=0.0).to(tl.float32)  # [16, K]
    if IS_KDA:
        # d_j = prod_{i>j} gbuf[i], multiplied from i = L-1 down as the reference's reverse cumulative product: row i
        # of gbuf is read into every row j < i of the tile (1 elsewhere). A tl.cumprod over the rows crosses the 8
        # warps through shared memory and barriers: 12 % of the kernel's stall samples on the H200.
        b_d = tl.full([16, K], 1.0, tl.float32)
        for i in tl.static_range(L - 1, c * 16, -1):
            b_gi = tl.load(p_g + i * K + o_j[:, None] * 0 + o_k[None, :], mask=o_j[:, None] < i, other=1.0)
            b_d = b_d * b_gi.to(tl.float32)
        b_kd = b_kd * b_d
    b_kd = b_kd * tl.load(p_w + o_j, mask=m_j, other=0.0)[:, None]
    b_k1 = b_kd.to(tl.bfloat16)
    b_r1 = b_kd - b_k1.to(tl.float32)
    b_k2 = b_r1.to(tl.bfloat16)
    b_k3 = (b_r1 - b_k2.to(tl.float32)).to(tl.bfloat16)
    b_ut = tl.load(p_u + o_j[None, :] * V + tl.arange(0, V)[:, None], mask=m_j[None, :], other=0.0)  # [V, 16]
    return b_ut, b_k1, b_k2, b_k3


@triton.jit
def _ring_dots(b_s, b_ut, b_k1, b_k2, b_k3, BF16_DOTS: tl.constexpr):
    """``b_s + ubuf^T kd`` for one chunk of the ring, the small pieces of kd first."""
    if BF16_DOTS:
        b_s = tl.dot(b_ut, _pin(b_k3), acc=b_s)
        b_s = tl.dot(b_ut, _pin(b_k2), acc=b_s)
        b_s = tl.dot(b_ut, _pin(b_k1), acc=b_s)
    else:  # the interpreter multiplies bf16 tiles as integers (Triton 3.6): the same exact products in fp32
        b_ut = b_ut.to(tl.float32)
        b_s = tl.dot(b_ut, b_k3.to(tl.float32), acc=b_s)
        b_s = tl.dot(b_ut, b_k2.to(tl.float32), acc=b_s)
        b_s = tl.dot(b_ut, b_k1.to(tl.float32), acc=b_s)
    return b_s


@triton.jit
def _rebuild(p_c, p_skv, p_uq, p_k, p_u, p_w, p_pc, p_e, p_g, p_q0, p_qt, m_q, K: tl.constexpr, V: tl.constexpr,
             L: tl.constexpr, R: tl.constexpr, BL: tl.constexpr, BR: tl.constexpr, IS_KDA: tl.constexpr,
             BF16_DOTS: tl.constexpr):
    """The rebuilt state S = (Dq + Lo) * scale + Ring (SPEC §3 steps 1-4) as a [V, K] fp32 tile, from the pointers
    of one (slot, head): its codes (the [V, K] tile of pointers), s_k | s_v, uq, and its kbuf, ubuf, w, pcum and gbuf
    rows. On the way it writes the program's scratch words that the rest reads: fp16(Q0) [V, 4] through the tile
    ``p_qt``, ``m_q`` (:func:`_q16_tile`) and, for KDA, exp(pcum) [K] at ``p_e``, computed once per value (in the
    state's layout every thread would compute 32 of each).

    Every input is loaded before the first barrier, so that their latencies overlap: the checkpoint, the first 16
    ring entries (with their decays and pieces), Q0 and pcum; a load after a barrier waits for it, and the barriers
    wait for the slowest warp's loads."""
    o_k, o_v, _, o_r, _, m_r = _ranges(K, V, L, R, BL, BR)
    b_pc = tl.load(p_pc + o_k) if IS_KDA else tl.load(p_pc)
    b_q0 = tl.load(p_q0 + o_v[:, None] * R + o_r[None, :], mask=m_r[None, :], other=0.0)  # [V, BR]
    b_sk = tl.load(p_skv + o_k)  # [K]
    b_sv = tl.load(p_skv + K + o_v)  # [V]
    b_c = tl.load(p_c)
    b_qo = tl.load(p_uq + o_r[None, :] * (K + V) + K + o_v[:, None], mask=m_r[None, :], other=0.0)  # [V, BR]
    b_uo = tl.load(p_uq + o_r[:, None] * (K + V) + o_k[None, :], mask=m_r[:, None], other=0.0)  # [BR, K]
    b_ut, b_k1, b_k2, b_k3 = _ring_chunk(p_k, p_u, p_w, p_g, 0, K, V, L, IS_KDA)
    tl.store(p_qt, b_q0.to(tl.float16), mask=m_q)
    if IS_KDA:
        tl.store(p_e + o_k, tl.exp(b_pc))
    tl.debug_barrier()  # fp16(Q0) and exp(pcum) are visible to every thread
    # (``/`` here and for the new scales below is the GPU's fast division, within 2 ulp: it moves a scale by fp32
    # rounding, far below the quantisation error; IEEE division costs a slow-path branch per value)
    b_cf = (b_c.to(tl.int32) + 0x4B400000).to(tl.float32, bitcast=True) - 12582912.0
    b_s = b_cf * (b_sv / QMAX)[:, None] * b_sk[None, :]
    # old rank-R part from the fp16 factors: products are exact in fp32
    b_s = tl.dot(b_qo, b_uo, acc=b_s)
    if IS_KDA:
        b_s *= tl.load(p_e + o_k)[None, :]  # exp(pcum)
    else:
        b_s *= tl.maximum(b_pc, PNMIN)
    # the ring, 16 entries at a time (a [16, K] operand is replicated in every warp: at L = 32 whole-ring operands
    # spilled)
    b_s = _ring_dots(b_s, b_ut, b_k1, b_k2, b_k3, BF16_DOTS)
    for c in tl.static_range(1, BL // 16):
        b_ut, b_k1, b_k2, b_k3 = _ring_chunk(p_k, p_u, p_w, p_g, c, K, V, L, IS_KDA)
        b_s = _ring_dots(b_s, b_ut, b_k1, b_k2, b_k3, BF16_DOTS)
    return b_s


@triton.jit
def _flush_one(o_scr, i_h, i_s, i_sh, codes, skv, uq, kbuf, ubuf, w, pcum, gbuf, q0, scratch, scratch16, SS,
               K: tl.constexpr, V: tl.constexpr, L: tl.constexpr, R: tl.constexpr, BL: tl.constexpr,
               BR: tl.constexpr, ITERS: tl.constexpr, IS_KDA: tl.constexpr, BF16_DOTS: tl.constexpr):
    """The flush of one due (slot ``i_s``, head ``i_h``) in place; ``i_sh = i_s HV + i_h`` is its row of the dense
    buffers, ``o_scr`` the first of the program's scratch words (int64)."""
    o_k, o_v, o_l, o_r, m_l, m_r = _ranges(K, V, L, R, BL, BR)
    # region of (slot, head) in words; the pool passes 2^31 bytes at ~1000 slots of 32 heads
    o_reg = i_s * SS + i_h * (V * K)

    # the program's scratch words (scratch_words): Y / Q [V, 4] (later 1 / s_k), the Gram matrices, c, fp16(Q)
    # [V, 4], exp(pcum) [K] (later the column sums of |E|)
    p_y = scratch + o_scr
    p_gram = p_y + 4 * V
    p_cn = p_gram + 32 * ITERS
    p_q16 = scratch16 + (o_scr + 32 * ITERS + 4 * V + 4) * 2
    p_e = p_cn + 4 + 2 * V
    p_qt, m_q = _q16_tile(p_q16, V, BR)

    # --- 1-4. rebuild S = (Dq + Lo) * scale + Ring -------------------------------------------------------------
    p_c = codes + o_reg * 4 + o_v[:, None] * K + o_k[None, :]
    b_s = _rebuild(p_c, skv + o_reg, uq + o_reg * 2, kbuf + i_sh * (L * K), ubuf + i_sh * (L * V),
                   w + i_sh * L, pcum + i_sh * (K if IS_KDA else 1), p_e, gbuf + i_sh * (L * K), q0, p_qt, m_q, K, V, L,
                   R, BL, BR, IS_KDA, BF16_DOTS)

    # --- 5. subspace iteration on Sn = c S, c = 2^(126 - e) from the fp32 exponent field e of max|S| -----------
    a_max = tl.max(tl.max(tl.abs(b_s), axis=1), axis=0)
    e_max = (a_max.to(tl.int32, bitcast=True) >> 23) & 0xFF
    e_max = tl.minimum(tl.maximum(e_max, 1), 252)
    c_norm = ((253 - e_max) << 23).to(tl.float32, bitcast=True)  # max|c S| in [0.5, 1)
    b_sh = (b_s * c_norm).to(tl.float16)
    # CholeskyQR2 works on Y's 4 leading columns (R <= 4 live, the rest zero) in the program's scratch words; the
    # products take fp16(Q) loaded as fp16, so that their operands go through shared memory as fp16 (from an fp32
    # load, Triton moves the conversion after the layout change and doubles the shared-memory traffic)
    tl.store(p_cn, c_norm)  # read back for U
    for it in tl.static_range(ITERS):
        b_q16 = tl.load(p_qt, mask=m_q, other=0.0)  # [V, BR]
        b_p = tl.dot(tl.trans(b_sh), b_q16)  # [K, BR]
        b_y = tl.dot(b_sh, b_p.to(tl.float16))  # [V, BR]
        tl.store(p_y + o_v[:, None] * 4 + o_r[None, :], b_y, mask=o_r[None, :] < 4)
        tl.debug_barrier()
        _cholqr(p_y, p_gram + 32 * it, p_q16, V, R, False)
        _cholqr(p_y, p_gram + 32 * it + 16, p_q16, V, R, True)

    # --- 6-7. new factors U = S^T q16 and the residual E = S - q16 u16^T ----------------------------------------
    # U from the fp16 state Sn as the seed computes it (one tl.dot; the residual absorbs its rounding, since E is
    # taken against the fp32 S). With the state's fp16 rounding error split off as a second fp16 product, U was
    # fp32-exact, at +24 % time (bench/NOTES.md). Sn is formed again from c read back from scratch: the operand of
    # the first product is not kept in registers through the CholeskyQR2.
    b_q16 = tl.load(p_qt, mask=m_q, other=0.0)  # [V, BR]
    c_back = tl.load(p_cn)
    b_u = tl.dot(tl.trans((b_s * c_back).to(tl.float16)), b_q16) * tl.math.div_rn(1.0, c_back)  # [K, BR]
    b_ut16 = tl.trans(tl.minimum(tl.maximum(b_u, -FP16_MAX), FP16_MAX).to(tl.float16))  # [BR, K]
    # fp16 x fp16 products are exact in fp32 (R <= 4 terms, padding zero), accumulated onto S
    b_s = tl.dot(-b_q16, b_ut16, acc=b_s)

    # --- 8-9. column scales, row scales, codes -----------------------------------------------------------------
    # the column sums of |E| on the tensor cores, as the seed takes them: bf16 |E|^T [K, V] x a [V, 16] tile whose
    # column 0 is ones (bf16 keeps fp32's range; its rounding moves s_k by at most 2^-10 relative, which the codes
    # absorb); a reduction over V in the state's layout costs 96 shuffles per thread. They go through scratch so
    # that s_k and 1 / s_k are computed once per column: in the state's layout every thread would compute 32 of each.
    o_16 = tl.arange(0, 16)
    if BF16_DOTS:
        b_cs = tl.dot(tl.trans(tl.abs(b_s).to(tl.bfloat16)),
                      tl.where(o_16[None, :] == 0, 1.0, 0.0).to(tl.bfloat16) + tl.zeros([V, 16], tl.bfloat16))
    else:  # (the interpreter's bf16 dot is wrong: exact fp32 sums there)
        b_cs = tl.dot(tl.trans(tl.abs(b_s)), tl.where(o_16[None, :] == 0, 1.0, 0.0) + tl.zeros([V, 16], tl.float32))
    tl.store(p_e + o_k[:, None] + o_16[None, :], b_cs, mask=o_16[None, :] == 0)  # [K, 16]: column 0
    tl.debug_barrier()
    m_k = tl.load(p_e + o_k) * (1.0 / V)  # [K]; V is a power of two: the exact mean
    tl.store(skv + o_reg + o_k, tl.maximum(tl.sqrt(m_k), EPS))
    # 1 / s_k as one reciprocal square root (within 2 ulp, as the fast reciprocal was; the codes absorb it), in the
    # words of Y, free since the CholeskyQR2
    tl.store(p_y + o_k, tl.minimum(tl.math.rsqrt(m_k), 1.0 / EPS))
    tl.debug_barrier()
    b_s = b_s * tl.load(p_y + o_k)[None, :]
    b_sv = tl.maximum(tl.max(tl.abs(b_s), axis=1), EPS)  # [V]
    # |X| <= s_v in every row, so |b_x| <= QMAX (1 + 2^-22) and rounds into [-QMAX, QMAX]: no clamp needed
    b_x = b_s * ((tl.zeros_like(b_sv) + QMAX) / b_sv)[:, None]
    # x + 1.5 * 2^23 holds round_half_even(x) in its low mantissa bits, offset by 2^22 (a multiple of 256): the low
    # byte of its bit pattern is the int8 code in two's complement
    b_c = (b_x + RINT_MAGIC).to(tl.int32, bitcast=True).to(tl.int8)

    # --- 10. store the checkpoint and reset the ring ----------------------------------------------------------
    tl.store(p_c, b_c)
    # stored as a [V, 1] tile in the state's layout: a 1-D store makes Triton move the whole tile into the store's
    # layout before the reduction
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


@triton.jit
def due_list_kernel(idx, hcnt, work, NS, HV, FIRST: tl.constexpr, L: tl.constexpr, HB: tl.constexpr,
                    PDL: tl.constexpr):
    """Grid ``(N,)``: appends the due (slot, head) pairs of row ``n`` as ``slot HV + head`` to ``work[1:]`` and counts
    them in ``work[0]`` (zero before the launch): one atomic add per row, the positions within it by a prefix sum.
    ``PDL``: launched as a programmatic dependent of the zeroing of ``work[0]``; it lets the flush launch at once."""
    if PDL:
        gdc_wait()  # the zeroed count is visible
        gdc_launch_dependents()  # the flush's programs may start (they wait for this grid before reading work)
    i_n = tl.program_id(0)
    i_s = tl.load(idx + i_n).to(tl.int64)
    o_h = tl.arange(0, HB)
    # the row's slot test as a select: Triton 3.9's interpreter rejects a mask made by `&` of a block and a scalar
    # comparison ("mask has unsupported dtype"); the sm_90 PTX (Triton 3.6) differs only in the order of its ands
    m_h = tl.where((i_s >= FIRST) & (i_s < NS), o_h < HV, False)
    b_due = (tl.load(hcnt + i_s * HV + o_h, mask=m_h, other=0) == L).to(tl.int32)
    n_due = tl.sum(b_due, axis=0)
    if n_due > 0:
        base = tl.atomic_add(work, n_due)
        tl.store(work + 1 + base + tl.cumsum(b_due, axis=0) - b_due, (i_s * HV + o_h).to(tl.int32), mask=b_due > 0)


@triton.jit
def leapquant_flush_kernel(
    idx,  # int32 [N] (grid schedule)
    hcnt,  # int32 [NS, HV] (grid schedule)
    work,  # int32 [1 + N HV]: the due count, then the due pairs (list schedule, written by due_list_kernel)
    codes,  # int8 view of the pool: region (n, h) at byte n * 4 SS + h * 4 V K
    skv,  # fp32 view: s_k [K] | s_v [V] at word n * SS + h * V K
    uq,  # fp16 view: uq [R, K + V] at half n * 2 SS + h * 2 V K
    kbuf,  # bf16 [NS, HV, L, K]
    ubuf,  # bf16 [NS, HV, L, V]
    w,  # fp32 [NS, HV, L]
    pcum,  # fp32 [NS, HV, K] (KDA) or [NS, HV, 1] (GDN)
    gbuf,  # fp16 [NS, HV, L, K] (KDA); any pointer for GDN, never read
    q0,  # fp32 [V, R]
    scratch,  # fp32 [programs, SCR]: per-program words for Y / Q, the Gram matrices, c, fp16(Q) (scratch_words)
    scratch16,  # the same words as fp16
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
    SCR: tl.constexpr,
    BF16_DOTS: tl.constexpr,  # False under the interpreter (its bf16 dot is wrong): the ring's pieces go as fp32
    LIST: tl.constexpr,  # the schedule: False = grid, True = list
    PDL: tl.constexpr,  # (list) launched as a programmatic dependent of due_list_kernel (sm_90 and later)
    AHEAD: tl.constexpr,  # (list, sm_90) L2 prefetch of the inputs of the pair AHEAD places later (0: none)
):
    """The flush of one (slot, head) per program, found by either schedule (the module's docstring):

    grid (``LIST`` False)  grid ``(N, HV)``: program (n, h) flushes (idx[n], h) if it is due and returns otherwise;
                           ``work`` is not read
    list (``LIST`` True)   grid ``(N HV,)``: program p flushes the due pair ``work[1 + p]`` listed by
                           :func:`due_list_kernel`, or returns after one load when p >= ``work[0]``; the due programs
                           come first in launch order, the rest cost one load each, after them. ``idx`` and ``hcnt``
                           are not read."""
    if LIST:
        pid = tl.program_id(0)
        if PDL:
            gdc_wait()  # the due list is complete and visible
        n_due = tl.load(work)
        if pid >= n_due:
            return
        if AHEAD > 0:
            _prefetch(work, n_due, pid + AHEAD, codes, kbuf, ubuf, w, gbuf, HV, SS, K, V, L, R, IS_KDA)
        i_s, i_h, i_sh = _listed_pair(work, pid, HV, True)
        o_scr = pid.to(tl.int64) * SCR
    else:
        i_n, i_h = tl.program_id(0), tl.program_id(1)
        i_s = tl.load(idx + i_n).to(tl.int64)
        if (i_s < FIRST) | (i_s >= NS):
            return
        # (slot, head) row of the dense buffers; int64: NS * HV * L * K passes 2^31 at a few thousand slots
        i_sh = i_s * HV + i_h
        if tl.load(hcnt + i_sh) != L:
            return
        o_scr = (i_n.to(tl.int64) * HV + i_h) * SCR
    _flush_one(o_scr, i_h, i_s, i_sh, codes, skv, uq, kbuf, ubuf, w, pcum, gbuf, q0, scratch, scratch16, SS, K, V,
               L, R, BL, BR, ITERS, IS_KDA, BF16_DOTS)


def num_warps_for(head_k: int, head_v: int) -> int:
    """Warps per program. The [V, K] fp32 state costs V K / (32 num_warps) registers per thread: 64 at 128 x 128
    with 8 warps. 64 x 64 fits 4 warps (32 per thread); 128 x 64 at 4 warps spilled (sm_80, sm_90), so it takes 8."""
    return 4 if head_k * head_v <= 64 * 64 else 8


def maxnreg_for(num_warps: int) -> int | None:
    """Register cap per thread. At 8 warps, 128 registers let two programs share an SM (65,536 registers); the kernel
    then spills 0.2-0.55 KB per thread at ring 16, and is faster than one program per SM uncapped: 601.3 against
    816.8 us all due at 256 x 32 KDA on the H200 (bench/NOTES.md, session 4). 4-warp programs (64 x 64) are left
    uncapped."""
    return 128 if num_warps == 8 else None


# FMA contraction on, as every parity figure was measured: Triton 3.10 turns it off by default (3.9 warns), and
# TRITON_DEFAULT_FP_FUSION=0 in the caller's environment would too
FP_FUSION = dict(enable_fp_fusion=True)


def compile_options(num_warps: int, maxnreg: int | None) -> dict:
    """The options of the flush kernel's build: what :func:`flush_pool` launches and the AOT check compiles."""
    return dict(num_warps=num_warps, num_stages=1, **FP_FUSION, **({"maxnreg": maxnreg} if maxnreg else {}))


def scratch_words(head_k: int, head_v: int, iters: int) -> int:
    """fp32 words of scratch per program: Y / Q [V, 4] (then 1 / s_k), 2 ITERS Gram matrices (4 x 4), c (padded to
    4 words), fp16(Q) [V, 4] and [K] for the KDA decay exp(pcum) (then the column sums of |E|)."""
    return 6 * head_v + 32 * iters + 4 + head_k


def kernel_constants(geometry, convention: str, iters: int) -> dict:
    """The constexpr arguments of :func:`leapquant_flush_kernel` for a pool (also what the AOT check compiles), but
    the schedule's ``LIST`` and ``PDL``, which :func:`flush_pool` adds."""
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
        SCR=scratch_words(g.head_k, g.head_v, iters),
        BF16_DOTS=not _interpreting(),
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
    passes SPEC §4, about 10 % slower (session 2, on the kernel of that time). Triton has open reports of the same kind
    for kernels with several ``tl.dot`` on sm_90 (triton-lang/triton #10486, #11366). Triton reads the switch from the
    environment while it compiles and keys its on-disk cache on it; its in-process cache does not see it, so any launch
    that compiles (the first of each specialisation) must have it: it is set, and restored, around every launch that
    goes through ``JITFunction.run`` (the first of each :class:`~leapquant_triton.launcher.Launcher` key; the launches
    after it call the kept kernel, which cannot compile). The AOT check fails a claimed build whose PTX is not
    ``mma.sync`` (:func:`leapquant_triton.portability.mma_family`).
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


def prefetch_ahead(device: torch.device) -> int:
    """How far ahead in the due list a program of the list schedule prefetches the inputs of another pair into L2
    (``cp.async.bulk.prefetch.L2``, sm_90 and later; 0 elsewhere and under the interpreter): two programs per SM, so
    2 x the SM count is the pair that starts about one round later, on whichever SM frees first. Measured on the H200
    (bench/NOTES.md, session 13): -3 to -4 % all due, -0.7 to -1.3 us at 1/16; four SMs' worth ahead gained less."""
    if not _sm90_or_later(device):
        return 0
    return 2 * torch.cuda.get_device_properties(device).multi_processor_count


def _pdl(device: torch.device) -> bool:
    """Whether the list schedule's kernels launch as programmatic dependents of the kernel before them (sm_90 and
    later, not under the interpreter): a kernel's programs then start while the one before it finishes, and wait for
    it (``griddepcontrol.wait``) before reading what it wrote."""
    return _sm90_or_later(device)


def _sm90_or_later(device: torch.device) -> bool:
    """Whether the kernels are compiled for ``device`` with sm_90's instructions (griddepcontrol, bulk L2 prefetch):
    a CUDA device of capability 9.0 or later, not under the interpreter. A host-side property: no sync."""
    return not _interpreting() and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


# every launch of the two kernels: compiled inside mma_sync_only, launched directly once compiled (launcher.py), from
# the per-pool plans of flush_pool (_plan)
_launch_due_list = Launcher(due_list_kernel, mma_sync_only)
_launch_flush = Launcher(leapquant_flush_kernel, mma_sync_only)


# the two schedules of flush_pool (also the two builds the AOT check compiles: portability.check)
SCHEDULES = ("grid", "list")


def schedule_for(rows: int, heads: int) -> str:
    """The schedule :func:`flush_pool` takes for ``rows`` x ``heads`` programs (the host knows ``N``, not how many are
    due). Measured on the H200 at fc0a630 (bench/NOTES.md, KDA 128 x 128, grid / list): a program that is not due
    still holds an SM slot for two dependent loads (8,192 with none due: 18.2 / 12.6 us); the list's two extra
    launches cost ~3 us on small flushes (one program: 14.0 / 17.1 us). With 1/16 of the heads due, the steady state
    of a ring of 16, the list is faster from ~1,000 programs (1,024: 20.2 / 18.1 us; 8,192: 54.7 / 42.9 us); all due
    it is 1-6 % slower (1,024: 65.6 / 69.4 us; 8,192: 468.5 / 473.5 us). From 2,048 programs the list's gain at 1/16
    outweighs its loss all due."""
    return "list" if rows * heads >= 2048 else "grid"


class _Plan:
    """What :func:`flush_pool` launches for one pool, ``N`` and build, but ``idx`` and the per-call buffers: the
    kernels' static arguments prepared once (:meth:`~leapquant_triton.launcher.Launcher.prepare`), so that an eager
    flush looks at four arguments on the host rather than at all 31 (bench/NOTES.md, session 11). The pool's tensors
    enter the kernels as their addresses and dtypes only (the shapes are the geometry's constants): a plan serves
    any pool over the same memory (:func:`_memory`), as the custom op's pool, made afresh per call over the caller's
    tensors. It holds the tensors it was made with, so their memory cannot be freed and handed to another pool."""

    def __init__(self, pool, tensors: tuple, memory: list, N: int, schedule: str, nw: int, cap: int | None,
                 device: torch.device):
        g = pool.geometry
        self.memory = memory
        consts = kernel_constants(g, pool.convention, pool.iters)
        self.scratch_words = N * g.heads * consts["SCR"]
        pdl = schedule == "list" and _pdl(device)
        ahead = prefetch_ahead(device) if schedule == "list" else 0
        self.grid = (N * g.heads,) if schedule == "list" else (N, g.heads)
        self.work_words = 1 + N * g.heads if schedule == "list" else 0
        codes, skv, uq, kbuf, ubuf, w, pcum, gbuf, q0, hcnt = tensors
        self.flush = _launch_flush.prepare(
            dict(hcnt=hcnt, codes=codes, skv=skv, uq=uq, kbuf=kbuf, ubuf=ubuf, w=w, pcum=pcum,
                 gbuf=gbuf if gbuf is not None else w,  # GDN never reads it
                 q0=q0, NS=g.num_slots, HV=g.heads, SS=g.slot_stride, **consts, LIST=schedule == "list", PDL=pdl,
                 AHEAD=ahead),
            dict(compile_options(nw, cap), launch_pdl=pdl))
        self.due_list = None
        if schedule == "list":
            self.due_list = _launch_due_list.prepare(
                dict(hcnt=hcnt, NS=g.num_slots, HV=g.heads, FIRST=consts["FIRST"], L=g.ring,
                     HB=triton.next_power_of_2(g.heads), PDL=pdl),
                dict(num_warps=1, **FP_FUSION, launch_pdl=pdl))


def _pool_tensors(pool) -> tuple:
    """The pool's tensors the kernels take (``gbuf`` None for GDN)."""
    return (pool.codes, pool.s_kv, pool.uq, pool.kbuf, pool.ubuf, pool.w, pool.pcum, pool.gbuf, pool.q0, pool.hcnt)


def _memory(tensors: tuple) -> list:
    """What the kernels see of the pool's tensors: (address, dtype) each."""
    return [None if t is None else (t.data_ptr(), t.dtype) for t in tensors]


# per pool memory (keyed weakly by the pool's raw tensor: the plans go with it):
# {(geometry, convention, iters, N, schedule, warps, cap, device): _Plan}
_PLANS = WeakIdKeyDictionary()


def _plan(pool, N: int, schedule: str, nw: int, cap: int | None, device: torch.device) -> _Plan:
    plans = _PLANS.get(pool.raw)
    if plans is None:
        plans = _PLANS[pool.raw] = {}
    key = (pool.geometry, pool.convention, pool.iters, N, schedule, nw, cap, device)
    tensors = _pool_tensors(pool)
    memory = _memory(tensors)
    plan = plans.get(key)
    if plan is None or plan.memory != memory:
        plan = plans[key] = _Plan(pool, tensors, memory, N, schedule, nw, cap, device)
    return plan


def flush_pool(pool, idx: torch.Tensor, num_warps: int | None = None, maxnreg: int | None = None,
               schedule: str | None = None) -> None:
    """Launch the flush over ``idx`` (int32 ``[N]``) on ``pool`` in place, with no host synchronisation and the same
    launches for the same pool and ``N``.

    ``schedule="grid"``: one program per (row, head), grid ``(N, HV)``; a program that is not due returns after reading
    ``idx`` and ``hcnt``. ``"list"``: :func:`due_list_kernel` lists the due pairs first, and program p of the flush
    takes pair p: the due programs are launched first, the others return after one load. The default is
    :func:`schedule_for`; ``schedule``, ``num_warps`` and ``maxnreg`` override the tuned defaults (for experiments;
    ``maxnreg=0`` lifts the cap)."""
    g = pool.geometry
    N = idx.numel()
    if N == 0:
        return
    schedule = schedule or schedule_for(N, g.heads)
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, not {schedule!r}")
    nw = num_warps or num_warps_for(g.head_k, g.head_v)
    cap = maxnreg if maxnreg is not None else maxnreg_for(nw)
    plan = _plan(pool, N, schedule, nw, cap, idx.device)
    # from the caching allocator (inside a CUDA graph capture: the graph's pool); due programs only touch their own
    # words
    scratch = torch.empty(plan.scratch_words, dtype=torch.float32, device=idx.device)
    if plan.due_list is None:
        work = idx  # (not read by the grid schedule)
    else:
        work = torch.empty(plan.work_words, dtype=torch.int32, device=idx.device)
        work[:1].zero_()
        plan.due_list((N,), dict(idx=idx, work=work))
    plan.flush(plan.grid, dict(idx=idx, work=work, scratch=scratch, scratch16=scratch.view(torch.float16)))
