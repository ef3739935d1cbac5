"""The compact layout (SPEC §2): ``Pool(..., layout="compact")`` holds the same checkpoints back to back, and every
backend that takes it computes what it computes on the engine layout.

Each case builds a compact pool whose every byte is random first (the poison), fills the programs under test with
valid checkpoints and rings through the views, and an engine-layout **twin** with the same contents: its own random
bytes, then every checkpoint field and ring tensor copied through the views. The same call on both must store the same
bytes in every view (the arithmetic does not see the layout; only the addresses differ), and on the compact pool
nothing outside the called programs' checkpoints and ring rows may change (``parity.untouched_failures``, whose mask
is the layout's). The reference is the oracle for the Triton flush (SPEC §4, ``parity.measure``), step (SPEC §6, the
checks of ``test_triton_step``) and states (SPEC §5.1). On a machine without CUDA the kernels run in Triton's
interpreter: few slots and heads.
"""

from __future__ import annotations

import zlib

import pytest
import torch

import leapquant
from leapquant import parity
from leapquant import formulas as ref
from leapquant.constants import BASE_WORDS
from leapquant.memory import formats

from .strategies import reloaded
from .test_triton_kernel import _fill_program, _randomise

triton = pytest.importorskip("triton")

from leapquant_triton.backend import TritonBackend  # noqa: E402
from leapquant_triton.flush import flush_pool  # noqa: E402
from leapquant_triton.step import step_pool  # noqa: E402

from . import test_triton_step as ts  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TRITON_OK = TritonBackend().supports(leapquant.Pool(2, 1, 64, 64, 8, 1, device=DEVICE, layout="compact"))[0]
needs_triton = pytest.mark.skipif(not TRITON_OK, reason="Triton backend cannot run here (needs CUDA or the interpreter)")

VIEWS = ("codes", "s_k", "s_v", "s_kv", "uq", "u", "q", "codes32")
RINGS = ("kbuf", "ubuf", "w", "pcum", "gbuf", "hcnt")


def _seed(*key) -> int:
    return zlib.crc32(repr(key).encode()) % 10_000


def _compact(num_slots, heads, K, V, L, R, gate, convention="vllm", seed=0):
    """A poisoned compact pool and its generator."""
    g = torch.Generator().manual_seed(seed)
    pool = leapquant.Pool(num_slots, heads, K, V, L, R, gate=gate, convention=convention, device=DEVICE,
                          layout="compact")
    _randomise(pool, g)
    return pool, g


def _twin(pool, layout: str = "engine", seed: int = 12345) -> leapquant.Pool:
    """A pool of ``layout`` with ``pool``'s contents: its own random bytes in ``raw`` (so its spare heads and the rest
    of its regions are garbage of their own), then every checkpoint field and ring tensor copied through the views."""
    g = torch.Generator().manual_seed(seed)
    twin = leapquant.Pool(pool.num_slots, pool.heads, pool.head_k, pool.head_v, pool.ring, pool.rank, gate=pool.gate,
                          convention=pool.convention, device=DEVICE, iters=pool.iters, layout=layout)
    b = twin.raw.view(torch.uint8)
    b.copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8, generator=g).to(b.device))
    for name in ("codes", "s_kv", "uq") + RINGS:
        src = getattr(pool, name)
        if src is not None:
            getattr(twin, name).view(torch.uint8).copy_(src.view(torch.uint8))
    return twin


def _same_contents(a, b) -> list[str]:
    """The views and ring tensors whose bytes differ between ``a`` and ``b`` (two layouts: raw itself is not
    compared)."""
    bad = []
    for name in VIEWS + RINGS:
        x, y = getattr(a, name), getattr(b, name)
        if x is None:
            continue
        if not torch.equal(parity.as_bytes(x), parity.as_bytes(y)):
            bad.append(name)
    return bad


