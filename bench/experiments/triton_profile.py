# experiment: one all-due Triton flush at 256 x 32 KDA for a profiler to look at (bench/experiments/README.md).
# Run: ncu -k regex:leapquant_flush_kernel --launch-skip 1 -c 1 --section ... python bench/experiments/triton_profile.py
import torch

import leapquant
from leapquant.workloads import fill
from leapquant_triton.kernel import flush_pool

gen = torch.Generator().manual_seed(0)
pool = leapquant.Pool(257, 32, gate="kda", device="cuda")
fill(pool, torch.arange(1, 257), "realistic", gen)
idx = (torch.randperm(256, generator=gen) + 1).to(torch.int32).cuda()
saved = {n: getattr(pool, n).clone() for n in ("raw", "w", "pcum", "gbuf")}
for _ in range(2):  # the first launch compiles; the profiler takes the second
    for n, t in saved.items():
        getattr(pool, n).copy_(t)
    # the grid schedule (the list schedule launches the same kernel after due_list_kernel)
    flush_pool(pool, idx, schedule="grid")
torch.cuda.synchronize()
print("flushed", int((pool.w[1:257] == 0).all(dim=-1).sum()), "programs")
