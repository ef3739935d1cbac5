"""The reference backend: :mod:`leapquant.formulas` (SPEC §3, §6 in fp32 torch) run over a pool's rows.

What this module adds to the formulas is the row gathering: which programs of ``idx`` a call writes (due, first row
of a slot, not already flushed), and writes that touch only those, with or without host synchronisation.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .backends import Backend, Requirements
from .formulas import compress, empty_ring, rebuild, ring_empty, ring_in_use, step_rows

if TYPE_CHECKING:
    from .pool import Pool


def _rows(pool: "Pool", idx: torch.Tensor):
    """For ``idx [N]``, no host synchronisation: ``real`` (the row names a real slot), ``safe`` (its slot, 0 for the
    others), ``first`` (the row is the first of ``idx`` naming its slot: only it may write, so that every (slot, head)
    is written at most once per call), and ``src`` (the row whose values a row's writes take, in the graph-capturable
    path: the first row naming its slot; for a row naming no real slot, the first real row, else row 0)."""
    NS, N = pool.num_slots, idx.numel()
    idxl = idx.long()
    real = (idxl >= pool.first_slot) & (idxl < NS)
    safe = torch.where(real, idxl, torch.zeros_like(idxl))
    rows = torch.arange(N, device=idx.device)
    # the smallest row naming each slot; rows whose slot is not real go to a dummy entry past the end
    target = torch.where(real, idxl, torch.full_like(idxl, NS))
    first_row = torch.full((NS + 1,), N, dtype=torch.long, device=idx.device)
    first_row.scatter_reduce_(0, target, rows, "amin")
    first = real & (first_row[safe] == rows)
    anchor = torch.argmax(real.to(torch.int32))  # the first real row (0 when there is none)
    src = torch.where(real, first_row[safe], anchor)
    return real, safe, first, src


def _pairs(pool: "Pool", s: torch.Tensor, h: torch.Tensor) -> dict[str, torch.Tensor]:
    """The checkpoints and rings of the programs ``(s[i], h[i])``, gathered as ``[P, ...]`` (keys of ``run``)."""
    names = ("codes", "s_k", "s_v", "u", "q", "kbuf", "ubuf", "w", "pcum")
    out = {n: getattr(pool, n)[s, h] for n in names}
    out["gbuf"] = pool.gbuf[s, h] if pool.gbuf is not None else None
    return out


def _room(force: bool | int, L: int) -> int:
    """The entries a flush must leave room for: 1 (a full ring is due), ``L`` (``force=True``: any ring with an
    entry), or ``T`` for a step of T tokens (SPEC §6.1: the rings that cannot hold T more)."""
    if force is True:
        return L
    return max(1, int(force))


def _due(hcnt: torch.Tensor, L: int, force: bool | int) -> torch.Tensor:
    """SPEC §2's due rule on fill counts: a ring that cannot hold ``_room(force)`` more entries and holds one
    (``1 <= hcnt <= L`` and ``hcnt + room > L``): a full ring by default, any ring with an entry with ``force``."""
    return (hcnt >= 1) & (hcnt <= L) & (hcnt + _room(force, L) > L)


def _flushed(pool: "Pool", c: dict) -> dict[str, torch.Tensor]:
    """The new checkpoints and ring resets (SPEC §3 steps 1-10) of the gathered programs ``c``, by pool tensor."""
    S = rebuild(**c, gate=pool.gate)
    codes, s_k, s_v, u, q = compress(S, pool.q0, pool.iters)
    return dict(codes=codes, s_k=s_k, s_v=s_v, u=u, q=q, **empty_ring(c["w"], c["pcum"], c["gbuf"], pool.gate))


def _graph_capturable(pool: "Pool") -> bool:
    """Whether the reference must run without host synchronisation (a CUDA pool: the contract's ``check=False`` and
    CUDA-graph capture); on the CPU a synchronisation costs nothing, so it gathers exactly the programs it writes."""
    return pool.device.type != "cpu"


def _put_rows(pool: "Pool", name: str, safe: torch.Tensor, src: torch.Tensor, final: torch.Tensor) -> None:
    """The graph-capturable write: row n writes ``final[src[n]]`` (``[N, HV, ...]``, already what each (row, head)
    must hold afterwards) over the heads of slot ``safe[src[n]]``. Rows naming one slot write the same bytes, and a
    row naming no real slot rewrites a real row's (or, with none, slot ``safe[0]``'s unchanged) bytes: a static
    number of index writes, no whole-tensor rewrite."""
    dst = getattr(pool, name)
    N, HV = final.shape[:2]
    heads = torch.arange(HV, device=dst.device).expand(N, HV)
    dst.index_put_((safe[src][:, None].expand(N, HV), heads), final[src].to(dst.dtype))


def _record(pool: "Pool", dst: torch.Tensor, t: int | None, values: torch.Tensor, real, safe, first, src,
            per_row: bool = False) -> None:
    """``dst[slot, :]`` (or ``dst[slot, :, t]``) = ``values[slot, :]`` (``per_row``: ``values[n]`` of the row n
    naming the slot) for the slots the rows of ``idx`` name, written once per slot (the first row), nothing for
    padding rows; no host synchronisation on CUDA."""
    view = dst if t is None else dst[:, :, t]
    vals = values if per_row else values[safe]
    if not _graph_capturable(pool):
        view[safe[first]] = vals[first].to(view.dtype)
        return
    new = torch.where(real.reshape((-1,) + (1,) * (view.dim() - 1)), vals.to(view.dtype), view[safe])
    N, HV = new.shape[:2]
    heads = torch.arange(HV, device=dst.device).expand(N, HV)
    view.index_put_((safe[src][:, None].expand(N, HV), heads), new[src])


def _snapshot(pool: "Pool", hist, t: int, real, safe, first, src) -> None:
    """The pool's ``pcum`` and ``w`` of the named slots after ``t`` tokens of this call, for :func:`accept`."""
    _record(pool, hist.pcum, t, pool.pcum, real, safe, first, src)
    _record(pool, hist.w, t, pool.w, real, safe, first, src)


