"""The decode step (docs/SPEC.md §6, T tokens per row §6.1) as a Gluon kernel with explicit layouts, for the shape
engines run: K = V = 128, ring 16, rank at most 4, two warps. Same arguments, grid ``(N, HV)`` and writes as
:func:`.step_kernel.leapquant_step_kernel`, which serves every other configuration (and the CPU: Gluon has no
interpreter).

Where the ``tl`` kernel spends its instructions is layout traffic (docs/DESIGN.md, "Triton: the decode step"); here
every tile is placed so that the work on it stays inside a thread:

    codes    [V, K] int8   loaded from global memory straight into int8 mma A-fragments (no shared memory); times the
                           keys' int8 pieces [K, 8] (k in columns 0-3, q in 4-7: exact int32 products and sums)
    ring     [L, K]        kbuf (times its suffix gate products and weights) and ubuf with the ring axis inside a
                           thread (each thread two channels x 16 entries): the gates' products and the value-side sums
                           over the entries are thread-local
    rank     [4, K], [4, V] u_r and q_r with the rank axis inside a thread
    call     [TP, K]       the call's own entries (keys with their decays, values), the token axis inside a thread

Two phases. First the checkpoint's products of every token (its decay e_t needs only the gates): the codes' 64
registers per thread are dead before the ring's tiles are loaded, which takes the spills out (measured: KDA
1.21x, GDN 1.10x faster than the ring first); several tokens park their keys and products in shared memory. Then
the ring is loaded once, decayed to the call and weighted, and the tokens go one after the other: a token's decay
of the ring is the product of the call's gates so far (a factor of its keys), the call's earlier entries sit in
registers, and every sum over the channels a token needs (its k and q against the ring's and the call's keys, the
rank factors) is a per-thread partial sum, all reduced in one pass through shared memory (two barriers a token).

Every product of the checkpoint's part is exact (27-bit int8 pieces, as the ``tl`` kernel); the ring and rank parts
are fp32 products, so ``o`` and ``ubuf`` differ from the ``tl`` kernel in the last fp32 bits, within SPEC §6's
criteria. Gates, counts and the other ring bytes are bit for bit the same (libdevice's expf, as torch).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.extra import libdevice
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

from leapquant import constants

QMAX = gl.constexpr(constants.QMAX)
PNMIN = gl.constexpr(constants.PNMIN)
SOFTPLUS_THRESHOLD = gl.constexpr(constants.SOFTPLUS_THRESHOLD)
L2NORM_EPS = gl.constexpr(1e-6)
# a CTA barrier: thread_barrier until Triton 3.6, barrier from 3.7
_barrier = gl.barrier if hasattr(gl, "barrier") else gl.thread_barrier
# cp.async into shared memory: async_copy_global_to_shared until 3.7, async_load from 3.8
_async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared


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
def _shift_of(m):
    """(t1, t2) for a maximum ``m``: 2^(t1 + t2) scales m into [32, 64), each factor within fp32's normal range."""
    t = 5 - (((m.to(gl.int32, bitcast=True) >> 23) & 0xFF) - 127)
    t = gl.where(m > 0, t, 0)
    t1 = t >> 1
    return t1, t - t1


@gluon.jit
def _shifts(x, y):
    """:func:`_shift_of` of max|x| and of max|y|, both maxima in one reduction over the threads."""
    mx, my = gl.split(gl.max(gl.abs(gl.join(x, y)), axis=0))
    tx1, tx2 = _shift_of(mx)
    ty1, ty2 = _shift_of(my)
    return tx1, tx2, ty1, ty2


