# experiment: determinism, graph replay, parity and time of the Triton kernel on the GPU (bench/experiments/README.md)
import sys, os, copy, torch, leapquant, time
from leapquant import parity
from leapquant.workloads import fill
from leapquant_triton.kernel import flush_pool
tag = os.environ.get("DISABLE_MMA_V3", "0")
gen = torch.Generator().manual_seed(0)
nw = int(sys.argv[1]) if len(sys.argv) > 1 else None
def state(pool):
    return torch.cat([pool.raw.view(torch.uint8).flatten(), pool.w.view(torch.uint8).flatten(), pool.pcum.view(torch.uint8).flatten()])
for gate in ("kda", "gdn"):
    for frac in (1.0, 1/16):
        pool = leapquant.Pool(257, 32, gate=gate, device="cuda")
        slots = torch.arange(1, 257)
        fill(pool, slots, "gaussian", gen)
        due = torch.rand(256, 32, generator=gen) < frac
        pool.hcnt[1:257] = torch.where(due, 16, 3).to(torch.int32).cuda()
        idx = slots[torch.randperm(256, generator=gen)].to(torch.int32).cuda()
        try:
            outs = []
            for rep in range(3):
                p = copy.deepcopy(pool)
                flush_pool(p, idx, num_warps=nw); torch.cuda.synchronize()
                outs.append(state(p))
            same = all(torch.equal(outs[0], o) for o in outs[1:])
            p = copy.deepcopy(pool)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                flush_pool(p, idx, num_warps=nw)
            saved = {n: getattr(p, n).clone() for n in ("raw", "w", "pcum", "gbuf") if getattr(p, n) is not None}
            g.replay(); torch.cuda.synchronize()
            gsame = torch.equal(state(p), outs[0])
            scratch = torch.empty(2**26, device="cuda"); ts = []
            for _ in range(15):
                for n, t in saved.items(): getattr(p, n).copy_(t)
                scratch.zero_()
                a, b = torch.cuda.Event(True), torch.cuda.Event(True)
                a.record(); g.replay(); b.record(); b.synchronize(); ts.append(a.elapsed_time(b) * 1e3)
            print(f"tri MMAV3off={tag} nw={nw} {gate} frac={frac:.4f} due={int(due.sum())} eager-deterministic={same} graph==eager={gsame} t={sorted(ts)[7]:.1f} us", flush=True)
        except Exception as e:
            print(f"tri MMAV3off={tag} {gate} frac={frac} FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
            sys.exit(1)
    # parity on a smaller pool, every regime
    from parity_tests.strategies import build_case
    from leapquant.workloads import REGIMES
    for i, regime in enumerate(REGIMES):
        case = build_case(heads=32, head_k=128, head_v=128, ring=16, rank=4, gate=gate, convention="vllm", regime=regime, rows=4, due_frac=1.0, padding=2, seed=500 + i, device="cuda")
        pr = parity.measure(case.pool, case.idx, "triton", check=False)
        s = pr.summary()
        print(f"tri-parity MMAV3off={tag} {gate} {regime:14s} mean {s['ratio_mean']:.5f} worst {s['ratio_worst']:.5f} rms {s['ratio_rms']:.5f} ok={pr.backend_ok()} {pr.failures()}", flush=True)
