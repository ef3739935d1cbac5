"""The LeapQuant flush as Triton kernels, one ``@triton.jit`` function per step of docs/SPEC.md §3 (launches:
:mod:`.flush`; design and measurements: docs/DESIGN.md, "Triton: one program per due pair" and on). One program
flushes one due (slot, head), its state in registers from the rebuild to the codes. Block values (``b_``; ``BR``,
``BL``: rank and ring padded to 16 for ``tl.dot``, the padding zero):

    b_s    [V, K]  fp32  the rebuilt state S, then the residual E, then X = E / s_k
    b_sh   [V, K]  fp16  Sn = c S (c a power of two, max|Sn| in [0.5, 1)), the subspace operand
    b_q16  [V, BR] fp16  fp16(Q), what the products take and the checkpoint stores
    b_ut16 [BR, K] fp16  U^T saturated at +-65504, the layout of uq's rows

``p_`` pointers, ``o_`` offsets and index vectors, ``m_`` masks, ``i_`` the pair's indices. Small values go through
scratch words (L1/L2-resident) to be computed once, not in every thread. ``tl.dot`` is ``mma.sync`` (wgmma miscompiles
this kernel on sm_90: docs/DESIGN.md, "Triton: mma.sync, not wgmma"); why each product has its precision: "Triton:
numerics, product by product".
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .common_kernel import EPS, FLOOR, FP16_MAX, PNMIN, QMAX, ROUND_MAGIC, ROUND_MAGIC_BITS, TINY, _pair_pointers

# rows of idx compared per step of the scan for an earlier row naming the same slot (:func:`_named_before`)
SCAN = tl.constexpr(256)

# thread 0 asks for a pair's checkpoint region and kbuf, ubuf, gbuf and w rows in L2 (flag 0: nothing)
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


# --- which due pairs a call flushes: once each, and only with something in the ring ----------------------------------


@triton.jit
def _named_before(idx, i_n, i_s):
    """How many rows of ``idx`` before row ``i_n`` name slot ``i_s`` (>= 0). Only the first row naming a slot
    flushes it: a repeat would flush it again, and on a GPU two programs would write its region at once."""
    n_same = 0
    start = 0
    # a while, not range(0, i_n): the interpreters of Triton 3.5-3.8 cannot take a program id as a range bound
    while start < i_n:
        o_m = start + tl.arange(0, SCAN)
        b_m = tl.load(idx + o_m, mask=o_m < i_n, other=-1)  # -1 is never a due row's slot
        n_same += tl.sum((b_m.to(tl.int64) == i_s).to(tl.int32), axis=0)
        start += SCAN
    return n_same


@triton.jit
def _ring_has_entries(p_w, p_pc, n_used, K: tl.constexpr, BL: tl.constexpr, IS_KDA: tl.constexpr):
    """Whether the pair's ring holds anything since its last flush: not every ``w`` of its ``n_used`` entries in use
    zero, or the checkpoint's scale not the identity (KDA ``pcum`` not all 0, GDN ``pcum != 1``). A ring in the state
    a flush's reset leaves is not flushed again (SPEC §2): its state is its checkpoint, and re-compressing it would
    only add error. NaN counts as something."""
    o_l = tl.arange(0, BL)
    n_live = tl.sum((tl.load(p_w + o_l, mask=o_l < n_used, other=0.0) != 0.0).to(tl.int32), axis=0)
    if IS_KDA:
        n_live += tl.sum((tl.load(p_pc + tl.arange(0, K)) != 0.0).to(tl.int32), axis=0)
    else:
        n_live += (tl.load(p_pc) != 1.0).to(tl.int32)
    return n_live > 0


# --- the list schedule ------------------------------------------------------------------------------------------------


@triton.jit
def _listed_pair(work, p, HV, live):
    """(slot, head, row) of the due pair ``work[1 + p]`` (pair 0 where not ``live``); an int32 split, not int64."""
    i_sh = tl.load(work + 1 + p, mask=live, other=0)
    i_s = i_sh // HV
    i_h = i_sh - i_s * HV
    return i_s.to(tl.int64), i_h, i_sh.to(tl.int64)


@triton.jit
def _prefetch(work, n_due, q, codes, kbuf, ubuf, w, gbuf, HV, SS, HS, K: tl.constexpr, V: tl.constexpr,
              L: tl.constexpr, R: tl.constexpr, IS_KDA: tl.constexpr):
    """The inputs of the due pair ``work[1 + q]`` into L2, for its program about one round later."""
    live = q < n_due
    i_s, i_h, i_sh = _listed_pair(work, q, HV, live)
    a_reg = (codes + (i_s * SS + i_h * HS) * 4).to(tl.int64, bitcast=True)
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
def due_list_kernel(idx, hcnt, work, NS, HV, FIRST: tl.constexpr, L: tl.constexpr, HB: tl.constexpr,
                    PDL: tl.constexpr):
    """Grid ``(N,)``: appends row n's due pairs as ``slot HV + head`` to ``work[1:]`` and counts them in ``work[0]``
    (zeroed before): one atomic add per row, a prefix sum within it. A pair is listed if it is due and row n is the
    first row naming its slot (at most once per call); whether its ring holds anything the flush program asks itself
    (from L1, after its loads: reading the rings here would make the list one dependent load longer)."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()  # the flush may start: it waits for this grid before reading work
    i_n = tl.program_id(0)
    i_s = tl.load(idx + i_n).to(tl.int64)
    o_h = tl.arange(0, HB)
    # a select: Triton 3.9's interpreter rejects `&` of a block and a scalar comparison as a mask
    m_h = tl.where((i_s >= FIRST) & (i_s < NS), o_h < HV, False)
    b_due = tl.load(hcnt + i_s * HV + o_h, mask=m_h, other=0) == L
    b_due = tl.where(_named_before(idx, i_n, i_s) == 0, b_due, False).to(tl.int32)
    n_due = tl.sum(b_due, axis=0)
    if n_due > 0:
        base = tl.atomic_add(work, n_due)
        tl.store(work + 1 + base + tl.cumsum(b_due, axis=0) - b_due, (i_s * HV + o_h).to(tl.int32), mask=b_due > 0)


