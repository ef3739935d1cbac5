"""``Pool.copy_slots(src, dst)`` (SPEC §5.3): slot ``src[i]``'s checkpoints, rings, ``pcum`` and ``hcnt`` into slot
``dst[i]``, bit for bit, every value read before any is written; nothing else written.

Pools are poisoned first (every byte random, NaN payloads included: they must travel as bits), in both layouts (the
engine layout's region tails and spare heads must stay as they were), both gates and both slot conventions. The
expected pool is computed independently of the implementation: per (slot, head) byte ranges of ``raw``
(``Pool.checkpoint_mask``) and the ring tensors' rows. ``graph`` is the path without host synchronisation (CUDA's),
taken on the CPU.
"""

from __future__ import annotations

import pytest
import torch

import leapquant
from leapquant import parity
from leapquant.tools.workloads import fill

from .strategies import random_bits

PATHS = ["exact", "graph", "triton"]
# on a GPU the pools live there (both variants then take the path without synchronisation, CUDA's)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
RINGS = ("kbuf", "ubuf", "w", "pcum", "gbuf", "hcnt")


def _t(*values, dtype=torch.int64):
    return torch.tensor(values, dtype=dtype, device=DEVICE)


def _path(path: str, monkeypatch) -> str:
    """The backend of a test's copies: ``triton`` the Triton backend's kernels (under the interpreter on the CPU), the
    others the step's backend here (the reference's torch form on the CPU, with or without host reads)."""
    if path == "graph":
        import leapquant.pool as pool_module

        monkeypatch.setattr(pool_module, "_without_sync", lambda pool: True)
    if path == "triton":
        pytest.importorskip("triton")
        from leapquant_triton.backend import TritonBackend

        if not TritonBackend().available()[0]:
            pytest.skip(TritonBackend().available()[1])
        return "triton"
    return "auto"


def _poisoned(gate="kda", convention="vllm", layout="engine", num_slots=7, heads=3, seed=0) -> leapquant.Pool:
    pool = leapquant.Pool(num_slots, heads, 64, 64, 8, 2, gate=gate, convention=convention, layout=layout,
                          device=DEVICE)
    gen = torch.Generator().manual_seed(seed)
    for name in parity.POOL_TENSORS:
        if getattr(pool, name) is not None:
            random_bits(getattr(pool, name), gen)
    return pool


def _expected(pool: leapquant.Pool, before: dict, src: list[int], dst: list[int]) -> dict:
    """The snapshot a copy of ``src[i] -> dst[i]`` must leave, from the snapshot ``before``: each dst head's checkpoint
    bytes and ring rows those of its src, read from ``before`` (so a permutation moves old values)."""
    g = pool.geometry
    want = {n: b.clone() for n, b in before.items()}
    raw = want["raw"].view(-1)
    for s, d in zip(src, dst):
        for h in range(g.heads):
            a = 4 * (pool.base + s * g.slot_stride + h * g.head_stride)
            b = 4 * (pool.base + d * g.slot_stride + h * g.head_stride)
            raw[b:b + g.checkpoint_bytes] = before["raw"].view(-1)[a:a + g.checkpoint_bytes]
        for name in RINGS:
            if name in want:
                t = getattr(pool, name)
                rows = want[name].view(t.shape[0], -1)
                rows[d] = before[name].view(t.shape[0], -1)[s]
    return want


def _differs(pool: leapquant.Pool, want: dict) -> list[str]:
    got = parity.snapshot(pool)
    return [n for n in want if not torch.equal(got[n], want[n])]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("convention", ["vllm", "sglang"])