@gluon.jit
def _pieces(x, t1, t2, p):
    """Piece p (0-3) of x scaled by 2^(t1 + t2): rint(128^p r) - 128 rint(128^(p-1) r), the p-th seven bits of r's
    expansion (every product by a power of two exact, every rint of an fp32 exact)."""
    r = (x * _pow2(t1)) * _pow2(t2)
    hi = libdevice.rint(r * _pow2(7 * p))
    lo = libdevice.rint(r * _pow2(7 * p - 7))
    return hi - gl.where(p == 0, 0.0, 128.0 * lo)


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
def _stage(buf, p, SHIFT: gl.constexpr, j, L: gl.constexpr, K: gl.constexpr, cp: gl.constexpr):
    """Rows SHIFT .. L - 1 + SHIFT of a ring tile [L, K] into ``buf`` by cp.async, 16 bytes a thread and copy, the
    entries at or past j (less SHIFT) not read (zero-filled)."""
    o_l = gl.arange(0, L, layout=gl.SliceLayout(1, cp))
    o_k = gl.arange(0, K, layout=gl.SliceLayout(0, cp))
    _async_load(buf, p + (o_l[:, None] + SHIFT) * K + o_k[None, :],
                mask=(o_l + SHIFT < j)[:, None] & (o_k < K)[None, :])


@gluon.jit
def _load_keys(pk, pq, o_k, USE_QK_L2NORM: gl.constexpr):
    """A token's key and query [K] in fp32, l2-normalised with correctly rounded sqrt and division (as the ``tl``
    kernel); both sums of squares in one reduction over the threads."""
    x = gl.load(pk + o_k).to(gl.float32)
    y = gl.load(pq + o_k).to(gl.float32)
    if USE_QK_L2NORM:
        sx, sy = gl.split(gl.sum(gl.join(x * x, y * y), axis=0))
        x = gl.div_rn(x, gl.sqrt_rn(sx + L2NORM_EPS))
        y = gl.div_rn(y, gl.sqrt_rn(sy + L2NORM_EPS))
    return x, y


@gluon.jit
def _store_out(p, x):
    """``x`` (fp32) stored in the dtype of ``p``, rounded to nearest even."""
    gl.store(p, x.to(p.dtype.element_ty))


@gluon.jit
def _mul_rn(x, y):
    """``x * y`` as ``mul.rn.f32`` (:func:`.gate_math._mul`: never contracted, subnormals kept)."""
    return gl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=r,r,r", [x, y], dtype=gl.float32, is_pure=True,
                                     pack=1)


@gluon.jit
def _add_rn(x, y):
    """``x + y`` as ``add.rn.f32`` (:func:`.gate_math._add`)."""
    return gl.inline_asm_elementwise("add.rn.f32 $0, $1, $2;", "=r,r,r", [x, y], dtype=gl.float32, is_pure=True,
                                     pack=1)


@gluon.jit
def _sigmoid(x):
    """``torch.sigmoid``: ``1 / (1 + exp(-x))``, the sum and the division rounded on their own (as
    :mod:`.gate_math`)."""
    return gl.div_rn(1.0, _add_rn(1.0, libdevice.exp(-x)))


@gluon.jit
def _packed_gates(a, b, a_log, dt_bias, lower_bound, i_n64, i_hv, sa_n, sa_h, sb_n, o_k, K: gl.constexpr,
                  IS_KDA: gl.constexpr, PACKED: gl.constexpr, BETA_ROUND: gl.constexpr):
    """``step_packed``'s gates from its raw inputs, :func:`.gate_math.gate_values` and the beta rounding of
    :func:`.step_kernel._token_gates` (the same operations in the same order, each product and sum rounded on its own:
    this kernel is compiled with FMA contraction on): (the log decay, [K] for KDA, GDN a scalar; beta)."""
    b_A = libdevice.exp(gl.load(a_log + i_hv).to(gl.float32))
    if IS_KDA:  # the scalars as [K] tiles (libdevice's functions take operands of one layout)
        x = _add_rn(gl.load(a + i_n64 * sa_n + i_hv * sa_h + o_k).to(gl.float32),
                    gl.load(dt_bias + i_hv * K + o_k).to(gl.float32))
        b_A = gl.full_like(x, b_A)
    else:
        x = _add_rn(gl.load(a + i_n64 * sa_n + i_hv * sa_h).to(gl.float32), gl.load(dt_bias + i_hv).to(gl.float32))
    if PACKED == 2:  # KDA's lower-bound gate
        gg = _mul_rn(gl.full_like(x, lower_bound), _sigmoid(_mul_rn(b_A, x)))
    else:  # softplus: x above 20, else log1p(exp(x)) (exp's argument clamped where it is not used)
        big = x > SOFTPLUS_THRESHOLD
        sp = gl.where(big, x, libdevice.log1p(libdevice.exp(gl.where(big, SOFTPLUS_THRESHOLD, x))))
        gg = _mul_rn(-b_A, sp)
    bb = _sigmoid(gl.load(b + i_n64 * sb_n + i_hv).to(gl.float32))
    if BETA_ROUND == 1:
        bb = bb.to(gl.bfloat16).to(gl.float32)
    elif BETA_ROUND == 2:
        bb = bb.to(gl.float16).to(gl.float32)
    return gg, bb


