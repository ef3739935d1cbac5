"""States in and out of a pool as Triton kernels (launched by :mod:`.states`): :func:`load_states_kernel` (compress
given fp32 states into checkpoints, SPEC §3 steps 5-10, rings emptied, ``hcnt = 0``) and :func:`states_kernel`
(rebuild states from checkpoint and ring, SPEC §3 steps 1-4), built from the flush kernel's phase functions
(:mod:`.flush_kernel`), so a state goes through exactly the arithmetic of a flush (docs/DESIGN.md, "Triton: states
in and out").

Both kernels run one program per (row n of ``slots``, head h), grid ``(n, HV)``, the state ``[V, K]`` in registers as
in the flush. The caller's state tensor is read or written through its four strides, so both layouts, V-first
``[n, HV, V, K]`` and FLA's ``[n, HV, K, V]``, are one build each (Triton specialises a unit stride). A row whose slot
lies outside ``[0, NS)`` is skipped: ``load_states`` writes nothing for it, ``states`` writes zeros.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common_kernel import _pair_pointers
from .flush_kernel import _compress, _q16_tile, _ranges, _rebuild, _region_and_scratch


@triton.jit
def _state_tile(p, i_n, i_h, s_n, s_h, s_v, s_k, K: tl.constexpr, V: tl.constexpr):
    """Pointers of row n, head h's ``[V, K]`` state in a caller's tensor of strides (s_n, s_h, s_v, s_k)."""
    o_k, o_v = tl.arange(0, K), tl.arange(0, V)
    return p + i_n.to(tl.int64) * s_n + i_h.to(tl.int64) * s_h + o_v[:, None] * s_v + o_k[None, :] * s_k


@triton.jit
def load_states_kernel(slots, states, hcnt, codes, skv, uq, w, pcum, gbuf, q0, scratch, scratch16, NS, HV, SS, HS,
                       s_n, s_h, s_v, s_k, K: tl.constexpr, V: tl.constexpr, L: tl.constexpr, R: tl.constexpr,
                       BL: tl.constexpr, BR: tl.constexpr, ITERS: tl.constexpr, IS_KDA: tl.constexpr,
                       SCR: tl.constexpr, BF16_DOTS: tl.constexpr):
    """Grid (n, HV): the state of (row n, head h) compressed into the checkpoint of (slots[n], h) by the flush's
    steps 5-10, its ring reset as a flush resets it, and ``hcnt = 0``. ``scratch``, ``scratch16``: SCR words per
    program, as the flush's."""
    i_n, i_h = tl.program_id(0), tl.program_id(1)
    i_s = tl.load(slots + i_n).to(tl.int64)
    if (i_s < 0) | (i_s >= NS):
        return
    i_sh = i_s * HV + i_h
    o_scr = (i_n.to(tl.int64) * HV + i_h) * SCR
    o_k, o_v, o_l, o_r, m_l, m_r = _ranges(K, V, L, R, BL, BR)
    o_reg, p_y, p_gram, p_cn, p_q16, p_e = _region_and_scratch(scratch, scratch16, o_scr, i_s, i_h, SS, HS, K, V,
                                                               ITERS)
    p_qt, m_q = _q16_tile(p_q16, V, BR)
    # kbuf and ubuf are not touched: the emptied ring voids their entries (placeholders for their pointers)
    p_c, p_skv, p_uq, _, _, p_w, p_pc, p_g = _pair_pointers(codes, skv, uq, w, w, w, pcum, gbuf, o_reg, i_sh, K, V,
                                                            L, IS_KDA)
    b_q0 = tl.load(q0 + o_v[:, None] * R + o_r[None, :], mask=m_r[None, :], other=0.0)
    b_s = tl.load(_state_tile(states, i_n, i_h, s_n, s_h, s_v, s_k, K, V))
    # the subspace iteration starts from fp16(Q0) in scratch, as the flush's rebuild leaves it
    tl.store(p_qt, b_q0.to(tl.float16), mask=m_q)
    tl.debug_barrier()
    _compress(b_s, p_c, p_skv, p_uq, p_w, p_pc, p_g, p_y, p_gram, p_cn, p_q16, p_qt, m_q, p_e, o_k, o_v, o_l, o_r, m_l,
              m_r, K, V, R, BL, BR, ITERS, IS_KDA, BF16_DOTS)
    tl.store(hcnt + i_sh, 0)


@triton.jit
def states_kernel(slots, out, codes, skv, uq, kbuf, ubuf, w, pcum, gbuf, q0, NS, HV, SS, HS, s_n, s_h, s_v, s_k,
                  K: tl.constexpr, V: tl.constexpr, L: tl.constexpr, R: tl.constexpr, BL: tl.constexpr,
                  BR: tl.constexpr, IS_KDA: tl.constexpr, BF16_DOTS: tl.constexpr):
    """Grid (n, HV): ``out[n, h]`` = the state of (slots[n], h) rebuilt by the flush's steps 1-4 (zeros for a slot
    outside [0, NS)). ``out`` is dense per head (either layout): the program's own ``[V, K]`` words are its scratch
    for exp(pcum) (the flush keeps it in scratch words) until the state overwrites them."""
    i_n, i_h = tl.program_id(0), tl.program_id(1)
    p_o = _state_tile(out, i_n, i_h, s_n, s_h, s_v, s_k, K, V)
    i_s = tl.load(slots + i_n).to(tl.int64)
    if (i_s < 0) | (i_s >= NS):
        tl.store(p_o, tl.zeros([V, K], dtype=tl.float32))
        return
    i_sh = i_s * HV + i_h
    o_reg = i_s * SS + i_h * HS
    o_k, o_v, _, o_r, _, _ = _ranges(K, V, L, R, BL, BR)
    p_e = out + i_n.to(tl.int64) * s_n + i_h.to(tl.int64) * s_h
    # the rebuild also stores fp16(Q0) for the subspace iteration, which does not follow here: masked off
    p_qt = p_e + o_v[:, None] * BR + o_r[None, :]
    m_none = (o_v[:, None] < 0) & (o_r[None, :] < 0)
    p_c, p_skv, p_uq, p_k, p_u, p_w, p_pc, p_g = _pair_pointers(codes, skv, uq, kbuf, ubuf, w, pcum, gbuf, o_reg,
                                                                i_sh, K, V, L, IS_KDA)
    # the whole ring, weighted by w (SPEC §5.1)
    b_s = _rebuild(p_c, p_skv, p_uq, p_k, p_u, p_w, p_pc, p_g, q0, p_e, p_qt, m_none, L, K, V, L, R, BL, BR, IS_KDA,
                   BF16_DOTS)
    tl.debug_barrier()  # every warp has read exp(pcum) back before the state overwrites it
    tl.store(p_o, b_s)