@pytest.mark.parametrize("gate", ["kda", "gdn"])
@pytest.mark.parametrize("layout", ["engine", "compact"])
def test_copies_bit_for_bit(layout, gate, convention, path, monkeypatch):
    """A permutation of three slots, one slot fanned out to two others, a slot copied onto itself: every dst holds its
    src's old bytes, every other byte (other slots, an engine region's tail and spare head, the OFF prefix, q0) as
    it was. Tensors of int32 and int64, on the pool's device, and Python lists, with and without check."""
    backend = _path(path, monkeypatch)
    pool = _poisoned(gate, convention, layout, seed=3 + (gate == "gdn"))
    f = pool.first_slot
    src = [f + 1, f + 2, f, f + 4, f + 4, f + 3]
    dst = [f + 2, f, f + 1, f + 5, f + 3, f + 4]  # a 3-cycle; f + 4 out to f + 5 and into f + 3, f + 3 into f + 4
    q0 = pool.q0.clone()
    for kind in ("list", "int32", "int64"):
        before = parity.snapshot(pool)
        want = _expected(pool, before, src, dst)
        if kind == "list":
            pool.copy_slots(src, dst, backend=backend)
        else:
            dtype = torch.int32 if kind == "int32" else torch.int64
            pool.copy_slots(torch.tensor(src, dtype=dtype, device=DEVICE), torch.tensor(dst, dtype=dtype, device=DEVICE),
                            check=kind == "int64", backend=backend)
        assert _differs(pool, want) == [], kind
        assert torch.equal(pool.q0, q0)
    pool.copy_slots([f + 1], [f + 1], backend=backend)  # onto itself: nothing changes
    assert _differs(pool, parity.snapshot(pool)) == []


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("convention", ["vllm", "sglang"])
def test_skipped_pairs_without_check(convention, path, monkeypatch):
    """With ``check=False`` a pair whose src or dst is not a real slot (padding, the null slot, past the pool) is
    skipped; the others are copied as if alone. With no pair left nothing is written at all."""
    backend = _path(path, monkeypatch)
    pool = _poisoned(convention=convention, seed=8)
    pad = 0 if convention == "vllm" else -1
    src = torch.tensor([2, pad, 3, 1, 9], dtype=torch.int32, device=DEVICE)
    dst = torch.tensor([4, 5, pad, 3, 6], dtype=torch.int32, device=DEVICE)
    want = _expected(pool, parity.snapshot(pool), [2, 1], [4, 3])
    pool.copy_slots(src, dst, check=False, backend=backend)
    assert _differs(pool, want) == []
    before = parity.snapshot(pool)
    pool.copy_slots(torch.tensor([pad, 7], device=DEVICE), torch.tensor([1, 2], device=DEVICE), check=False,
                    backend=backend)
    empty = torch.tensor([], dtype=torch.int32, device=DEVICE)
    pool.copy_slots(empty, empty, check=False, backend=backend)
    assert _differs(pool, before) == []


@pytest.mark.parametrize("gate", ["kda", "gdn"])
def test_kernel_gives_a_destination_named_twice_its_first_copy(gate, monkeypatch):
    """The Triton kernels, ``check=False``: a ``dst`` named twice gets the first of its copies, whole (no mix of the
    two sources' words); the pair after it is copied as if alone."""
    backend = _path("triton", monkeypatch)
    pool = _poisoned(gate, seed=12)
    want = _expected(pool, parity.snapshot(pool), [1, 5], [3, 2])
    pool.copy_slots(_t(1, 4, 5, dtype=torch.int32), _t(3, 3, 2, dtype=torch.int32), check=False, backend=backend)
    assert _differs(pool, want) == []


@pytest.mark.parametrize("gate", ["kda", "gdn"])
def test_prefix_reuse(gate):
    """What copy_slots is for: a sequence's state at a block boundary, a forced flush then a copy into a new slot
    (its checkpoint alone is the state); the copy then decodes exactly as the original: the same tokens give the same
    outputs and the same bytes in both slots, through a later full-ring flush."""
    pool = leapquant.Pool(5, 2, 64, 64, 8, 2, gate=gate, device=DEVICE)
    gen = torch.Generator().manual_seed(12)
    fill(pool, [1], "gaussian", gen)
    pool.hcnt[1] = 3  # a ring partly filled: three tokens since the last flush

    def tokens(B):
        t = dict(q=torch.randn(B, 2, 64, generator=gen),
                 k=torch.nn.functional.normalize(torch.randn(B, 2, 64, generator=gen), dim=-1),
                 v=torch.randn(B, 2, 64, generator=gen),
                 g=-0.1 * torch.rand(*((B, 2, 64) if gate == "kda" else (B, 2)), generator=gen),
                 beta=torch.rand(B, 2, generator=gen))
        return {n: x.to(DEVICE) for n, x in t.items()}

    leapquant.flush(pool, _t(1, dtype=torch.int32), force=True)
    pool.copy_slots([1], [3])
    idx = _t(1, 3, dtype=torch.int32)
    for _ in range(11):  # past the next full ring of 8
        t = tokens(1)
        o = leapquant.step(pool, idx, **{n: x.expand(2, *x.shape[1:]) for n, x in t.items()})
        assert torch.equal(o[0], o[1])
    snap = parity.snapshot(pool)
    for name in RINGS:
        if name in snap:
            rows = snap[name].view(pool.num_slots, -1)
            assert torch.equal(rows[1], rows[3]), name
    c = pool.checkpoint([1, 3])
    for name in ("codes", "s_k", "s_v", "u", "q"):
        assert torch.equal(parity.as_bytes(c[name][0]), parity.as_bytes(c[name][1])), name


