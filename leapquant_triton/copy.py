"""``Pool.copy_slots`` (docs/SPEC.md §5.3) as two Triton kernel launches: one program per (pair, head), grid
``(n, HV)``, no host synchronisation (graph-capturable). It writes what the torch form writes, bit for bit: every
head's checkpoint words and its rows of ``kbuf``, ``ubuf``, ``w``, ``pcum``, ``gbuf`` and ``hcnt``.

Every value must be read before any is written, as if copied from a snapshot. The first launch copies a pair
straight into its destination when that slot is no pair's source (nothing reads it, so nothing can read it too late:
the common case, a cached prefix into a new sequence's slot, moves its bytes once), and otherwise into a temporary;
the second launch writes the temporaries into their destinations. The torch form gathers every tensor into
temporaries and scatters them back, about fourteen launches moving the bytes twice.

Costs that grow with ``n``: the temporary has room for every pair (the host cannot know how many need it without a
synchronisation; the torch form's temporaries are as large), and each program scans ``src`` and ``dst`` (O(n) int
loads from L2: at thousands of pairs about what the copy itself moves).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .flush_kernel import _named_before
from .launcher import Launcher


@triton.jit
def _copy_words(p_from, p_to, X: tl.constexpr, BLOCK: tl.constexpr):
    """X int32 words from ``p_from`` to ``p_to``, BLOCK at a time."""
    o = tl.arange(0, BLOCK)
    for off in tl.static_range(0, X, BLOCK):
        m = off + o < X
        tl.store(p_to + off + o, tl.load(p_from + off + o, mask=m), mask=m)


@triton.jit
def _segment(t, row, i_h, s_slot, s_head, tmp, at, X: tl.constexpr, FROM_TMP: tl.constexpr, TO_TMP: tl.constexpr,
             BLOCK: tl.constexpr):
    """One tensor's words of (row, head): between the pool (slot stride ``s_slot``, head stride ``s_head``) and the
    temporary at word ``at``, or from the pool row ``row`` to ``tmp``'s pool row (both in the pool: ``tmp`` is then
    the destination row's address)."""
    p_pool = t + row * s_slot + i_h * s_head
    if FROM_TMP:
        _copy_words(tmp + at, p_pool, X, BLOCK)
    elif TO_TMP:
        _copy_words(p_pool, tmp + at, X, BLOCK)
    else:
        _copy_words(p_pool, t + tmp * s_slot + i_h * s_head, X, BLOCK)


@triton.jit
def _all_segments(row, i_h, tmp, base, FROM_TMP: tl.constexpr, TO_TMP: tl.constexpr, ckpt, kbuf, ubuf, w, pcum, gbuf,
                  hcnt, SS, HS, HV, CW: tl.constexpr, KW: tl.constexpr, UW: tl.constexpr, WW: tl.constexpr,
                  PW: tl.constexpr, GW: tl.constexpr, BLOCK: tl.constexpr):
    """Every tensor's words of (row, head), in the temporary's order: checkpoint, kbuf, ubuf, w, pcum, gbuf, hcnt."""
    _segment(ckpt, row, i_h, SS, HS, tmp, base, CW, FROM_TMP, TO_TMP, BLOCK)
    _segment(kbuf, row, i_h, HV * KW, KW, tmp, base + CW, KW, FROM_TMP, TO_TMP, BLOCK)
    _segment(ubuf, row, i_h, HV * UW, UW, tmp, base + CW + KW, UW, FROM_TMP, TO_TMP, BLOCK)
    _segment(w, row, i_h, HV * WW, WW, tmp, base + CW + KW + UW, WW, FROM_TMP, TO_TMP, BLOCK)
    _segment(pcum, row, i_h, HV * PW, PW, tmp, base + CW + KW + UW + WW, PW, FROM_TMP, TO_TMP, BLOCK)
    if GW > 0:
        _segment(gbuf, row, i_h, HV * GW, GW, tmp, base + CW + KW + UW + WW + PW, GW, FROM_TMP, TO_TMP, BLOCK)
    _segment(hcnt, row, i_h, HV, 1, tmp, base + CW + KW + UW + WW + PW + GW, 1, FROM_TMP, TO_TMP, BLOCK)


