"""The host side of the Triton flush: the build's constants, the schedules, and :func:`flush_pool`, which launches
the kernels of :mod:`.flush_kernel` from a plan prepared once per pool (docs/DESIGN.md, "Triton: schedules,
PDL and the L2 prefetch" and "Triton: host-side launches")."""

from __future__ import annotations

import torch
import triton

from .flush_kernel import due_list_kernel, leapquant_flush_kernel
from .launcher import Launcher, per_pool
from .targets import (
    FP_FUSION,
    compile_options,
    device_capability,
    interpreting,
    mma_sync_only,
    warps_and_cap,
)


def scratch_words(head_k: int, head_v: int, iters: int) -> int:
    """fp32 words of scratch per program: Y / Q [V, 4] (then 1 / s_k), 2 ITERS Gram matrices (4 x 4), c (padded to
    4 words), fp16(Q) [V, 4] and [K] for the KDA decay exp(pcum) (then the column sums of |E|)."""
    return 6 * head_v + 32 * iters + 4 + head_k


def room(force: bool | int, ring: int) -> int:
    """``FORCE`` of a flush: 0 (full rings), ``ring`` (``force=True``: every ring with an entry) or T (``force=T``,
    before a step of T tokens: the rings that cannot hold T more, SPEC §6.1)."""
    if force is True:
        return ring
    return 0 if not force or int(force) <= 1 else int(force)


def kernel_constants(geometry, first_slot: int, iters: int, force: bool | int = False) -> dict:
    """The constexpr arguments of :func:`.flush_kernel.leapquant_flush_kernel` for a pool whose real slots start at
    ``first_slot`` (also what the AOT check compiles), but the schedule's ``LIST``, ``PDL`` and ``AHEAD``, which
    :func:`flush_pool` adds; ``force``: the forced flush's build (``FORCE``)."""
    g = geometry
    return dict(
        FIRST=first_slot,
        K=g.head_k,
        V=g.head_v,
        L=g.ring,
        R=g.rank,
        BL=max(16, g.ring),
        BR=16,
        ITERS=iters,
        IS_KDA=g.gate == "kda",
        SCR=scratch_words(g.head_k, g.head_v, iters),
        BF16_DOTS=not interpreting(),
        FORCE=room(force, g.ring),
    )


def prefetch_ahead(device: torch.device) -> int:
    """How far ahead in the due list a program prefetches another pair's inputs into L2 (sm_90 and later; else 0):
    with two programs per SM, 2 x the SM count is the pair that starts about one round later."""
    if not _sm90_or_later(device):
        return 0
    return 2 * torch.cuda.get_device_properties(device).multi_processor_count


def _pdl(device: torch.device) -> bool:
    """Whether the list schedule's kernels launch as programmatic dependents of the kernel before them: their
    programs then start while it finishes, and wait for it (``griddepcontrol.wait``) before reading what it wrote."""
    return _sm90_or_later(device)


def _sm90_or_later(device: torch.device) -> bool:
    """Whether the kernels are compiled for ``device`` with sm_90's instructions (griddepcontrol, bulk L2 prefetch):
    a CUDA device of capability 9.0 or later, not under the interpreter. A host-side property: no sync."""
    return not interpreting() and (device_capability(device) or 0) >= 90


# every launch of the two kernels: compiled inside mma_sync_only, then launched directly (launcher.py)
_launch_due_list = Launcher(due_list_kernel, mma_sync_only)
_launch_flush = Launcher(leapquant_flush_kernel, mma_sync_only)


# the two schedules of flush_pool (also the two builds the AOT check compiles: portability.check)
SCHEDULES = ("grid", "list")


def schedule_for(rows: int, heads: int) -> str:
    """The schedule :func:`flush_pool` takes for ``rows`` x ``heads`` programs (the host knows ``N``, not how many are
    due). In the grid a program that is not due still holds an SM slot; the list costs two more launches. From 2,048
    programs the list's gain with 1/16 of the heads due (a ring of 16 in steady state) outweighs its loss all due."""
    return "list" if rows * heads >= 2048 else "grid"