# --- where a pair's values are ----------------------------------------------------------------------------------------


@triton.jit
def _region_and_scratch(scratch, scratch16, o_scr, i_s, i_h, SS, HS, K: tl.constexpr, V: tl.constexpr,
                        ITERS: tl.constexpr):
    """The pair's first word in the pool (slot stride ``SS``, head stride ``HS`` words: the layout's), and the
    program's scratch words (:func:`.flush.scratch_words`): Y / Q [V, 4] (later 1 / s_k), two Gram matrices per ITERS,
    c, fp16(Q) [V, 4], exp(pcum) [K] (later the column sums of |E|)."""
    o_reg = i_s * SS + i_h * HS
    p_y = scratch + o_scr
    p_gram = p_y + 4 * V
    p_cn = p_gram + 32 * ITERS
    p_q16 = scratch16 + (o_scr + 32 * ITERS + 4 * V + 4) * 2
    p_e = p_cn + 4 + 2 * V
    return o_reg, p_y, p_gram, p_cn, p_q16, p_e


@triton.jit
def _ranges(K: tl.constexpr, V: tl.constexpr, L: tl.constexpr, R: tl.constexpr, BL: tl.constexpr,
            BR: tl.constexpr):
    o_l = tl.arange(0, BL)
    o_r = tl.arange(0, BR)
    return tl.arange(0, K), tl.arange(0, V), o_l, o_r, o_l < L, o_r < R


@triton.jit
def _q16_tile(p_q16, V: tl.constexpr, BR: tl.constexpr):
    """fp16(Q) [V, 4] at ``p_q16`` as the [V, BR] tile the products take (pointers, mask)."""
    o_v, o_r = tl.arange(0, V), tl.arange(0, BR)
    return p_q16 + o_v[:, None] * 4 + o_r[None, :], (o_r[None, :] < 4) & (o_v[:, None] < V)


# --- steps 1-4: the rebuild -------------------------------------------------------------------------------------------


@triton.jit
def _pin(b_x):
    """An opaque move: Triton converts the dot operand here, not at the loads with the arithmetic in every warp."""
    return tl.inline_asm_elementwise("mov.b16 $0, $1;", "=h,h", [b_x], dtype=tl.bfloat16, is_pure=False, pack=1)


