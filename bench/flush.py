"""Flush benchmark: the cases, the bytes a flush must move (its floor), and the per-backend worker.

A case is (heads per GPU, batch rows N, due fraction f). Its batch is a random permutation of N distinct slots of a
pool filled by ``leapquant.tools.workloads.fill(..., "gaussian")``; exactly ``max(1, round(f * N * HV))`` of its
(row, head) programs are due, chosen at random, the others hold a count below L. ``leapquant.flush(pool, idx,
backend=B, check=False)`` is captured in a CUDA graph and replayed; before each replay the rings a flush resets
(``w``, ``pcum``, ``gbuf``) are copied back from saved copies, so every replay flushes full rings (the checkpoints
evolve from replay to replay: each replay compresses the state the previous one stored, still real data).

Floor: what the due programs must move through DRAM (read checkpoint + ring, write checkpoint + ring resets), plus
what every program must read to know whether it is due (``hcnt`` per (row, head), ``idx`` per row), each counted from
the pool's own dtypes and shapes, over the copy bandwidth measured in the same run.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
import traceback
import zlib
from dataclasses import asdict, dataclass
from fractions import Fraction

import torch

FRACTIONS = (Fraction(1, 16), Fraction(1, 4), Fraction(1))
BATCHES = (1, 8, 32, 64, 128, 256, 512)
HEADS = 32
EXTRA_HEADS = (8, 16)  # heads per GPU under tensor parallelism, at EXTRA_BATCH sequences
EXTRA_BATCH = 256
AMORTISE_BATCH = 256  # the step is timed at this batch x HEADS; the all-due flush there is amortised over L tokens


@dataclass(frozen=True)
class Case:
    heads: int
    batch: int
    due_fraction: str  # "1/16", "1/4", "1"

    @property
    def key(self) -> str:
        return f"h{self.heads}_n{self.batch}_f{self.due_fraction}"

    @property
    def fraction(self) -> Fraction:
        return Fraction(self.due_fraction)

    def due_count(self) -> int:
        x = float(self.fraction) * self.batch * self.heads
        return max(1, int(math.floor(x + 0.5)))


@dataclass(frozen=True)
class Plan:
    """What one run measures: cases in the order they run (most important first) and the pool geometry."""

    cases: tuple[Case, ...]
    head_k: int = 128
    head_v: int = 128
    ring: int = 16
    rank: int = 4
    gate: str = "kda"
    seed: int = 0
    # (heads, batch) where the decode step is timed and the all-due flush is amortised over L tokens
    amortise: tuple[int, int] = (HEADS, AMORTISE_BATCH)

    def slots_for(self, heads: int) -> int:
        """Pool slots for a heads setting: the largest batch of that setting plus the null slot 0."""
        return max(c.batch for c in self.cases if c.heads == heads) + 1


def plan(mode: str) -> Plan:
    """``full`` (the GPU run), ``quick`` (a smoke test on the GPU) or ``cpu`` (``--cpu-smoke``: tiny, reference)."""
    fr = [str(f) for f in FRACTIONS]
    if mode == "full":
        first = [Case(HEADS, AMORTISE_BATCH, f) for f in reversed(fr)]  # the headline case, all due first
        rest = [Case(HEADS, n, f) for n in BATCHES if n != AMORTISE_BATCH for f in fr]
        extra = [Case(h, EXTRA_BATCH, f) for h in EXTRA_HEADS for f in fr]
        return Plan(tuple(first + rest + extra))
    if mode == "quick":
        return Plan((Case(HEADS, AMORTISE_BATCH, "1"), Case(HEADS, AMORTISE_BATCH, "1/16"), Case(HEADS, 8, "1/16"),
                     Case(8, AMORTISE_BATCH, "1")))
    if mode == "cpu":
        return Plan((Case(2, 3, "1"), Case(2, 3, "1/4"), Case(2, 1, "1"), Case(1, 3, "1")), amortise=(2, 3))
    raise ValueError(f"unknown plan {mode!r}")


def _slice_bytes(t: torch.Tensor | None) -> int:
    """Bytes of one (slot, head) slice of a pool tensor ``[NS, HV, ...]`` (0 for an absent tensor)."""
    if t is None:
        return 0
    return t[0, 0].numel() * t.element_size()


def program_bytes(pool) -> dict:
    """Bytes one due program must read and write, counted from the pool's views (SPEC §2)."""
    checkpoint = sum(_slice_bytes(t) for t in (pool.codes, pool.s_k, pool.s_v, pool.uq))
    ring = sum(_slice_bytes(t) for t in (pool.kbuf, pool.ubuf, pool.w, pool.pcum, pool.gbuf))
    resets = sum(_slice_bytes(t) for t in (pool.w, pool.pcum, pool.gbuf))
    return {"checkpoint": checkpoint, "ring": ring, "resets": resets,
            "read": checkpoint + ring, "write": checkpoint + resets, "total": 2 * checkpoint + ring + resets,
            "scan_per_row": pool.hcnt[0].numel() * pool.hcnt.element_size() + torch.int32.itemsize}


