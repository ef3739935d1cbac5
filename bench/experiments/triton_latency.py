# experiment: where the Triton flush's time goes at small and sparse batches (bench/experiments/README.md): KDA
# 257 x 32 pool, the flush timed on (rows, due programs) cases from one program to all due, and with nothing due
# (the cost of the (row, head) programs that only read idx and hcnt). Graph replays, L2 evicted, medians.
# Usage: python bench/experiments/triton_latency.py [grid|list|file:PATH ...]  (the default schedule, then each named
# schedule of the working tree's kernel or another kernel.py copy, timed beside it)
import statistics
import sys

import torch

import leapquant
from bench.seed_vs_port import load_module
from bench.timing import Evictor, capture
from leapquant.workloads import fill
from leapquant_triton import kernel as kk

dev = torch.device("cuda")
gen = torch.Generator().manual_seed(0)
pool = leapquant.Pool(257, 32, gate="kda", device="cuda")
fill(pool, torch.arange(1, 257), "realistic", gen)
saved = {n: getattr(pool, n).clone() for n in ("raw", "w", "pcum", "gbuf")}
evict = Evictor(dev)


def launchers():
    yield "default", kk.flush_pool
    for arg in sys.argv[1:]:
        if arg in kk.SCHEDULES:  # the working tree's kernel with this schedule
            yield arg, lambda p, ix, s=arg: kk.flush_pool(p, ix, schedule=s)
            continue
        yield arg, load_module(arg[5:], "kernel_" + str(abs(hash(arg)))).flush_pool


# (rows, due (row, head) pairs among rows x 32)
CASES = [(1, 1), (1, 32), (8, 256), (16, 512), (32, 64), (32, 1024), (64, 128), (64, 2048), (256, 0), (256, 512),
         (256, 8192)]
for name, flush in launchers():
    for rows, due in CASES:
        idx = (torch.randperm(256, generator=gen)[:rows] + 1).to(torch.int32).cuda()
        flat = torch.zeros(rows * 32, dtype=torch.bool)
        flat[torch.randperm(rows * 32, generator=gen)[:due]] = True
        pool.hcnt.fill_(3)
        pool.hcnt[idx.long()] = torch.where(flat.reshape(rows, 32), 16, 3).to(torch.int32).cuda()
        flush(pool, idx)  # compile outside the capture
        replay = capture(lambda: flush(pool, idx), dev)
        ts = []
        for _ in range(25):
            for n, t in saved.items():
                getattr(pool, n).copy_(t)
            evict()
            a, b = torch.cuda.Event(True), torch.cuda.Event(True)
            a.record()
            replay()
            b.record()
            b.synchronize()
            ts.append(a.elapsed_time(b) * 1e3)
        print(f"{name} rows {rows:3d} due {due:5d} programs {rows * 32:5d}: {statistics.median(ts[5:]):7.1f} us",
              flush=True)
