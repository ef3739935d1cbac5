"""CUDA-graph capture and replay of ``flush(check=False)`` (ordinary and forced) for every backend available on the
GPU, and of ``Pool.copy_slots(check=False)``.

Only generated where CUDA is present (the parameter list is empty elsewhere). The captured graph must follow what
``idx`` and ``hcnt`` hold at replay time, not at capture time: the test changes both in place between replays and
compares each replay with an eager flush of a twin pool, bit for bit.
"""

import copy

import pytest
import torch

import leapquant
from leapquant.tools.workloads import fill

from .conftest import backends_here

CUDA_BACKENDS = backends_here("cuda") if torch.cuda.is_available() else ["none"]
# the Triton backend's second schedule (a due list first; the default from 2,048 programs up) at this small size too
if "triton" in CUDA_BACKENDS:
    CUDA_BACKENDS = CUDA_BACKENDS + ["triton:list"]
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")


def _state(pool):
    return [pool.raw, pool.w, pool.pcum, pool.hcnt] + ([pool.gbuf] if pool.gbuf is not None else [])


@pytest.mark.parametrize("gate", ["kda", "gdn"])
@pytest.mark.parametrize("backend", CUDA_BACKENDS)
def test_graph_capture_and_replay(backend, gate, monkeypatch):
    if backend == "triton:list":
        import leapquant_triton.flush as triton_flush

        monkeypatch.setattr(triton_flush, "schedule_for", lambda rows, heads: "list")
        backend = "triton"
    pool = leapquant.Pool(12, 32, gate=gate, device="cuda")
    gen = torch.Generator().manual_seed(21)
    fill(pool, torch.arange(1, 12), "gaussian", gen, due=torch.rand(11, 32, generator=gen) < 0.5)
    if not leapquant.get_backend(backend).supports(pool)[0]:
        pytest.fail(f"{backend} is available on this GPU but does not support the default pool")
    idx = torch.tensor([3, 0, 7, 1, 9, 0, 11, 5], dtype=torch.int32, device="cuda")
    leapquant.flush(pool, idx, backend=backend)  # warm-up: compile outside the capture
    fill(pool, torch.arange(1, 12), "gaussian", gen, due=torch.rand(11, 32, generator=gen) < 0.5)
    start = copy.deepcopy(pool)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        leapquant.flush(pool, idx, backend=backend, check=False)
    # capture records the launches; restore the state, then replay three times with new idx / due patterns
    for a, b in zip(_state(pool), _state(start)):
        a.copy_(b)
    for step in range(3):
        twin = copy.deepcopy(pool)
        due = pool.due(idx)
        assert bool(due.any()), "the case must flush something"
        graph.replay()
        leapquant.flush(twin, idx, backend=backend, check=False)
        torch.cuda.synchronize()
        for a, b in zip(_state(pool), _state(twin)):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), (backend, step)
        rows = idx.long()[:, None].expand_as(due)[due], torch.arange(32, device="cuda").expand_as(due)[due]
        assert bool((pool.w[rows] == 0).all()), "the replay did not flush the programs due now"
        # new rows in the same idx buffer and a new due pattern: the graph must follow them
        perm = torch.randperm(11, generator=gen)[:8] + 1
        idx.copy_(perm.to(torch.int32))
        fill(pool, torch.arange(1, 12), "lowrank", gen, due=torch.rand(11, 32, generator=gen) < 0.3)


def _partial(pool, gen):
    """Fill counts anywhere in 0..L (0: nothing to flush) over the filled slots."""
    pool.hcnt[1:] = torch.randint(0, pool.ring + 1, tuple(pool.hcnt[1:].shape), generator=gen,
                                  dtype=torch.int32).to("cuda")


# (Triton's forced flush has one schedule, the grid)
FORCE_BACKENDS = [b for b in CUDA_BACKENDS if b not in ("none", "triton:list")
                  and leapquant.get_backend(b).implements("force_flush")] or ["none"]


@pytest.mark.parametrize("gate", ["kda", "gdn"])
@pytest.mark.parametrize("backend", FORCE_BACKENDS)
def test_forced_flush_capture_and_replay(backend, gate):
    """``flush(..., force=True, check=False)`` captured once follows the fill counts and ``idx`` of each replay (SPEC
    §2, "Forced flush"): every replay stores the bytes of an eager forced flush of a twin pool."""
    pool = leapquant.Pool(12, 32, gate=gate, device="cuda")
    gen = torch.Generator().manual_seed(23)
    fill(pool, torch.arange(1, 12), "gaussian", gen)
    _partial(pool, gen)
    idx = torch.tensor([3, 0, 7, 1, 9, 0, 11, 5], dtype=torch.int32, device="cuda")
    leapquant.flush(pool, idx, backend=backend, force=True)  # warm-up: compile outside the capture
    fill(pool, torch.arange(1, 12), "gaussian", gen)
    _partial(pool, gen)
    start = copy.deepcopy(pool)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        leapquant.flush(pool, idx, backend=backend, check=False, force=True)
    for a, b in zip(_state(pool), _state(start)):
        a.copy_(b)
    for step in range(3):
        twin = copy.deepcopy(pool)
        assert bool(pool.due(idx, force=True).any()), "the case must flush something"
        graph.replay()
        leapquant.flush(twin, idx, backend=backend, check=False, force=True)
        torch.cuda.synchronize()
        for a, b in zip(_state(pool), _state(twin)):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), (backend, step)
        idx.copy_((torch.randperm(11, generator=gen)[:8] + 1).to(torch.int32))
        fill(pool, torch.arange(1, 12), "lowrank", gen)
        _partial(pool, gen)


def test_copy_slots_capture_and_replay():
    """``copy_slots(src, dst, check=False)`` captured once copies what ``src`` and ``dst`` hold at each replay
    (a permutation, a fan-out, skipped pairs), as an eager copy does."""
    pool = leapquant.Pool(12, 32, device="cuda", layout="compact")
    gen = torch.Generator().manual_seed(29)
    fill(pool, torch.arange(1, 12), "gaussian", gen)
    _partial(pool, gen)
    src = torch.tensor([1, 2, 3, 4, 0], dtype=torch.int64, device="cuda")
    dst = torch.tensor([2, 3, 1, 5, 6], dtype=torch.int64, device="cuda")
    pool.copy_slots(src, dst, check=False)  # warm-up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    start = copy.deepcopy(pool)
    with torch.cuda.graph(graph):
        pool.copy_slots(src, dst, check=False)
    for a, b in zip(_state(pool) + [pool.kbuf, pool.ubuf], _state(start) + [start.kbuf, start.ubuf]):
        a.copy_(b)
    for step in range(3):
        twin = copy.deepcopy(pool)
        graph.replay()
        twin.copy_slots(src, dst, check=False)
        torch.cuda.synchronize()
        for a, b in zip(_state(pool) + [pool.kbuf, pool.ubuf], _state(twin) + [twin.kbuf, twin.ubuf]):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), step
        perm = torch.randperm(11, generator=gen)[:5] + 1
        src.copy_(perm.to("cuda"))
        dst.copy_(perm.roll(1).to("cuda"))
        src[4] = 11 + step  # past the pool from the second replay on: skipped