@triton.jit
def _ring_chunk(p_k, p_u, p_w, p_g, n_used, c: tl.constexpr, K: tl.constexpr, V: tl.constexpr, L: tl.constexpr,
                IS_KDA: tl.constexpr):
    """Ring entries 16 c .. 16 c + 15 of the ``n_used`` in use (``L``, or a forced flush's fill count; zero past
    them, whatever those entries hold): ubuf^T [V, 16] and the decayed keys [16, K] as three bf16 pieces, largest
    first, whose sum is exact (so is every product with ubuf)."""
    o_k = tl.arange(0, K)
    o_j = c * 16 + tl.arange(0, 16)
    m_j = o_j < n_used
    b_kd = tl.load(p_k + o_j[:, None] * K + o_k[None, :], mask=m_j[:, None], other=0.0).to(tl.float32)
    if IS_KDA:
        # d_j = prod_{j<i<n_used} gbuf[i] from i = L-1 down, as the reference (a tl.cumprod would cross the warps)
        b_d = tl.full([16, K], 1.0, tl.float32)
        for i in tl.static_range(L - 1, c * 16, -1):
            # a select, not `&`: Triton 3.9's interpreter rejects `&` of a block and a scalar comparison as a mask
            b_gi = tl.load(p_g + i * K + o_j[:, None] * 0 + o_k[None, :],
                           mask=tl.where(i < n_used, o_j[:, None] < i, False), other=1.0)
            b_d = b_d * b_gi.to(tl.float32)
        b_kd = b_kd * b_d
    b_kd = b_kd * tl.load(p_w + o_j, mask=m_j, other=0.0)[:, None]
    b_k1 = b_kd.to(tl.bfloat16)
    b_r1 = b_kd - b_k1.to(tl.float32)
    b_k2 = b_r1.to(tl.bfloat16)
    b_k3 = (b_r1 - b_k2.to(tl.float32)).to(tl.bfloat16)
    b_ut = tl.load(p_u + o_j[None, :] * V + tl.arange(0, V)[:, None], mask=m_j[None, :], other=0.0)
    return b_ut, b_k1, b_k2, b_k3


@triton.jit
def _ring_dots(b_s, b_ut, b_k1, b_k2, b_k3, BF16_DOTS: tl.constexpr):
    """``b_s + ubuf^T kd`` for one chunk, the small pieces first."""
    if BF16_DOTS:
        b_s = tl.dot(b_ut, _pin(b_k3), acc=b_s)
        b_s = tl.dot(b_ut, _pin(b_k2), acc=b_s)
        b_s = tl.dot(b_ut, _pin(b_k1), acc=b_s)
    else:  # the interpreter's bf16 dot is wrong: the same exact products in fp32
        b_ut = b_ut.to(tl.float32)
        b_s = tl.dot(b_ut, b_k3.to(tl.float32), acc=b_s)
        b_s = tl.dot(b_ut, b_k2.to(tl.float32), acc=b_s)
        b_s = tl.dot(b_ut, b_k1.to(tl.float32), acc=b_s)
    return b_s


