"""What a backend's launch does with a pool on ``cuda:1`` while ``cuda:0`` is current, without ``leapquant.flush``'s
device guard (needs two GPUs; the evidence behind the guard in ``leapquant.ops._launch``).

    PYTHONPATH=$PWD python bench/experiments/unguarded_second_gpu.py [backend ...]

First, torch alone: a batched matmul of ``cuda:1`` tensors with ``cuda:0`` current. Then per backend, each in a
subprocess of its own (a fault can end the CUDA context): a pool on ``cuda:1``, built with ``cuda:1`` current, is
flushed by ``leapquant.get_backend(name).flush(pool, idx)`` directly with ``cuda:0`` current, and compared bit for bit
with a twin flushed with ``cuda:1`` current. One line each: the error, or whether the bytes agree.
"""

import subprocess
import sys

CHILD = r"""
import copy, sys, torch, leapquant
from leapquant.workloads import fill
name = sys.argv[1]
dev = torch.device("cuda", 1)
torch.cuda.set_device(dev)   # the pool built and a twin flushed with its own GPU current
pool = leapquant.Pool(12, 32, gate="kda", device=dev)
gen = torch.Generator().manual_seed(33)
fill(pool, torch.arange(1, 12), "gaussian", gen, due=torch.rand(11, 32, generator=gen) < 0.5)
idx = torch.tensor([3, 0, 7, 1, 9, 0, 11, 5], dtype=torch.int32, device=dev)
twin = copy.deepcopy(pool)
leapquant.flush(twin, idx, backend=name)   # also compiles on cuda:1 first
torch.cuda.synchronize(dev)
torch.cuda.set_device(0)
try:
    leapquant.get_backend(name).flush(pool, idx)   # the backend's own launch with cuda:0 current
    torch.cuda.synchronize(0)
    torch.cuda.set_device(dev)
    torch.cuda.synchronize(dev)
    same = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
               for a, b in zip((pool.raw, pool.w, pool.gbuf), (twin.raw, twin.w, twin.gbuf)))
    print(f"no error; bytes {'equal' if same else 'DIFFER'} to the flush with cuda:1 current")
except Exception as e:
    print(f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
"""

# torch alone: a batched matmul of cuda:1 tensors with cuda:0 current (what the reference backend and the pool's
# compression run), in a fresh process
TORCH_ONLY = r"""
import torch
a = torch.randn(4, 128, 128, device="cuda:1")
b = torch.randn(4, 128, 4, device="cuda:1")
torch.cuda.set_device(0)
try:
    c = a @ b
    torch.cuda.synchronize(1)
    print("torch bmm on cuda:1 with cuda:0 current: ok, max |c| %.3f" % c.abs().max().item())
except Exception as e:
    print(f"torch bmm on cuda:1 with cuda:0 current: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
"""


def _child(code: str, *args: str) -> str:
    try:
        r = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=90)
    except subprocess.TimeoutExpired:
        return "no answer within 90 s (a hang)"
    out = (r.stdout.strip().splitlines() or [""])[-1]
    if out:
        return out
    errors = [line for line in r.stderr.splitlines() if "Error" in line] or r.stderr.strip().splitlines() or [""]
    return f"child exited {r.returncode}: {errors[-1][:300]}"


def main(argv) -> int:
    print(_child(TORCH_ONLY), flush=True)
    for name in argv or ["triton", "tilelang", "reference"]:
        print(f"{name}: {_child(CHILD, name)}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
