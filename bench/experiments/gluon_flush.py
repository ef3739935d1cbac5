"""The flush written in Gluon (session 13): the question was how much of a due program's time is the ``tl`` kernel's
layout traffic, which Gluon's explicit layouts and shared memory take out. Answer (bench/NOTES.md, session 13): little;
the best build is 2.6 / 3.9 % faster than the ``tl`` kernel all due (KDA / GDN), with the same parity.

Same numerics and schedule as leapquant_triton/kernel.py (the list schedule; its ``due_list_kernel`` lists the due
pairs), for the default geometry only (V = K = 128, ring <= 16, rank <= 4, one iteration), 8 warps per program, two
programs per SM (128 registers):

* the state S [V, K] fp32 lives in the ``mma.sync`` accumulator layout from the rebuild to the codes: the old rank-R
  part, the ring's three bf16 pieces and the correction -q16 u16^T are ``mma_v2`` products accumulated onto it in
  place, with no layout conversion of the state (its warps: ``S_WARPS``);
* Sn = fp16(c S) is stored once into shared memory; P = Sn^T Q, Y = Sn P and U = Sn^T q16 all read that one copy
  (``ldmatrix``; the ``tl`` kernel converts the state into each product's operand layout from registers);
* the KDA decays are a forward scan within the thread holding a key column, over the ring's rows in reverse order
  (no masked row products; Triton's reverse scan goes through shuffles);
* Y goes to shared memory once; CholeskyQR2 runs on its four [V] columns (``CHOLQR``: the layout), the 10 Gram
  entries in one 10-operand reduction; the second step reuses the first's columns in registers;
* the column sums of |E| are bf16 |E|^T x ones on the tensor cores from shared memory (Sn's buffer), as the ``tl``
  kernel and the seed take them; the codes are converted to 16-byte rows before they are stored;
* the L2 prefetch of the pair ``AHEAD`` places later is the ``tl`` kernel's (kernel._prefetch).

No scratch words in global memory. Gluon does not run under Triton's interpreter: this is for the GPU only; the
``tl`` kernel stays the portable and CPU path. ``flush_pool(pool, idx)`` has kernel.flush_pool's form, so that
triton_sweep.py takes it as a variant: ``python bench/experiments/triton_sweep.py -:-:list
-:-:file:bench/experiments/gluon_flush.py``; ``python bench/experiments/gluon_flush.py variants DIR`` writes the
other builds measured (``VARIANTS``).
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

import leapquant_triton.kernel as kk
# the SPEC's constants as the `tl` kernel holds them (gl.constexpr is tl.constexpr)
from leapquant_triton.kernel import EPS, FLOOR, FP16_MAX, PNMIN, QMAX, RINT_MAGIC, TINY


@gluon.jit
def _mul(a, b):
    return a * b


@gluon.jit
def _add10(a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, b0, b1, b2, b3, b4, b5, b6, b7, b8, b9):
    return a0 + b0, a1 + b1, a2 + b2, a3 + b3, a4 + b4, a5 + b5, a6 + b6, a7 + b7, a8 + b8, a9 + b9


@gluon.jit
def _gdc_wait():
    gl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _cholqr_step(y0, y1, y2, y3, R: gl.constexpr):
    """One CholeskyQR step on the four [V] columns of Y (columns >= R zero): the Gram matrix as one reduction of its
    10 entries, the lower Cholesky factor with the SPEC's relative pivot floor (every thread factorises it itself),
    Q = Y L^{-T} by forward substitution, as leapquant_triton.kernel._cholqr."""
    g00, g10, g11, g20, g21, g22, g30, g31, g32, g33 = gl.reduce(
        (y0 * y0, y1 * y0, y1 * y1, y2 * y0, y2 * y1, y2 * y2, y3 * y0, y3 * y1, y3 * y2, y3 * y3), 0, _add10)
    l10, l20, l21, l30, l31, l32 = 1.0, 1.0, 1.0, 1.0, 1.0, 1.0
    i11, i22, i33 = 1.0, 1.0, 1.0
    i00 = 1.0 / gl.sqrt(gl.maximum(gl.maximum(g00, FLOOR * g00), TINY))
    q0 = y0 * i00
    q1 = q0
    q2 = q0
    q3 = q0
    if R > 1:
        l10 = g10 * i00
        i11 = 1.0 / gl.sqrt(gl.maximum(gl.maximum(g11 - l10 * l10, FLOOR * g11), TINY))
        q1 = (y1 - l10 * q0) * i11
    if R > 2:
        l20 = g20 * i00
        l21 = (g21 - l20 * l10) * i11
        i22 = 1.0 / gl.sqrt(gl.maximum(gl.maximum(g22 - (l20 * l20 + l21 * l21), FLOOR * g22), TINY))
        q2 = ((y2 - l20 * q0) - l21 * q1) * i22
    if R > 3:
        l30 = g30 * i00
        l31 = (g31 - l30 * l10) * i11
        l32 = (g32 - (l30 * l20 + l31 * l21)) * i22
        i33 = 1.0 / gl.sqrt(gl.maximum(gl.maximum(g33 - (l30 * l30 + l31 * l31 + l32 * l32), FLOOR * g33), TINY))
        q3 = (((y3 - l30 * q0) - l31 * q1) - l32 * q2) * i33
    if R < 2:
        q1 = gl.zeros_like(y0)
    if R < 3:
        q2 = gl.zeros_like(y0)
    if R < 4:
        q3 = gl.zeros_like(y0)
    return q0, q1, q2, q3


@gluon.jit
def _columns_tile(o_r, q0, q1, q2, q3):
    """The [16, V] tile whose rows 0-3 are the four [V] columns (rows >= 4 zero)."""
    r = o_r[:, None]
    t = gl.where(r == 0, q0[None, :], 0.0)
    t = gl.where(r == 1, q1[None, :], t)
    t = gl.where(r == 2, q2[None, :], t)
    return gl.where(r == 3, q3[None, :], t)


@gluon.jit
def _tid():
    return gl.inline_asm_elementwise("mov.u32 $0, %tid.x;", "=r", [], dtype=gl.int32, is_pure=True, pack=1)


@gluon.jit
def _cholqr2(y_sm, q_sm, p_uq, o_j4, o_v4, K: gl.constexpr, V: gl.constexpr, R: gl.constexpr, LQ: gl.constexpr):
    """CholeskyQR2 on Y^T [16, V] in shared memory (rows >= R zero): fp16(Q)^T into ``q_sm`` (rows >= 4 zero) and
    the q part of the checkpoint's factors."""
    # the four leading rows of Y^T, in LQ (the masks are compile-time constants per register: the other rows' loads
    # are dead, and each sum is one addition of zero)
    b_yt = y_sm.load(LQ)
    y0 = gl.sum(gl.where(o_j4[:, None] == 0, b_yt, 0.0), axis=0)
    y1 = gl.sum(gl.where(o_j4[:, None] == 1, b_yt, 0.0), axis=0)
    y2 = gl.sum(gl.where(o_j4[:, None] == 2, b_yt, 0.0), axis=0)
    y3 = gl.sum(gl.where(o_j4[:, None] == 3, b_yt, 0.0), axis=0)
    y0, y1, y2, y3 = _cholqr_step(y0, y1, y2, y3, R)
    y0, y1, y2, y3 = _cholqr_step(y0, y1, y2, y3, R)
    q_sm.store(_columns_tile(o_j4, y0, y1, y2, y3).to(gl.float16))  # q16^T (every warp passed the barrier after
    # its Q0 loads)
    gl.store(p_uq + K + o_v4, y0.to(gl.float16))
    if R > 1:
        gl.store(p_uq + (K + V) + K + o_v4, y1.to(gl.float16))
    if R > 2:
        gl.store(p_uq + 2 * (K + V) + K + o_v4, y2.to(gl.float16))
    if R > 3:
        gl.store(p_uq + 3 * (K + V) + K + o_v4, y3.to(gl.float16))


