# experiment: builds of the Triton kernel on the GPU: parity on four regimes, eager determinism, graph == eager, and
# the time at 256 x 32 all due and 1/16 due beside the floor (bench/experiments/README.md).
# Usage: python bench/experiments/triton_sweep.py [nw:maxnreg:variant ...]; "-" for the default; variant "old" is the
# kernel of commit ff82b6e copied to .device/kernel_old.py, "file:PATH" another copy of kernel.py (git show), "grid"
# or "list" the working tree's kernel with that schedule, any other variant a dict of extra constexprs.
# SWEEP_PARITY_ROWS (default 4): rows of 32 heads in each parity case
import copy
import os
import statistics
import sys

import torch

import leapquant
from bench.flush import floor_bytes, program_bytes
from bench.seed_vs_port import load_module
from bench.timing import capture, copy_bandwidth
from leapquant import parity
from leapquant.workloads import fill
from leapquant_triton import backend as tb
from leapquant_triton.kernel import flush_pool
from parity_tests.strategies import build_case

import json

import leapquant_triton.kernel as kk


def parse(c):
    nw, mr, var = (c.split(":", 2) + ["-", "-"])[:3]
    return (None if nw == "-" else int(nw), None if mr == "-" else int(mr), var)


configs = [parse(c) for c in sys.argv[1:]] or [(None, None, "-")]
# rows of the parity cases (x 32 programs); more than two per SM make a looping schedule take several pairs
parity_rows = int(os.environ.get("SWEEP_PARITY_ROWS", "4"))
_base_constants = kk.kernel_constants


def launcher(nw, mr, var):
    if var == "old":
        old = load_module(".device/kernel_old.py", "kernel_old")
        return lambda p, ix: old.flush_pool(p, ix, num_warps=nw)
    if var in kk.SCHEDULES:  # the working tree's kernel with this schedule (kernel.flush_pool)
        return lambda p, ix: flush_pool(p, ix, num_warps=nw, maxnreg=mr, schedule=var)
    if var.startswith("file:"):  # another version of leapquant_triton/kernel.py, e.g. from git show
        mod = load_module(var[5:], "kernel_" + str(abs(hash(var))))
        return lambda p, ix: mod.flush_pool(p, ix, num_warps=nw, maxnreg=mr)
    extra = json.loads(var) if var != "-" else {}

    def run(p, ix):
        kk.kernel_constants = lambda *a, **k: dict(_base_constants(*a, **k), **extra)
        try:
            flush_pool(p, ix, num_warps=nw, maxnreg=mr)
        finally:
            kk.kernel_constants = _base_constants
    return run
dev = torch.device("cuda")
bw = copy_bandwidth(dev, 1 << 30)
print("copy bandwidth", bw, flush=True)
gbps = bw["GBps"]


def state(pool):
    return torch.cat([pool.raw.view(torch.uint8).flatten(), pool.w.view(torch.uint8).flatten(),
                      pool.pcum.view(torch.uint8).flatten()])


gen = torch.Generator().manual_seed(0)
pools = {}
for gate in ("kda", "gdn"):
    pool = leapquant.Pool(257, 32, gate=gate, device="cuda")
    fill(pool, torch.arange(1, 257), "realistic", gen)
    pools[gate] = pool
idx = (torch.randperm(256, generator=gen) + 1).to(torch.int32).cuda()
pb = program_bytes(pools["kda"])

for nw, mr, var in configs:
    tag = f"nw={nw} maxnreg={mr} variant={var}"
    launch = launcher(nw, mr, var)
    try:
        orig = tb.TritonBackend.flush  # the parity harness flushes through the backend: point it at this build
        tb.TritonBackend.flush = lambda self, p, ix: launch(p, ix)
        try:
            for gate in ("kda", "gdn"):
                for i, regime in enumerate(("realistic", "lowrank", "large_columns", "decayed")):
                    case = build_case(heads=32, head_k=128, head_v=128, ring=16, rank=4, gate=gate,
                                      convention="vllm", regime=regime, rows=parity_rows, due_frac=1.0, padding=2,
                                      seed=500 + i, device="cuda")
                    pr = parity.measure(case.pool, case.idx, "triton", check=False)
                    s = pr.summary()
                    print(f"{tag} parity {gate} {regime:14s} mean {s['ratio_mean']:.5f} worst "
                          f"{s['ratio_worst']:.5f} rms {s['ratio_rms']:.5f} ok={pr.backend_ok()} {pr.failures()}",
                          flush=True)
        finally:
            tb.TritonBackend.flush = orig
        for gate in ("kda", "gdn"):
            for frac_due in (8192, 512):
                pool = pools[gate]
                flat = torch.zeros(256 * 32, dtype=torch.bool)
                flat[torch.randperm(256 * 32, generator=gen)[:frac_due]] = True
                pool.hcnt.fill_(3)
                pool.hcnt[1:257] = torch.where(flat.reshape(256, 32), 16, 3).to(torch.int32).cuda()
                outs = []
                for _ in range(3):
                    p = copy.deepcopy(pool)
                    launch(p, idx)
                    torch.cuda.synchronize()
                    outs.append(state(p))
                same = all(torch.equal(outs[0], o) for o in outs[1:])
                p = copy.deepcopy(pool)
                saved = {n: getattr(p, n).clone() for n in ("raw", "w", "pcum", "gbuf") if getattr(p, n) is not None}
                replay = capture(lambda: launch(p, idx), dev)  # compiled by the eager launches above
                replay()
                torch.cuda.synchronize()
                gsame = torch.equal(state(p), outs[0])
                evict = torch.empty(2 ** 26, device="cuda")
                ts = []
                for _ in range(25):
                    for n, t in saved.items():
                        getattr(p, n).copy_(t)
                    evict.zero_()
                    a, b = torch.cuda.Event(True), torch.cuda.Event(True)
                    a.record(); replay(); b.record(); b.synchronize()
                    ts.append(a.elapsed_time(b) * 1e3)
                t = statistics.median(ts[5:])
                floor = floor_bytes(pb, frac_due, 256) / (gbps * 1e3)
                print(f"{tag} time {gate} due={frac_due} {t:.1f} us floor {floor:.1f} us ({t / floor:.2f}x) "
                      f"deterministic={same} graph==eager={gsame}", flush=True)
    except Exception as e:  # report and go on to the next configuration
        print(f"{tag} FAILED {type(e).__name__}: {str(e)[:400]}", flush=True)
