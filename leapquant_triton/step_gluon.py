"""The decode step (docs/SPEC.md §6, T tokens per row §6.1) as a Gluon kernel with explicit layouts, for the shape
engines run: K = V = 128, ring 16, rank at most 4, two warps. Same arguments, grid ``(N, HV)`` and writes as
:func:`.step_kernel.leapquant_step_kernel`, which serves every other configuration (and the CPU: Gluon has no
interpreter).

Where the ``tl`` kernel spends its instructions is layout traffic (docs/DESIGN.md, "Triton: the decode step"); here
every tile is placed so that the work on it stays inside a thread:

    codes    [V, K] int8   loaded from global memory straight into int8 mma A-fragments (no shared memory); times the
                           keys' int8 pieces [K, 8] (k in columns 0-3, q in 4-7: exact int32 products and sums)
    ring     [L, K]        kbuf, the shifted gates and ubuf with the ring axis inside a thread (each thread two
                           channels x 16 entries): the gates' suffix products and the value-side sums over the
                           entries are thread-local; the K-sums of the 2 L ring dot products are per-thread partial
                           sums, then one transpose through shared memory
    rank     [4, K], [4, V] u_r and q_r with the rank axis inside a thread

Two phases. First the checkpoint's products of every token (its decay e_t needs only the gates): the codes' 64
registers per thread are dead before the ring's tiles are loaded, which takes the spills out (measured: KDA
1.21x, GDN 1.10x faster than the ring first). Then the tokens one after the other, each loading the ring's entries
before it (the earlier tokens' entries from this program's own rows, after a barrier) and storing its own: tiles
carried across the tokens in registers spilled.

Every product of the checkpoint's part is exact (27-bit int8 pieces, as the ``tl`` kernel); the ring and rank parts
are fp32 products, so ``o`` and ``ubuf`` differ from the ``tl`` kernel in the last fp32 bits, within SPEC §6's
criteria. Gates, counts and the other ring bytes are bit for bit the same (libdevice's expf, as torch).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.extra import libdevice
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from leapquant import constants

QMAX = gl.constexpr(constants.QMAX)
PNMIN = gl.constexpr(constants.PNMIN)
L2NORM_EPS = gl.constexpr(1e-6)


@gluon.jit
def _suffix16(g0, g1, g2, g3, g4, g5, g6, g7, g8, g9, g10, g11, g12, g13, g14, g15):
    """d_i = g_i g_(i+1) ... g_15 for one channel, multiplied from the last entry down (SPEC §6's order)."""
    d14 = g14 * g15
    d13 = g13 * d14
    d12 = g12 * d13
    d11 = g11 * d12
    d10 = g10 * d11
    d9 = g9 * d10
    d8 = g8 * d9
    d7 = g7 * d8
    d6 = g6 * d7
    d5 = g5 * d6
    d4 = g4 * d5
    d3 = g3 * d4
    d2 = g2 * d3
    d1 = g1 * d2
    d0 = g0 * d1
    return d0, d1, d2, d3, d4, d5, d6, d7, d8, d9, d10, d11, d12, d13, d14, g15


@gluon.jit
def _pow2(e):
    """2^e as fp32 from its exponent bits, for integer e in [-126, 127]."""
    return ((e + 127) << 23).to(gl.float32, bitcast=True)


@gluon.jit
def _shift(x):
    """(t1, t2): 2^(t1 + t2) scales max|x| into [32, 64), each factor within fp32's normal range."""
    m = gl.max(gl.abs(x), axis=0)
    t = 5 - (((m.to(gl.int32, bitcast=True) >> 23) & 0xFF) - 127)
    t = gl.where(m > 0, t, 0)
    t1 = t >> 1
    return t1, t - t1


@gluon.jit
def _pieces(x, t1, t2, p):
    """Piece p (0-3) of x scaled by 2^(t1 + t2): rint(128^p r) - 128 rint(128^(p-1) r), the p-th seven bits of r's
    expansion (every product by a power of two exact, every rint of an fp32 exact)."""
    r = (x * _pow2(t1)) * _pow2(t2)
    hi = libdevice.rint(r * _pow2(7 * p))
    lo = libdevice.rint(r * _pow2(7 * p - 7))
    return hi - gl.where(p == 0, 0.0, 128.0 * lo)


@gluon.jit
def _reduce_rows(x, L: gl.constexpr, K: gl.constexpr, KPT: gl.constexpr, NW: gl.constexpr, rows: gl.constexpr):
    """sum over K of an [L, K] tile whose threads hold all L rows of KPT channels: per-thread partial sums, one
    transpose through shared memory, then sums within a thread and over 4 lanes; in ``rows`` (every thread all L)."""
    tl2: gl.constexpr = gl.BlockedLayout([1, K // KPT // 4 // NW], [8, 4], [1, NW], [1, 0])
    part = gl.sum(gl.reshape(x, [L, K // KPT, KPT]), axis=2)
    return gl.convert_layout(gl.sum(gl.convert_layout(part, tl2), axis=1), rows)


@gluon.jit
def _load_tile(p, SHIFT: gl.constexpr, j, L: gl.constexpr, K: gl.constexpr, kl: gl.constexpr, kv: gl.constexpr):
    """Rows SHIFT .. L - 1 + SHIFT of a ring tile [L, K] as rows 0 .. L - 1, in ``kl``: the entries at or past j
    (less SHIFT) are not read (zero; one for the shifted gates). Loaded in ``kv`` (channels first: vector loads, a mask
    constant along a row) and reordered in registers."""
    o_l = gl.arange(0, L, layout=gl.SliceLayout(1, kv))
    o_k = gl.arange(0, K, layout=gl.SliceLayout(0, kv))
    x = gl.load(p + (o_l[:, None] + SHIFT) * K + o_k[None, :], mask=(o_l + SHIFT < j)[:, None],
                other=float(SHIFT))
    return gl.convert_layout(x, kl)


@gluon.jit
def _load_key(p, o_k, USE_QK_L2NORM: gl.constexpr):
    """A [K] key in fp32, l2-normalised with correctly rounded sqrt and division (as the ``tl`` kernel)."""
    x = gl.load(p + o_k).to(gl.float32)
    if USE_QK_L2NORM:
        x = gl.div_rn(x, gl.sqrt_rn(gl.sum(x * x, axis=0) + L2NORM_EPS))
    return x


@gluon.jit
def _store_out(p, x):
    """``x`` (fp32) stored in the dtype of ``p``, rounded to nearest even."""
    gl.store(p, x.to(p.dtype.element_ty))


@gluon.jit
def _token(q, k, g, beta, t, pc, i_n64, i_h, i_hv, sq_n, sq_t, sq_h, sk_n, sk_t, sk_h, sg_n, sg_t, sg_h, sb_n, sb_t,
           sb_h, o_k, IS_KDA: gl.constexpr, USE_QK_L2NORM: gl.constexpr):
    """Token t's inputs and gates: (k, q, beta, pcum after it, the checkpoint's decay e, the gate's factor: the fp16
    exp(g) that gbuf stores (KDA) or exp(g) (GDN)), from ``pc``, the pcum before it (SPEC §6 step 2)."""
    kk = _load_key(k + i_n64 * sk_n + t * sk_t + i_h * sk_h, o_k, USE_QK_L2NORM)
    qq = _load_key(q + i_n64 * sq_n + t * sq_t + i_h * sq_h, o_k, USE_QK_L2NORM)
    b_beta = gl.load(beta + i_n64 * sb_n + t * sb_t + i_hv * sb_h).to(gl.float32)
    p_g = g + i_n64 * sg_n + t * sg_t + i_hv * sg_h
    if IS_KDA:
        gg = gl.load(p_g + o_k).to(gl.float32)
        pc = pc + gg
        return kk, qq, b_beta, pc, libdevice.exp(pc), libdevice.exp(gg).to(gl.float16)
    else:
        a_g = libdevice.exp(gl.load(p_g).to(gl.float32))
        pc = pc * a_g
        return kk, qq, b_beta, pc, gl.maximum(pc, PNMIN), a_g


@gluon.jit
def _checkpoint_products(a, kk, qq, e, sk, V: gl.constexpr, mma: gl.constexpr, lb: gl.constexpr, pl: gl.constexpr,
                         ch: gl.constexpr):
    """(C (s_k k e), C (s_k q e)) [V] for the codes C in ``a`` on the tensor cores: four int8 pieces of each key,
    exact integer products and sums, scaled back per piece."""
    xk = kk * e * sk
    xq = qq * e * sk
    tk1, tk2 = _shift(xk)
    tq1, tq2 = _shift(xq)
    o_c = gl.arange(0, 8, layout=gl.SliceLayout(0, pl))
    pp = o_c % 4
    xkp = gl.convert_layout(xk, gl.SliceLayout(1, pl))[:, None]
    xqp = gl.convert_layout(xq, gl.SliceLayout(1, pl))[:, None]
    piece = gl.where((o_c < 4)[None, :], _pieces(xkp, tk1, tk2, pp[None, :]), _pieces(xqp, tq1, tq2, pp[None, :]))
    acc = mma_v2(a, gl.convert_layout(piece.to(gl.int8), lb), gl.zeros([V, 8], gl.int32, layout=mma))
    cn = gl.arange(0, 8, layout=gl.SliceLayout(0, mma))
    cp = cn % 4
    w1 = gl.where(cn < 4, _pow2(-7 * cp - tk1), _pow2(-7 * cp - tq1))
    w2 = gl.where(cn < 4, _pow2(-tk2), _pow2(-tq2))
    accf = acc.to(gl.float32) * w1[None, :] * w2[None, :]
    dk = gl.convert_layout(gl.sum(gl.where(cn[None, :] < 4, accf, 0.0), axis=1), ch)
    dq = gl.convert_layout(gl.sum(gl.where(cn[None, :] >= 4, accf, 0.0), axis=1), ch)
    return dk, dq


@gluon.jit
def _put(tile, t, x, TP: gl.constexpr, tl_: gl.constexpr):
    """``tile`` [TP, C] in ``tl_`` (the token axis inside a thread) with row t set to ``x`` [C]."""
    o_t = gl.arange(0, TP, layout=gl.SliceLayout(1, tl_))
    return gl.where((o_t == t)[:, None], gl.convert_layout(x, gl.SliceLayout(0, tl_))[None, :], tile)


@gluon.jit
def _row_of(tile, t, TP: gl.constexpr, tl_: gl.constexpr, ch: gl.constexpr):
    """Row t of ``tile`` [TP, C] in ``tl_``, in ``ch`` (a select and a sum inside each thread)."""
    o_t = gl.arange(0, TP, layout=gl.SliceLayout(1, tl_))
    return gl.convert_layout(gl.sum(gl.where((o_t == t)[:, None], tile, 0.0), axis=0), ch)


@gluon.jit
def leapquant_step_gluon_kernel(idx, q, k, v, g, beta, out, codes, skv, uq, kbuf, ubuf, w, pcum, gbuf, hcnt,
                                sq_n, sq_h, sk_n, sk_h, sv_n, sv_h, sg_n, sg_h, sb_n, sb_h, so_n, so_h, scale, NS, HV,
                                G, SS, HS, sq_t, sk_t, sv_t, sg_t, sb_t, so_t, hstart, hcount, hpcum, hw,
                                FIRST: gl.constexpr, K: gl.constexpr, V: gl.constexpr, L: gl.constexpr,
                                R: gl.constexpr, IS_KDA: gl.constexpr, USE_QK_L2NORM: gl.constexpr,
                                HIST: gl.constexpr, HT: gl.constexpr, T: gl.constexpr, NW: gl.constexpr):
    """T tokens into the ring of (idx[n], hv), one after the other, and ``out[n, t, hv] = scale S_t q_t``; grid
    (N, HV), ``NW`` warps. The arguments are :func:`.step_kernel.leapquant_step_kernel`'s (``NW``: its
    ``num_warps``)."""
    KPT: gl.constexpr = K // (32 * NW)
    BR: gl.constexpr = 4
    TP: gl.constexpr = 1 if T == 1 else (2 if T == 2 else (4 if T <= 4 else 8))
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NW, 1], instr_shape=[16, 8])
    la: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=16)
    lb: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=16)
    # [L, K] and [L, V]: every thread holds all L ring entries of KPT channels
    kl: gl.constexpr = gl.BlockedLayout([L, KPT], [1, 32], [1, NW], [0, 1])
    # the same threads and elements with the channels first in registers: the loads' layout (KPT-element vectors)
    kv: gl.constexpr = gl.BlockedLayout([L, KPT], [1, 32], [1, NW], [1, 0])
    rl: gl.constexpr = gl.BlockedLayout([BR, KPT], [1, 32], [1, NW], [1, 0])
    pl: gl.constexpr = gl.BlockedLayout([KPT, 8], [32, 1], [NW, 1], [1, 0])
    # [TP, V]: the checkpoint's products of every token, the token axis inside a thread
    tl_: gl.constexpr = gl.BlockedLayout([TP, KPT], [1, 32], [1, NW], [0, 1])
    ch: gl.constexpr = gl.SliceLayout(0, kl)  # [K] / [V]: KPT channels per thread
    rows: gl.constexpr = gl.SliceLayout(1, kl)  # [L]: every thread all of them

    i_n = gl.program_id(0)
    i_hv = gl.program_id(1)
    i_n64 = i_n.to(gl.int64)
    o_k = gl.arange(0, K, layout=ch)
    p_o = out + i_n64 * so_n + i_hv * so_h + o_k
    i_s = gl.load(idx + i_n).to(gl.int64)
    if (i_s < FIRST) | (i_s >= NS):
        for t in gl.static_range(T):
            _store_out(p_o + t * so_t, gl.zeros([V], gl.float32, layout=ch))
        return
    i_h = i_hv // G
    i_sh = i_s * HV + i_hv  # int64: NS HV L K passes 2^31 at a few thousand slots
    o_reg = i_s * SS + i_hv * HS
    # the codes first: the largest load, and it depends on nothing but the slot
    o_va = gl.arange(0, V, layout=gl.SliceLayout(1, la))
    o_ka = gl.arange(0, K, layout=gl.SliceLayout(0, la))
    a = gl.load(codes + o_reg * 4 + o_va[:, None] * K + o_ka[None, :])

    h = gl.load(hcnt + i_sh)
    j = gl.where(h >= L, 0, h)  # a full ring was flushed: it restarts at entry 0
    o_l = gl.arange(0, L, layout=rows)
    p_kb = kbuf + i_sh * (L * K)
    p_ub = ubuf + i_sh * (L * V)
    p_w = w + i_sh * L
    p_gb = gbuf + i_sh * (L * K)
    if IS_KDA:
        p_pc = pcum + i_sh * K
        pc0 = gl.load(p_pc + o_k)
    else:
        p_pc = pcum + i_sh
        pc0 = gl.load(p_pc)
    p_skv = skv + o_reg
    sk = gl.load(p_skv + o_k)

    # SPEC §6 steps 2-3 for the checkpoint: C (s_k x e_t) for x = k_t and q_t of every token, the codes then dead
    pc = pc0
    dks = gl.zeros([TP, V], gl.float32, layout=tl_)
    dqs = gl.zeros([TP, V], gl.float32, layout=tl_)
    if T == 1:  # the token's inputs stay in registers for the ring's part
        kk, qq, b_beta, pc, e, gx = _token(q, k, g, beta, 0, pc, i_n64, i_h, i_hv, sq_n, sq_t, sq_h, sk_n, sk_t, sk_h,
                                           sg_n, sg_t, sg_h, sb_n, sb_t, sb_h, o_k, IS_KDA, USE_QK_L2NORM)
        dk, dq = _checkpoint_products(a, kk, qq, e, sk, V, mma, lb, pl, ch)
        dks = _put(dks, 0, dk, TP, tl_)
        dqs = _put(dqs, 0, dq, TP, tl_)
    else:
        for t in range(T):  # a loop, not unrolled: unrolled, the tokens' products are scheduled side by side
            kk, qq, b_beta, pc, e, gx = _token(q, k, g, beta, t, pc, i_n64, i_h, i_hv, sq_n, sq_t, sq_h, sk_n, sk_t,
                                               sk_h, sg_n, sg_t, sg_h, sb_n, sb_t, sb_h, o_k, IS_KDA, USE_QK_L2NORM)
            dk, dq = _checkpoint_products(a, kk, qq, e, sk, V, mma, lb, pl, ch)
            dks = _put(dks, t, dk, TP, tl_)
            dqs = _put(dqs, t, dq, TP, tl_)

    # the rank-R factors, and the history's first row before anything is overwritten
    o_r = gl.arange(0, BR, layout=gl.SliceLayout(1, rl))
    o_kr = gl.arange(0, K, layout=gl.SliceLayout(0, rl))
    p_uq = uq + o_reg * 2
    m_r = (o_r < R)[:, None] & (o_kr < K)[None, :]
    ur = gl.load(p_uq + o_r[:, None] * (K + V) + o_kr[None, :], mask=m_r, other=0.0)  # fp16 until used
    qr = gl.load(p_uq + K + o_r[:, None] * (K + V) + o_kr[None, :], mask=m_r, other=0.0)
    o_v = o_k
    sv = gl.load(p_skv + K + o_v) / QMAX
    if HIST:
        gl.store(hstart + i_sh, h)
        gl.store(hcount + i_sh, T)
        if IS_KDA:
            gl.store(hpcum + i_sh * HT * K + o_k, pc0)
        else:
            gl.store(hpcum + i_sh * HT, pc0)
        gl.store(hw + i_sh * HT * L + o_l, gl.load(p_w + o_l))

    if T > 1:
        pc = pc0
    for t in range(T):  # a loop, not unrolled: T bodies side by side spill
        if T > 1:  # one token: its inputs are still in registers
            kk, qq, b_beta, pc, e, gx = _token(q, k, g, beta, t, pc, i_n64, i_h, i_hv, sq_n, sq_t, sq_h, sk_n, sk_t,
                                               sk_h, sg_n, sg_t, sg_h, sb_n, sb_t, sb_h, o_k, IS_KDA, USE_QK_L2NORM)
        jt = j + t
        # the ring before token t, from memory: the entries before jt (those past j this program stored for the
        # earlier tokens), the rest zero; the gates shifted, row i holding gbuf[i + 1] and the new gate after the last
        wv = gl.where(o_l < jt, gl.load(p_w + o_l), 0.0)
        kb = _load_tile(p_kb, 0, jt, L, K, kl, kv).to(gl.float32)
        # the ring's key products: w_i (kd_i . k), w_i (kd_i . q), kd_i the key times its decay d_i
        if IS_KDA:
            gs = _load_tile(p_gb, 1, jt, L, K, kl, kv).to(gl.float32)
            gs = gl.where((o_l + 1 == jt)[:, None], gx.to(gl.float32)[None, :], gs)
            kd = kb * gl.map_elementwise(_suffix16, gs, pack=16)[0]
        else:
            wv = wv * gx
            kd = kb
        ck = wv * _reduce_rows(kd * kk[None, :], L, K, KPT, NW, rows)
        cq = wv * _reduce_rows(kd * qq[None, :], L, K, KPT, NW, rows)
        # the old rank-R part: a_r = u_r . (x e)
        ak = gl.sum(ur.to(gl.float32) * gl.convert_layout(kk * e, gl.SliceLayout(0, rl))[None, :], axis=1)
        aq = gl.sum(ur.to(gl.float32) * gl.convert_layout(qq * e, gl.SliceLayout(0, rl))[None, :], axis=1)
        # the value side, in the ring's layout: ring and rank sums inside a thread
        ub = _load_tile(p_ub, 0, jt, L, V, kl, kv).to(gl.float32)
        rk = gl.sum(ub * ck[:, None], axis=0)
        rq = gl.sum(ub * cq[:, None], axis=0)
        lk = gl.convert_layout(gl.sum(qr.to(gl.float32) * ak[:, None], axis=0), ch)
        lq = gl.convert_layout(gl.sum(qr.to(gl.float32) * aq[:, None], axis=0), ch)
        p = sv * _row_of(dks, t, TP, tl_, ch) + lk + rk
        un = (gl.load(v + i_n64 * sv_n + t * sv_t + i_hv * sv_h + o_v).to(gl.float32) - p).to(gl.bfloat16)
        # the new entry (decay 1): kbuf[j] = bf16(k), w_j = beta, and what it adds to o per unit of ubuf[j]
        kj = kk.to(gl.bfloat16)
        cj = b_beta * gl.sum(kj.to(gl.float32) * qq, axis=0)
        o = sv * _row_of(dqs, t, TP, tl_, ch) + lq + rq + un.to(gl.float32) * cj
        _store_out(p_o + t * so_t, scale * o)

        # every thread has read w (replicated over threads) before any overwrites it
        gl.thread_barrier()
        m_new = gl.where(jt >= 0, o_k < K, False)  # an invalid negative count writes no entry, as the reference
        wv = gl.where(o_l == jt, b_beta, wv)
        if IS_KDA:
            gl.store(p_gb + jt * K + o_k, gx, mask=m_new)
            gl.store(p_w + jt, b_beta, mask=jt >= 0)
        else:
            gl.store(p_w + o_l, wv, mask=o_l <= jt)
        gl.store(p_kb + jt * K + o_k, kj, mask=m_new)
        gl.store(p_ub + jt * V + o_v, un, mask=m_new)
        if HIST:
            if IS_KDA:
                gl.store(hpcum + (i_sh * HT + t + 1) * K + o_k, pc)
            else:
                gl.store(hpcum + i_sh * HT + t + 1, pc)
            # past entry jt the row is as the call found it: this program writes no entry past jt before token jt
            gl.store(hw + (i_sh * HT + t + 1) * L + o_l, gl.where(o_l <= jt, wv, gl.load(p_w + o_l, mask=o_l > jt)))
        if T > 1:  # the next token reads this one's entry
            gl.thread_barrier()
    if IS_KDA:
        gl.store(p_pc + o_k, pc)
    else:
        gl.store(p_pc, pc)
    gl.store(hcnt + i_sh, j + T)