@gluon.jit
def gluon_flush_kernel(work, codes, skv, uq, kbuf, ubuf, w, pcum, gbuf, q0, HV, SS,
                       K: gl.constexpr, V: gl.constexpr, L: gl.constexpr, R: gl.constexpr, IS_KDA: gl.constexpr,
                       PDL: gl.constexpr, NW: gl.constexpr, WM: gl.constexpr, WN: gl.constexpr,
                       LQ: gl.constexpr, WARP0: gl.constexpr, AHEAD: gl.constexpr,
                       SWIZZLE: gl.constexpr):
    # ---- layouts --------------------------------------------------------------------------------------------------
    # the state's products ([V, K] accumulators: Lo, the ring, -q16 u16^T), warps WM x WN; the thin products
    # ([X, 16]: P, Y, U, the column sums) with every warp on 16 rows of their 128
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[WM, WN], instr_shape=[16, 8])
    OPA: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    OPB: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
    ROW: gl.constexpr = gl.SliceLayout(1, MMA)  # [V] beside the state
    COL: gl.constexpr = gl.SliceLayout(0, MMA)  # [K] beside the state
    MT: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NW, 1], instr_shape=[16, 8])
    OPAT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MT, k_width=2)
    OPBT: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MT, k_width=2)
    ROWT: gl.constexpr = gl.SliceLayout(1, MT)  # [K] (or [V]) of an [X, 16] product
    COLT: gl.constexpr = gl.SliceLayout(0, MT)  # the 16 columns of an [X, 16] product
    BC: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [NW, 1], [1, 0])  # [V, K] int8: 16-byte rows
    BJ: gl.constexpr = gl.BlockedLayout([16, 1], [1, 32], [1, NW], [0, 1])  # [16, X]: a thread holds one column
    BU: gl.constexpr = gl.BlockedLayout([4, 1], [32, 1], [1, NW], [0, 1])  # [V, 16] ubuf^T: 8-byte runs along V
    BQ: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [NW, 1], [1, 0])  # [16, 128] fp16: a 16-byte run each
    VJ: gl.constexpr = gl.SliceLayout(0, BJ)  # [V] / [K]: one value per thread
    V4: gl.constexpr = gl.SliceLayout(0, LQ)  # [V] columns of Q and Y (LQ: q_layout)
    SW: gl.constexpr = gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=8, order=[1, 0])
    # Y^T [16, V] fp32, stored from the accumulator layout (thread (g, t) writes rows 2t, 2t + 1 at column g): the
    # 8-word chunks of rows 2p, 2p + 1 are permuted by p, so that the four t of a store land in four bank groups
    if SWIZZLE:
        SQ: gl.constexpr = SW
        SY: gl.constexpr = gl.SwizzledSharedLayout(vec=8, per_phase=2, max_phase=4, order=[1, 0])
    else:  # (the first build: unswizzled [16, X] buffers, 8-way bank conflicts on every ldmatrix of them)
        SQ: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
        SY: gl.constexpr = SQ

    # ---- the due pair (list schedule) -----------------------------------------------------------------------------
    pid = gl.program_id(0)
    if PDL:
        _gdc_wait()
    n_due = gl.load(work)
    if pid >= n_due:
        return
    if AHEAD > 0:
        kk._prefetch(work, n_due, pid + AHEAD, codes, kbuf, ubuf, w, gbuf, HV, SS, K, V, L, R, IS_KDA)
    i_sh = gl.load(work + 1 + pid)
    i_s = i_sh // HV
    i_h = i_sh - i_s * HV
    i_s = i_s.to(gl.int64)
    i_sh = i_sh.to(gl.int64)
    o_reg = i_s * SS + i_h * (V * K)
    p_c = codes + o_reg * 4
    p_skv = skv + o_reg
    p_uq = uq + o_reg * 2
    p_k = kbuf + i_sh * (L * K)
    p_u = ubuf + i_sh * (L * V)
    p_w = w + i_sh * L
    p_g = gbuf + i_sh * (L * K)

    # ---- loads: the checkpoint, the ring, pcum, Q0 ------------------------------------------------------------------
    o_vc = gl.arange(0, V, layout=gl.SliceLayout(1, BC))
    o_kc = gl.arange(0, K, layout=gl.SliceLayout(0, BC))
    b_c8 = gl.load(p_c + o_vc[:, None] * K + o_kc[None, :])  # [V, K] int8
    o_vr = gl.arange(0, V, layout=ROW)
    o_kk = gl.arange(0, K, layout=COL)
    b_sv = gl.load(p_skv + K + o_vr)
    b_sk = gl.load(p_skv + o_kk)
    o_j = gl.arange(0, 16, layout=gl.SliceLayout(1, BJ))
    o_kj = gl.arange(0, K, layout=VJ)
    # the old factors as [16, X] tiles of 16-byte rows (rows >= R zero)
    o_jq = gl.arange(0, 16, layout=gl.SliceLayout(1, BQ))
    o_xq = gl.arange(0, K, layout=gl.SliceLayout(0, BQ))
    m_rq = o_jq[:, None] < R
    b_uo = gl.load(p_uq + o_jq[:, None] * (K + V) + o_xq[None, :], mask=m_rq, other=0.0)  # [16, K] u_old^T
    b_qo = gl.load(p_uq + o_jq[:, None] * (K + V) + K + o_xq[None, :], mask=m_rq, other=0.0)  # [16, V] q_old^T
    # Q0 [V, R] as four [V] columns (columns >= R zero)
    o_j4 = gl.arange(0, 16, layout=gl.SliceLayout(1, LQ))
    o_v4 = gl.arange(0, V, layout=V4)
    c_0 = gl.load(q0 + o_v4 * R)
    c_1 = gl.zeros_like(c_0)
    c_2 = gl.zeros_like(c_0)
    c_3 = gl.zeros_like(c_0)
    if R > 1:
        c_1 = gl.load(q0 + o_v4 * R + 1)
    if R > 2:
        c_2 = gl.load(q0 + o_v4 * R + 2)
    if R > 3:
        c_3 = gl.load(q0 + o_v4 * R + 3)
    # the ring's rows in reverse order, row i holding entry 15 - i (zero past L): the KDA decays are then a forward
    # scan within the thread that holds the column (Triton's reverse scan goes through shuffles)
    o_e = 15 - o_j
    m_j = o_e < L
    b_kd = gl.load(p_k + o_e[:, None] * K + o_kj[None, :], mask=m_j[:, None], other=0.0).to(gl.float32)  # [16, K]
    o_vu = gl.arange(0, V, layout=gl.SliceLayout(1, BU))
    o_eu = 15 - gl.arange(0, 16, layout=gl.SliceLayout(0, BU))
    b_ut = gl.load(p_u + o_eu[None, :] * V + o_vu[:, None], mask=o_eu[None, :] < L, other=0.0)  # [V, 16] bf16
    b_wj = gl.load(p_w + o_e, mask=m_j, other=0.0)
    if IS_KDA:
        # d_j = prod_{i > j} gbuf[i], multiplied from i = L - 1 down (the reference's order): row i of the scan's
        # input is gbuf[16 - i] (1 past L), so its inclusive product up to row i is d_{15 - i}
        b_gs = gl.load(p_g + (o_e[:, None] + 1) * K + o_kj[None, :], mask=(o_e[:, None] + 1) < L, other=1.0)
        b_pc = gl.load(pcum + i_sh * K + o_kj)
        b_kd = b_kd * gl.associative_scan(b_gs.to(gl.float32), 0, _mul)
        b_e = gl.convert_layout(gl.exp(b_pc), COL)
    else:
        b_pn = gl.maximum(gl.load(pcum + i_sh), PNMIN)
    b_kd = b_kd * b_wj[:, None]
    b_k1 = b_kd.to(gl.bfloat16)
    b_r1 = b_kd - b_k1.to(gl.float32)
    b_k2 = b_r1.to(gl.bfloat16)
    b_k3 = (b_r1 - b_k2.to(gl.float32)).to(gl.bfloat16)

    # ---- rebuild S = (Dq + Lo) scale + Ring, in the accumulator layout ---------------------------------------------
    b_ci = gl.convert_layout(b_c8, MMA).to(gl.int32)
    b_cf = (b_ci + 0x4B400000).to(gl.float32, bitcast=True) - 12582912.0
    b_s = b_cf * (b_sv / QMAX)[:, None] * b_sk[None, :]
    q_sm = gl.allocate_shared_memory(gl.float16, [16, V], SQ, b_qo)  # q_old^T, then Q0^T, then q16^T
    u_sm = gl.allocate_shared_memory(gl.float16, [16, K], SQ, b_uo)  # u_old^T, then u16^T
    gl.thread_barrier()
    b_s = mma_v2(q_sm.permute((1, 0)).load(OPA), u_sm.load(OPB), b_s)
    if IS_KDA:
        b_s = b_s * b_e[None, :]
    else:
        b_s = b_s * b_pn
    b_uta = gl.convert_layout(b_ut, OPA)
    b_s = mma_v2(b_uta, gl.convert_layout(b_k3, OPB), b_s)
    b_s = mma_v2(b_uta, gl.convert_layout(b_k2, OPB), b_s)
    b_s = mma_v2(b_uta, gl.convert_layout(b_k1, OPB), b_s)

    # ---- subspace iteration on Sn = c S, c = 2^(126 - e) from the exponent field e of max|S| ------------------------
    a_max = gl.max(gl.max(gl.abs(b_s), axis=1), axis=0)
    e_max = (a_max.to(gl.int32, bitcast=True) >> 23) & 0xFF
    e_max = gl.minimum(gl.maximum(e_max, 1), 252)
    c_norm = ((253 - e_max) << 23).to(gl.float32, bitcast=True)
    c_inv = ((e_max + 1) << 23).to(gl.float32, bitcast=True)  # 1 / c_norm, exactly (a power of two)
    sn_sm = gl.allocate_shared_memory(gl.float16, [V, K], SW, (b_s * c_norm).to(gl.float16))
    gl.thread_barrier()  # every warp has read q_old (the Lo product) before Q0 overwrites it
    q_sm.store(_columns_tile(o_j4, c_0, c_1, c_2, c_3).to(gl.float16))  # Q0^T
    gl.thread_barrier()
    b_qb = q_sm.permute((1, 0)).load(OPBT)  # [V, 16]
    b_p = mma_v2(sn_sm.permute((1, 0)).load(OPAT), b_qb, gl.zeros([K, 16], gl.float32, MT))  # [K, 16]
    b_y = mma_v2(sn_sm.load(OPAT), gl.convert_layout(b_p.to(gl.float16), OPBT), gl.zeros([V, 16], gl.float32, MT))
    y_sm = gl.allocate_shared_memory(gl.float32, [16, V], SY)
    y_sm.permute((1, 0)).store(b_y)
    gl.thread_barrier()
    # the four leading rows of Y^T, one column of the tile per thread (the masks are compile-time constants per
    # register: the other rows' loads are dead, and each sum is one addition of zero)
    if WARP0:  # CholeskyQR2 in the first warp only (LQ keeps every sum within a warp): the others wait
        if _tid() < 32:
            _cholqr2(y_sm, q_sm, p_uq, o_j4, o_v4, K, V, R, LQ)
    else:
        _cholqr2(y_sm, q_sm, p_uq, o_j4, o_v4, K, V, R, LQ)
    gl.thread_barrier()

    # ---- new factors U = Sn^T q16 / c, the residual E = S - q16 u16^T -------------------------------------------------
    b_qb = q_sm.permute((1, 0)).load(OPBT)
    b_u = mma_v2(sn_sm.permute((1, 0)).load(OPAT), b_qb, gl.zeros([K, 16], gl.float32, MT)) * c_inv
    b_u16 = gl.minimum(gl.maximum(b_u, -FP16_MAX), FP16_MAX).to(gl.float16)  # [K, 16]
    u_sm.permute((1, 0)).store(b_u16)  # (every warp passed two barriers after its u_old loads)
    gl.thread_barrier()
    b_qa = q_sm.permute((1, 0)).load(OPA)  # [V, 16]
    b_s = mma_v2(-b_qa, u_sm.load(OPB), b_s)

    # ---- column scales: the column sums of |E| as bf16 |E|^T x ones, from Sn's buffer ---------------------------------
    e_sm = sn_sm._reinterpret(gl.bfloat16, [V, K], SW)
    e_sm.store(gl.abs(b_s).to(gl.bfloat16))  # (every warp passed the barrier after its last Sn loads)
    gl.thread_barrier()
    b_cs = mma_v2(e_sm.permute((1, 0)).load(OPAT), gl.full([V, 16], 1.0, gl.bfloat16, OPBT),
                  gl.zeros([K, 16], gl.float32, MT))  # [K, 16], every column the sums
    o_16 = gl.arange(0, 16, layout=COLT)
    m_k = gl.sum(gl.where(o_16[None, :] == 0, b_cs, 0.0), axis=1) * (1.0 / V)  # [K] (ROW of [K, 16])
    o_kr = gl.arange(0, K, layout=ROWT)
    gl.store(p_skv + o_kr, gl.maximum(gl.sqrt(m_k), EPS))
    b_isk = gl.convert_layout(gl.minimum(gl.rsqrt(m_k), 1.0 / EPS), COL)

    # ---- row scales and codes ------------------------------------------------------------------------------------------
    b_s = b_s * b_isk[None, :]
    b_sv = gl.maximum(gl.max(gl.abs(b_s), axis=1), EPS)  # [V]
    b_x = b_s * ((gl.zeros_like(b_sv) + QMAX) / b_sv)[:, None]
    b_co = (b_x + RINT_MAGIC).to(gl.int32, bitcast=True).to(gl.int8)
    gl.store(p_c + o_vc[:, None] * K + o_kc[None, :], gl.convert_layout(b_co, BC))
    gl.store(p_skv + K + o_vr, b_sv)

    # ---- the new factors and the ring resets ----------------------------------------------------------------------------
    o_rr = gl.arange(0, 16, layout=COLT)
    gl.store(p_uq + o_rr[None, :] * (K + V) + o_kr[:, None], b_u16, mask=o_rr[None, :] < R)
    gl.store(p_w + o_j, gl.zeros([16], gl.float32, gl.SliceLayout(1, BJ)), mask=o_j < L)
    if IS_KDA:
        gl.store(pcum + i_sh * K + o_kj, gl.zeros([K], gl.float32, VJ))
        gl.store(p_g + o_j[:, None] * K + o_kj[None, :], gl.full([16, K], 1.0, gl.float16, BJ),
                 mask=(o_j < L)[:, None])
    else:
        gl.store(pcum + i_sh, 1.0)


