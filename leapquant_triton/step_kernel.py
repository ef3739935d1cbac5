"""The LeapQuant decode step (docs/SPEC.md §6) as Triton kernels (launched by :mod:`.step` after the flush of the full
rings).

One program per (row n of ``idx``, value head hv), grid ``(N, HV)``; value head hv reads key head
``hv // (HV / H)``. It reads the checkpoint region once and never forms the state. Both keys it serves, ``k`` (the
prediction ``p = S' k``) and ``q`` (the output ``o = scale S_t q``), go through one [V, 16] accumulator on the tensor
cores, columns 0-7 for k and 8-15 for q:

    b_cd          [V, K]   the int8 codes, as they are stored
    b_xs          [K, 16]  s_k * key * the checkpoint's decay as four int8 pieces per key (27 bits, exact products:
                           int8 x int8 -> int32), columns 0-3 and 8-11; scaled back per column
    b_acc         [V, 16]  (s_v / QMAX) (C x) per piece, + q_r a_r (the old rank-R part, a_r = u_r . (key * decay))
                           + ubuf^T [V, BL] x the bf16 pieces of c_k, c_q [BL, 16] (the ring: three pieces, exact)
    b_ck, b_cq    [BL]     w_i (kd_i . k), w_i (kd_i . q) for the entries i < j, kd_i the ring key times its decay
                           d_i (KDA: the suffix product of the shifted gates, SPEC §6 step 2)

so ``p`` and ``S_t q`` are the sums of the accumulator's two column halves: every product is exact and only the sums
round (fp32, tensor-core order). int8 mma exists from sm_75 on; Triton lowers the bf16 product for sm_75 (no bf16
tensor cores) to FMAs. Only the entries i < j of the ring are loaded (masked, zero or one where not), so whatever the
others hold, NaN included, is never read. A program writes only its own ring row (entry j of kbuf, ubuf, gbuf; w;
pcum; hcnt) and its row of ``out``: splitting V over programs would race on those. Within the program, the values
it reads and then overwrites (pcum, w, hcnt) are stored after a barrier: their small blocks are replicated over the
warps, and a warp that stored early would change what a later one reads.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice

from .common_kernel import PNMIN, QMAX, ROUND_MAGIC, ROUND_MAGIC_BITS, _pair_pointers
from .gate_math import gate_values

# FLA's use_qk_l2norm_in_kernel: x / sqrt(sum x^2 + L2NORM_EPS)
L2NORM_EPS = tl.constexpr(1e-6)


@triton.jit
def _exp(b_x, NATIVE: tl.constexpr):
    """exp as torch's CUDA kernel computes it (libdevice's expf, so the gates it stores match bit for bit); the
    interpreter has no libdevice."""
    if NATIVE:
        return libdevice.exp(b_x)
    else:
        return tl.exp(b_x)


@triton.jit
def _bf16(b_x, NATIVE: tl.constexpr):
    """fp32 to bf16 rounded to nearest even (the interpreter's conversion truncates: there, by the bits)."""
    if NATIVE:
        return b_x.to(tl.bfloat16)
    else:
        b_b = b_x.to(tl.uint32, bitcast=True)
        b_b = (b_b + 0x7FFF + ((b_b >> 16) & 1)) >> 16
        return b_b.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _store_out(p, b_x, NATIVE: tl.constexpr):
    """``b_x`` (fp32) stored in the dtype of ``p``, rounded to nearest even."""
    if p.dtype.element_ty == tl.bfloat16:
        tl.store(p, _bf16(b_x, NATIVE))
    else:
        tl.store(p, b_x.to(p.dtype.element_ty))


@triton.jit
def _load_key(p, USE_QK_L2NORM: tl.constexpr, K: tl.constexpr):
    """A [K] key in fp32, l2-normalised with correctly rounded sqrt and division (what kbuf stores is its bf16)."""
    b_x = tl.load(p + tl.arange(0, K)).to(tl.float32)
    if USE_QK_L2NORM:
        b_x = tl.math.div_rn(b_x, tl.sqrt_rn(tl.sum(b_x * b_x, axis=0) + L2NORM_EPS))
    return b_x


@triton.jit
def _gate(b_g, p_pc, p_w, p_gb, j, o_k, o_l, m_old, K: tl.constexpr, IS_KDA: tl.constexpr, NATIVE: tl.constexpr):
    """SPEC §6 step 1 for the token's log decay ``b_g`` (fp32, [K] for KDA, GDN a scalar), not stored yet: (the new
    pcum, the checkpoint's decay [K] (KDA exp(pcum); GDN max(pcum, PNMIN)), the ring's weights w [L] (GDN: times a;
    zero from j on), (KDA) fp16(exp g) [K] and the shifted gates ``gbuf[i + 1]`` [L, K] (the new one at row j - 1, one
    from there on); GDN: placeholders)."""
    b_w = tl.load(p_w + o_l, mask=m_old, other=0.0)
    if IS_KDA:
        b_pc = tl.load(p_pc + o_k) + b_g
        b_gn = _exp(b_g, NATIVE).to(tl.float16)
        # row i holds gbuf[i + 1], the factor entry i takes from the entry after it
        m_next = (o_l + 1 < j)[:, None] & (o_k[None, :] < K)
        b_gs = tl.load(p_gb + (o_l[:, None] + 1) * K + o_k[None, :], mask=m_next, other=1.0).to(tl.float32)
        b_gs = tl.where((o_l + 1 == j)[:, None], b_gn.to(tl.float32)[None, :], b_gs)
        return b_pc, _exp(b_pc, NATIVE), b_w, b_gn, b_gs
    else:
        b_a = _exp(b_g, NATIVE)
        b_pc = tl.load(p_pc) * b_a
        return b_pc, tl.maximum(b_pc, PNMIN), b_w * b_a, b_a, b_a


@triton.jit
def _ring_keys(p_kb, b_k, b_q, b_w, b_gs, o_k, o_l, m_old, K: tl.constexpr, IS_KDA: tl.constexpr):
    """(w_i (kd_i . k), w_i (kd_i . q)) [BL] for the entries i < j (zero elsewhere), ``kd_i = kbuf[i] * d_i`` with
    ``d_i = prod_{i < m <= j} gbuf[m]`` (KDA; the suffix product of the shifted gates)."""
    b_kd = tl.load(p_kb + o_l[:, None] * K + o_k[None, :], mask=m_old[:, None] & (o_k[None, :] < K),
                   other=0.0).to(tl.float32)
    if IS_KDA:
        b_kd = b_kd * tl.cumprod(b_gs, axis=0, reverse=True)
    return b_w * tl.sum(b_kd * b_k[None, :], axis=1), b_w * tl.sum(b_kd * b_q[None, :], axis=1)


@triton.jit
def _bf16_pieces(b_x, NATIVE: tl.constexpr):
    """Three bf16 values (as fp32) whose sum is ``b_x`` exactly: 8 + 8 + 8 bits of its 24."""
    b_1 = _bf16(b_x, NATIVE).to(tl.float32)
    b_r = b_x - b_1
    b_2 = _bf16(b_r, NATIVE).to(tl.float32)
    return b_1, b_2, _bf16(b_r - b_2, NATIVE).to(tl.float32)


@triton.jit
def _piece_rows(b_a, b_b, o_c, NATIVE: tl.constexpr):
    """[E, 16]: the bf16 pieces of ``a`` [E] in columns 0-2 and of ``b`` in columns 8-10, zero elsewhere."""
    b_a1, b_a2, b_a3 = _bf16_pieces(b_a, NATIVE)
    b_b1, b_b2, b_b3 = _bf16_pieces(b_b, NATIVE)
    c = o_c[None, :]
    b_t = tl.where(c == 0, b_a1[:, None], 0.0)
    b_t = tl.where(c == 1, b_a2[:, None], b_t)
    b_t = tl.where(c == 2, b_a3[:, None], b_t)
    b_t = tl.where(c == 8, b_b1[:, None], b_t)
    b_t = tl.where(c == 9, b_b2[:, None], b_t)
    return tl.where(c == 10, b_b3[:, None], b_t)


@triton.jit
def _store_ring_row(p_pc, p_w, p_gb, p_kb, p_h, b_pc, b_w, b_gn, b_kj, b_beta, j, o_k, o_l, K: tl.constexpr,
                    IS_KDA: tl.constexpr):
    """The ring row's new values (SPEC §6 steps 1 and 4): pcum; w (GDN: every i < j decayed) with w[j] = beta; KDA
    gbuf[j]; kbuf[j]; hcnt = j + 1. An invalid negative count writes no entry, as the reference (the masks are
    selects: see flush_kernel.due_list_kernel)."""
    m_new = tl.where(j >= 0, o_k < K, False)
    if IS_KDA:
        tl.store(p_pc + o_k, b_pc)
        tl.store(p_gb + j * K + o_k, b_gn, mask=m_new)
        tl.store(p_w + o_l, tl.zeros_like(b_w) + b_beta, mask=o_l == j)
    else:
        tl.store(p_pc, b_pc)
        tl.store(p_w + o_l, tl.where(o_l == j, b_beta, b_w), mask=o_l <= j)
    tl.store(p_kb + j * K + o_k, b_kj, mask=m_new)
    tl.store(p_h, j + 1)


@triton.jit
def _pow2(b_e):
    """2^e as fp32 from its exponent bits, for integer e in [-126, 127]."""
    return ((b_e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _int8_pieces(b_x):
    """``x`` [K] fp32 as four int8 pieces x1..x4 and an exponent t: ``x ~ 2^-t (x1 + x2 / 128 + x3 / 128^2 +
    x4 / 128^3)``, error at most 2^-28 max|x| (27 bits, more than fp32's 24, where max|x| is normal). Scaled so that
    max|x| lies in [32, 64): every piece lies in [-64, 64]. 2^t goes as two factors 2^t1 2^t2, each within fp32's
    normal range whatever max|x| (2^-149 .. 2^128). Each round takes round-half-even(r) from r + ROUND_MAGIC (exact
    for |r| < 2^22), in the kernel and the interpreter alike."""
    b_m = tl.max(tl.abs(b_x), axis=0)
    b_t = 5 - (((b_m.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127)
    b_t = tl.where(b_m > 0, b_t, 0)
    b_t1 = b_t >> 1
    b_t2 = b_t - b_t1
    b_r = (b_x * _pow2(b_t1)) * _pow2(b_t2)
    b_r1 = b_r + ROUND_MAGIC
    b_x1 = b_r1.to(tl.int32, bitcast=True) - ROUND_MAGIC_BITS
    b_r = (b_r - (b_r1 - ROUND_MAGIC)) * 128.0
    b_r1 = b_r + ROUND_MAGIC
    b_x2 = b_r1.to(tl.int32, bitcast=True) - ROUND_MAGIC_BITS
    b_r = (b_r - (b_r1 - ROUND_MAGIC)) * 128.0
    b_r1 = b_r + ROUND_MAGIC
    b_x3 = b_r1.to(tl.int32, bitcast=True) - ROUND_MAGIC_BITS
    b_r = (b_r - (b_r1 - ROUND_MAGIC)) * 128.0
    b_x4 = (b_r + ROUND_MAGIC).to(tl.int32, bitcast=True) - ROUND_MAGIC_BITS
    return b_x1, b_x2, b_x3, b_x4, b_t1, b_t2


@triton.jit
def _piece_columns(b_x1, b_x2, b_x3, b_x4, o_c, FIRST: tl.constexpr):
    """The four pieces as columns FIRST .. FIRST + 3 of a [K, 16] int32 tile (zero elsewhere)."""
    b_p = tl.where(o_c[None, :] == FIRST, b_x1[:, None], 0)
    b_p = tl.where(o_c[None, :] == FIRST + 1, b_x2[:, None], b_p)
    b_p = tl.where(o_c[None, :] == FIRST + 2, b_x3[:, None], b_p)
    return tl.where(o_c[None, :] == FIRST + 3, b_x4[:, None], b_p)


@triton.jit
def _row(idx, out, i_n, i_n64, i_hv, so_n, so_h):
    """(row n's output pointer for head hv, its slot ``idx[n]`` as int64)."""
    p_o = out + i_n64 * so_n + i_hv * so_h
    i_s = tl.load(idx + i_n).to(tl.int64)
    return p_o, i_s


@triton.jit
def _pair(i_s, i_hv, G, HV, SS, HS):
    """(key head, ring row, first word of the checkpoint region) of the pair (slot, value head hv)."""
    i_h = i_hv // G
    i_sh = i_s * HV + i_hv  # int64: NS HV L K passes 2^31 at a few thousand slots
    o_reg = i_s * SS + i_hv * HS
    return i_h, i_sh, o_reg


@triton.jit
def _token_gates(g, beta, i_n64, i_hv, sg_n, sg_h, sb_n, sb_h, a_log, dt_bias, lower_bound, K: tl.constexpr,
                 IS_KDA: tl.constexpr, NATIVE: tl.constexpr, PACKED: tl.constexpr, BETA_ROUND: tl.constexpr):
    """The token's log decay (fp32, [K] for KDA, GDN a scalar) and beta (fp32): loaded from ``g`` and ``beta``, or
    (``PACKED`` 1: softplus gate, 2: KDA's lower-bound gate) computed from ``step_packed``'s raw inputs, ``g`` and
    ``beta`` then ``a`` and ``b`` (:func:`.gate_math.gate_values`), beta rounded to the dtype ``BETA_ROUND`` names
    (1 bf16, 2 fp16; 0 none) as the workspace of the gates apart stores it."""
    if PACKED:
        b_g, b_beta = gate_values(g, beta, a_log, dt_bias, lower_bound, i_n64, i_hv, sg_n, sg_h, sb_n, K, IS_KDA,
                                  PACKED == 2, NATIVE)
        if BETA_ROUND == 1:
            b_beta = _bf16(b_beta, NATIVE).to(tl.float32)
        elif BETA_ROUND == 2:
            b_beta = b_beta.to(tl.float16).to(tl.float32)
    else:
        b_beta = tl.load(beta + i_n64 * sb_n + i_hv * sb_h).to(tl.float32)
        if IS_KDA:
            b_g = tl.load(g + i_n64 * sg_n + i_hv * sg_h + tl.arange(0, K)).to(tl.float32)
        else:
            b_g = tl.load(g + i_n64 * sg_n + i_hv * sg_h).to(tl.float32)
    return b_g, b_beta


@triton.jit
def _token(q, k, g, beta, hcnt, p_pc, p_w, p_gb, p_kb, i_n64, i_h, i_hv, i_sh, sq_n, sq_h, sk_n, sk_h, sg_n, sg_h,
           sb_n, sb_h, o_k, o_l, a_log, dt_bias, lower_bound, K: tl.constexpr, L: tl.constexpr, IS_KDA: tl.constexpr,
           USE_QK_L2NORM: tl.constexpr, NATIVE: tl.constexpr, PACKED: tl.constexpr, BETA_ROUND: tl.constexpr):
    """What both step kernels take in before the checkpoint's products: the ring's count j and the entries in use,
    the token's k, q and beta, the gate's values (:func:`_gate`) and the ring's key products (:func:`_ring_keys`).
    ``PACKED``: ``g`` and ``beta`` are the raw ``a`` and ``b`` of ``step_packed``, the gates computed here
    (:func:`_token_gates`)."""
    j = tl.load(hcnt + i_sh)
    j = tl.where(j >= L, 0, j)  # a full ring was flushed: it restarts at entry 0
    m_old = o_l < j  # the entries in use; nothing at or past j is read
    b_k = _load_key(k + i_n64 * sk_n + i_h * sk_h, USE_QK_L2NORM, K)
    b_q = _load_key(q + i_n64 * sq_n + i_h * sq_h, USE_QK_L2NORM, K)
    b_g, b_beta = _token_gates(g, beta, i_n64, i_hv, sg_n, sg_h, sb_n, sb_h, a_log, dt_bias, lower_bound, K, IS_KDA,
                               NATIVE, PACKED, BETA_ROUND)
    b_pc, b_e, b_w, b_gn, b_gs = _gate(b_g, p_pc, p_w, p_gb, j, o_k, o_l, m_old, K, IS_KDA, NATIVE)
    b_ck, b_cq = _ring_keys(p_kb, b_k, b_q, b_w, b_gs, o_k, o_l, m_old, K, IS_KDA)
    return j, m_old, b_k, b_q, b_beta, b_pc, b_e, b_w, b_gn, b_gs, b_ck, b_cq


@triton.jit
def _history(hpcum, hw, p_pc, p_w, i_sh, t, o_k, o_l, K: tl.constexpr, L: tl.constexpr, HT: tl.constexpr,
             IS_KDA: tl.constexpr):
    """The pair's ``pcum`` and ``w`` as they are now into its history, after ``t`` tokens of this call (SPEC §6.1)."""
    if IS_KDA:
        tl.store(hpcum + (i_sh * HT + t) * K + o_k, tl.load(p_pc + o_k))
    else:
        tl.store(hpcum + i_sh * HT + t, tl.load(p_pc))
    tl.store(hw + (i_sh * HT + t) * L + o_l, tl.load(p_w + o_l, mask=o_l < L, other=0.0), mask=o_l < L)


@triton.jit
def leapquant_step_kernel(idx, q, k, v, g, beta, out, codes, skv, uq, kbuf, ubuf, w, pcum, gbuf, hcnt,
                          sq_n, sq_h, sk_n, sk_h, sv_n, sv_h, sg_n, sg_h, sb_n, sb_h, so_n, so_h, scale, NS, HV, G,
                          SS, HS, sq_t, sk_t, sv_t, sg_t, sb_t, so_t, hstart, hcount, hpcum, hw, a_log, dt_bias,
                          lower_bound, FIRST: tl.constexpr, K: tl.constexpr, V: tl.constexpr, L: tl.constexpr,
                          R: tl.constexpr, BR: tl.constexpr, BL: tl.constexpr, IS_KDA: tl.constexpr,
                          USE_QK_L2NORM: tl.constexpr, NATIVE: tl.constexpr, HIST: tl.constexpr, HT: tl.constexpr,
                          T: tl.constexpr, PACKED: tl.constexpr, BETA_ROUND: tl.constexpr, TOFF: tl.constexpr):
    """T tokens into the ring of (idx[n], hv), one after the other, and ``out[n, t, hv] = scale S_t q_t``; grid
    (N, HV). The checkpoint is read once for all of them; the ring, gates and count between tokens go through memory
    (this program's own rows, after a barrier).

    Token tensors (any float dtype; strides ``s*_n``, ``s*_t``, ``s*_h`` of their row, token and head dims, unit
    last stride): q, k [N, T, H, K] with H = HV / G; v [N, T, HV, V]; g [N, T, HV, K] (KDA) or [N, T, HV]; beta
    [N, T, HV]; out [N, T, HV, V] (T = 1: any stride ``s*_t``). Pool: ``codes``, ``skv``, ``uq`` int8, fp32, fp16
    views of ``raw``, region (s, hv) at word s SS + hv HS; the ring rows kbuf [L, K], ubuf [L, V], w [L], pcum [K]
    or [1], gbuf [L, K] (KDA; GDN: any pointer), hcnt, at row s HV + hv. ``HIST``: the pool's history (SPEC §6.1)
    at row s HV + hv: ``hstart``, ``hcount`` int32, ``hpcum`` [HT, K or 1], ``hw`` [HT, L]. ``PACKED`` (1: the
    softplus gate, 2: KDA's lower-bound gate; 0: off): ``g`` and ``beta`` are ``step_packed``'s raw ``a`` and ``b``
    and the gates are computed here from them and ``a_log``, ``dt_bias``, ``lower_bound`` (SPEC §6.2), beta rounded
    as ``BETA_ROUND`` says (:func:`_token_gates`). ``TOFF``: the call's tokens before this launch's (a call taken in
    several launches, :func:`.step.step_pool`): the history rows after each token are TOFF + 1 .., the count
    TOFF + T, and the start and row 0 are the first launch's. A row whose slot is not real gets out = 0 and writes
    nothing else."""
    i_n, i_hv = tl.program_id(0), tl.program_id(1)
    i_n64 = i_n.to(tl.int64)
    o_k, o_v, o_l, o_c = tl.arange(0, K), tl.arange(0, V), tl.arange(0, BL), tl.arange(0, 16)
    p_o, i_s = _row(idx, out, i_n, i_n64, i_hv, so_n, so_h)
    if (i_s < FIRST) | (i_s >= NS):
        for t in tl.static_range(T):
            _store_out(p_o + t * so_t + o_v, tl.zeros([V], dtype=tl.float32), NATIVE)
        return
    i_h, i_sh, o_reg = _pair(i_s, i_hv, G, HV, SS, HS)
    p_cd, p_skv, p_uq, p_kb, p_ub, p_w, p_pc, p_gb = _pair_pointers(codes, skv, uq, kbuf, ubuf, w, pcum, gbuf,
                                                                     o_reg, i_sh, K, V, L, IS_KDA)
    if HIST:  # before the codes are in registers: nothing else is live here
        if TOFF == 0:  # the call's first launch: its start and the state before it
            tl.store(hstart + i_sh, tl.load(hcnt + i_sh))
            _history(hpcum, hw, p_pc, p_w, i_sh, 0, o_k, o_l, K, L, HT, IS_KDA)
        tl.store(hcount + i_sh, TOFF + T)
    # the codes first: the largest load, and it depends on nothing but the slot; read once for every token
    b_cd = tl.load(p_cd)
    for t in range(T):  # a loop, not unrolled: unrolled, T tokens keep T bodies live (KBs of spills)
        j, m_old, b_k, b_q, b_beta, b_pc, b_e, b_w, b_gn, b_gs, b_ck, b_cq = _token(
            q + t * sq_t, k + t * sk_t, g + t * sg_t, beta + t * sb_t, hcnt, p_pc, p_w, p_gb, p_kb, i_n64, i_h, i_hv,
            i_sh, sq_n, sq_h, sk_n, sk_h, sg_n, sg_h, sb_n, sb_h, o_k, o_l, a_log, dt_bias, lower_bound, K, L, IS_KDA,
            USE_QK_L2NORM, NATIVE, PACKED, BETA_ROUND)
        # the old rank-R part: a_r = u_r . (x * decay)
        o_r = tl.arange(0, BR)
        b_u = tl.load(p_uq + o_r[:, None] * (K + V) + o_k[None, :], mask=(o_r < R)[:, None] & (o_k[None, :] < K),
                      other=0.0).to(tl.float32)
        b_ak = tl.sum(b_u * (b_k * b_e)[None, :], axis=1)
        b_aq = tl.sum(b_u * (b_q * b_e)[None, :], axis=1)
        # Dq x = (s_v / QMAX) * (C (s_k * x * decay)) for x = k and q at once: C times the keys' int8 pieces on the
        # tensor cores, integer products and sums (exact), columns 0-3 for k, 8-11 for q
        b_sk = tl.load(p_skv + o_k)
        b_k1, b_k2, b_k3, b_k4, b_tk1, b_tk2 = _int8_pieces(b_k * b_e * b_sk)
        b_q1, b_q2, b_q3, b_q4, b_tq1, b_tq2 = _int8_pieces(b_q * b_e * b_sk)
        b_xs = _piece_columns(b_k1, b_k2, b_k3, b_k4, o_c, 0) + _piece_columns(b_q1, b_q2, b_q3, b_q4, o_c, 8)
        if NATIVE:
            b_d = tl.dot(b_cd, b_xs.to(tl.int8), out_dtype=tl.int32).to(tl.float32)
        else:  # the interpreter: integers below 2^24 in fp32, the same exact sums
            b_d = tl.dot(b_cd.to(tl.float32), b_xs.to(tl.float32), input_precision="ieee")
        b_w1 = tl.where(o_c < 4, _pow2(-7 * o_c - b_tk1), _pow2(-7 * (o_c - 8) - b_tq1))
        b_w2 = tl.where(o_c < 4, _pow2(-b_tk2), tl.where((o_c >= 8) & (o_c < 12), _pow2(-b_tq2), 0.0))
        b_sv = tl.load(p_skv + K + o_v) / QMAX
        b_acc = b_d * b_w1[None, :] * b_w2[None, :] * b_sv[:, None]
        # + the rank-R part: q_r a_r, in the product's layout
        for r in tl.static_range(R):
            b_qr = tl.load(p_uq + r * (K + V) + K + o_v).to(tl.float32)
            b_akr = tl.sum(tl.where(o_r == r, b_ak, 0.0), axis=0)
            b_aqr = tl.sum(tl.where(o_r == r, b_aq, 0.0), axis=0)
            b_acc += b_qr[:, None] * tl.where(o_c == 0, b_akr, tl.where(o_c == 8, b_aqr, 0.0))[None, :]
        # + the ring: ubuf^T [V, BL] x the bf16 pieces of c_k, c_q [BL, 16] (every product exact)
        b_ub = tl.load(p_ub + o_l[None, :] * V + o_v[:, None], mask=m_old[None, :] & (o_v[:, None] < V), other=0.0)
        b_cc = _piece_rows(b_ck, b_cq, o_c, NATIVE)
        if NATIVE:
            b_acc = tl.dot(b_ub, b_cc.to(tl.bfloat16), acc=b_acc)
        else:
            b_acc = tl.dot(b_ub.to(tl.float32), b_cc, acc=b_acc, input_precision="ieee")
        b_p = tl.sum(tl.where(o_c[None, :] < 8, b_acc, 0.0), axis=1)
        b_un = _bf16(tl.load(v + t * sv_t + i_n64 * sv_n + i_hv * sv_h + o_v).to(tl.float32) - b_p, NATIVE)
        # the new entry (decay 1): kbuf[j] = bf16(k), w_j = beta, and what it adds to o per unit of ubuf[j]
        b_kj = _bf16(b_k, NATIVE)
        b_cj = b_beta * tl.sum(b_kj.to(tl.float32) * b_q, axis=0)
        b_o = tl.sum(tl.where(o_c[None, :] >= 8, b_acc, 0.0), axis=1) + b_un.to(tl.float32) * b_cj
        _store_out(p_o + t * so_t + o_v, scale * b_o, NATIVE)
        # every warp has read pcum, w and hcnt (their layouts replicate them over warps) before any overwrites them
        tl.debug_barrier()
        _store_ring_row(p_pc, p_w, p_gb, p_kb, hcnt + i_sh, b_pc, b_w, b_gn, b_kj, b_beta, j, o_k, o_l, K, IS_KDA)
        tl.store(p_ub + j * V + o_v, b_un, mask=tl.where(j >= 0, o_v < V, False))
        # the next token (and the history) reads what this one stored
        tl.debug_barrier()
        if HIST:
            _history(hpcum, hw, p_pc, p_w, i_sh, TOFF + t + 1, o_k, o_l, K, L, HT, IS_KDA)


@triton.jit
def leapquant_step_fma_kernel(idx, q, k, v, g, beta, out, codes, skv, uq, kbuf, ubuf, w, pcum, gbuf, hcnt,
                              sq_n, sq_h, sk_n, sk_h, sv_n, sv_h, sg_n, sg_h, sb_n, sb_h, so_n, so_h, scale, NS, HV,
                              G, SS, HS, sq_t, sk_t, sv_t, sg_t, sb_t, so_t, hstart, hcount, hpcum, hw, a_log,
                              dt_bias, lower_bound, FIRST: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                              L: tl.constexpr, R: tl.constexpr, BR: tl.constexpr, BV: tl.constexpr,
                              IS_KDA: tl.constexpr, USE_QK_L2NORM: tl.constexpr, NATIVE: tl.constexpr,
                              HIST: tl.constexpr, HT: tl.constexpr, T: tl.constexpr, PACKED: tl.constexpr,
                              BETA_ROUND: tl.constexpr, TOFF: tl.constexpr):
    """:func:`leapquant_step_kernel` without tensor cores, for sm_75 (Triton cannot lower its int8 product there):
    fp32 elementwise products and sums over chunks of BV value channels, one chunk of the codes in registers at a
    time. The same arguments (but ``BV`` for ``BL``), grid and writes."""
    i_n, i_hv = tl.program_id(0), tl.program_id(1)
    i_n64 = i_n.to(tl.int64)
    o_k, o_v, o_l, o_r = tl.arange(0, K), tl.arange(0, V), tl.arange(0, L), tl.arange(0, BR)
    p_o, i_s = _row(idx, out, i_n, i_n64, i_hv, so_n, so_h)
    if (i_s < FIRST) | (i_s >= NS):
        for t in tl.static_range(T):
            _store_out(p_o + t * so_t + o_v, tl.zeros([V], dtype=tl.float32), NATIVE)
        return
    i_h, i_sh, o_reg = _pair(i_s, i_hv, G, HV, SS, HS)
    _, p_skv, p_uq, p_kb, p_ub, p_w, p_pc, p_gb = _pair_pointers(codes, skv, uq, kbuf, ubuf, w, pcum, gbuf, o_reg,
                                                                 i_sh, K, V, L, IS_KDA)
    p_cd = codes + o_reg * 4 + tl.arange(0, BV)[:, None] * K + o_k[None, :]
    if HIST:
        if TOFF == 0:  # the call's first launch: its start and the state before it
            tl.store(hstart + i_sh, tl.load(hcnt + i_sh))
            _history(hpcum, hw, p_pc, p_w, i_sh, 0, o_k, o_l, K, L, HT, IS_KDA)
        tl.store(hcount + i_sh, TOFF + T)
    for t in range(T):  # a loop, not unrolled: unrolled, T tokens keep T bodies live (KBs of spills)
        j, m_old, b_k, b_q, b_beta, b_pc, b_e, b_w, b_gn, b_gs, b_ck, b_cq = _token(
            q + t * sq_t, k + t * sk_t, g + t * sg_t, beta + t * sb_t, hcnt, p_pc, p_w, p_gb, p_kb, i_n64, i_h, i_hv,
            i_sh, sq_n, sq_h, sk_n, sk_h, sg_n, sg_h, sb_n, sb_h, o_k, o_l, a_log, dt_bias, lower_bound, K, L, IS_KDA,
            USE_QK_L2NORM, NATIVE, PACKED, BETA_ROUND)
        # the old rank-R part: u_r . (x * decay)
        m_r = o_r < R
        b_u = tl.load(p_uq + o_r[:, None] * (K + V) + o_k[None, :], mask=m_r[:, None] & (o_k[None, :] < K),
                      other=0.0).to(tl.float32)
        b_xk = b_k * b_e
        b_xq = b_q * b_e
        b_ak = tl.sum(b_u * b_xk[None, :], axis=1)
        b_aq = tl.sum(b_u * b_xq[None, :], axis=1)
        # Dq x = (s_v / QMAX) * (C (s_k * x * decay))
        b_sk = tl.load(p_skv + o_k)
        b_xk *= b_sk
        b_xq *= b_sk
        # the new entry (decay 1): kbuf[j] = bf16(k), w_j = beta, and what it adds to o per unit of ubuf[j]
        b_kj = _bf16(b_k, NATIVE)
        b_cj = b_beta * tl.sum(b_kj.to(tl.float32) * b_q, axis=0)
        # every warp has read pcum, w and hcnt (their layouts replicate them over warps) before any overwrites them
        tl.debug_barrier()
        _store_ring_row(p_pc, p_w, p_gb, p_kb, hcnt + i_sh, b_pc, b_w, b_gn, b_kj, b_beta, j, o_k, o_l, K, IS_KDA)
        p_v = v + t * sv_t + i_n64 * sv_n + i_hv * sv_h
        for c in tl.static_range(V // BV):
            o_vc = c * BV + tl.arange(0, BV)
            m_vc = o_vc < V
            b_cf = tl.load(p_cd + c * BV * K).to(tl.float32)
            b_sv = tl.load(p_skv + K + o_vc) / QMAX
            b_qf = tl.load(p_uq + o_r[None, :] * (K + V) + K + o_vc[:, None], mask=m_r[None, :] & m_vc[:, None],
                           other=0.0).to(tl.float32)
            b_ub = tl.load(p_ub + o_l[:, None] * V + o_vc[None, :], mask=m_old[:, None] & m_vc[None, :],
                           other=0.0).to(tl.float32)
            b_p = (b_sv * tl.sum(b_cf * b_xk[None, :], axis=1) + tl.sum(b_qf * b_ak[None, :], axis=1)
                   + tl.sum(b_ub * b_ck[:, None], axis=0))
            b_un = _bf16(tl.load(p_v + o_vc).to(tl.float32) - b_p, NATIVE)
            tl.store(p_ub + j * V + o_vc, b_un, mask=tl.where(j >= 0, m_vc, False))
            b_o = (b_sv * tl.sum(b_cf * b_xq[None, :], axis=1) + tl.sum(b_qf * b_aq[None, :], axis=1)
                   + tl.sum(b_ub * b_cq[:, None], axis=0) + b_un.to(tl.float32) * b_cj)
            _store_out(p_o + t * so_t + o_vc, scale * b_o, NATIVE)
        # the next token (and the history) reads what this one stored
        tl.debug_barrier()
        if HIST:
            _history(hpcum, hw, p_pc, p_w, i_sh, TOFF + t + 1, o_k, o_l, K, L, HT, IS_KDA)
