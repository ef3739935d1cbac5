# experiment: what the lo2 piece costs; three builds of the TileLang kernel and the seed (bench/experiments/README.md)
import copy, sys, torch, leapquant
from leapquant import parity
from leapquant.workloads import fill
from leapquant_tilelang.backend import TileLangBackend
from parity_tests.strategies import build_case
from bench.seed_vs_port import load_module, _replay_median

def variant(path):
    mod = load_module(path, path.split("/")[-1][:-3])
    class B(TileLangBackend):
        name = "tl-" + path.split("/")[-1][:-3]
        def kernel(self, pool):
            g = pool.geometry
            key = (g.num_slots, pool.first_slot, pool.iters)
            if key not in self._kernels:
                self._kernels[key] = mod.flush_kernel(g.num_slots, g.heads, g.head_k, g.head_v, g.ring, g.rank, g.gate,
                                                      pool.first_slot, pool.iters, self._sm_count(pool.device))
            return self._kernels[key]
    b = B(); leapquant.register(b); return b

vs = [variant(f".device/tl_v{i}.py") for i in range(3)]
# correctness: KDA decayed + gaussian, 8 rows x 32 heads
for regime in ("decayed", "gaussian", "realistic"):
    case = build_case(heads=32, head_k=128, head_v=128, ring=16, rank=4, gate="kda", convention="vllm", regime=regime,
                      rows=8, due_frac=1.0, padding=2, seed=77, device="cuda")
    for b in vs:
        p = parity.measure(copy.deepcopy(case.pool), case.idx, b.name, check=False); s = p.summary()
        print(f"abl-parity {b.name} {regime:10s} mean {s['ratio_mean']:.4f} worst {s['ratio_worst']:.4f} ok={p.backend_ok()}", flush=True)
seed = load_module(".device/seed_kernel.py")
gen = torch.Generator().manual_seed(0)
mine = leapquant.Pool(513, 32, gate="kda", device="cuda"); rows = torch.arange(1, 257); fill(mine, rows, "gaussian", gen)
theirs = seed.Pool(513, "cuda")
for n in ("raw", "kbuf", "ubuf", "w", "pcum", "gbuf"): getattr(theirs, n).copy_(getattr(mine, n))
idx = rows[torch.randperm(256, generator=gen)].to(torch.int32).cuda(); scratch = torch.empty(2**26, device="cuda")
for frac in (1.0, 1/16):
    due = torch.rand(256, 32, generator=gen) < frac
    h = torch.where(due, 16, 3).to(torch.int32).cuda(); mine.hcnt[1:257] = h; theirs.hcnt[1:257] = h
    res = []
    for rep in range(2):
        res.append(("seed", _replay_median(lambda: seed.flush_inplace(theirs, idx, mine.q0), (theirs.w, theirs.pcum, theirs.gbuf), scratch)))
        for b in vs:
            res.append((b.name, _replay_median(lambda b=b: leapquant.flush(mine, idx, backend=b.name, check=False), (mine.w, mine.pcum, mine.gbuf), scratch)))
    print(f"abl-time frac={frac:.4f} due={int(due.sum())} " + "  ".join(f"{n} {t:.1f}" for n, t in res), flush=True)