def _due_pairs(pool, idx_t):
    rows, heads = pool.due(idx_t).cpu().nonzero(as_tuple=True)
    return idx_t.cpu().long()[rows], heads


# --- the layout itself -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("K,V,R", [(128, 128, 4), (64, 64, 1), (128, 64, 3)])
def test_addresses_and_allocation(K, V, R):
    """Checkpoint (n, h) starts at byte 4 OFF + (n HV + h) C, C = V K + 4K + 4V + 2R(K + V) rounded up to 128 (19,456
    at K = V = 128, R = 4); its fields in the engine layout's order; raw holds nothing else. Bytes per sequence match
    what ``python -m leapquant info`` reports (leapquant.memory)."""
    NS, HV = 3, 5
    pool = leapquant.Pool(NS, HV, K, V, 16, R, device=DEVICE, layout="compact")
    C = -(-(V * K + 4 * K + 4 * V + 2 * R * (K + V)) // 128) * 128
    if (K, V, R) == (128, 128, 4):
        assert C == 19456
    assert pool.raw.numel() * 4 == 4 * BASE_WORDS + NS * HV * C
    base = pool.raw.data_ptr() + 4 * BASE_WORDS
    for n, h in [(0, 0), (1, 3), (2, HV - 1)]:
        start = base + (n * HV + h) * C
        assert pool.codes[n, h].data_ptr() == start
        assert pool.codes32[n, h].data_ptr() == start
        assert pool.s_k[n, h].data_ptr() == pool.s_kv[n, h].data_ptr() == start + V * K
        assert pool.s_v[n, h].data_ptr() == start + V * K + 4 * K
        assert pool.uq[n, h].data_ptr() == pool.u[n, h].data_ptr() == start + V * K + 4 * K + 4 * V
        assert pool.q[n, h].data_ptr() == start + V * K + 4 * K + 4 * V + 2 * K
        assert pool.uq[n, h, R - 1, -1].data_ptr() + 2 == start + V * K + 4 * K + 4 * V + 2 * R * (K + V)
    # the memory table: per sequence, the compact checkpoints plus every ring tensor's bytes per slot
    rings = sum(t[0].numel() * t.element_size() for t in (pool.kbuf, pool.ubuf, pool.w, pool.pcum, pool.gbuf,
                                                            pool.hcnt))
    table = {f.name: f.per_sequence for f in formats(HV, K, V, 16, R, "kda")}
    assert table["LeapQuant, compact layout"] == (pool.raw.numel() * 4 - 4 * BASE_WORDS) // NS + rings
    engine = leapquant.Pool(NS, HV, K, V, 16, R, device=DEVICE, layout="engine")
    assert table["LeapQuant, engine layout"] == (engine.raw.numel() * 4 - 4 * BASE_WORDS) // NS + rings
    # a new compact pool holds the same zero states as a new engine pool
    assert _same_contents(pool, engine) == []


def test_construction_checks():
    """An unknown layout is refused; ``from_tensors`` takes the layout and refuses a raw of the wrong length for it
    (too short, or the other layout's), never growing the caller's storage."""
    with pytest.raises(ValueError, match="layout must be"):
        leapquant.Pool(3, 2, 64, 64, 8, 2, layout="dense")
    pool = leapquant.Pool(3, 2, 64, 64, 8, 2, layout="compact")
    engine = leapquant.Pool(3, 2, 64, 64, 8, 2, layout="engine")
    geo = dict(num_slots=3, heads=2, head_k=64, head_v=64, ring=8, rank=2, gate="kda")
    parts = dict(kbuf=pool.kbuf, ubuf=pool.ubuf, w=pool.w, pcum=pool.pcum, gbuf=pool.gbuf, hcnt=pool.hcnt,
                 q0=pool.q0)
    back = leapquant.Pool.from_tensors(pool.raw, **parts, **geo, layout="compact")
    assert back.layout == "compact" and back.codes.data_ptr() == pool.codes.data_ptr()
    assert back.codes.stride() == pool.codes.stride()
    for raw, layout in [(pool.raw[:-4], "compact"), (pool.raw.clone()[: pool.raw.numel() - 1], "compact"),
                        (engine.raw.clone(), "compact"), (pool.raw, "engine")]:
        n = raw.untyped_storage().nbytes()
        with pytest.raises(ValueError, match=r"\braw must hold"):
            leapquant.Pool.from_tensors(raw, **parts, **geo, layout=layout)
        assert raw.untyped_storage().nbytes() == n
    with pytest.raises(ValueError, match="layout must be"):
        leapquant.Pool.from_tensors(pool.raw, **parts, **geo, layout="dense")


@pytest.mark.parametrize("how", ["pickle", "torch.save weights_only", "deepcopy"])
def test_pickled_compact_pool_aliases_raw(how):
    """A compact pool comes back compact, its views aliasing the loaded raw with the compact strides, and a flush of
    it stores what a flush of the original stores."""
    pool, g = _compact(4, 2, 64, 64, 8, 2, "gdn", seed=3)
    for s, h in [(1, 0), (2, 1)]:
        _fill_program(pool, s, h, g)
    back = reloaded(pool, how)
    assert back.layout == "compact" and back.raw.numel() == pool.raw.numel()
    st = back.raw.untyped_storage().data_ptr()
    for name in VIEWS:
        v = getattr(back, name)
        assert v.untyped_storage().data_ptr() == st and v.stride() == getattr(pool, name).stride(), name
    assert back.raw.data_ptr() != pool.raw.data_ptr()
    start = parity.snapshot(pool)
    idx = torch.tensor([1, 2], dtype=torch.int32, device=DEVICE)
    leapquant.flush(pool, idx, backend="reference")
    leapquant.flush(back, idx, backend="reference", check=False)
    a, b = parity.snapshot(pool), parity.snapshot(back)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["raw"], start["raw"]), "the flush stored nothing"


