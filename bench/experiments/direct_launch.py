"""Host time of the Triton backend's launches through Triton's argument binding against direct launches of the kept
compiled kernel (leapquant_triton/launcher.py), same process, same pool (the evidence behind the launcher).

    PYTHONPATH=$PWD python bench/experiments/direct_launch.py

KDA, 32 heads, nothing due: 8 rows (the grid schedule, one launch) and 64 rows (the list schedule: a zeroing, the due
list and the flush). Per case and path, ``bench.host_overhead.measure`` (median over rounds of back-to-back calls) of
``leapquant.flush(pool, idx, backend="triton", check=False)`` and of the backend's own ``flush``. Then, per case, the
bytes a flush of due programs leaves, bound against direct.
"""

import copy

import torch

import leapquant
from bench.host_overhead import _idle_pool, measure
from leapquant.workloads import fill
from leapquant_triton import kernel


def set_direct(on: bool) -> None:
    kernel._launch_flush.direct = on
    kernel._launch_due_list.direct = on


def main() -> None:
    dev = torch.device("cuda")
    b = leapquant.get_backend("triton")
    for rows in (8, 64):
        pool, idx = _idle_pool(dev, rows)
        print(f"rows {rows} ({kernel.schedule_for(rows, 32)} schedule), nothing due:")
        for on in (False, True, False, True):
            set_direct(on)
            f = measure(lambda: leapquant.flush(pool, idx, backend="triton", check=False), dev, 200, 7, 30)
            k = measure(lambda: b.flush(pool, idx), dev, 200, 7, 30)
            print(f"  {'direct' if on else 'bound '}: flush {f['host_us']:.1f} us (wall {f['wall_us']:.1f}), "
                  f"backend {k['host_us']:.1f} us (wall {k['wall_us']:.1f})", flush=True)
        full = leapquant.Pool(2 * rows + 1, 32, gate="kda", device=dev)
        gen = torch.Generator().manual_seed(rows)
        fill(full, torch.arange(1, rows + 1), "gaussian", gen, due=torch.rand(rows, 32, generator=gen) < 0.5)
        out = []
        p = copy.deepcopy(full)  # one pool object: its plan (session 11) keeps the kernel after the first direct run
        for on in (False, True, True):
            set_direct(on)
            for n in ("raw", "w", "gbuf", "pcum"):
                getattr(p, n).copy_(getattr(full, n))
            leapquant.flush(p, idx, backend="triton", check=False)
            torch.cuda.synchronize()
            out.append([p.raw.clone(), p.w.clone(), p.gbuf.clone(), p.pcum.clone()])
        same = all(torch.equal(a.view(torch.uint8), c.view(torch.uint8)) for o in out[1:] for a, c in zip(out[0], o))
        print(f"  half due: bytes of direct launches {'equal' if same else 'DIFFER'} to bound ones")
    set_direct(True)
    print(f"pools with plans: {len(kernel._PLANS)}")


if __name__ == "__main__":
    main()
