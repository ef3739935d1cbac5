"""Host time of the Triton backend's direct launches with tensors as arguments (the launcher of d0b97c6) against
tensors passed as their addresses (leapquant_triton/launcher.py since session 11), same process, same pool.

    git show d0b97c6:leapquant_triton/launcher.py > .device/launcher_d0b97c6.py
    PYTHONPATH=$PWD python bench/experiments/address_launch.py .device/launcher_d0b97c6.py

Given a tensor, Triton's launcher calls its ``data_ptr`` from C and asks the driver (``cuPointerGetAttribute``) whether
each pointer can be reached from the current device, on every launch; given an int it takes it as the address. KDA,
32 heads, nothing due: 8 rows (the grid schedule, one launch) and 64 rows (the list schedule: a zeroing, the due list
and the flush), alternating old and new three times; per path ``bench.host_overhead.measure`` of
``leapquant.flush(pool, idx, backend="triton", check=False)`` and of the backend's own ``flush``. Then, per case, the
bytes a flush of due programs leaves, old against new. Last, the launch alone: the kept flush kernel of the 8-row case
called as ``kernel[grid](*args)`` with tensors and with their addresses, alternating (the host's speed moved the
end-to-end figures by up to 2x between calls in session 11).
"""

import copy
import importlib.util
import statistics
import sys
import time

import torch

import leapquant
from bench.host_overhead import _idle_pool, measure
from leapquant.workloads import fill
from leapquant_triton import kernel
from leapquant_triton.launcher import Launcher


def _old_launcher_class(path: str):
    spec = importlib.util.spec_from_file_location("launcher_old", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.Launcher


def main(path: str) -> None:
    dev = torch.device("cuda")
    old_cls = _old_launcher_class(path)
    launchers = {
        "tensors ": (old_cls(kernel.due_list_kernel, kernel.mma_sync_only),
                     old_cls(kernel.leapquant_flush_kernel, kernel.mma_sync_only)),
        "address": (Launcher(kernel.due_list_kernel, kernel.mma_sync_only),
                    Launcher(kernel.leapquant_flush_kernel, kernel.mma_sync_only)),
    }

    def use(name):
        kernel._launch_due_list, kernel._launch_flush = launchers[name]

    b = leapquant.get_backend("triton")
    for rows in (8, 64):
        pool, idx = _idle_pool(dev, rows)
        print(f"rows {rows} ({kernel.schedule_for(rows, 32)} schedule), nothing due:")
        for name in ("tensors ", "address") * 3:
            use(name)
            f = measure(lambda: leapquant.flush(pool, idx, backend="triton", check=False), dev, 200, 7, 30)
            k = measure(lambda: b.flush(pool, idx), dev, 200, 7, 30)
            print(f"  {name}: flush {f['host_us']:.1f} us (wall {f['wall_us']:.1f}), "
                  f"backend {k['host_us']:.1f} us (wall {k['wall_us']:.1f})", flush=True)
        full = leapquant.Pool(2 * rows + 1, 32, gate="kda", device=dev)
        gen = torch.Generator().manual_seed(rows)
        fill(full, torch.arange(1, rows + 1), "gaussian", gen, due=torch.rand(rows, 32, generator=gen) < 0.5)
        out = []
        for name in ("tensors ", "address", "address"):
            use(name)
            p = copy.deepcopy(full)
            leapquant.flush(p, idx, backend="triton", check=False)
            torch.cuda.synchronize()
            out.append(p)
        same = all(torch.equal(a.view(torch.uint8), c.view(torch.uint8)) for p in out[1:]
                   for a, c in zip((out[0].raw, out[0].w, out[0].gbuf, out[0].pcum), (p.raw, p.w, p.gbuf, p.pcum)))
        changed = not torch.equal(out[0].raw.view(torch.uint8), full.raw.view(torch.uint8))
        print(f"  half due: bytes of address launches {'equal' if same else 'DIFFER'} to tensor launches; "
              f"the flush {'changed' if changed else 'DID NOT CHANGE'} the pool")
    print(f"kept kernels (address): flush {len(launchers['address'][1].kernels)}, "
          f"due list {len(launchers['address'][0].kernels)}")
    launch_alone(dev, launchers["address"][1])


def launch_alone(dev, la, calls: int = 2000, rounds: int = 9) -> None:
    """The kept grid-schedule flush kernel of an 8-row pool, launched with tensors and with addresses."""
    pool, idx = _idle_pool(dev, 8)
    kernel.flush_pool(pool, idx, schedule="grid")
    captured = []
    run = la.kernels[next(k for k in la.kernels if k[1 + la.names.index("LIST")] is False)]
    orig = la.__class__.__call__

    def grab(self, grid, args, options):  # the argument list flush_pool builds
        captured.append((grid, dict(args)))
    la.__class__.__call__ = grab
    try:
        kernel.flush_pool(pool, idx, schedule="grid")
    finally:
        la.__class__.__call__ = orig
    grid, args = captured[0]
    tensors = [args[n] for n in la.names]
    addresses = [a.data_ptr() if isinstance(a, torch.Tensor) else a for a in tensors]
    launch = run[tuple(grid) + (1,) * (3 - len(grid))]
    times = {"tensors ": [], "address": []}
    for _ in range(rounds):
        for name, values in (("tensors ", tensors), ("address", addresses)):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(calls):
                launch(*values)
            times[name].append((time.perf_counter() - t0) / calls * 1e6)
    torch.cuda.synchronize()
    for name, t in times.items():
        print(f"launch alone, {name}: median {statistics.median(t):.2f} us, min {min(t):.2f} us "
              f"({rounds} rounds of {calls}, alternating)")


if __name__ == "__main__":
    main(sys.argv[1])
