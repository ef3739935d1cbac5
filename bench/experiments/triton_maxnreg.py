# experiment: does a register cap that fits 2 programs per SM help the Triton kernel? (bench/experiments/README.md)
import copy, torch, leapquant
from leapquant.workloads import fill
from leapquant_triton.kernel import leapquant_flush_kernel, kernel_constants, mma_sync_only
def launch(pool, idx, maxnreg):
    g = pool.geometry
    kw = dict(num_warps=8, num_stages=1)
    if maxnreg: kw["maxnreg"] = maxnreg
    with mma_sync_only():
        leapquant_flush_kernel[(idx.numel(), g.heads)](idx, pool.hcnt, pool.codes, pool.s_kv, pool.uq, pool.kbuf, pool.ubuf, pool.w, pool.pcum, pool.gbuf if pool.gbuf is not None else pool.w, pool.q0, g.num_slots, g.heads, g.slot_stride, **kernel_constants(g, pool.convention, pool.iters), **kw)
gen = torch.Generator().manual_seed(0)
pool = leapquant.Pool(257, 32, gate="kda", device="cuda")
slots = torch.arange(1, 257); fill(pool, slots, "gaussian", gen)
idx = slots[torch.randperm(256, generator=gen)].to(torch.int32).cuda()
for frac in (1.0, 1/16):
    due = torch.rand(256, 32, generator=gen) < frac
    pool.hcnt[1:257] = torch.where(due, 16, 3).to(torch.int32).cuda()
    outs = {}
    for mr in (None, 128):
        p = copy.deepcopy(pool)
        launch(p, idx, mr); torch.cuda.synchronize(); outs[mr] = p.raw.clone()
        q = copy.deepcopy(pool)
        saved = [(t, t.clone()) for t in (q.w, q.pcum, q.gbuf)]
        g = torch.cuda.CUDAGraph()
        launch(q, idx, mr); torch.cuda.synchronize()
        with torch.cuda.graph(g): launch(q, idx, mr)
        scratch = torch.empty(2**26, device="cuda"); ts = []
        for _ in range(15):
            for t, s in saved: t.copy_(s)
            scratch.zero_()
            a, b = torch.cuda.Event(True), torch.cuda.Event(True)
            a.record(); g.replay(); b.record(); b.synchronize(); ts.append(a.elapsed_time(b) * 1e3)
        print(f"tri-regs maxnreg={mr} frac={frac:.4f} due={int(due.sum())} {sorted(ts)[7]:.1f} us", flush=True)
    print("tri-regs same bytes:", torch.equal(outs[None], outs[128]), flush=True)