@triton.jit
def leapquant_copy_slots_kernel(src, dst, n, tmp, ckpt, kbuf, ubuf, w, pcum, gbuf, hcnt, NS, HV, SS, HS,
                                FIRST: tl.constexpr, CW: tl.constexpr, KW: tl.constexpr, UW: tl.constexpr,
                                WW: tl.constexpr, PW: tl.constexpr, GW: tl.constexpr, BLOCK: tl.constexpr,
                                SECOND: tl.constexpr):
    """Program (pair i, head h) of launch ``SECOND`` (0 or 1) for ``s = src[i]``, ``d = dst[i]``: nothing if either
    is not a real slot or an earlier pair names ``d`` too (a destination named twice gets its first copy). The first
    launch copies (s, h) into (d, h) when no pair's source is ``d``, else into ``tmp``'s words of (i, h); the second
    copies those into (d, h). All int32 words: ``ckpt`` the checkpoints at word ``slot SS + head HS`` (CW words each),
    the ring tensors dense ``[NS, HV, X]`` (X = KW, UW, WW, PW, GW words; GW 0 without gates), ``hcnt`` ``[NS, HV]``."""
    i = tl.program_id(0)
    i_h = tl.program_id(1).to(tl.int64)
    s = tl.load(src + i).to(tl.int64)
    d = tl.load(dst + i).to(tl.int64)
    if (s < FIRST) | (s >= NS) | (d < FIRST) | (d >= NS):
        return
    if _named_before(dst, i, d) > 0:
        return
    later = _named_before(src, n, d) > 0  # d is a source: it is written only once every source has been read
    TW: tl.constexpr = CW + KW + UW + WW + PW + GW + 1
    base = (i.to(tl.int64) * HV + i_h) * TW
    if SECOND:
        if later:
            _all_segments(d, i_h, tmp, base, True, False, ckpt, kbuf, ubuf, w, pcum, gbuf, hcnt, SS, HS, HV, CW, KW,
                          UW, WW, PW, GW, BLOCK)
    elif later:
        _all_segments(s, i_h, tmp, base, False, True, ckpt, kbuf, ubuf, w, pcum, gbuf, hcnt, SS, HS, HV, CW, KW, UW,
                      WW, PW, GW, BLOCK)
    else:
        _all_segments(s, i_h, d, 0, False, False, ckpt, kbuf, ubuf, w, pcum, gbuf, hcnt, SS, HS, HV, CW, KW, UW, WW,
                      PW, GW, BLOCK)


# 4 warps, 1,024 words a round: 16-byte accesses, 2 per thread
OPTIONS = dict(num_warps=4, num_stages=1)
BLOCK = 1024
_LAUNCHER = Launcher(leapquant_copy_slots_kernel)


def copy_slots_pool(pool, src: torch.Tensor, dst: torch.Tensor) -> None:
    """``pool.copy_slots(src, dst)`` (checked by the caller; ``src``, ``dst`` 1-D integer tensors of one length on
    the pool's device), on the current stream. The pool's checks make its ring tensors dense, and every supported
    shape has a whole number of int32 words per head."""
    n = src.numel()
    if n == 0:
        return
    g = pool.geometry
    # what the torch form copies, as int32 words [NS, HV, X]: the checkpoints (at the layout's strides), the rings,
    # pcum and (KDA) gbuf; hcnt last
    ckpt, *ring, hcnt = pool._slot_rows()
    ring = [t.reshape(g.num_slots, g.heads, -1).view(torch.int32) for t in ring]
    kb, ub, w, pc = ring[:4]
    gb = ring[4] if len(ring) > 4 else None
    X = dict(CW=g.checkpoint_bytes // 4, KW=kb.shape[2], UW=ub.shape[2], WW=w.shape[2], PW=pc.shape[2],
             GW=gb.shape[2] if gb is not None else 0)
    tmp = torch.empty(n * g.heads * (sum(X.values()) + 1), dtype=torch.int32, device=src.device)
    args = dict(src=src, dst=dst, n=n, tmp=tmp, ckpt=ckpt, kbuf=kb, ubuf=ub, w=w, pcum=pc,
                gbuf=gb if gb is not None else w, hcnt=hcnt, NS=g.num_slots, HV=g.heads, SS=g.slot_stride,
                HS=g.head_stride, FIRST=pool.first_slot, BLOCK=BLOCK, **X)
    for second in (False, True):
        _LAUNCHER((n, g.heads), dict(args, SECOND=second), OPTIONS)
