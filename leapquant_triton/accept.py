"""``leapquant.accept`` (docs/SPEC.md §6.1) as one Triton kernel: one program per (row, value head), grid ``(B, HV)``,
no host synchronisation, no allocation (graph-capturable). It writes what the torch form writes, bit for bit: the
fill count, ``pcum`` and ``w`` from the history after ``n`` tokens, the history's count, and (KDA) the gates of the
entries past the new count set to 1; only the first row naming a slot writes it, padding rows nothing.

The torch form gathers and scatters whole rows of every tensor (``gbuf`` is 4 KiB per head at 128 x 16) in about ten
launches; here a program moves its head's few hundred bytes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .flush_kernel import _named_before
from .launcher import Launcher


@triton.jit
def leapquant_accept_kernel(idx, nacc, start, count, hpcum, hw, hcnt, pcum, w, gbuf, NS, HV,
                            FIRST: tl.constexpr, L: tl.constexpr, K: tl.constexpr, PK: tl.constexpr,
                            HT: tl.constexpr, IS_KDA: tl.constexpr):
    """Program (row n, value head hv): for slot ``s = idx[n]`` (a real slot, no earlier row naming it), with
    ``c = count[s, hv]`` and ``m = clamp(nacc[n], 0, c)``: ``hcnt = start`` if ``m == 0`` else ``j0 + m``,
    ``pcum`` (``PK`` values) and ``w`` (``L``) the history's after m tokens, ``count = m``, and (KDA) ``gbuf``'s
    entries from ``j0 + m`` on set to 1. Every pool tensor dense, the history ``[NS, HV, HT, PK or L]``."""
    i_n = tl.program_id(0)
    i_hv = tl.program_id(1).to(tl.int64)
    s = tl.load(idx + i_n).to(tl.int64)
    if (s < FIRST) | (s >= NS):
        return
    if _named_before(idx, i_n, s) > 0:  # a slot named by several rows is written once, by the first of them
        return
    sh = s * HV + i_hv
    c = tl.load(count + sh)
    m = tl.minimum(tl.maximum(tl.load(nacc + i_n).to(tl.int32), 0), c)
    st = tl.load(start + sh)
    j0 = tl.where(st >= L, 0, st)
    tl.store(hcnt + sh, tl.where(m == 0, st, j0 + m))
    tl.store(count + sh, m)
    o_p = tl.arange(0, PK)
    tl.store(pcum + sh * PK + o_p, tl.load(hpcum + (sh * HT + m) * PK + o_p))
    o_l = tl.arange(0, L)
    tl.store(w + sh * L + o_l, tl.load(hw + (sh * HT + m) * L + o_l))
    if IS_KDA:
        o_k = tl.arange(0, K)
        one = tl.full([L, K], 1.0, tl.float16)
        tl.store(gbuf + (sh * L + o_l[:, None]) * K + o_k[None, :], one, mask=(o_l >= j0 + m)[:, None])


# 4 warps: a KDA program's gate rows are L x K fp16 (4 KiB at 16 x 128), 16-byte stores
OPTIONS = dict(num_warps=4, num_stages=1)
_LAUNCHER = Launcher(leapquant_accept_kernel)


def dense(pool) -> bool:
    """Whether the tensors the kernel addresses as dense are (a pool made from an engine's tensors may not be)."""
    hist = pool.history
    ts = [pool.hcnt, pool.pcum, pool.w, hist.start, hist.count, hist.pcum, hist.w]
    return all(t.is_contiguous() for t in ts + ([pool.gbuf] if pool.gbuf is not None else []))


def accept_pool(pool, idx: torch.Tensor, num_accepted: torch.Tensor) -> None:
    """:func:`leapquant.accept` on ``pool`` (checked by the caller; its tensors dense: :func:`dense`), on the current
    stream."""
    B = idx.numel()
    if B == 0:
        return
    hist = pool.history
    args = dict(idx=idx, nacc=num_accepted, start=hist.start, count=hist.count, hpcum=hist.pcum, hw=hist.w,
                hcnt=pool.hcnt, pcum=pool.pcum, w=pool.w, gbuf=pool.gbuf if pool.gbuf is not None else pool.w,
                NS=pool.num_slots, HV=pool.heads, FIRST=pool.first_slot, L=pool.ring, K=pool.head_k,
                PK=pool.pcum.shape[-1], HT=hist.pcum.shape[2], IS_KDA=pool.gate == "kda")
    _LAUNCHER((B, pool.heads), args, OPTIONS)
