"""The reliability checks of SPEC §5.2 that need a GPU: a captured flush replayed twice, and a repeated slot.

    python -m parity_tests.gpu_reliability [--sanitize]

For each backend that flushes on the GPU here (Triton in both schedules, TileLang, the reference on the GPU) and both
gates:

* **idempotent under CUDA graphs**: a flush with ``check=False`` captured once; the first replay flushes the due
  programs, the second must leave every byte of the pool as the first left it (nothing in the rings since);
* **at most once per call**: ``idx`` naming each due slot three times, with ``check=False``, must leave the same bytes
  as ``idx`` naming each once (the kernels would otherwise flush a region from two programs at once), on pools of 9
  and 129 slots (8 and 128 named).

``--sanitize``: only the repeated-slot flush, once per backend and gate, on a small pool, for
``compute-sanitizer --tool memcheck|racecheck python -m parity_tests.gpu_reliability --sanitize`` (the tool's
report is the check). Prints one line per check and exits non-zero if any fails.
"""

from __future__ import annotations

import argparse
import sys

import torch

import leapquant
from leapquant import parity
from leapquant.tools.workloads import fill


def _backends() -> list[str]:
    names = [i.name for i in leapquant.backends() if i.available]
    out = [b for b in ("triton:grid", "triton:list", "tilelang") if b.split(":")[0] in names]
    return out + ["reference"]


def _flush(backend: str, pool, idx) -> None:
    if backend.startswith("triton:"):
        import leapquant_triton.flush as flush

        flush.flush_pool(pool, idx, schedule=backend.split(":")[1])
    else:
        leapquant.flush(pool, idx, backend=backend, check=False)


def _pool(gate: str, slots: int, heads: int, seed: int):
    # 32 heads of 128 x 128: the one geometry every GPU backend (TileLang included) flushes
    pool = leapquant.Pool(slots, heads, 128, 128, 16, 4, gate=gate, device="cuda")
    gen = torch.Generator().manual_seed(seed)
    due = torch.rand(slots - 1, heads, generator=gen) < 0.5
    fill(pool, list(range(1, slots)), "gaussian", gen, due=due)
    return pool


def _diff(a: dict, b: dict) -> list[str]:
    return [n for n in a if not torch.equal(a[n], b[n])]


def replay_twice(backend: str, gate: str) -> list[str]:
    pool = _pool(gate, 9, 32, seed=3)
    idx = torch.arange(1, 9, dtype=torch.int32, device="cuda")
    before = parity.snapshot(pool)
    _flush(backend, pool, idx)  # compiles and plans outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        _flush(backend, pool, idx)
    parity.restore(pool, before)  # back to the rings full
    graph.replay()
    torch.cuda.synchronize()
    once = parity.snapshot(pool)
    fails = [] if _diff(before, once) else ["the first replay changed nothing"]
    graph.replay()
    torch.cuda.synchronize()
    changed = _diff(once, parity.snapshot(pool))
    return fails + ([f"the second replay changed {changed}"] if changed else [])


def repeated_slots(backend: str, gate: str, slots: int = 9, heads: int = 32) -> list[str]:
    pool = _pool(gate, slots, heads, seed=5)
    twin = parity.twin(pool)
    once = torch.arange(1, slots, dtype=torch.int32, device="cuda")
    thrice = torch.cat([once, once.flip(0), once])
    _flush(backend, twin, once)
    _flush(backend, pool, thrice)
    torch.cuda.synchronize()
    changed = _diff(parity.snapshot(twin), parity.snapshot(pool))
    return [f"idx with each slot three times differs from once in {changed}"] if changed else []


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m parity_tests.gpu_reliability", description=__doc__.split("\n\n")[0])
    ap.add_argument("--sanitize", action="store_true", help="only the repeated-slot flush, small (under a sanitizer)")
    ap.add_argument("--backends", default=None, help="comma list, e.g. triton:grid,tilelang (default: all here)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("no GPU: nothing to check", file=sys.stderr)
        return 2
    failed = 0
    chosen = _backends() if args.backends is None else args.backends.split(",")
    for backend in chosen:
        for gate in ("kda", "gdn"):
            checks = [("repeated slots", lambda: repeated_slots(backend, gate, 4))] if args.sanitize else [
                ("replayed twice", lambda: replay_twice(backend, gate)),
                ("repeated slots", lambda: repeated_slots(backend, gate)),
                # 384 rows: TileLang's compaction keeps 130 in registers (KMAX = 10 at 129 slots), the rest in its tail
                ("repeated, 129", lambda: repeated_slots(backend, gate, 129))]
            for what, fn in checks:
                try:
                    fails = fn()
                except Exception as e:  # reported as a failure of this check
                    fails = [f"{type(e).__name__}: {e}"[:300]]
                failed += bool(fails)
                print(f"{backend:12s} {gate}  {what:15s} {'ok' if not fails else 'FAIL: ' + '; '.join(fails)}",
                      flush=True)
    print(f"{failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
