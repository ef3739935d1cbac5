"""What a backend's launch does with a pool on ``cuda:1`` while ``cuda:0`` is current, without ``leapquant.flush``'s
device guard (needs two GPUs; the evidence behind the guard in ``leapquant.ops._launch``).

    PYTHONPATH=$PWD python bench/experiments/unguarded_second_gpu.py [backend ...]

Per backend, in a subprocess of its own (a fault can end the CUDA context): a pool on ``cuda:1`` is flushed by
``leapquant.get_backend(name).flush(pool, idx)`` directly, with ``cuda:0`` current, and compared bit for bit with a twin
flushed through ``leapquant.flush`` (the guard). Prints one line per backend: the error, or whether the bytes agree.
"""

import subprocess
import sys

CHILD = r"""
import copy, sys, torch, leapquant
from leapquant.workloads import fill
name = sys.argv[1]
dev = torch.device("cuda", 1)
pool = leapquant.Pool(12, 32, gate="kda", device=dev)
gen = torch.Generator().manual_seed(33)
fill(pool, torch.arange(1, 12), "gaussian", gen, due=torch.rand(11, 32, generator=gen) < 0.5)
idx = torch.tensor([3, 0, 7, 1, 9, 0, 11, 5], dtype=torch.int32, device=dev)
twin = copy.deepcopy(pool)
leapquant.flush(twin, idx, backend=name)   # guarded; also compiles on cuda:1 first
torch.cuda.synchronize(dev)
torch.cuda.set_device(0)
try:
    leapquant.get_backend(name).flush(pool, idx)   # unguarded: cuda:0 current
    torch.cuda.synchronize(dev)
    torch.cuda.synchronize(0)
    same = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
               for a, b in zip((pool.raw, pool.w, pool.gbuf), (twin.raw, twin.w, twin.gbuf)))
    print(f"{name}: no error; bytes {'equal' if same else 'DIFFER'} to the guarded flush")
except Exception as e:
    print(f"{name}: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
"""


def main(argv) -> int:
    names = argv or ["triton", "tilelang", "reference"]
    for name in names:
        try:
            r = subprocess.run([sys.executable, "-c", CHILD, name], capture_output=True, text=True, timeout=90)
        except subprocess.TimeoutExpired:
            print(f"{name}: no answer within 90 s (a hang)", flush=True)
            continue
        out = (r.stdout.strip().splitlines() or [""])[-1]
        err = (r.stderr.strip().splitlines() or [""])[-1]
        print(out if out else f"{name}: child exited {r.returncode}: {err[:200]}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