class _Plan:
    """What :func:`flush_pool` launches for one pool, ``N`` and build, but ``idx`` and the per-call buffers: the
    static arguments prepared once (:meth:`.launcher.Launcher.prepare`), so that an eager flush looks at four of the
    31. Kept per pool memory (:func:`_plan`)."""

    def __init__(self, pool, tensors: tuple, N: int, schedule: str, nw: int, cap: int | None, device: torch.device,
                 force: bool):
        g = pool.geometry
        consts = kernel_constants(g, pool.first_slot, pool.iters, force)
        self.scratch_words = N * g.heads * consts["SCR"]
        pdl = schedule == "list" and _pdl(device)
        ahead = prefetch_ahead(device) if schedule == "list" else 0
        self.grid = (N * g.heads,) if schedule == "list" else (N, g.heads)
        self.work_words = 1 + N * g.heads if schedule == "list" else 0
        codes, skv, uq, kbuf, ubuf, w, pcum, gbuf, q0, hcnt = tensors
        self.flush = _launch_flush.prepare(
            dict(hcnt=hcnt, codes=codes, skv=skv, uq=uq, kbuf=kbuf, ubuf=ubuf, w=w, pcum=pcum,
                 gbuf=gbuf if gbuf is not None else w,  # GDN never reads it
                 q0=q0, NS=g.num_slots, HV=g.heads, SS=g.slot_stride, HS=g.head_stride, **consts,
                 LIST=schedule == "list", PDL=pdl, AHEAD=ahead),
            dict(compile_options(nw, cap), launch_pdl=pdl))
        self.due_list = None
        if schedule == "list":
            self.due_list = _launch_due_list.prepare(
                dict(hcnt=hcnt, NS=g.num_slots, HV=g.heads, FIRST=consts["FIRST"], L=g.ring,
                     HB=triton.next_power_of_2(g.heads), PDL=pdl),
                dict(num_warps=1, **FP_FUSION, launch_pdl=pdl))


def _pool_tensors(pool) -> tuple:
    """The pool's tensors the kernels take (``gbuf`` None for GDN)."""
    return (pool.codes, pool.s_kv, pool.uq, pool.kbuf, pool.ubuf, pool.w, pool.pcum, pool.gbuf, pool.q0, pool.hcnt)


def _plan(pool, N: int, schedule: str, nw: int, cap: int | None, device: torch.device,
          force: bool | int = False) -> _Plan:
    """The pool's plan for ``N`` rows and this build (:func:`.launcher.per_pool`)."""
    tensors = _pool_tensors(pool)
    key = ("flush", pool.geometry, pool.first_slot, pool.iters, N, schedule, nw, cap, device, force)
    return per_pool(pool.raw, key, tensors, lambda: _Plan(pool, tensors, N, schedule, nw, cap, device, force))


def flush_pool(pool, idx: torch.Tensor, num_warps: int | None = None, maxnreg: int | None = None,
               schedule: str | None = None, force: bool | int = False) -> None:
    """Launch the flush over ``idx`` (int32 ``[N]``) on ``pool`` in place, with no host synchronisation and the same
    launches for the same pool and ``N``.

    ``schedule="grid"``: one program per (row, head), grid ``(N, HV)``; a program that is not due returns after reading
    ``idx`` and ``hcnt``. ``"list"``: :func:`.flush_kernel.due_list_kernel` lists the due pairs first, and program p
    of the flush takes pair p: the due programs are launched first, the others return after one load. The default is
    :func:`schedule_for`; ``schedule``, ``num_warps`` and ``maxnreg`` override the tuned defaults (for experiments;
    ``maxnreg=0`` lifts the cap). ``force``: the forced flush (SPEC §2), partially filled rings too, their ``hcnt``
    set to L: the grid schedule built with ``FORCE``, whatever ``N`` (nearly every named ring holds an entry, and all
    due is where the grid beats the list; docs/DESIGN.md, "Forced flush"); an int T: the rings that cannot hold T
    more (SPEC §6.1)."""
    g = pool.geometry
    N = idx.numel()
    if N == 0:
        return
    schedule = schedule or ("grid" if force else schedule_for(N, g.heads))
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, not {schedule!r}")
    if force and schedule != "grid":
        raise ValueError("the forced flush takes the grid schedule only")
    nw, cap = warps_and_cap(g.head_k, g.head_v, num_warps, maxnreg)
    plan = _plan(pool, N, schedule, nw, cap, idx.device, room(force, g.ring))
    # from the caching allocator (inside a CUDA graph capture: the graph's pool); due programs only touch their own
    # words
    scratch = torch.empty(plan.scratch_words, dtype=torch.float32, device=idx.device)
    if plan.due_list is None:
        work = idx  # (not read by the grid schedule)
    else:
        work = torch.empty(plan.work_words, dtype=torch.int32, device=idx.device)
        work[:1].zero_()
        plan.due_list((N,), dict(idx=idx, work=work))
    plan.flush(plan.grid, dict(idx=idx, work=work, scratch=scratch, scratch16=scratch.view(torch.float16)))
