"""The reliability checks of SPEC §5.2 that need a GPU: a captured flush replayed twice, and a repeated slot.

    python -m parity_tests.gpu_reliability [--sanitize]

For each backend that flushes on the GPU here (Triton in both schedules, TileLang, the reference on the GPU) and both
gates:

* **idempotent under CUDA graphs**: a flush with ``check=False`` captured once; the first replay flushes the due
  programs, the second must leave every byte of the pool as the first left it (nothing in the rings since);
* **at most once per call**: ``idx`` naming each due slot three times, with ``check=False``, must leave the same bytes
  as ``idx`` naming each once (the kernels would otherwise flush a region from two programs at once), on pools of 9
  and 129 slots (8 and 128 named).

``--sanitize``: only the repeated-slot flush and the decode step with the shortest legal storages (every token
tensor, ``idx`` and ``out`` in a storage that ends at its last element, one ``q`` strided; some fill counts outside
``[0, L]``, whose programs ``check=False`` leaves undefined but must keep inside the row's own bytes), once per
backend and gate, on a small pool, for ``compute-sanitizer --tool memcheck|racecheck python -m
parity_tests.gpu_reliability --sanitize`` (the tool's report is the check). Prints one line per check and exits
non-zero if any fails.
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


def _exact(shape: tuple, dtype: torch.dtype, gen: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    """A random tensor of ``shape`` whose storage holds exactly its elements: one element more read or written is
    outside the allocation, which memcheck reports."""
    t = torch.empty(int(torch.tensor(shape).prod()), dtype=dtype, device="cuda")
    t.copy_((scale * torch.randn(t.numel(), generator=gen)).to(dtype))
    return t.view(shape)


def step_shortest_storages(backend: str, gate: str) -> list[str]:
    """``leapquant.step(check=False)`` on tensors at their shortest legal storages, with full rings (flushed inside),
    in-range fills, and fill counts of L + 5 and -3 on two rows; the outputs of real rows finite."""
    B, HV, K, V = 4, 32, 128, 128
    pool = _pool(gate, B + 1, HV, seed=7)
    gen = torch.Generator().manual_seed(11)
    pool.hcnt[1, :4] = pool.ring + 5
    pool.hcnt[2, :4] = -3
    idx = torch.empty(B, dtype=torch.int32, device="cuda")
    idx.copy_(torch.arange(1, B + 1, dtype=torch.int32))
    # q strided: row n starts 2 K elements after row n - 1 (one head's gap), its storage ends at the last element
    q = torch.empty((B - 1) * (HV * K + K) + HV * K, dtype=torch.bfloat16, device="cuda")
    q.copy_(torch.randn(q.numel(), generator=gen).to(torch.bfloat16))
    q = q.as_strided((B, HV, K), (HV * K + K, K, 1))
    k = _exact((B, HV, K), torch.bfloat16, gen)
    k.copy_(torch.nn.functional.normalize(k.float(), dim=-1))
    v = _exact((B, HV, V), torch.bfloat16, gen)
    g = -_exact((B, HV, K) if gate == "kda" else (B, HV), torch.float32, gen, 0.05).abs()
    beta = _exact((B, HV), torch.float32, gen).abs().clamp_max(1.0)
    out = _exact((B, HV, V), torch.bfloat16, gen)
    leapquant.step(pool, idx, q, k, v, g, beta, out=out, backend=backend, check=False)
    torch.cuda.synchronize()
    return [] if bool(torch.isfinite(out[2:].float()).all()) else ["non-finite outputs on rows of in-range fills"]


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
            step = [("step, short storages", lambda: step_shortest_storages(backend.split(":")[0], gate))] if (
                backend.split(":")[0] in ("triton", "reference") and not backend.endswith(":list")) else []
            checks = [("repeated slots", lambda: repeated_slots(backend, gate, 4))] + step if args.sanitize else [
                ("replayed twice", lambda: replay_twice(backend, gate)),
                ("repeated slots", lambda: repeated_slots(backend, gate)),
                # 384 rows: TileLang's compaction keeps 130 in registers (KMAX = 10 at 129 slots), the rest in its tail
                ("repeated, 129", lambda: repeated_slots(backend, gate, 129))] + step
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