NUM_WARPS = 8
S_WARPS = (4, 2)  # warps of the state's [V, K] accumulator (rows, columns)
# CholeskyQR2's layout of Q^T / Y^T [16, V]: "column" one value of V per thread (every warp on its part of V; the Gram
# sums cross the warps through shared memory), "rows4" four values of V per thread in one warp (the other warps hold
# copies; the sums stay within a warp), "warp0" that layout in the first warp only
CHOLQR = "column"
# bulk L2 prefetch of the inputs of the due pair AHEAD places later in the list (0: none); 2 x the SM count is about
# one round of programs
AHEAD = -2  # (negative: that many times the SM count)
SWIZZLE = True  # swizzled [16, X] shared buffers (False: the first build's plain ones)


def q_layout(mode: str, nw: int):
    if mode == "column":
        return gl.BlockedLayout([16, 1], [1, 32], [1, nw], [0, 1])
    return gl.BlockedLayout([16, 4], [1, 32], [1, nw], [0, 1])


def kernel_args(pool):
    """The pool's pointers and constexprs of :func:`gluon_flush_kernel`."""
    g = pool.geometry
    assert g.head_k == 128 and g.head_v == 128 and g.ring <= 16 and g.rank <= 4 and pool.iters == 1, g
    return (pool.codes, pool.s_kv, pool.uq, pool.kbuf, pool.ubuf, pool.w, pool.pcum,
            pool.gbuf if pool.gbuf is not None else pool.w, pool.q0, g.heads, g.slot_stride), \
        dict(K=g.head_k, V=g.head_v, L=g.ring, R=g.rank, IS_KDA=g.gate == "kda")