def test_tilelang_takes_both_layouts():
    """TileLang builds the layout's strides into its kernel (test_tilelang_compile: the addresses are all that
    changes), so its requirements take both layouts; where it cannot run, the reason is the machine, not the
    layout."""
    from leapquant_tilelang.backend import TileLangBackend

    backend = TileLangBackend()
    for layout in ("engine", "compact"):
        pool = leapquant.Pool(2, 32, layout=layout)
        assert backend.requirements.check_layout(pool) == (True, "ok")
        ok, why = backend.supports(pool)
        assert ok or "layout" not in why, why


def test_compiled_flush_of_a_compact_pool():
    """Under torch.compile the custom op rebuilds the pool in its layout: the bytes of an eager flush."""
    pool, g = _compact(4, 2, 64, 64, 8, 2, "kda", seed=9)
    for s, h in [(1, 0), (3, 1)]:
        _fill_program(pool, s, h, g)
    twin = _twin(pool, "compact")
    idx = torch.tensor([1, 3], dtype=torch.int32, device=DEVICE)

    @torch.compile(backend="eager", fullgraph=True)
    def go(i):
        leapquant.flush(pool, i, backend="reference", check=True)

    go(idx)
    leapquant.flush(twin, idx, backend="reference")
    assert _same_contents(pool, twin) == []


# --- the reference flush -----------------------------------------------------------------------------------------

REF_CASES = [(gate, conv, K, V) for gate in ("kda", "gdn") for conv in ("vllm", "sglang")
             for K, V in ((64, 64), (128, 64), (64, 128), (128, 128))]