@gluon.jit
def _token(q, k, g, beta, t, i_n64, i_h, i_hv, sq_n, sq_t, sq_h, sk_n, sk_t, sk_h, sg_n, sg_t, sg_h, sb_n, sb_t, sb_h,
           o_k, a_log, dt_bias, lower_bound, K: gl.constexpr, IS_KDA: gl.constexpr, USE_QK_L2NORM: gl.constexpr,
           PACKED: gl.constexpr, BETA_ROUND: gl.constexpr):
    """Token t's inputs: (k, q, then :func:`_gate_inputs`' beta and log decay)."""
    kk, qq = _load_keys(k + i_n64 * sk_n + t * sk_t + i_h * sk_h, q + i_n64 * sq_n + t * sq_t + i_h * sq_h, o_k,
                        USE_QK_L2NORM)
    b_beta, gp = _gate_inputs(g, beta, t, i_n64, i_hv, sg_n, sg_t, sg_h, sb_n, sb_t, sb_h, o_k, a_log, dt_bias,
                              lower_bound, K, IS_KDA, PACKED, BETA_ROUND)
    return kk, qq, b_beta, gp


@gluon.jit
def _checkpoint_products(a, kk, qq, e, sk, V: gl.constexpr, mma: gl.constexpr, lb: gl.constexpr, pl: gl.constexpr,
                         ch: gl.constexpr, NW: gl.constexpr):
    """(C (s_k k e), C (s_k q e)) [V] for the codes C in ``a`` on the tensor cores: four int8 pieces of each key,
    exact integer products and sums, scaled back per piece."""
    xk = kk * e * sk
    xq = qq * e * sk
    tk1, tk2, tq1, tq2 = _shifts(xk, xq)
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
    # the pieces' sums of k (columns 0-3) and of q (4-7) side by side, then one layout change for both
    dkq = gl.sum(gl.reshape(accf, [V, 2, 4]), axis=2)
    dk, dq = gl.split(gl.convert_layout(dkq, gl.BlockedLayout([V // 32 // NW, 2], [32, 1], [NW, 1], [1, 0])))
    return gl.convert_layout(dk, ch), gl.convert_layout(dq, ch)


@gluon.jit
def _put(tile, t, x, TP: gl.constexpr, tl_: gl.constexpr):
    """``tile`` [TP, C] in ``tl_`` (the token axis inside a thread) with row t set to ``x`` [C]."""
    o_t = gl.arange(0, TP, layout=gl.SliceLayout(1, tl_))
    return gl.where((o_t == t)[:, None], gl.convert_layout(x, gl.SliceLayout(0, tl_))[None, :], tile)


@gluon.jit
def _partials(x, R: gl.constexpr, K: gl.constexpr, KPT: gl.constexpr):
    """An [R, K] product tile whose threads hold KPT channels of every row, summed over those channels: [R, K / KPT],
    a thread's R partial sums in its column."""
    return gl.sum(gl.reshape(x, [R, K // KPT, KPT]), axis=2)


@gluon.jit
def _gate_inputs(g, beta, t, i_n64, i_hv, sg_n, sg_t, sg_h, sb_n, sb_t, sb_h, o_k, a_log, dt_bias, lower_bound,
                 K: gl.constexpr, IS_KDA: gl.constexpr, PACKED: gl.constexpr, BETA_ROUND: gl.constexpr):
    """Token t's (beta, log decay: [K] for KDA, GDN a scalar), loaded; ``PACKED``: ``g`` and ``beta`` are
    ``step_packed``'s ``a`` and ``b``, the gates computed here (:func:`_packed_gates`)."""
    if PACKED:
        gp, b_beta = _packed_gates(g + t * sg_t, beta + t * sb_t, a_log, dt_bias, lower_bound, i_n64, i_hv, sg_n,
                                   sg_h, sb_n, o_k, K, IS_KDA, PACKED, BETA_ROUND)
    else:
        b_beta = gl.load(beta + i_n64 * sb_n + t * sb_t + i_hv * sb_h).to(gl.float32)
        p_g = g + i_n64 * sg_n + t * sg_t + i_hv * sg_h
        if IS_KDA:
            gp = gl.load(p_g + o_k).to(gl.float32)
        else:
            gp = gl.load(p_g).to(gl.float32)
    return b_beta, gp


@gluon.jit
def _decays(gp, pc, IS_KDA: gl.constexpr):
    """From a token's log decay ``gp`` and ``pc``, the pcum before it: (pcum after it, the checkpoint's decay e, the
    gate's factor: the fp16 exp(g) that gbuf stores (KDA) or exp(g) (GDN)) (SPEC §6 step 2)."""
    if IS_KDA:
        pc = pc + gp
        return pc, libdevice.exp(pc), libdevice.exp(gp).to(gl.float16)
    else:
        a_g = libdevice.exp(gp)
        pc = pc * a_g
        return pc, gl.maximum(pc, PNMIN), a_g


@gluon.jit
def _pick(x, o_t, t):
    """Element t of ``x`` [TP] (every thread all of them): a thread-local sum of it and zeros (exact for what is
    picked here, which is never -0)."""
    return gl.sum(gl.where(o_t == t, x, 0.0), axis=0)


@gluon.jit
def leapquant_step_gluon_kernel(idx, q, k, v, g, beta, out, codes, skv, uq, kbuf, ubuf, w, pcum, gbuf, hcnt,
                                sq_n, sq_h, sk_n, sk_h, sv_n, sv_h, sg_n, sg_h, sb_n, sb_h, so_n, so_h, scale, NS, HV,
                                G, SS, HS, sq_t, sk_t, sv_t, sg_t, sb_t, so_t, hstart, hcount, hpcum, hw, a_log,
                                dt_bias, lower_bound, FIRST: gl.constexpr, K: gl.constexpr, V: gl.constexpr,
                                L: gl.constexpr, R: gl.constexpr, IS_KDA: gl.constexpr, USE_QK_L2NORM: gl.constexpr,
                                HIST: gl.constexpr, HT: gl.constexpr, T: gl.constexpr, PACKED: gl.constexpr,
                                BETA_ROUND: gl.constexpr, TOFF: gl.constexpr, NW: gl.constexpr):
    """T tokens into the ring of (idx[n], hv), one after the other, and ``out[n, t, hv] = scale S_t q_t``; grid
    (N, HV), ``NW`` warps. The arguments are :func:`.step_kernel.leapquant_step_kernel`'s (``NW``: its
    ``num_warps``)."""
    KPT: gl.constexpr = K // (32 * NW)
    KT: gl.constexpr = K // KPT  # the threads over the channels
    BR: gl.constexpr = 4
    TP: gl.constexpr = 1 if T == 1 else (2 if T == 2 else (4 if T <= 4 else 8))
    OFF: gl.constexpr = 4 if TP <= 4 else TP  # rows of the second sum buffer: [Cn | Dn | Ek | Eq]
    NR2: gl.constexpr = 16 if TP <= 4 else 32
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NW, 1], instr_shape=[16, 8])
    la: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=16)
    lb: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=16)
    # [L, K] and [L, V]: every thread holds all L ring entries of KPT channels
    kl: gl.constexpr = gl.BlockedLayout([L, KPT], [1, 32], [1, NW], [0, 1])
    # the same threads and elements with the channels first in registers: the loads' layout (KPT-element vectors)
    kv: gl.constexpr = gl.BlockedLayout([L, KPT], [1, 32], [1, NW], [1, 0])
    rl: gl.constexpr = gl.BlockedLayout([BR, KPT], [1, 32], [1, NW], [1, 0])
    pl: gl.constexpr = gl.BlockedLayout([KPT, 8], [32, 1], [NW, 1], [1, 0])
    # [TP, K]: the call's own entries (keys and values), the token axis inside a thread
    tl_: gl.constexpr = gl.BlockedLayout([TP, KPT], [1, 32], [1, NW], [0, 1])
    # the sums over the threads' partials: 8 lanes of a row read it in consecutive 16-byte pieces (no bank conflicts)
    sl: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [NW, 1], [1, 0])
    flat2: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    flat1: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    ch: gl.constexpr = gl.SliceLayout(0, kl)  # [K] / [V]: KPT channels per thread
    rows: gl.constexpr = gl.SliceLayout(1, kl)  # [L]: every thread all of them
    tv: gl.constexpr = gl.SliceLayout(1, tl_)  # [TP]: every thread all of them
    rv: gl.constexpr = gl.SliceLayout(1, rl)  # [BR]: every thread all of them
    wl: gl.constexpr = gl.BlockedLayout([1], [32], [NW], [0])  # [L] or [TP] for stores: an element per thread

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
    p_uq = uq + o_reg * 2
    o_lw = gl.arange(0, L, layout=wl)
    o_v = o_k
    if T == 1:
        # what phase two reads, copied into shared memory now (cp.async, no registers), so that its latency passes
        # during phase one: the ring's rows in use, the rank factors and s_v; the weights (an element per thread)
        # and the token's value loaded now, not at their use. Several tokens keep the loads after phase one: their
        # phase two spills more with the staged tiles' registers (verify T = 4 +3-6 %, measured)
        cp: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [NW, 1], [1, 0])  # 16-bit [4 x, 128]: 16 B per copy
        kbs = gl.allocate_shared_memory(kbuf.dtype.element_ty, [L, K], flat2)
        ubs = gl.allocate_shared_memory(ubuf.dtype.element_ty, [L, V], flat2)
        _stage(kbs, p_kb, 0, j, L, K, cp)
        _stage(ubs, p_ub, 0, j, L, V, cp)
        if IS_KDA:
            gbs = gl.allocate_shared_memory(gbuf.dtype.element_ty, [L, K], flat2)
            _stage(gbs, p_gb, 1, j, L, K, cp)
        o_rc = gl.arange(0, BR, layout=gl.SliceLayout(1, cp))
        o_kc = gl.arange(0, K, layout=gl.SliceLayout(0, cp))
        m_rc = (o_rc < R)[:, None] & (o_kc < K)[None, :]
        urs = gl.allocate_shared_memory(uq.dtype.element_ty, [BR, K], flat2)
        qrs = gl.allocate_shared_memory(uq.dtype.element_ty, [BR, V], flat2)
        _async_load(urs, p_uq + o_rc[:, None] * (K + V) + o_kc[None, :], mask=m_rc)
        _async_load(qrs, p_uq + K + o_rc[:, None] * (K + V) + o_kc[None, :], mask=m_rc)
        svs = gl.allocate_shared_memory(skv.dtype.element_ty, [V], flat1)
        _async_load(svs, p_skv + K + gl.arange(0, V, layout=gl.BlockedLayout([2], [32], [NW], [0])))
        async_copy.commit_group()
        w0w = gl.load(p_w + o_lw)
        vv = gl.load(v + i_n64 * sv_n + i_hv * sv_h + o_v)

    # SPEC §6 steps 2-3 for the checkpoint: C (s_k x e_t) for x = k_t and q_t of every token, the codes then dead.
    # One token keeps its inputs and products in registers; several park them in shared memory (each thread its
    # own channels: no barrier)
    pc = pc0
    if T == 1:
        kk, qq, b_beta, gp = _token(q, k, g, beta, 0, i_n64, i_h, i_hv, sq_n, sq_t, sq_h, sk_n, sk_t, sk_h, sg_n,
                                    sg_t, sg_h, sb_n, sb_t, sb_h, o_k, a_log, dt_bias, lower_bound, K, IS_KDA,
                                    USE_QK_L2NORM, PACKED, BETA_ROUND)
        pc, e, gx = _decays(gp, pc, IS_KDA)
        dk, dq = _checkpoint_products(a, kk, qq, e, sk, V, mma, lb, pl, ch, NW)
    else:
        ts = gl.allocate_shared_memory(gl.float32, [4 * TP, K], flat1)
        if PACKED:  # the computed gates are parked for phase two: computed again there, they spill
            o_tg = gl.arange(0, TP, layout=tv)
            bt = gl.zeros([TP], gl.float32, layout=tv)  # beta
            if IS_KDA:
                gs = gl.allocate_shared_memory(gl.float32, [TP, K], flat1)  # the log decays
            else:
                at = gl.zeros([TP], gl.float32, layout=tv)  # exp(g)
        for t in range(T):  # a loop, not unrolled: unrolled, the tokens' products are scheduled side by side
            kk, qq, b_beta, gp = _token(q, k, g, beta, t, i_n64, i_h, i_hv, sq_n, sq_t, sq_h, sk_n, sk_t, sk_h, sg_n,
                                        sg_t, sg_h, sb_n, sb_t, sb_h, o_k, a_log, dt_bias, lower_bound, K, IS_KDA,
                                        USE_QK_L2NORM, PACKED, BETA_ROUND)
            pc, e, gx = _decays(gp, pc, IS_KDA)
            dk, dq = _checkpoint_products(a, kk, qq, e, sk, V, mma, lb, pl, ch, NW)
            ts.index(4 * t).store(kk)
            ts.index(4 * t + 1).store(qq)
            ts.index(4 * t + 2).store(dk)
            ts.index(4 * t + 3).store(dq)
            if PACKED:
                bt = gl.where(o_tg == t, b_beta, bt)
                if IS_KDA:
                    gs.index(t).store(gp)
                else:
                    at = gl.where(o_tg == t, gx, at)
        if PACKED:  # the scalars too: held in registers through phase two, they spill
            bs = gl.allocate_shared_memory(gl.float32, [TP], flat1)
            bs.store(bt)
            if not IS_KDA:
                ats = gl.allocate_shared_memory(gl.float32, [TP], flat1)
                ats.store(at)
            _barrier()  # every thread reads them; the store of a vector all threads hold may be left to some

    # the ring as the call found it, read once: its entries before j with their decays to the call (the products of
    # the gates after them; every token's own gate then multiplies in), the rank-R factors
    if T == 1:
        wsh = gl.allocate_shared_memory(gl.float32, [L], flat1)
        wsh.store(w0w)
        async_copy.wait_group(0)
        _barrier()
        w0 = wsh.load(rows)
        # the staged tiles read channels first (each thread its channels' 16 entries), reordered in registers
        kd = gl.convert_layout(kbs.load(kv), kl).to(gl.float32)
        if IS_KDA:  # the gates after each entry (rows 1 .. L; one past j - 1)
            gs = gl.where((o_l + 1 < j)[:, None], gl.convert_layout(gbs.load(kv), kl).to(gl.float32), 1.0)
            kd = kd * gl.map_elementwise(_suffix16, gs, pack=16)[0]
        ub = gl.convert_layout(ubs.load(kv), kl)  # bf16 until used
        ur = urs.load(rl)  # fp16 until used
        qr = qrs.load(rl)
        sv = svs.load(ch) / QMAX
    else:
        w0 = gl.load(p_w + o_l)
        w0w = gl.convert_layout(w0, wl)
        kd = _load_tile(p_kb, 0, j, L, K, kl, kv).to(gl.float32)
        if IS_KDA:
            kd = kd * gl.map_elementwise(_suffix16, _load_tile(p_gb, 1, j, L, K, kl, kv).to(gl.float32), pack=16)[0]
        ub = _load_tile(p_ub, 0, j, L, V, kl, kv)  # bf16 until used
        o_r = gl.arange(0, BR, layout=gl.SliceLayout(1, rl))
        o_kr = gl.arange(0, K, layout=gl.SliceLayout(0, rl))
        m_r = (o_r < R)[:, None] & (o_kr < K)[None, :]
        ur = gl.load(p_uq + o_r[:, None] * (K + V) + o_kr[None, :], mask=m_r, other=0.0)  # fp16 until used
        qr = gl.load(p_uq + K + o_r[:, None] * (K + V) + o_kr[None, :], mask=m_r, other=0.0)
        sv = gl.load(p_skv + K + o_v) / QMAX
    kd = kd * gl.where(o_l < j, w0, 0.0)[:, None]  # the weights in (GDN: their decays since, a factor of the call's)
    if HIST:
        if TOFF == 0:  # the call's first launch: its start and the state before it
            gl.store(hstart + i_sh, h)
            if IS_KDA:
                gl.store(hpcum + i_sh * HT * K + o_k, pc0)
            else:
                gl.store(hpcum + i_sh * HT, pc0)
            gl.store(hw + i_sh * HT * L + o_l, w0)
        gl.store(hcount + i_sh, TOFF + T)

    # the tokens: each one's sums over the channels (its products with the ring's keys, the call's earlier keys and
    # the rank factors) in one pass through shared memory, two barriers
    red1 = gl.allocate_shared_memory(gl.float32, [2 * L, KT], flat2)
    red2 = gl.allocate_shared_memory(gl.float32, [NR2, KT], flat2)
    sum1 = gl.allocate_shared_memory(gl.float32, [2 * L], flat1)
    sum2 = gl.allocate_shared_memory(gl.float32, [NR2], flat1)
    o_tp = gl.arange(0, TP, layout=tv)
    # the ring's weights (GDN: decayed token by token) and the call's, an element per thread: for the stores
    o_tw = gl.arange(0, TP, layout=wl)
    wold = gl.where(o_lw < j, w0w, 0.0)
    # the call's gates so far: per channel (KDA), or their product times every channel (GDN)
    pk = gl.full([K], 1.0, gl.float32, layout=ch)
    kn = gl.zeros([TP, K], gl.float32, layout=tl_)  # the call's entries: keys times their decays so far
    un_t = gl.zeros([TP, V], gl.float32, layout=tl_)  # and their values
    wn = gl.zeros([TP], gl.float32, layout=tv)  # and their weights
    if T > 1:  # the gates again, token by token (one token: pc is the pcum after it)
        pc = pc0
    for t in range(T):  # a loop, not unrolled: T bodies side by side spill
        jt = j + t
        if T == 1:  # its inputs are still in registers
            kk2 = kk
            qq2 = qq
            dk2 = dk
            dq2 = dq
        else:
            kk2 = ts.index(4 * t).load(ch)
            qq2 = ts.index(4 * t + 1).load(ch)
            dk2 = ts.index(4 * t + 2).load(ch)
            dq2 = ts.index(4 * t + 3).load(ch)
            if PACKED:
                b_beta = _pick(bs.load(tv), o_tg, t)
                if IS_KDA:
                    pc, e, gx = _decays(gs.index(t).load(ch), pc, IS_KDA)
                else:
                    gx = _pick(ats.load(tv), o_tg, t)
                    pc = pc * gx
                    e = gl.maximum(pc, PNMIN)
            else:
                b_beta, gp = _gate_inputs(g, beta, t, i_n64, i_hv, sg_n, sg_t, sg_h, sb_n, sb_t, sb_h, o_k, a_log,
                                          dt_bias, lower_bound, K, IS_KDA, PACKED, BETA_ROUND)
                pc, e, gx = _decays(gp, pc, IS_KDA)
        # the decays to this token: the ring's through the call's gates, the call's entries by this gate
        if IS_KDA:
            gxf = gx.to(gl.float32)
            pk = pk * gxf
            kn = kn * gl.convert_layout(gxf, gl.SliceLayout(0, tl_))[None, :]
        else:
            pk = pk * gx
            wold = wold * gx
            wn = gl.where(o_tp < t, wn * gx, wn)
        xk = kk2 * pk
        xq = qq2 * pk
        kt = gl.convert_layout(kk2, gl.SliceLayout(0, tl_))
        qt = gl.convert_layout(qq2, gl.SliceLayout(0, tl_))
        red1.slice(0, L).store(_partials(kd * xk[None, :], L, K, KPT))
        red1.slice(L, L).store(_partials(kd * xq[None, :], L, K, KPT))
        red2.slice(0, TP).store(_partials(kn * kt[None, :], TP, K, KPT))
        # the new entry (decay 1): kbuf[jt] = bf16(k), w_jt = beta; its q product with the others'
        kj = kk2.to(gl.bfloat16)
        kn = _put(kn, t, kj.to(gl.float32), TP, tl_)
        wn = gl.where(o_tp == t, b_beta, wn)
        red2.slice(OFF, TP).store(_partials(kn * qt[None, :], TP, K, KPT))
        # the old rank-R part: a_r = u_r . (x e)
        urf = ur.to(gl.float32)
        red2.slice(2 * OFF, BR).store(_partials(urf * gl.convert_layout(kk2 * e, gl.SliceLayout(0, rl))[None, :],
                                                BR, K, KPT))
        red2.slice(2 * OFF + BR, BR).store(_partials(urf * gl.convert_layout(qq2 * e, gl.SliceLayout(0, rl))[None, :],
                                                     BR, K, KPT))
        _barrier()
        sum1.store(gl.sum(red1.load(sl), axis=1))
        sum2.store(gl.sum(red2.load(sl), axis=1))
        _barrier()
        ck = sum1.slice(0, L).load(rows)
        cq = sum1.slice(L, L).load(rows)
        cnk = wn * sum2.slice(0, TP).load(tv)
        cnq = wn * sum2.slice(OFF, TP).load(tv)
        ak = sum2.slice(2 * OFF, BR).load(rv)
        aq = sum2.slice(2 * OFF + BR, BR).load(rv)
        # the value side: the ring's, the call's and the rank's sums inside a thread
        ubf = ub.to(gl.float32)
        rk = gl.sum(ubf * ck[:, None], axis=0) + gl.convert_layout(gl.sum(un_t * cnk[:, None], axis=0), ch)
        lk = gl.convert_layout(gl.sum(qr.to(gl.float32) * ak[:, None], axis=0), ch)
        p = sv * dk2 + lk + rk
        if T > 1:
            vv = gl.load(v + i_n64 * sv_n + t * sv_t + i_hv * sv_h + o_v)
        un = (vv.to(gl.float32) - p).to(gl.bfloat16)
        un_t = _put(un_t, t, un.to(gl.float32), TP, tl_)
        rq = gl.sum(ubf * cq[:, None], axis=0) + gl.convert_layout(gl.sum(un_t * cnq[:, None], axis=0), ch)
        lq = gl.convert_layout(gl.sum(qr.to(gl.float32) * aq[:, None], axis=0), ch)
        o = sv * dq2 + lq + rq
        _store_out(p_o + t * so_t, scale * o)

        m_new = gl.where(jt >= 0, o_k < K, False)  # an invalid negative count writes no entry, as the reference
        if IS_KDA:
            gl.store(p_gb + jt * K + o_k, gx, mask=m_new)
        gl.store(p_kb + jt * K + o_k, kj, mask=m_new)
        gl.store(p_ub + jt * V + o_v, un, mask=m_new)
        if HIST:
            if IS_KDA:
                gl.store(hpcum + (i_sh * HT + TOFF + t + 1) * K + o_k, pc)
            else:
                gl.store(hpcum + i_sh * HT + TOFF + t + 1, pc)
            # the weights after token t: the ring's, the call's up to t, and past jt the row as the call found it
            p_hw = hw + (i_sh * HT + TOFF + t + 1) * L
            gl.store(p_hw + o_lw, gl.where(o_lw < j, wold, w0w), mask=(o_lw < j) | (o_lw > jt))
            gl.store(p_hw + j + o_tw, gl.convert_layout(wn, wl), mask=(o_tw <= t) & (j + o_tw >= 0))
    if IS_KDA:
        gl.store(p_pc + o_k, pc)
    else:
        gl.store(p_pc, pc)
        gl.store(p_w + o_lw, wold, mask=o_lw < j)
    # the call's entries (jt < 0: none)
    gl.store(p_w + j + o_tw, gl.convert_layout(wn, wl), mask=(o_tw < T) & (j + o_tw >= 0))
    gl.store(hcnt + i_sh, j + T)
