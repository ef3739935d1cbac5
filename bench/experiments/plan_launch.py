"""Host time of the Triton backend's eager flush with per-pool plans (leapquant_triton/kernel.py ``_plan``, session 11)
against the ``flush_pool`` of 56bfd5d, which builds every argument and the launcher's key of 31 arguments per call;
same process, same pool, same launcher module.

    git show 56bfd5d:leapquant_triton/kernel.py > .device/kernel_56bfd5d.py
    PYTHONPATH=$PWD python bench/experiments/plan_launch.py .device/kernel_56bfd5d.py

KDA, 32 heads, nothing due: 8 rows (the grid schedule, one launch) and 64 rows (the list schedule: a zeroing, the due
list and the flush), alternating old and new three times; per path ``bench.host_overhead.measure`` of the backend's
``flush_pool``. Then, per case, the bytes a flush of half the programs leaves, old against new (the new one three
times into the same pool object, so that its plan binds once and then launches directly).
"""

import importlib.util
import sys

import torch

import leapquant
from bench.host_overhead import _idle_pool, measure
from leapquant.workloads import fill
from leapquant_triton import kernel


def _old_kernel_module(path: str):
    # a submodule of leapquant_triton, so that its relative imports (backend, launcher) resolve to this tree's
    spec = importlib.util.spec_from_file_location("leapquant_triton._kernel_old", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


STATE = ("raw", "kbuf", "ubuf", "w", "pcum", "gbuf", "hcnt")


def main(path: str) -> None:
    dev = torch.device("cuda")
    old = _old_kernel_module(path)
    paths = {"old ": old.flush_pool, "plan": kernel.flush_pool}
    for rows in (8, 64):
        pool, idx = _idle_pool(dev, rows)
        print(f"rows {rows} ({kernel.schedule_for(rows, 32)} schedule), nothing due:")
        for name in ("old ", "plan") * 3:
            f = paths[name]
            k = measure(lambda: f(pool, idx), dev, 200, 7, 30)
            print(f"  {name}: flush_pool {k['host_us']:.1f} us (wall {k['wall_us']:.1f}, min {k['host_min_us']:.1f})",
                  flush=True)
        full = leapquant.Pool(2 * rows + 1, 32, gate="kda", device=dev)
        gen = torch.Generator().manual_seed(rows)
        fill(full, torch.arange(1, rows + 1), "gaussian", gen, due=torch.rand(rows, 32, generator=gen) < 0.5)
        p = leapquant.Pool(2 * rows + 1, 32, gate="kda", device=dev)
        out = []
        for name in ("old ", "plan", "plan", "plan"):
            for n in STATE:
                getattr(p, n).copy_(getattr(full, n))
            paths[name](p, idx)
            torch.cuda.synchronize()
            out.append([getattr(p, n).clone() for n in STATE])
        same = all(torch.equal(a.view(torch.uint8), c.view(torch.uint8)) for o in out[1:] for a, c in zip(out[0], o))
        changed = not torch.equal(out[0][0].view(torch.uint8), full.raw.view(torch.uint8))
        (plan,) = kernel._PLANS[p.raw].values()
        print(f"  half due: bytes of the plan's launches {'equal' if same else 'DIFFER'} to the old flush_pool's; the "
              f"flush {'changed' if changed else 'DID NOT CHANGE'} the pool; the plan keeps {len(plan.flush.kernels)} "
              "flush kernel(s)")


if __name__ == "__main__":
    main(sys.argv[1])