def _sms(device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def flush_pool(pool, idx: torch.Tensor, num_warps: int | None = None, maxnreg: int | None = None) -> None:
    """The list schedule of kernel.flush_pool with the Gluon flush kernel (sm_90)."""
    g = pool.geometry
    N = idx.numel()
    nw = num_warps or NUM_WARPS
    pdl = kk._pdl(idx.device)
    work = torch.empty(1 + N * g.heads, dtype=torch.int32, device=idx.device)
    work[:1].zero_()
    kk.due_list_kernel[(N,)](idx, pool.hcnt, work, g.num_slots, g.heads, FIRST=1 if pool.convention == "vllm" else 0,
                             L=g.ring, HB=triton.next_power_of_2(g.heads), PDL=pdl, num_warps=1, launch_pdl=pdl,
                             **kk.FP_FUSION)
    args, consts = kernel_args(pool)
    gluon_flush_kernel[(N * g.heads,)](work, *args, **consts, PDL=pdl, NW=nw, WM=S_WARPS[0], WN=S_WARPS[1],
                                       LQ=q_layout(CHOLQR, nw), WARP0=CHOLQR == "warp0",
                                       AHEAD=AHEAD if AHEAD >= 0 else -AHEAD * _sms(idx.device), SWIZZLE=SWIZZLE,
                                       num_warps=nw,
                                       maxnreg=maxnreg if maxnreg is not None else 128, launch_pdl=pdl)


def _diagnose() -> int:
    """Field-by-field comparison with the ``tl`` kernel on the same pools (which field goes wrong first), then
    the sweep's parity and timing (triton_sweep.py) are the measurement."""
    import copy

    from leapquant_triton.kernel import flush_pool as tl_flush
    from parity_tests.strategies import build_case

    bad = 0
    for gate in ("kda", "gdn"):
        for regime, rank, ring in (("realistic", 4, 16), ("lowrank", 4, 16), ("realistic", 2, 16), ("gaussian", 1, 8)):
            case = build_case(heads=32, head_k=128, head_v=128, ring=ring, rank=rank, gate=gate, convention="vllm",
                              regime=regime, rows=2, due_frac=0.5, padding=2, seed=7, device="cuda")
            a, b = copy.deepcopy(case.pool), copy.deepcopy(case.pool)
            tl_flush(a, case.idx)
            flush_pool(b, case.idx)
            torch.cuda.synchronize()
            dc = (a.codes.int() - b.codes.int()).abs()

            def rel(x, y):
                x, y = x.float(), y.float()
                return ((x - y).abs().max() / x.abs().max().clamp_min(1e-30)).item()

            same_rest = all(torch.equal(getattr(a, n), getattr(b, n)) for n in ("w", "pcum", "gbuf", "hcnt")
                            if getattr(a, n) is not None)
            print(f"{gate} {regime} R{rank} L{ring}: codes differ {(dc > 0).float().mean().item():.2e} max {dc.max().item()}"
                  f" | s_k {rel(a.s_k, b.s_k):.1e} s_v {rel(a.s_v, b.s_v):.1e} u {rel(a.u, b.u):.1e}"
                  f" q {rel(a.q, b.q):.1e} | resets equal {same_rest} | finite "
                  f"{bool(torch.isfinite(b.s_kv).all() and torch.isfinite(b.uq.float()).all())}", flush=True)
            bad += int(dc.max().item() > 1 or not same_rest)
    return bad


def _profile(gate: str = "kda") -> None:
    """One all-due flush at 256 x 32 for a profiler (``ncu -k regex:gluon_flush_kernel --launch-skip 1 -c 1``)."""
    import leapquant
    from leapquant.workloads import fill

    gen = torch.Generator().manual_seed(0)
    pool = leapquant.Pool(257, 32, gate=gate, device="cuda")
    fill(pool, torch.arange(1, 257), "realistic", gen)
    idx = (torch.randperm(256, generator=gen) + 1).to(torch.int32).cuda()
    saved = {n: getattr(pool, n).clone() for n in ("raw", "w", "pcum", "gbuf") if getattr(pool, n) is not None}
    for _ in range(2):  # the first launch compiles; the profiler takes the second
        for n, t in saved.items():
            getattr(pool, n).copy_(t)
        flush_pool(pool, idx)
    torch.cuda.synchronize()


# the builds measured in session 13 (bench/NOTES.md): name -> (S_WARPS, CHOLQR, AHEAD, SWIZZLE)
VARIANTS = {
    "g_plain81": ((8, 1), "column", 0, False),
    "g_c81": ((8, 1), "column", 0, True),
    "g_r81": ((8, 1), "rows4", 0, True),
    "g_r42": ((4, 2), "rows4", 0, True),
    "g_w42": ((4, 2), "warp0", 0, True),
    "g_c42": ((4, 2), "column", 0, True),
    "g_c42p": ((4, 2), "column", -2, True),
    "g_c42p4": ((4, 2), "column", -4, True),
}


def write_variants(folder: str) -> None:
    """Copies of this file with other defaults, as VARIANTS names them, for triton_sweep.py's ``file:`` variants."""
    import os
    import re

    text = open(__file__).read()
    for name, (warps, chol, ahead, swz) in VARIANTS.items():
        t = re.sub(r"^S_WARPS = \(\d, \d\)", f"S_WARPS = {warps}", text, count=1, flags=re.M)
        t = re.sub(r'^CHOLQR = "\w+"', f'CHOLQR = "{chol}"', t, count=1, flags=re.M)
        t = re.sub(r"^AHEAD = -?\d+", f"AHEAD = {ahead}", t, count=1, flags=re.M)
        t = re.sub(r"^SWIZZLE = \w+", f"SWIZZLE = {swz}", t, count=1, flags=re.M)
        with open(os.path.join(folder, name + ".py"), "w") as f:
            f.write(t)
        print(name, "->", os.path.join(folder, name + ".py"))


if __name__ == "__main__":
    import sys

    if sys.argv[1:2] == ["variants"]:
        write_variants(sys.argv[2] if len(sys.argv) > 2 else "/tmp")
    elif sys.argv[1:2] == ["profile"]:
        _profile(*sys.argv[2:3])
    else:
        sys.exit(1 if _diagnose() else 0)
