"""The seed kernel, unchanged, against the TileLang port: same pool, same timing method, one run (GPU).

    python -m bench.seed_vs_port --seed-file PATH [--slots 264]

``PATH`` is the seed (``../shared/seeds/leapquant_kda_flush_tilelang_seed.reindented.py``); on the device machine
copy it into a carried, git-ignored folder first (``.device/``), since ``../shared`` does not travel. Both kernels
flush byte-identical copies of one KDA pool (the layouts are the same, SPEC §2), 256 rows x 32 heads, all due and
1/16 due. Two timing methods, each a median of CUDA-graph replays with the rings restored before each:

* ``sync``: 25 replays, 256 MiB of scratch zeroed before each, the host waiting for every replay;
* ``bench``: ``bench.timing.time_replays``, the benchmark's own method (scratch written, then 128 MiB of clean data
  read, replays queued without host synchronisation).
"""

from __future__ import annotations

import argparse
import importlib.util

import torch

import leapquant
from leapquant.workloads import fill

from .flush import program_bytes
from .timing import copy_bandwidth, time_replays


def load_module(path: str, name: str = "leapquant_seed_kernel"):
    """The Python file at ``path`` as a module (a kernel file outside the packages: the seed, or a copy of a backend's
    kernel taken with git show), named ``name``."""
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _captured(fn, rings):
    """``fn`` run once, then captured in a CUDA graph; and the step that restores ``rings`` to their values now."""
    saved = [(t, t.clone()) for t in rings]
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()

    def restore():
        for t, s in saved:
            t.copy_(s)

    return graph, restore


def _replay_median(fn, rings, scratch, reps: int = 25) -> float:
    """The sync method: scratch zeroed, then one replay timed by events, the host waiting for it; median in us."""
    graph, restore = _captured(fn, rings)
    times = []
    for _ in range(reps):
        restore()
        scratch.zero_()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return sorted(times)[len(times) // 2]


def _bench_median(fn, rings) -> float:
    """The benchmark's method (bench.timing.time_replays); median in us."""
    graph, restore = _captured(fn, rings)
    tm = time_replays(graph.replay, restore, torch.device("cuda"), budget_s=2.0, min_reps=50, max_reps=200)
    restore()
    return tm.median * 1e6


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seed-file", required=True)
    ap.add_argument("--slots", type=int, default=264)
    args = ap.parse_args(argv)
    seed = load_module(args.seed_file)
    bw = copy_bandwidth(torch.device("cuda"), 1 << 30)["GBps"] * 1e9
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s")
    gen = torch.Generator().manual_seed(0)
    mine = leapquant.Pool(args.slots, 32, gate="kda", device="cuda")
    rows = torch.arange(1, 257)
    fill(mine, rows, "gaussian", gen)
    theirs = seed.Pool(args.slots, "cuda")
    for name in ("raw", "kbuf", "ubuf", "w", "pcum", "gbuf"):
        getattr(theirs, name).copy_(getattr(mine, name))
    idx = rows[torch.randperm(256, generator=gen)].to(torch.int32).cuda()
    scratch = torch.empty(2**26, device="cuda")
    per_program = program_bytes(mine)["total"]
    for frac in (1.0, 1 / 16):
        due = torch.rand(256, 32, generator=gen) < frac
        hcnt = torch.where(due, 16, 3).to(torch.int32).cuda()
        mine.hcnt[1:257] = hcnt
        theirs.hcnt[1:257] = hcnt
        floor = int(due.sum()) * per_program / bw * 1e6
        run_seed = lambda: seed.flush_inplace(theirs, idx, mine.q0)  # noqa: E731
        run_port = lambda: leapquant.flush(mine, idx, backend="tilelang", check=False)  # noqa: E731
        rings_seed, rings_port = (theirs.w, theirs.pcum, theirs.gbuf), (mine.w, mine.pcum, mine.gbuf)
        t_seed = _replay_median(run_seed, rings_seed, scratch)
        t_port = _replay_median(run_port, rings_port, scratch)
        t_seed2 = _replay_median(run_seed, rings_seed, scratch)
        print(f"seed-vs-port sync  due={int(due.sum())} frac={frac:.4f}: seed {t_seed:.1f} / {t_seed2:.1f} us, "
              f"port {t_port:.1f} us, floor {floor:.1f} us", flush=True)
        b_seed, b_port, b_seed2 = (_bench_median(run_seed, rings_seed), _bench_median(run_port, rings_port),
                                   _bench_median(run_seed, rings_seed))
        print(f"seed-vs-port bench due={int(due.sum())} frac={frac:.4f}: seed {b_seed:.1f} / {b_seed2:.1f} us, "
              f"port {b_port:.1f} us, floor {floor:.1f} us", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
