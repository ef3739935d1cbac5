"""What the Triton kernel does with an idx that flush(check=False) used to pass unchecked (CPU interpreter).

    TRITON_INTERPRET=1 PYTHONPATH=$PWD python bench/experiments/strided_idx.py

The backend's own ``flush`` (no interface checks) is given a strided int32 view and an int64 tensor. The kernels read
``idx`` as consecutive words of its element type: the strided view [3, 7] of [3, 5, 7, 2] flushes slots 3 and 5,
not 7; an int64 idx is read as int64 (Triton specialises the pointer type), so it flushes the right slots.
"""

import torch

import leapquant
from leapquant.workloads import fill


def flushed(idx: torch.Tensor, slots) -> list:
    pool = leapquant.Pool(9, 2, gate="gdn")
    fill(pool, torch.arange(1, 9), "gaussian", torch.Generator().manual_seed(1))
    leapquant.get_backend("triton").flush(pool, idx)
    return [(s, bool((pool.w[s] == 0).all())) for s in slots]


if __name__ == "__main__":
    view = torch.tensor([3, 5, 7, 2], dtype=torch.int32)[::2]
    print(f"strided int32 view {view.tolist()}: flushed {flushed(view, (3, 5, 7))}")
    wide = torch.tensor([3, 7], dtype=torch.int64)
    print(f"int64 {wide.tolist()}: flushed {flushed(wide, (3, 5, 7))}")