# --- bad input: a clear error, nothing written ------------------------------------------------------------------

BAD = {
    "dst the null slot": (lambda p: ([1], [0]), ValueError, r"dst names slot 0, the null slot"),
    "src the null slot": (lambda p: ([0], [2]), ValueError, r"src names slot 0, the null slot"),
    "dst twice": (lambda p: ([1, 2], [3, 3]), ValueError, r"dst names slots more than once: \[3\]"),
    "dst past the pool": (lambda p: ([1], [7]), ValueError, r"dst must lie in \[0, 7\)"),
    "src negative": (lambda p: ([-1], [2]), ValueError, r"src must lie in \[0, 7\)"),
    "lengths differ": (lambda p: ([1, 2], [3]), ValueError, r"src and dst must name as many slots"),
    "float slots": (lambda p: ([1.0], [2]), TypeError, r"src must hold Python ints"),
    "bool slots": (lambda p: ([1], [True]), TypeError, r"dst must hold Python ints"),
    "float tensor": (lambda p: (torch.tensor([1.0]), [2]), TypeError, r"src must hold integers"),
}
BAD_UNCHECKED = {
    "int16": (lambda p: (_t(1, dtype=torch.int16), _t(2)), TypeError, r"src must be int32 or int64"),
    "a list": (lambda p: ([1], _t(2)), TypeError, r"src must be a torch.Tensor with check=False"),
    "2-D": (lambda p: (_t(1)[None], _t(2)[None]), ValueError, r"src must be 1-D and contiguous"),
    "strided": (lambda p: (_t(1, 0, 2, 0)[::2], _t(3, 4)), ValueError, r"src must be 1-D and contiguous"),
    "lengths differ": (lambda p: (_t(1, 2), _t(3)), ValueError, r"src and dst must name as many slots"),
    "src inside the pool": (lambda p: (p.hcnt.view(-1)[:1], _t(2, dtype=torch.int32)), ValueError,
                            r"src and pool\.hcnt share memory"),
}


@pytest.mark.parametrize("check,case", [(True, c) for c in BAD] + [(False, c) for c in BAD_UNCHECKED],
                         ids=[f"check-{c}" for c in BAD] + [f"nocheck-{c}" for c in BAD_UNCHECKED])
def test_bad_input_is_refused(check, case):
    """A bad argument is refused before anything is written; ``check=False`` reads no value but still refuses what
    the copy could not index or would write through."""
    pool = _poisoned(seed=5 if check else 6)
    pool.hcnt.zero_()
    make, exc, words = (BAD if check else BAD_UNCHECKED)[case]
    before = parity.snapshot(pool)
    with pytest.raises(exc, match=words):
        pool.copy_slots(*make(pool), check=check)
    assert _differs(pool, before) == []


@pytest.mark.parametrize("compiler", ["eager", "aot_eager"])
@pytest.mark.parametrize("path", ["exact", "triton"])
def test_under_torch_compile(path, compiler, monkeypatch):
    """``copy_slots`` compiles with fullgraph=True into the custom op ``leapquant::copy_slots`` (``aot_eager``: through
    functionalisation, as Inductor takes it), for tensors with check=False and Python lists with check=True, and
    copies what the eager call copies; with check=True a slot out of range raises inside the compiled call and writes
    nothing."""
    backend = _path(path, monkeypatch)
    pool = _poisoned("kda", "vllm", "compact", seed=21)
    src, dst = [3, 1, 2], [1, 2, 6]  # a chain: 1 and 2 are read before they are written

    @torch.compile(backend=compiler, fullgraph=True)
    def graphed(s, d):
        pool.copy_slots(s, d, check=False, backend=backend)

    @torch.compile(backend=compiler, fullgraph=True)
    def checked():
        pool.copy_slots([4], [5], backend=backend)

    want = _expected(pool, parity.snapshot(pool), src, dst)
    graphed(_t(*src, dtype=torch.int32), _t(*dst, dtype=torch.int32))
    assert _differs(pool, want) == []
    want = _expected(pool, parity.snapshot(pool), [4], [5])
    checked()
    assert _differs(pool, want) == []

    @torch.compile(backend=compiler, fullgraph=True)
    def out_of_range(d):
        pool.copy_slots(_t(1), d, backend=backend)

    with pytest.raises(ValueError, match=r"dst must lie in \[0, 7\)"):
        out_of_range(_t(7))
    assert _differs(pool, want) == []