@pytest.mark.parametrize("gate,convention,K,V", REF_CASES, ids=[f"{g}-{c}-K{k}V{v}" for g, c, k, v in REF_CASES])
def test_reference_flush_compact_equals_engine(gate, convention, K, V):
    """Rows: two due slots (one with a head not due), padding, a repeated slot, and a due slot no row names: the
    compact pool stores, view for view, the engine twin's bytes; outside the due programs' checkpoints and ring rows
    no byte of the compact pool changes, and their rings are reset."""
    HV, R, L = 3, (K + V) // 64, 8
    pool, g = _compact(5, HV, K, V, L, R, gate, convention, seed=_seed(gate, convention, K, V))
    for s, h in [(1, 0), (1, 2), (3, 0), (3, 1), (3, 2), (4, 1)]:
        _fill_program(pool, s, h, g)
    pool.hcnt[1, 1] = L - 1  # not due
    twin = _twin(pool)
    pad = 0 if convention == "vllm" else -1
    idx = torch.tensor([3, pad, 1, 3, pad], dtype=torch.int32, device=DEVICE)
    s, h = _due_pairs(pool, idx)
    assert set(zip(s.tolist(), h.tolist())) == {(1, 0), (1, 2), (3, 0), (3, 1), (3, 2)}
    before = parity.snapshot(pool)
    leapquant.flush(pool, idx, backend="reference", check=False)
    leapquant.flush(twin, idx, backend="reference", check=False)
    assert _same_contents(pool, twin) == []
    assert parity.untouched_failures(pool, before, s, h) == []
    changed = (before["raw"] != parity.as_bytes(pool.raw)).sum()
    assert int(changed) > 0, "the flush stored nothing"


# --- the Triton flush --------------------------------------------------------------------------------------------

FLUSH_CASES = [
    # schedule, gate, convention, K, V, R, L
    ("grid", "kda", "vllm", 64, 64, 2, 8),
    ("list", "kda", "sglang", 128, 64, 4, 16),
    ("grid", "gdn", "sglang", 64, 128, 3, 8),
    ("list", "gdn", "vllm", 64, 64, 1, 32),
]


@needs_triton
@pytest.mark.parametrize("schedule,gate,convention,K,V,R,L", FLUSH_CASES,
                         ids=[f"{c[0]}-{c[1]}-{c[2]}-K{c[3]}V{c[4]}" for c in FLUSH_CASES])
def test_triton_flush_compact(schedule, gate, convention, K, V, R, L):
    """SPEC §4 against the reference (parity.measure: accuracy, untouched bytes, resets) on the compact pool, for
    both schedules; and the kernel stores on the compact pool exactly the bytes it stores on the engine twin."""
    HV = 2
    pool, g = _compact(5, HV, K, V, L, R, gate, convention, seed=_seed(schedule, gate, K, V))
    for s, h in [(1, 0), (1, 1), (2, 1), (4, 0)]:
        _fill_program(pool, s, h, g)
    twin = _twin(pool)
    pad = 0 if convention == "vllm" else -1
    idx = torch.tensor([2, pad, 1, 3], dtype=torch.int32, device=DEVICE)  # slot 4 is due but named by no row
    s, h = _due_pairs(pool, idx)
    assert sorted(zip(s.tolist(), h.tolist())) == [(1, 0), (1, 1), (2, 1)]
    p = parity.measure(pool, idx, "triton", flush_fn=lambda p_, i_: flush_pool(p_, i_, schedule=schedule))
    assert p.count == 3 and p.ok(), p.failures()
    flush_pool(twin, idx, schedule=schedule)
    assert _same_contents(pool, twin) == []


# --- the Triton step ---------------------------------------------------------------------------------------------

STEP_CASES = [
    # gate, K, V, L, R, HV, H, convention, dtype, l2norm, layout of the tokens
    ("kda", 64, 64, 8, 2, 2, 1, "vllm", torch.float32, False, "padded"),
    ("gdn", 128, 64, 16, 3, 2, 2, "sglang", torch.bfloat16, True, "contiguous"),
    ("kda", 128, 128, 16, 4, 2, 1, "vllm", torch.float16, False, "heads_first"),  # the Gluon kernel's shape
]


