"""A pool on the second GPU, flushed while the first is the current device (two or more CUDA devices only).

An engine process that holds pools on several GPUs (or a test harness) need not make each one current before it
flushes: ``leapquant.flush`` and the custom op make the pool's GPU current around the backend's launches. Without that,
Triton refuses the launch and the reference backend's torch code faults with an illegal memory access.
Each case flushes the pool with ``cuda:0`` current, and a twin with ``cuda:1`` current, and compares them bit for bit.
"""

import copy

import pytest
import torch

import leapquant
from leapquant.ops import op_args
from leapquant.tools.workloads import fill

from .conftest import backends_here

if not (torch.cuda.is_available() and torch.cuda.device_count() >= 2):
    pytest.skip("needs two CUDA devices", allow_module_level=True)
BACKENDS = backends_here("cuda")


def _state(pool):
    return [pool.raw, pool.w, pool.pcum, pool.hcnt] + ([pool.gbuf] if pool.gbuf is not None else [])


@pytest.mark.parametrize("path", ["flush", "flush-check", "op"])
@pytest.mark.parametrize("gate", ["kda", "gdn"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_pool_on_a_gpu_that_is_not_current(backend, gate, path):
    dev = torch.device("cuda", 1)
    with torch.cuda.device(dev):  # everything but the flush under test with the pool's GPU current
        pool = leapquant.Pool(12, 32, gate=gate, device=dev)
        gen = torch.Generator().manual_seed(33)
        fill(pool, torch.arange(1, 12), "gaussian", gen, due=torch.rand(11, 32, generator=gen) < 0.5)
        idx = torch.tensor([3, 0, 7, 1, 9, 0, 11, 5], dtype=torch.int32, device=dev)
        due = pool.due(idx)
        assert bool(due.any()), "the case must flush something"
        twin = copy.deepcopy(pool)
        leapquant.flush(twin, idx, backend=backend)
        torch.cuda.synchronize(dev)

    with torch.cuda.device(0):
        if path == "op":
            torch.ops.leapquant.flush(*op_args(pool, idx, backend))
        else:
            leapquant.flush(pool, idx, backend=backend, check=path == "flush-check")
        assert torch.cuda.current_device() == 0, "the flush left another device current"

    with torch.cuda.device(dev):
        torch.cuda.synchronize(dev)
        for a, b in zip(_state(pool), _state(twin)):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), (backend, gate, path)
        rows = idx.long()[:, None].expand_as(due)[due], torch.arange(32, device=dev).expand_as(due)[due]
        assert bool((pool.w[rows] == 0).all()), "the due programs were not flushed"


@pytest.mark.skipif("triton" not in BACKENDS, reason="the Triton backend is not available here")
def test_triton_backend_refuses_a_pool_off_the_current_gpu():
    """The Triton backend's own ``flush`` (what ``leapquant.flush`` calls after making the pool's GPU current), given a
    pool on ``cuda:1`` while ``cuda:0`` is current, raises a ValueError and writes nothing, also after a flush of the same
    shape on ``cuda:0``: direct launches pass addresses, which Triton's launcher does not check, so
    leapquant_triton/launcher.py checks the tensors' device itself (for a prepared launch, the static tensors' device
    against the current one). The GPUs stay usable: no kernel ran on another device's memory."""
    dev = torch.device("cuda", 1)
    b = leapquant.get_backend("triton")
    with torch.cuda.device(dev):
        pool = leapquant.Pool(12, 32, gate="kda", device=dev)
        gen = torch.Generator().manual_seed(34)
        fill(pool, torch.arange(1, 12), "gaussian", gen, due=torch.rand(11, 32, generator=gen) < 0.5)
        idx = torch.tensor([3, 0, 7, 1, 9, 0, 11, 5], dtype=torch.int32, device=dev)
        assert bool(pool.due(idx).any())
        before = [t.clone() for t in _state(pool)]
    with torch.cuda.device(0):
        leapquant.flush(leapquant.Pool(12, 32, gate="kda", device="cuda:0"),
                        torch.tensor([3, 0, 7, 1, 9, 0, 11, 5], dtype=torch.int32, device="cuda:0"),
                        backend="triton")  # kernels kept on cuda:0 for this shape
        with pytest.raises(ValueError, match=r"on (cuda:1|device\(s\) \[1\]), but the current device is 0"):
            b.flush(pool, idx)
        torch.cuda.synchronize(0)
    with torch.cuda.device(dev):
        torch.cuda.synchronize(dev)
        for a, c in zip(_state(pool), before):
            assert torch.equal(a.view(torch.uint8), c.view(torch.uint8))