def floor_bytes(pb: dict, due: int, batch: int) -> int:
    """Due programs' traffic plus the due scan (``hcnt`` per (row, head) and ``idx`` per row)."""
    return due * pb["total"] + batch * pb["scan_per_row"]


def _build_pool(plan_: Plan, heads: int, device: torch.device):
    import leapquant
    try:
        from leapquant.tools.workloads import fill
    except ImportError:  # a --baseline tree from before leapquant.tools
        from leapquant.workloads import fill

    ns = plan_.slots_for(heads)
    pool = leapquant.Pool(ns, heads, plan_.head_k, plan_.head_v, plan_.ring, plan_.rank, gate=plan_.gate,
                          device=device)
    fill(pool, torch.arange(1, ns), "gaussian", torch.Generator().manual_seed(plan_.seed + heads))
    return pool


def _set_due(pool, case: Case, seed: int) -> torch.Tensor:
    """idx (a random permutation of ``case.batch`` distinct real slots) and hcnt with exactly ``due_count()`` due
    programs among its rows; returns idx (int32 on the pool's device)."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(case.key.encode()))  # same in every process
    N, HV, L = case.batch, pool.heads, pool.ring
    idx = torch.randperm(pool.num_slots - 1, generator=gen)[:N] + 1
    flat = torch.zeros(N * HV, dtype=torch.bool)
    flat[torch.randperm(N * HV, generator=gen)[: case.due_count()]] = True
    below = torch.randint(0, L, (N, HV), generator=gen, dtype=torch.int32)
    hcnt = torch.where(flat.reshape(N, HV), torch.full_like(below, L), below)
    pool.hcnt.fill_(0)
    pool.hcnt[idx.to(pool.device)] = hcnt.to(pool.device)
    return idx.to(torch.int32).to(pool.device)


class _Rings:
    """Saved copies of what a flush resets (``w``, ``pcum``, ``gbuf``) and the restore step between replays."""

    def __init__(self, pool):
        self.pairs = [(t, t.clone()) for t in (pool.w, pool.pcum, pool.gbuf) if t is not None]

    def restore(self) -> None:
        for live, saved in self.pairs:
            live.copy_(saved)


def _flushed_as_expected(pool, idx, rings: _Rings) -> str | None:
    """After one replay from restored rings: due programs' ``w`` is 0, everyone else's is untouched. None if so,
    else what is wrong (a replay that flushes nothing would time as fast and wrong)."""
    due = pool.due(idx)  # [N, HV]
    rows = idx.long()
    w_now = pool.w[rows]  # [N, HV, L]
    w_saved = rings.pairs[0][1][rows]
    if not bool((w_now[due] == 0).all()):
        return "a due program's w was not reset by the replay"
    if not torch.equal(w_now[~due], w_saved[~due]):
        return "a program that was not due had its w changed"
    return None


def run_worker(backend: str, mode: str, device: torch.device, deadline: float, record) -> None:
    """Time ``backend`` over the plan's cases; one record per case (``status``: ok / unavailable / error / skipped).

    ``deadline`` (epoch seconds) bounds the work: a case that cannot start in time is recorded as skipped.
    """
    import leapquant
    from leapquant.backends import BackendError

    from .timing import device_info, module_version, time_replays

    plan_ = plan(mode)
    t_start = time.time()
    record(kind="env", backend=backend, **device_info(device),
           triton=module_version("triton"), tilelang=module_version("tilelang"),
           package=str(Path(leapquant.__file__).resolve().parent.parent))  # which tree ran (see --baseline)
    print(f"{backend}: leapquant from {Path(leapquant.__file__).resolve().parent}", flush=True)
    is_ref = backend == "reference"
    min_reps, max_reps = (3, 15) if is_ref else (10, 200)
    if device.type == "cpu":
        min_reps, max_reps = 2, 3

    def done(case, **r):
        record(kind="case", backend=backend, case=asdict(case), **r)

    try:
        b = leapquant.get_backend(backend)
        ok, why = b.available()
    except BackendError as e:
        ok, why = False, str(e)
    if not ok:
        for c in plan_.cases:
            done(c, status="unavailable", reason=why)
        print(f"[{backend}] unavailable: {why}", flush=True)
        return

    pools: dict[int, object] = {}
    pool_ok: dict[int, str | None] = {}
    broken: str | None = None
    for i, case in enumerate(plan_.cases):
        if broken is not None:
            done(case, status="error", reason=f"not run: the CUDA context is unusable after: {broken}")
            continue
        left = deadline - time.time()
        cases_left = len(plan_.cases) - i
        if left < 2.0:
            done(case, status="skipped", reason=f"time budget of this backend spent ({time.time() - t_start:.0f} s)")
            continue
        record(kind="start", backend=backend, case=asdict(case))
        try:
            if case.heads not in pools:
                t = time.time()
                pools[case.heads] = _build_pool(plan_, case.heads, device)
                print(f"[{backend}] pool of {pools[case.heads].num_slots} slots x {case.heads} heads filled in "
                      f"{time.time() - t:.1f} s", flush=True)
                sup, why = b.supports(pools[case.heads])
                pool_ok[case.heads] = None if sup else why
            pool = pools[case.heads]
            if pool_ok[case.heads] is not None:
                done(case, status="unavailable", reason=pool_ok[case.heads])
                print(f"[{backend}] {case.key}: unavailable: {pool_ok[case.heads]}", flush=True)
                continue
            idx = _set_due(pool, case, plan_.seed)
            due = int(pool.due(idx).sum())
            rings = _Rings(pool)

            def flush(pool=pool, idx=idx):
                leapquant.flush(pool, idx, backend=backend, check=False)

            t = time.time()
            flush()  # compiles on first use; outside the capture
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            first_call_s = time.time() - t
            rings.restore()
            run, how = _graph_or_eager(flush, device)
            rings.restore()
            run()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            wrong = _flushed_as_expected(pool, idx, rings)
            budget = max(0.2, min(3.0 if is_ref else 1.5, 0.8 * (deadline - time.time()) / cases_left))
            tm = time_replays(run, rings.restore, device, budget_s=budget, min_reps=min_reps, max_reps=max_reps,
                              warmup=1 if is_ref else 3)
            del run
            rings.restore()
            status = "ok" if wrong is None else "wrong"
            done(case, status=status, due_programs=due, first_call_s=first_call_s, timed=how, **tm.as_dict(),
                 **({"reason": wrong} if wrong else {}))
            print(f"[{backend}] {case.key}: {tm.median * 1e6:10.1f} us  (median of {tm.n}, p20-p80 "
                  f"{tm.p20 * 1e6:.1f}-{tm.p80 * 1e6:.1f}; {due} due; first call {first_call_s:.1f} s; {how})"
                  + (f"  WRONG: {wrong}" if wrong else ""), flush=True)
        except Exception as e:
            msg = f"{type(e).__name__}: {e}".strip()[:600]
            done(case, status="error", reason=msg, traceback=traceback.format_exc()[-2000:])
            print(f"[{backend}] {case.key}: ERROR {msg}", flush=True)
            broken = _context_broken(device, msg)
        finally:
            if device.type == "cuda" and broken is None:
                try:
                    torch.cuda.empty_cache()
                except Exception:
                    pass
    record(kind="env", backend=backend, triton=module_version("triton"), tilelang=module_version("tilelang"))


def _graph_or_eager(flush, device: torch.device):
    """``(run, how)``: the flush captured in a CUDA graph, or (where it synchronises with the host, which capture
    forbids) the eager call, with ``how`` saying which and why. The check runs one eager call under torch's
    sync-debug mode "error" first, so a synchronising backend never reaches a capture it would break."""
    from .timing import capture

    if device.type != "cuda":
        return flush, "eager (cpu)"
    torch.cuda.synchronize(device)
    prev = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        flush()
        synced = None
    except RuntimeError as e:
        synced = str(e).splitlines()[0][:200]
    finally:
        torch.cuda.set_sync_debug_mode(prev)
    torch.cuda.synchronize(device)
    if synced is not None:
        return flush, f"eager: the flush synchronises with the host, no graph ({synced})"
    try:
        return capture(flush, device), "graph"
    except Exception as e:
        torch.cuda.synchronize(device)
        return flush, f"eager: graph capture failed ({type(e).__name__}: {str(e).splitlines()[0][:200]})"


def _context_broken(device: torch.device, msg: str) -> str | None:
    """After an error: does the device still work? (An illegal address is sticky: every later call fails.)"""
    if device.type != "cuda":
        return None
    try:
        x = torch.ones(4, device=device)
        torch.cuda.synchronize(device)
        if float(x.sum()) != 4.0:
            return msg
        return None
    except Exception as e:
        return f"{msg} (then: {type(e).__name__}: {str(e)[:200]})"