class ReferenceBackend(Backend):
    """The fp32 reference as a backend: plain torch on any device, every shape. Slow; the definition of correct.

    It writes only what the contract lets a call write, through indexed writes (never a whole pool tensor), so that
    calls on disjoint slots from several threads do not undo each other. On the CPU it gathers, computes and writes
    exactly the due programs (memory and time in proportion to them). On CUDA it takes a path without host
    synchronisation that launches the same work for the same pool and ``N`` (graph-capturable): every row of ``idx``
    is computed, and each named slot's heads are written back, unchanged where not due.
    """

    name = "reference"
    priority = 0
    description = "fp32 torch reference (SPEC §3), any device and shape; the definition of correct, not fast"
    requirements = Requirements(devices=("cpu", "cuda"), head_dims=None, rings=None, ranks=None, heads=None)
    partial_rings = True
    multi_token = True

    def flush(self, pool: "Pool", idx: torch.Tensor, force: bool | int = False) -> None:
        if idx.numel() == 0:
            return
        real, safe, first, src = _rows(pool, idx)
        L = pool.ring
        if not _graph_capturable(pool):
            # due (SPEC §2), written once per call (the first row naming the slot)
            n, h = (first[:, None] & _due(pool.hcnt[safe], L, force)).nonzero(as_tuple=True)
            s = safe[n]
            c = _pairs(pool, s, h)
            if force:
                c.update(ring_in_use(c["kbuf"], c["ubuf"], c["w"], c["gbuf"], pool.hcnt[s, h]))
            # not already flushed (SPEC §2, idempotence)
            keep = ~ring_empty(c["w"], c["pcum"], pool.gate)
            if not bool(keep.any()):
                return
            s, h = s[keep], h[keep]
            new = _flushed(pool, {k: (v[keep] if v is not None else None) for k, v in c.items()})
            if force:
                new["hcnt"] = torch.full_like(s, L, dtype=torch.int32)
            for name, t in new.items():
                dst = getattr(pool, name)
                dst.index_put_((s, h), t.to(dst.dtype))
            return
        c = pool.gather(safe)
        c["hcnt"] = pool.hcnt[safe]
        # the forced flush computes on the entries in use; what it writes back where it does not flush is c's
        use = dict(c, **ring_in_use(c["kbuf"], c["ubuf"], c["w"], c["gbuf"], c["hcnt"])) if force else c
        write = first[:, None] & _due(c["hcnt"], L, force) & ~ring_empty(use["w"], use["pcum"], pool.gate)
        new = _flushed(pool, {k: v for k, v in use.items() if k != "hcnt"})
        if force:
            new["hcnt"] = torch.full_like(c["hcnt"], L)
        for name, t in new.items():
            m = write.reshape(write.shape + (1,) * (t.dim() - 2))
            _put_rows(pool, name, safe, src, torch.where(m, t.to(c[name].dtype), c[name]))

    def step(self, pool: "Pool", idx: torch.Tensor, q, k, v, g, beta, scale: float, use_qk_l2norm: bool,
             out: torch.Tensor) -> None:
        T = q.shape[1] if q.dim() == 4 else 1  # [N, T, ...]: T tokens per row (SPEC §6.1)
        self.flush(pool, idx, T) if T > 1 else self.flush(pool, idx)
        if idx.numel() == 0:
            return
        real, safe, first, src = _rows(pool, idx)
        G = pool.heads // q.shape[-2]
        hist = pool.history
        if hist is not None:
            _record(pool, hist.start, None, pool.hcnt, real, safe, first, src)
            _record(pool, hist.count, None, torch.full_like(pool.hcnt, T), real, safe, first, src)
        for t in range(T):
            tok = [x[:, t] if T > 1 else x for x in (q, k, v, g, beta, out)]
            if hist is not None and t == 0:
                _snapshot(pool, hist, 0, real, safe, first, src)
            self._step_one(pool, idx, real, safe, first, src, G, *tok, scale, use_qk_l2norm)
            if hist is not None:
                _snapshot(pool, hist, t + 1, real, safe, first, src)

    def _step_one(self, pool: "Pool", idx, real, safe, first, src, G: int, q, k, v, g, beta, out, scale: float,
                  use_qk_l2norm: bool) -> None:
        """One token per row (SPEC §6 steps 1-5), the full rings already flushed."""
        q, k = q.repeat_interleave(G, 1), k.repeat_interleave(G, 1)
        if not _graph_capturable(pool):
            rows = real.nonzero().reshape(-1)  # every real row's output; only the first row of a slot writes it
            c = pool.gather(safe[rows])
            c["hcnt"] = pool.hcnt[safe[rows]]
            ring, o = step_rows(c, q[rows], k[rows], v[rows], g[rows], beta[rows], gate=pool.gate, scale=scale,
                                use_qk_l2norm=use_qk_l2norm)
            o_all = torch.zeros(idx.numel(), *o.shape[1:], dtype=o.dtype, device=o.device)
            o_all[rows] = o
            out.copy_(o_all.to(out.dtype))
            keep = first[rows]
            s = safe[rows][keep]
            for name, new in ring.items():
                getattr(pool, name).index_copy_(0, s, new[keep].to(getattr(pool, name).dtype))
            return
        c = pool.gather(safe)
        c["hcnt"] = pool.hcnt[safe]
        ring, o = step_rows(c, q, k, v, g, beta, gate=pool.gate, scale=scale, use_qk_l2norm=use_qk_l2norm)
        out.copy_(torch.where(real[:, None, None], o, torch.zeros_like(o)).to(out.dtype))
        for name, new in ring.items():
            old = c[name]
            m = real.reshape((-1,) + (1,) * (new.dim() - 1))
            _put_rows(pool, name, safe, src, torch.where(m, new.to(old.dtype), old))

    def load_states(self, pool: "Pool", slots: torch.Tensor, states: torch.Tensor, state_v_first: bool) -> None:
        # a slot outside [0, NS) (only with check=False) is skipped, as the kernels skip it: nothing computed for it on
        # the CPU; on CUDA, without a synchronisation, its row rewrites the first in-range row's new bytes (or, with
        # none, slot 0's unchanged bytes), so every write lands in the pool and nothing is half-written
        s = slots.long()
        S = states if state_v_first else states.transpose(-1, -2)
        real = (s >= 0) & (s < pool.num_slots)
        if not _graph_capturable(pool):
            rows = real.nonzero().reshape(-1)
            s, S = s[rows], S[rows]
            if s.numel() == 0:
                return
        else:
            anchor = torch.argmax(real.to(torch.int32))  # the first in-range row (0 when there is none)
            src = torch.where(real, torch.arange(s.numel(), device=s.device), anchor)
            s = torch.where(real, s, torch.zeros_like(s))[src]
            S = S[src]
        codes, s_k, s_v, u, q = compress(S, pool.q0, iters=pool.iters)
        gbuf = pool.gbuf[s] if pool.gbuf is not None else None
        new = dict(codes=codes, s_k=s_k, s_v=s_v, u=u, q=q, **empty_ring(pool.w[s], pool.pcum[s], gbuf, pool.gate),
                   hcnt=torch.zeros_like(pool.hcnt[s]))
        if _graph_capturable(pool):
            # with no in-range row, every row names slot 0 and writes back what it holds
            keep = real.any()
            for name in new:
                old = getattr(pool, name)[s]
                new[name] = torch.where(keep, new[name].to(old.dtype), old)
        for name, t in new.items():
            getattr(pool, name)[s] = t.to(getattr(pool, name).dtype)

    def states(self, pool: "Pool", slots: torch.Tensor, out: torch.Tensor, state_v_first: bool) -> None:
        # a slot outside [0, NS) (only with check=False) reads slot 0 and gives a zero row, as the kernel's
        s = slots.long()
        real = (s >= 0) & (s < pool.num_slots)
        S = rebuild(**pool.gather(torch.where(real, s, torch.zeros_like(s))), gate=pool.gate)
        S = torch.where(real[:, None, None, None], S, torch.zeros_like(S))
        (out if state_v_first else out.transpose(-1, -2)).copy_(S)