@triton.jit
def _rebuild(p_c, p_skv, p_uq, p_k, p_u, p_w, p_pc, p_g, p_q0, p_e, p_qt, m_q, n_used, K: tl.constexpr,
             V: tl.constexpr, L: tl.constexpr, R: tl.constexpr, BL: tl.constexpr, BR: tl.constexpr,
             IS_KDA: tl.constexpr, BF16_DOTS: tl.constexpr):
    """Steps 1-4: S = (Dq + Lo) * scale + Ring [V, K] over the ring's first ``n_used`` entries (``L``, or a forced
    flush's fill count); writes fp16(Q0) to ``p_qt`` and (KDA) exp(pcum) to ``p_e``. Every input is loaded before the
    first barrier, so that their latencies overlap."""
    o_k, o_v, _, o_r, _, m_r = _ranges(K, V, L, R, BL, BR)
    b_pc = tl.load(p_pc + o_k) if IS_KDA else tl.load(p_pc)
    b_q0 = tl.load(p_q0 + o_v[:, None] * R + o_r[None, :], mask=m_r[None, :], other=0.0)
    b_sk = tl.load(p_skv + o_k)
    b_sv = tl.load(p_skv + K + o_v)
    b_c = tl.load(p_c)
    b_qo = tl.load(p_uq + o_r[None, :] * (K + V) + K + o_v[:, None], mask=m_r[None, :], other=0.0)
    b_uo = tl.load(p_uq + o_r[:, None] * (K + V) + o_k[None, :], mask=m_r[:, None], other=0.0)
    b_ut, b_k1, b_k2, b_k3 = _ring_chunk(p_k, p_u, p_w, p_g, n_used, 0, K, V, L, IS_KDA)
    tl.store(p_qt, b_q0.to(tl.float16), mask=m_q)
    if IS_KDA:
        tl.store(p_e + o_k, tl.exp(b_pc))
    tl.debug_barrier()
    # the codes to fp32 by an integer add, not I2F; ``/`` here and in _quantise is the fast division (2 ulp)
    b_cf = (b_c.to(tl.int32) + ROUND_MAGIC_BITS).to(tl.float32, bitcast=True) - ROUND_MAGIC
    b_s = b_cf * (b_sv / QMAX)[:, None] * b_sk[None, :]
    b_s = tl.dot(b_qo, b_uo, acc=b_s)
    if IS_KDA:
        b_s *= tl.load(p_e + o_k)[None, :]
    else:
        b_s *= tl.maximum(b_pc, PNMIN)
    # the ring 16 entries at a time: whole-ring operands spill at L = 32
    b_s = _ring_dots(b_s, b_ut, b_k1, b_k2, b_k3, BF16_DOTS)
    for c in tl.static_range(1, BL // 16):
        b_ut, b_k1, b_k2, b_k3 = _ring_chunk(p_k, p_u, p_w, p_g, n_used, c, K, V, L, IS_KDA)
        b_s = _ring_dots(b_s, b_ut, b_k1, b_k2, b_k3, BF16_DOTS)
    return b_s


# --- step 5: the subspace iteration -----------------------------------------------------------------------------------


@triton.jit
def _cholesky(p_y, p_g, V: tl.constexpr, R: tl.constexpr):
    """Cholesky of G = Y^T Y (Y [V, 4] at ``p_y``) with the SPEC's floor: (L's lower entries, 1 / pivots; 1 past R).
    G goes through ``p_g`` so that every thread factorises it from scalars, with no reductions or barriers."""
    o_v = tl.arange(0, V)
    o_4 = tl.arange(0, 4)
    b_y = tl.load(p_y + o_v[:, None] * 4 + o_4[None, :])
    b_g = tl.sum(b_y[:, :, None] * b_y[:, None, :], axis=0)
    tl.store(p_g + o_4[:, None] * 4 + o_4[None, :], b_g)
    tl.debug_barrier()
    l10, l20, l21, l30, l31, l32 = 1.0, 1.0, 1.0, 1.0, 1.0, 1.0
    i11, i22, i33 = 1.0, 1.0, 1.0
    g00 = tl.load(p_g)
    # g * FLOOR, not FLOOR * g: the interpreters of Triton 3.7 and 3.8 fail on the latter
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
    tl.store(p + o_v * 4, q0)
    if R > 1:
        tl.store(p + o_v * 4 + 1, q1)
    if R > 2:
        tl.store(p + o_v * 4 + 2, q2)
    if R > 3:
        tl.store(p + o_v * 4 + 3, q3)


@triton.jit
def _cholqr(p_y, p_g, p_q16, V: tl.constexpr, R: tl.constexpr, STORE16: tl.constexpr):
    """One CholeskyQR step on Y [V, 4] at ``p_y`` (columns >= R zero): Q = Y L^{-T} by forward substitution over the
    columns, stored over Y, or (``STORE16``) as fp16 at ``p_q16``."""
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
    tl.debug_barrier()  # Y is read before Q overwrites it
    if STORE16:
        _store_columns(p_q16, o_v, q0.to(tl.float16), q1.to(tl.float16), q2.to(tl.float16), q3.to(tl.float16), R)
    else:
        _store_columns(p_y, o_v, q0, q1, q2, q3, R)
    tl.debug_barrier()


@triton.jit
def _cholqr2(p_y, p_g, p_q16, V: tl.constexpr, R: tl.constexpr):
    """Q = CholQR(CholQR(Y)) for Y at ``p_y``, the two Gram matrices at ``p_g``: fp16(Q) at ``p_q16``."""
    _cholqr(p_y, p_g, p_q16, V, R, False)
    _cholqr(p_y, p_g + 16, p_q16, V, R, True)


@triton.jit
def _subspace_iteration(b_s, p_y, p_gram, p_cn, p_q16, p_qt, m_q, V: tl.constexpr, R: tl.constexpr,
                        BR: tl.constexpr, ITERS: tl.constexpr):
    """Step 5 from fp16(Q0) at ``p_q16``: ITERS times P = Sn^T Q, Y = Sn P, Q = CholQR2(Y) on Sn = c S; leaves
    fp16(Q) in its place and c at ``p_cn``."""
    a_max = tl.max(tl.max(tl.abs(b_s), axis=1), axis=0)
    e_max = (a_max.to(tl.int32, bitcast=True) >> 23) & 0xFF
    e_max = tl.minimum(tl.maximum(e_max, 1), 252)
    c_norm = ((253 - e_max) << 23).to(tl.float32, bitcast=True)  # 2^(126 - e): max|c S| in [0.5, 1)
    b_sh = (b_s * c_norm).to(tl.float16)
    tl.store(p_cn, c_norm)
    o_v, o_r = tl.arange(0, V), tl.arange(0, BR)
    for it in tl.static_range(ITERS):
        # fp16(Q) loaded as fp16 goes through shared memory as fp16 (converted after the load, it would as fp32)
        b_q16 = tl.load(p_qt, mask=m_q, other=0.0)
        b_p = tl.dot(tl.trans(b_sh), b_q16)
        b_y = tl.dot(b_sh, b_p.to(tl.float16))
        tl.store(p_y + o_v[:, None] * 4 + o_r[None, :], b_y, mask=o_r[None, :] < 4)
        tl.debug_barrier()
        _cholqr2(p_y, p_gram + 32 * it, p_q16, V, R)


# --- steps 6-10: factors, residual, scales, codes, stores -------------------------------------------------------------


@triton.jit
def _new_factors(b_s, p_cn, p_qt, m_q):
    """Step 6: (q16 [V, BR], u16^T [BR, K]). U is taken on Sn, as the seed does (the residual absorbs its
    rounding), formed again from c: Sn is not kept in registers through the CholeskyQR2."""
    b_q16 = tl.load(p_qt, mask=m_q, other=0.0)
    c_back = tl.load(p_cn)
    b_u = tl.dot(tl.trans((b_s * c_back).to(tl.float16)), b_q16) * tl.math.div_rn(1.0, c_back)
    b_ut16 = tl.trans(tl.minimum(tl.maximum(b_u, -FP16_MAX), FP16_MAX).to(tl.float16))
    return b_q16, b_ut16


@triton.jit
def _residual(b_s, b_q16, b_ut16):
    """Step 7: E = S - q16 u16^T, exact products of the stored factors onto S."""
    return tl.dot(-b_q16, b_ut16, acc=b_s)


@triton.jit
def _column_scales(b_s, p_skv, p_e, p_y, K: tl.constexpr, V: tl.constexpr, BF16_DOTS: tl.constexpr):
    """Step 8: stores s_k at ``p_skv``, returns X = E / s_k. The column sums of |E| are a bf16 product with a ones
    column, as the seed's (a reduction over V would shuffle); they and 1 / s_k go through scratch, once per column."""
    o_k = tl.arange(0, K)
    o_16 = tl.arange(0, 16)
    if BF16_DOTS:
        b_cs = tl.dot(tl.trans(tl.abs(b_s).to(tl.bfloat16)),
                      tl.where(o_16[None, :] == 0, 1.0, 0.0).to(tl.bfloat16) + tl.zeros([V, 16], tl.bfloat16))
    else:
        b_cs = tl.dot(tl.trans(tl.abs(b_s)), tl.where(o_16[None, :] == 0, 1.0, 0.0) + tl.zeros([V, 16], tl.float32))
    tl.store(p_e + o_k[:, None] + o_16[None, :], b_cs, mask=o_16[None, :] == 0)
    tl.debug_barrier()
    m_k = tl.load(p_e + o_k) * (1.0 / V)
    tl.store(p_skv + o_k, tl.maximum(tl.sqrt(m_k), EPS))
    # 1 / s_k as one fast rsqrt, in Y's words (free since the CholeskyQR2)
    tl.store(p_y + o_k, tl.minimum(tl.math.rsqrt(m_k), 1.0 / EPS))
    tl.debug_barrier()
    return b_s * tl.load(p_y + o_k)[None, :]


@triton.jit
def _quantise(b_x):
    """Step 9: (codes, s_v); |X| <= s_v needs no clamp, and the low byte of x + ROUND_MAGIC is the code."""
    b_sv = tl.maximum(tl.max(tl.abs(b_x), axis=1), EPS)
    b_x = b_x * ((tl.zeros_like(b_sv) + QMAX) / b_sv)[:, None]
    return (b_x + ROUND_MAGIC).to(tl.int32, bitcast=True).to(tl.int8), b_sv


@triton.jit
def _store_checkpoint(p_c, p_skv, p_uq, b_c, b_sv, b_ut16, b_q16, o_k, o_v, o_r, m_r, K: tl.constexpr,
                      V: tl.constexpr):
    """Step 10: the codes, s_v and uq = u16 | q16 (s_k: :func:`_column_scales`)."""
    tl.store(p_c, b_c)
    # as a [V, 1] tile: for a 1-D store Triton would move the whole state to the store's layout
    tl.store(p_skv + K + o_v[:, None], b_sv[:, None])
    tl.store(p_uq + o_r[:, None] * (K + V) + o_k[None, :], b_ut16, mask=m_r[:, None])
    m_rv = m_r[None, :] & (o_v[:, None] < V)
    tl.store(p_uq + o_r[None, :] * (K + V) + K + o_v[:, None], b_q16, mask=m_rv)


@triton.jit
def _reset_ring(p_w, p_pc, p_g, o_k, o_l, m_l, K: tl.constexpr, BL: tl.constexpr, IS_KDA: tl.constexpr):
    """Step 10: the ring resets of SPEC §2."""
    tl.store(p_w + o_l, tl.zeros([BL], dtype=tl.float32), mask=m_l)
    if IS_KDA:
        tl.store(p_pc + o_k, tl.zeros([K], dtype=tl.float32))
        tl.store(p_g + o_l[:, None] * K + o_k[None, :], tl.full([BL, K], 1.0, dtype=tl.float16), mask=m_l[:, None])
    else:
        tl.store(p_pc, 1.0)


@triton.jit
def _compress(b_s, p_c, p_skv, p_uq, p_w, p_pc, p_g, p_y, p_gram, p_cn, p_q16, p_qt, m_q, p_e, o_k, o_v, o_l, o_r, m_l,
              m_r, K: tl.constexpr, V: tl.constexpr, R: tl.constexpr, BL: tl.constexpr, BR: tl.constexpr,
              ITERS: tl.constexpr, IS_KDA: tl.constexpr, BF16_DOTS: tl.constexpr):
    """Steps 5-10 on the state ``b_s`` from fp16(Q0) at ``p_q16``: the new checkpoint stored, the ring reset."""
    _subspace_iteration(b_s, p_y, p_gram, p_cn, p_q16, p_qt, m_q, V, R, BR, ITERS)
    b_q16, b_ut16 = _new_factors(b_s, p_cn, p_qt, m_q)
    b_s = _residual(b_s, b_q16, b_ut16)
    b_s = _column_scales(b_s, p_skv, p_e, p_y, K, V, BF16_DOTS)
    b_c, b_sv = _quantise(b_s)
    _store_checkpoint(p_c, p_skv, p_uq, b_c, b_sv, b_ut16, b_q16, o_k, o_v, o_r, m_r, K, V)
    _reset_ring(p_w, p_pc, p_g, o_k, o_l, m_l, K, BL, IS_KDA)


# --- the flush --------------------------------------------------------------------------------------------------------


@triton.jit
def leapquant_flush_kernel(idx, hcnt, work, codes, skv, uq, kbuf, ubuf, w, pcum, gbuf, q0, scratch, scratch16, NS, HV,
                           SS, HS, FIRST: tl.constexpr, K: tl.constexpr, V: tl.constexpr, L: tl.constexpr,
                           R: tl.constexpr, BL: tl.constexpr, BR: tl.constexpr, ITERS: tl.constexpr,
                           IS_KDA: tl.constexpr, SCR: tl.constexpr, BF16_DOTS: tl.constexpr, LIST: tl.constexpr,
                           PDL: tl.constexpr, AHEAD: tl.constexpr, FORCE: tl.constexpr):
    """The flush, in place, of one due (slot, head) per program. ``LIST`` False: grid (N, HV), program (n, h) takes
    (idx[n], h) if it is due; True: grid (N HV,), program p the p-th pair of ``work`` (:func:`due_list_kernel`; ``PDL``:
    launched as its dependent; ``AHEAD``: the L2 prefetch distance). ``codes``, ``skv``, ``uq``: int8, fp32, fp16 views
    of the pool, region (n, h) at word n SS + h HS (SPEC §2: HS = V K in the engine layout, the rounded checkpoint in
    the compact one); ``scratch``, ``scratch16``: SCR words per program. ``FORCE``: the forced flush (SPEC §2), grid
    schedule only: every ring holding an entry is due, read up to its fill count, and a flushed pair's ``hcnt`` set
    to L."""
    tl.static_assert(not (LIST and FORCE), "the forced flush takes the grid schedule")
    # the ring entries in use: all L, or a forced flush's fill count (below)
    n_used = L
    if LIST:
        pid = tl.program_id(0)
        if PDL:
            gdc_wait()
        n_due = tl.load(work)
        if pid >= n_due:
            return
        if AHEAD > 0:
            _prefetch(work, n_due, pid + AHEAD, codes, kbuf, ubuf, w, gbuf, HV, SS, HS, K, V, L, R, IS_KDA)
        i_s, i_h, i_sh = _listed_pair(work, pid, HV, True)
        o_scr = pid.to(tl.int64) * SCR
    else:
        i_n, i_h = tl.program_id(0), tl.program_id(1)
        i_s = tl.load(idx + i_n).to(tl.int64)
        if (i_s < FIRST) | (i_s >= NS):
            return
        i_sh = i_s * HV + i_h  # int64: NS HV L K passes 2^31 at a few thousand slots
        if FORCE:
            # due: the ring holds an entry and cannot hold FORCE more (L: any entry; T: before T tokens, SPEC §6.1)
            n_used = tl.load(hcnt + i_sh)
            if (n_used < 1) | (n_used > L) | (n_used + FORCE <= L):
                return
        else:
            if tl.load(hcnt + i_sh) != L:
                return
        o_scr = (i_n.to(tl.int64) * HV + i_h) * SCR
    o_k, o_v, o_l, o_r, m_l, m_r = _ranges(K, V, L, R, BL, BR)
    o_reg, p_y, p_gram, p_cn, p_q16, p_e = _region_and_scratch(scratch, scratch16, o_scr, i_s, i_h, SS, HS, K, V,
                                                               ITERS)
    p_qt, m_q = _q16_tile(p_q16, V, BR)
    p_c, p_skv, p_uq, p_k, p_u, p_w, p_pc, p_g = _pair_pointers(codes, skv, uq, kbuf, ubuf, w, pcum, gbuf, o_reg,
                                                                i_sh, K, V, L, IS_KDA)
    b_s = _rebuild(p_c, p_skv, p_uq, p_k, p_u, p_w, p_pc, p_g, q0, p_e, p_qt, m_q, n_used, K, V, L, R, BL, BR, IS_KDA,
                   BF16_DOTS)
    if not LIST:
        # what due_list_kernel decides for the list: once per call. Here, after the rebuild's loads, so that the
        # scan's latency is not added before them; the pool is not written before this point
        if _named_before(idx, i_n, i_s) > 0:
            return
    # nothing for an empty ring (both schedules): its w and pcum come from L1 after the rebuild's loads
    if not _ring_has_entries(p_w, p_pc, n_used, K, BL, IS_KDA):
        return
    _compress(b_s, p_c, p_skv, p_uq, p_w, p_pc, p_g, p_y, p_gram, p_cn, p_q16, p_qt, m_q, p_e, o_k, o_v, o_l, o_r, m_l,
              m_r, K, V, R, BL, BR, ITERS, IS_KDA, BF16_DOTS)
    if FORCE:
        # "flushed, next entry 0" (SPEC §2): no program of this launch reads this pair's hcnt after its own load but
        # a later row naming the same slot, which finds it due either way and stops at the first-row scan above
        tl.store(hcnt + i_sh, L)