@needs_triton
@pytest.mark.parametrize("kernel", ts.KERNEL_PARAMS)
@pytest.mark.parametrize("gate,K,V,L,R,HV,H,convention,dtype,l2,layout", STEP_CASES,
                         ids=[f"{c[0]}-K{c[1]}V{c[2]}-{c[7]}" for c in STEP_CASES])
def test_triton_step_compact(gate, K, V, L, R, HV, H, convention, dtype, l2, layout, kernel):
    """The step on a compact pool (rings at every fill, one full: flushed inside) against the reference's step, as
    ``test_triton_step`` judges it (out, ring, untouched bytes), and byte for byte what it does on the engine twin:
    the same output and the same views."""
    pool, g = ts._case(gate, K, V, L, R, HV, convention, seed=_seed(gate, K, V, True if kernel == "fma" else None), counts=[0, L // 2, L - 1, L],
                       layout="compact")
    assert pool.layout == "compact"
    pad = 0 if convention == "vllm" else -1
    idx = [2, pad, 3, 5, 1, -7]
    twin = _twin(pool)
    gt = torch.Generator().manual_seed(_seed("tokens", gate))
    before, A, B, tok, idx_t, out_ref, out = ts._run_step(pool, idx, H, dtype, l2, layout, gt, kernel=kernel)
    assert A.layout == B.layout == "compact"
    assert ts._check(before, A, B, tok, idx_t, out_ref, out, l2) == 3 * HV
    ts._measure_flush(pool, idx_t)
    out_e = torch.full_like(out, float("nan"))
    step_pool(twin, idx_t, **tok, scale=0.3, use_qk_l2norm=l2, out=out_e, kernel=kernel)
    assert torch.equal(parity.as_bytes(out_e), parity.as_bytes(out))
    assert _same_contents(B, twin) == []


# --- the Triton states and load_states ----------------------------------------------------------------------------


@needs_triton
@pytest.mark.parametrize("gate,K,V,R,L", [("kda", 64, 64, 2, 8), ("gdn", 128, 64, 3, 16)])
def test_triton_states_compact(gate, K, V, R, L):
    """``states`` of a compact pool agrees with the reference (SPEC §5.1: 1e-6 relative, 2^-20 of the peak per
    element) and equals the engine twin's bit for bit; ``load_states`` meets SPEC §4 against the float64 model with
    nothing written outside the loaded slots' checkpoints and ring rows (``parity.measure_load_states``), and stores
    the twin's bytes."""
    pool, g = _compact(5, 2, K, V, L, R, gate, seed=_seed("states", gate))
    for s in (1, 2, 3):
        for h in range(2):
            _fill_program(pool, s, h, g)
    twin = _twin(pool)
    slots = torch.tensor([3, 1, 2], dtype=torch.int32, device=DEVICE)
    before = parity.snapshot(pool)
    want = pool.states(slots, backend="reference").cpu().double()
    got = pool.states(slots, backend="triton").cpu().double()
    assert float(ref.relative_error(got, want).max()) < 1e-6
    assert bool(((got - want).abs() <= 2.0**-20 * want.abs().amax(dim=(-2, -1), keepdim=True)).all())
    assert torch.equal(twin.states(slots, backend="triton").cpu().double(), got)
    after = parity.snapshot(pool)
    assert all(torch.equal(before[k], after[k]) for k in before), "states wrote into the pool"
    S = (got.float() * 1.5).transpose(-1, -2).contiguous().to(DEVICE)  # FLA's [n, HV, K, V]
    load = torch.tensor([2, 4], dtype=torch.int32, device=DEVICE)
    p = parity.measure_load_states(pool, load, S[:2], "triton", state_v_first=False)
    assert p.count == 4 and p.ok(), p.failures()
    twin.load_states(load, S[:2], backend="triton", state_v_first=False)
    assert _same_contents(pool, twin) == []
