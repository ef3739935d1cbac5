"""The LeapQuant decode step (docs/SPEC.md §6) as a Triton kernel, and :func:`step_pool`, its launch after the flush
of the full rings.

One program per (row n of ``idx``, value head hv), grid ``(N, HV)``; value head hv reads key head
``hv // (HV / H)``. It reads the checkpoint region once and never forms the state: every product is a mat-vec of
the two keys it serves at once, ``k`` (the prediction ``p = S' k``) and ``q`` (the output ``o = scale S_t q``), in
fp32 elementwise products and sums (no ``tl.dot``: the kernel builds for sm_75, which has no bf16 tensor cores).
Block values (``b_``), per program:

    b_k, b_q      [K]      the keys, l2-normalised if asked
    b_xk, b_xq    [K]      s_k * the keys * the checkpoint's decay (exp(pcum) per channel; GDN max(pcum, PNMIN))
    b_kd          [L, K]   the ring's keys times their decays d_i, entries i < j only (zero from j on)
    b_ck, b_cq    [L]      w_i (kd_i . k), w_i (kd_i . q): what entry i adds to p and to o per unit of ubuf[i]
    b_ak, b_aq    [BR]     u_r . (the keys * the decay): the old rank-R part's coefficients
    b_cd          [BV, K]  a chunk of the codes (BV value channels), the only [V, K]-sized operand

The value channels go in chunks of BV (registers: one chunk of the codes at a time); the key-side values above are
computed once. Only the entries i < j of the ring are loaded (masked, zero or one where not), so whatever the others
hold, NaN included, is never read. A program writes only its own ring row (entry j of kbuf, ubuf, gbuf; w; pcum;
hcnt) and its row of ``out``: splitting V over programs would race on those. Within the program, the values it
reads and then overwrites (pcum, w, hcnt) are stored after a barrier: their small blocks are replicated over the
warps, and a warp that stored early would change what a later one reads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice
from torch.utils.weak import WeakIdKeyDictionary

from .backend import _interpreting
from .host import compile_options, flush_pool
from .kernel import PNMIN, QMAX, _pair_pointers
from .launcher import Launcher

# FLA's use_qk_l2norm_in_kernel: x / sqrt(sum x^2 + L2NORM_EPS)
L2NORM_EPS = tl.constexpr(1e-6)
# one chunk of codes is BV x K = CHUNK values: 32 fp32 registers per thread at 4 warps. On an H200 (N = 256,
# HV = 32, 128 x 128) this was the fastest build: CHUNK 8192 at 4 warps took 1.3-1.5x as long, 8 warps 2.7-3x, and
# loading the next chunk a chunk ahead 1.17x for KDA (0.96x for GDN)
CHUNK = 4096
NUM_WARPS = 4


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
def _gate(p_g, p_pc, p_w, p_gb, j, o_k, o_l, m_old, K: tl.constexpr, IS_KDA: tl.constexpr, NATIVE: tl.constexpr):
    """SPEC §6 step 1, not stored yet: (the new pcum, the checkpoint's decay [K] (KDA exp(pcum); GDN
    max(pcum, PNMIN)), the ring's weights w [L] (GDN: times a; zero from j on), (KDA) fp16(exp g) [K] and the shifted
    gates ``gbuf[i + 1]`` [L, K] (the new one at row j - 1, one from there on); GDN: placeholders)."""
    b_w = tl.load(p_w + o_l, mask=m_old, other=0.0)
    if IS_KDA:
        b_g = tl.load(p_g + o_k).to(tl.float32)
        b_pc = tl.load(p_pc + o_k) + b_g
        b_gn = _exp(b_g, NATIVE).to(tl.float16)
        # row i holds gbuf[i + 1], the factor entry i takes from the entry after it
        m_next = (o_l + 1 < j)[:, None] & (o_k[None, :] < K)
        b_gs = tl.load(p_gb + (o_l[:, None] + 1) * K + o_k[None, :], mask=m_next, other=1.0).to(tl.float32)
        b_gs = tl.where((o_l + 1 == j)[:, None], b_gn.to(tl.float32)[None, :], b_gs)
        return b_pc, _exp(b_pc, NATIVE), b_w, b_gn, b_gs
    else:
        b_a = _exp(tl.load(p_g).to(tl.float32), NATIVE)
        b_pc = tl.load(p_pc) * b_a
        return b_pc, tl.maximum(b_pc, PNMIN), b_w * b_a, b_a, b_a


@triton.jit
def _ring_keys(p_kb, b_k, b_q, b_w, b_gs, o_k, o_l, m_old, K: tl.constexpr, IS_KDA: tl.constexpr):
    """(w_i (kd_i . k), w_i (kd_i . q)) [L] for the entries i < j, ``kd_i = kbuf[i] * d_i`` with
    ``d_i = prod_{i < m <= j} gbuf[m]`` (KDA; the suffix product of the shifted gates)."""
    b_kd = tl.load(p_kb + o_l[:, None] * K + o_k[None, :], mask=m_old[:, None] & (o_k[None, :] < K),
                   other=0.0).to(tl.float32)
    if IS_KDA:
        b_kd = b_kd * tl.cumprod(b_gs, axis=0, reverse=True)
    return b_w * tl.sum(b_kd * b_k[None, :], axis=1), b_w * tl.sum(b_kd * b_q[None, :], axis=1)


@triton.jit
def _store_ring_row(p_pc, p_w, p_gb, p_kb, p_h, b_pc, b_w, b_gn, b_kj, b_beta, j, o_k, o_l, K: tl.constexpr,
                    IS_KDA: tl.constexpr):
    """The ring row's new values (SPEC §6 steps 1 and 4): pcum; w (GDN: every i < j decayed) with w[j] = beta; KDA
    gbuf[j]; kbuf[j]; hcnt = j + 1. An invalid negative count writes no entry, as the reference (the masks are
    selects: see kernel.due_list_kernel)."""
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
def leapquant_step_kernel(idx, q, k, v, g, beta, out, codes, skv, uq, kbuf, ubuf, w, pcum, gbuf, hcnt,
                          sq_n, sq_h, sk_n, sk_h, sv_n, sv_h, sg_n, sg_h, sb_n, sb_h, so_n, so_h, scale, NS, HV, G,
                          SS, FIRST: tl.constexpr, K: tl.constexpr, V: tl.constexpr, L: tl.constexpr,
                          R: tl.constexpr, BR: tl.constexpr, BV: tl.constexpr, IS_KDA: tl.constexpr,
                          USE_QK_L2NORM: tl.constexpr, NATIVE: tl.constexpr):
    """One token into the ring of (idx[n], hv) and ``out[n, hv] = scale S_t q``; grid (N, HV).

    Token tensors (any float dtype; strides ``s*_n``, ``s*_h`` of their first two dims, unit last stride): q, k
    [N, H, K] with H = HV / G; v [N, HV, V]; g [N, HV, K] (KDA) or [N, HV]; beta [N, HV]; out [N, HV, V]. Pool:
    ``codes``, ``skv``, ``uq`` int8, fp32, fp16 views of ``raw``, region (s, hv) at word s SS + hv V K; the ring
    rows kbuf [L, K], ubuf [L, V], w [L], pcum [K] or [1], gbuf [L, K] (KDA; GDN: any pointer), hcnt, at row
    s HV + hv. A row whose slot is not real gets out = 0 and writes nothing else."""
    i_n, i_hv = tl.program_id(0), tl.program_id(1)
    i_n64 = i_n.to(tl.int64)
    o_k, o_v, o_l, o_r = tl.arange(0, K), tl.arange(0, V), tl.arange(0, L), tl.arange(0, BR)
    p_o = out + i_n64 * so_n + i_hv * so_h
    i_s = tl.load(idx + i_n).to(tl.int64)
    if (i_s < FIRST) | (i_s >= NS):
        _store_out(p_o + o_v, tl.zeros([V], dtype=tl.float32), NATIVE)
        return
    i_h = i_hv // G
    i_sh = i_s * HV + i_hv  # int64: NS HV L K passes 2^31 at a few thousand slots
    o_reg = i_s * SS + i_hv * (V * K)
    _, p_skv, p_uq, p_kb, p_ub, p_w, p_pc, p_gb = _pair_pointers(codes, skv, uq, kbuf, ubuf, w, pcum, gbuf, o_reg,
                                                                 i_sh, K, V, L, IS_KDA)
    p_cd = codes + o_reg * 4 + tl.arange(0, BV)[:, None] * K + o_k[None, :]
    j = tl.load(hcnt + i_sh)
    j = tl.where(j >= L, 0, j)  # a full ring was flushed: it restarts at entry 0
    m_old = o_l < j  # the entries in use; nothing at or past j is read
    b_k = _load_key(k + i_n64 * sk_n + i_h * sk_h, USE_QK_L2NORM, K)
    b_q = _load_key(q + i_n64 * sq_n + i_h * sq_h, USE_QK_L2NORM, K)
    b_beta = tl.load(beta + i_n64 * sb_n + i_hv * sb_h).to(tl.float32)
    b_pc, b_e, b_w, b_gn, b_gs = _gate(g + i_n64 * sg_n + i_hv * sg_h, p_pc, p_w, p_gb, j, o_k, o_l, m_old, K,
                                       IS_KDA, NATIVE)
    b_ck, b_cq = _ring_keys(p_kb, b_k, b_q, b_w, b_gs, o_k, o_l, m_old, K, IS_KDA)
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
    p_v = v + i_n64 * sv_n + i_hv * sv_h
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
        _store_out(p_o + o_vc, scale * b_o, NATIVE)


def step_constants(geometry, convention: str, use_qk_l2norm: bool) -> dict:
    """The constexpr arguments of :func:`leapquant_step_kernel` for a pool (also what the AOT check compiles)."""
    g = geometry
    return dict(FIRST=1 if convention == "vllm" else 0, K=g.head_k, V=g.head_v, L=g.ring, R=g.rank, BR=4,
                BV=min(g.head_v, CHUNK // g.head_k), IS_KDA=g.gate == "kda", USE_QK_L2NORM=bool(use_qk_l2norm),
                NATIVE=not _interpreting())


_launch_step = Launcher(leapquant_step_kernel)
# per pool memory (keyed weakly by the pool's raw tensor: they go with it):
# {(geometry, convention, l2norm): (the tensors' (address, dtype)s, Prepared)}
_PREPARED = WeakIdKeyDictionary()


def _prepared(pool, use_qk_l2norm: bool):
    """The step's launch with the pool's tensors and constants bound once (:meth:`.launcher.Launcher.prepare`),
    prepared again when a tensor of the pool moved (as :func:`.host._plan`)."""
    g = pool.geometry
    tensors = dict(codes=pool.codes, skv=pool.s_kv, uq=pool.uq, kbuf=pool.kbuf, ubuf=pool.ubuf, w=pool.w,
                   pcum=pool.pcum, gbuf=pool.gbuf if pool.gbuf is not None else pool.w,  # GDN never reads it
                   hcnt=pool.hcnt)
    memory = [(t.data_ptr(), t.dtype) for t in tensors.values()]
    cache = _PREPARED.get(pool.raw)
    if cache is None:
        cache = _PREPARED[pool.raw] = {}
    key = (g, pool.convention, bool(use_qk_l2norm))
    entry = cache.get(key)
    if entry is None or entry[0] != memory:
        static = dict(tensors, NS=g.num_slots, HV=g.heads, SS=g.slot_stride,
                      **step_constants(g, pool.convention, use_qk_l2norm))
        entry = cache[key] = (memory, _launch_step.prepare(static, compile_options(NUM_WARPS, None)))
    return entry[1]


def step_pool(pool, idx: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
              beta: torch.Tensor, scale: float, use_qk_l2norm: bool, out: torch.Tensor) -> None:
    """One decode token per row of ``idx`` (int32 ``[N]``) on ``pool`` in place, ``out`` written (SPEC §6).

    Flushes the full rings of ``idx`` first (:func:`.host.flush_pool`; stream order makes the step see the new
    checkpoints), then launches :func:`leapquant_step_kernel` on grid ``(N, HV)``. ``q``, ``k`` ``[N, H, K]``
    (H dividing HV), ``v`` ``[N, HV, V]``, ``g`` ``[N, HV, K]`` (KDA) or ``[N, HV]`` (GDN), ``beta`` ``[N, HV]``,
    ``out`` ``[N, HV, V]``: float32, bfloat16 or float16, unit last stride. No host synchronisation and no
    allocation beyond the flush's: graph-capturable."""
    N = idx.numel()
    if N == 0:
        return
    flush_pool(pool, idx)
    strides = {f"s{name}_{d}": t.stride(i) for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("b", beta),
                                                             ("o", out)) for i, d in enumerate("nh")}
    dynamic = dict(idx=idx, q=q, k=k, v=v, g=g, beta=beta, out=out, **strides, scale=float(scale),
                   G=pool.heads // q.shape[1])
    _prepared(pool, use_qk_l2norm)((N, pool.heads), dynamic)
