# experiment: the port with the seed's numerics (.device/tl_v0.py) against the seed at two pool sizes, both orders,
# through leapquant.flush and through the kernel directly (bench/experiments/README.md)
import torch, leapquant
from leapquant.workloads import fill
from bench.seed_vs_port import load_module, _replay_median

v0 = load_module(".device/tl_v0.py", "tl_v0")
seed = load_module(".device/seed_kernel.py")
scratch = torch.empty(2**26, device="cuda")
for NS in (264, 513):
    gen = torch.Generator().manual_seed(0)
    mine = leapquant.Pool(NS, 32, gate="kda", device="cuda"); rows = torch.arange(1, 257)
    fill(mine, rows, "gaussian", gen)
    theirs = seed.Pool(NS, "cuda")
    for n in ("raw", "kbuf", "ubuf", "w", "pcum", "gbuf"): getattr(theirs, n).copy_(getattr(mine, n))
    kern = v0.flush_kernel(NS, 32, 128, 128, 16, 4, "kda", 1, 1, 132)
    gb = mine.gbuf.view(torch.bfloat16)
    idx = rows[torch.randperm(256, generator=gen)].to(torch.int32).cuda()
    for frac in (1.0, 1 / 16):
        due = torch.rand(256, 32, generator=gen) < frac
        h = torch.where(due, 16, 3).to(torch.int32).cuda(); mine.hcnt[1:257] = h; theirs.hcnt[1:257] = h
        runs = {
            "port": (lambda: kern(mine.codes32, mine.s_k, mine.s_v, mine.s_kv, mine.kbuf, mine.ubuf, mine.w, mine.pcum,
                                  gb, mine.hcnt, mine.uq, mine.q0, idx), (mine.w, mine.pcum, mine.gbuf)),
            "seed": (lambda: seed.flush_inplace(theirs, idx, mine.q0), (theirs.w, theirs.pcum, theirs.gbuf)),
        }
        out = []
        for name in ("port", "seed", "seed", "port", "port", "seed"):
            fn, rings = runs[name]
            out.append(f"{name} {_replay_median(fn, rings, scratch):.1f}")
        print(f"slots NS={NS} frac={frac:.4f} due={int(due.sum())}: " + "  ".join(out), flush=True)
