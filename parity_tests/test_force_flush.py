"""The forced flush, ``leapquant.flush(pool, idx, force=True)`` (SPEC §2, "Forced flush"): every named ring holding an
entry is flushed, partially filled ones too, from its entries in use only; afterwards its ring is empty, its
checkpoint holds its whole state and its ``hcnt`` is L ("flushed, next entry 0").

Pools are poisoned first (random bytes everywhere, NaN and infinity included), then given valid checkpoints and
rings whose fill counts lie anywhere in 1..L, with the entries past each count poisoned again: a backend that read
them would store NaN or garbage. Each backend is judged by SPEC §4 against the reference on the entries in use
(``parity.measure(..., force=True)``); the reference itself against its definition (``formulas``), bit for bit. The
Triton kernel runs through its interpreter on the CPU (its forced flush has one schedule, the grid);
``reference:graph`` is the reference's path without host synchronisation (CUDA's), taken on the CPU.
"""

from __future__ import annotations

import importlib

import pytest
import torch

import leapquant
from leapquant import formulas as ref
from leapquant import parity
from leapquant.backends import BackendError
from leapquant.tools.workloads import fill

from .conftest import backends_here
from .strategies import random_bits

# on a GPU the kernels run there; on a CPU through the interpreter
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TRITON = "triton" in backends_here(DEVICE)
# the Triton forced flush has one schedule, the grid (leapquant_triton.flush.flush_pool)
BACKENDS = ["reference", "reference:graph"] + (["triton"] if TRITON else [])
GATES = ["kda", "gdn"]


def _use(backend: str, monkeypatch) -> str:
    """``backend`` by name; ``reference:graph``: the reference's graph-capturable path."""
    if backend == "reference:graph":
        import leapquant.reference as reference

        monkeypatch.setattr(reference, "_graph_capturable", lambda pool: True)
        return "reference"
    return backend


def _i32(*values, device=DEVICE):
    return torch.tensor(values, dtype=torch.int32, device=device)


def _poison_past(pool: leapquant.Pool, gen: torch.Generator) -> None:
    """Random bytes in every ring entry at or past its (slot, head)'s fill count (clamped to [0, L])."""
    L = pool.ring
    past = torch.arange(L, device=pool.device) >= pool.hcnt.clamp(0, L)[..., None]  # [NS, HV, L]
    for name in ("kbuf", "ubuf", "w", "gbuf"):
        t = getattr(pool, name)
        if t is None:
            continue
        junk = t.clone()
        random_bits(junk, gen)
        m = past if t.dim() == 3 else past[..., None]
        t.copy_(torch.where(m, junk, t))


def _partial_pool(gate: str, *, convention="vllm", seed=0, num_slots=6, heads=2, ring=16, rank=4, layout="engine",
                  counts=None, device=DEVICE) -> leapquant.Pool:
    """A poisoned pool whose real slots hold valid checkpoints and rings with fill counts ``counts`` (``[NS - first,
    HV]``; default random in 1..L), the entries past each count poisoned."""
    pool = leapquant.Pool(num_slots, heads, 64, 64, ring, rank, gate=gate, convention=convention, layout=layout,
                          device=device)
    gen = torch.Generator().manual_seed(seed)
    for name in parity.POOL_TENSORS:
        if getattr(pool, name) is not None and name != "hcnt":
            random_bits(getattr(pool, name), gen)
    slots = list(range(pool.first_slot, num_slots))
    fill(pool, slots, "gaussian", gen)
    if counts is None:
        counts = torch.randint(1, ring + 1, (len(slots), heads), generator=gen, dtype=torch.int32)
    pool.hcnt[slots] = torch.as_tensor(counts, dtype=torch.int32).to(device)
    _poison_past(pool, gen)
    return pool


def _expected(pool: leapquant.Pool, slots: list[int]) -> dict:
    """The definition of the forced flush of ``slots`` (every head with an entry, none empty): SPEC §3 on the ring's
    entries in use, by the formulas."""
    c = pool.checkpoint(slots)
    c.update(ref.ring_in_use(c["kbuf"], c["ubuf"], c["w"], c["gbuf"], pool.hcnt[slots]))
    S = ref.rebuild(**c, gate=pool.gate)
    codes, s_k, s_v, u, q = ref.compress(S, pool.q0, pool.iters)
    return dict(codes=codes, s_k=s_k, s_v=s_v, u=u, q=q)


# --- the reference is the definition ----------------------------------------------------------------------------


@pytest.mark.parametrize("convention", ["vllm", "sglang"])
@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("backend", ["reference", "reference:graph"])
def test_reference_is_the_definition(backend, gate, convention, monkeypatch):
    """The reference's forced flush stores ``compress(rebuild(entries in use))`` bit for bit, whatever the entries past
    the fill count hold; resets every entry of the ring; sets ``hcnt = L``; and writes nothing else (padding rows,
    unnamed slots, the rest of the region). On the CPU: the definition does not depend on the device."""
    pool = _partial_pool(gate, convention=convention, seed=11, device="cpu")
    named = [1, 3, 4]
    want = _expected(pool, named)
    pad = 0 if convention == "vllm" else -1
    idx = _i32(3, pad, 1, 4, 3, device="cpu")  # a repeat and a padding row
    before = parity.snapshot(pool)
    leapquant.flush(pool, idx, backend=_use(backend, monkeypatch), force=True, check=False)
    got = pool.checkpoint(named)
    for name, t in want.items():
        assert torch.equal(parity.as_bytes(got[name]), parity.as_bytes(t.to(got[name].dtype))), name
    slots = torch.tensor(named).repeat_interleave(pool.heads)
    heads = torch.arange(pool.heads).repeat(len(named))
    assert parity.untouched_failures(pool, before, slots, heads, hcnt=pool.ring) == []


@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_full_rings_flush_as_without_force(backend, gate, monkeypatch):
    """Where every named ring is full, ``force=True`` stores the bytes of the ordinary flush (``hcnt`` stays L)."""
    pool = _partial_pool(gate, seed=2, counts=torch.full((5, 2), 16))
    twin = parity.twin(pool)
    name = _use(backend, monkeypatch)
    idx = _i32(2, 5, 0)
    leapquant.flush(pool, idx, backend=name, force=True)
    leapquant.flush(twin, idx, backend=name)
    assert [n for n, t in parity.snapshot(pool).items() if not torch.equal(t, parity.snapshot(twin)[n])] == []


# --- every backend against the reference (SPEC §4) --------------------------------------------------------------


@pytest.mark.parametrize("layout", ["engine", "compact"])
@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_parity_on_partial_rings(backend, gate, layout, monkeypatch):
    """Fill counts 1..L over poisoned pools, repeated and padding rows: SPEC §4 per program and over the batch against
    the reference on the entries in use, nothing written outside the flushed programs, rings reset, ``hcnt = L``."""
    pool = _partial_pool(gate, seed=5 + (gate == "gdn"), num_slots=5, layout=layout,
                         counts=torch.tensor([[1, 16], [7, 3], [15, 9], [2, 12]]))
    idx = _i32(4, 0, 1, 3, 4, 9)
    p = parity.measure(pool, idx, _use(backend, monkeypatch), check=False, force=True)
    assert p.count == 8  # the heads of rows 0, 2 and 3, and of row 4 (slot 4 again: flushed once)
    assert p.ok(), p.failures()


@pytest.mark.parametrize("ring,rank", [(8, 1), (32, 3)])
@pytest.mark.parametrize("backend", [b for b in BACKENDS if b.startswith("triton")])
def test_triton_other_rings(backend, ring, rank, monkeypatch):
    """Rings of 8 and 32 entries (the kernel reads a ring of 32 in two chunks of 16): fill counts either side of
    16."""
    counts = torch.tensor([[1, ring], [ring - 1, ring // 2 + 1]])
    pool = _partial_pool("kda", seed=9, num_slots=3, ring=ring, rank=rank, counts=counts)
    p = parity.measure(pool, _i32(1, 2), _use(backend, monkeypatch), force=True)
    assert p.count == 4 and p.ok(), p.failures()


@pytest.mark.skipif(not TRITON, reason="Triton backend cannot run here (needs CUDA or the interpreter)")
def test_triton_takes_the_grid_for_any_batch(monkeypatch):
    """The forced flush launches the grid schedule whatever N (nearly every named ring is due, where the grid beats
    the list), even where the ordinary flush would take the list; asking for the list is refused."""
    import leapquant_triton.flush as flush

    monkeypatch.setattr(flush, "schedule_for", lambda rows, heads: "list")
    pool = _partial_pool("gdn", seed=31, num_slots=3)
    p = parity.measure(pool, _i32(1, 2), "triton", force=True)
    assert p.count == 4 and p.ok(), p.failures()
    with pytest.raises(ValueError, match="grid schedule only"):
        flush.flush_pool(pool, _i32(1, 2), schedule="list", force=True)


# --- what the pool holds afterwards -----------------------------------------------------------------------------


def _stream_pool(gate: str, counts: torch.Tensor, seed: int = 3) -> leapquant.Pool:
    """A pool fed as an engine feeds it: states loaded, then ``counts[s]`` tokens appended to slot ``s + 1`` (the
    rings partially filled, the entries past the fill count as the last load left them)."""
    n = counts.numel()
    pool = leapquant.Pool(n + 1, 2, 64, 64, 16, 4, gate=gate, device=DEVICE)
    gen = torch.Generator().manual_seed(seed)
    slots = torch.arange(1, n + 1)
    pool.load_states(slots, torch.randn(n, 2, 64, 64, generator=gen))
    for t in range(int(counts.max())):
        live = slots[counts > t]
        B = live.numel()
        k = torch.nn.functional.normalize(torch.randn(B, 2, 64, generator=gen), dim=-1)
        g = -0.1 * torch.rand(*((B, 2, 64) if gate == "kda" else (B, 2)), generator=gen)
        pool.append(live, k, torch.randn(B, 2, 64, generator=gen), g, torch.rand(B, 2, generator=gen))
    return pool


@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("backend", ["reference"] + (["triton"] if TRITON else []))
def test_forced_flush_is_states_then_load(backend, gate):
    """On one backend a forced flush stores what ``load_states(slots, states(slots))`` stores (SPEC §5.1, the flush
    split in two, for partial rings too), but ``hcnt``: L, where the load sets 0. Then a step on each gives the same
    bytes and output: after a forced flush the next token is entry 0."""
    counts = torch.tensor([1, 5, 16])
    pool = _stream_pool(gate, counts)
    twin = parity.twin(pool)
    idx = _i32(1, 2, 3)
    leapquant.flush(pool, idx, backend=backend, force=True)
    twin.load_states(idx, twin.states(idx, backend=backend), backend=backend)
    assert bool((pool.hcnt[1:] == 16).all()) and bool((twin.hcnt[1:] == 0).all())
    twin.hcnt[1:] = 16
    assert [n for n, t in parity.snapshot(pool).items() if not torch.equal(t, parity.snapshot(twin)[n])] == []
    gen = torch.Generator().manual_seed(7)
    k = torch.nn.functional.normalize(torch.randn(3, 2, 64, generator=gen), dim=-1)
    tok = dict(q=torch.randn(3, 2, 64, generator=gen), k=k, v=torch.randn(3, 2, 64, generator=gen),
               g=-0.1 * torch.rand(*((3, 2, 64) if gate == "kda" else (3, 2)), generator=gen),
               beta=torch.rand(3, 2, generator=gen))
    tok = {n: t.to(DEVICE) for n, t in tok.items()}
    twin.hcnt[1:] = 0
    o = leapquant.step(pool, idx, **tok, backend=backend)
    o_twin = leapquant.step(twin, idx, **tok, backend=backend)
    assert torch.equal(o, o_twin)
    assert bool((pool.hcnt[1:] == 1).all())
    assert [n for n, t in parity.snapshot(pool).items() if not torch.equal(t, parity.snapshot(twin)[n])] == []


@pytest.mark.parametrize("gate", GATES)
def test_checkpoint_holds_the_state(gate):
    """Afterwards the ring is empty (SPEC §2) and the checkpoint alone is the state before the flush up to the
    compression's error (a snapshot of the checkpoint is the whole state)."""
    pool = _stream_pool(gate, torch.tensor([3, 9]))
    slots = torch.tensor([1, 2])
    S = pool.states(slots)
    leapquant.flush(pool, slots.to(DEVICE, torch.int32), force=True)
    assert bool(ref.ring_empty(pool.w[slots], pool.pcum[slots], gate).all())
    c = pool.checkpoint(slots)
    err = ref.relative_error(ref.reconstruct(c["codes"], c["s_k"], c["s_v"], c["u"], c["q"]), S.double())
    assert float(err.max()) < 0.02, err
    # bit for bit on the reference backend; the Triton states kernel (a GPU's default) sums in its own order
    alone = ref.reconstruct(c["codes"], c["s_k"], c["s_v"], c["u"], c["q"], torch.float32)
    assert torch.equal(pool.states(slots, backend="reference"), alone)
    assert float(ref.relative_error(pool.states(slots), alone.double()).max()) < 1e-6


# --- idempotence, emptiness, what is not due --------------------------------------------------------------------


@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_twice_changes_nothing(backend, gate, monkeypatch):
    """A second forced flush, or an ordinary one, with no token in between writes no byte."""
    pool = _partial_pool(gate, seed=21, num_slots=4)
    name = _use(backend, monkeypatch)
    idx = _i32(1, 2, 3)
    leapquant.flush(pool, idx, backend=name, force=True, check=False)
    once = parity.snapshot(pool)
    leapquant.flush(pool, idx, backend=name, force=True, check=False)
    leapquant.flush(pool, idx, backend=name, check=False)
    assert [n for n, t in parity.snapshot(pool).items() if not torch.equal(t, once[n])] == []


@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_and_unfilled_rings_are_left_alone(backend, gate, monkeypatch):
    """Not a byte changes for a ring with no entry (``hcnt = 0``), nor for a partially filled ring that is empty (its
    entries in use weigh 0 and the checkpoint's scale is the identity: its state is its checkpoint), whatever the
    entries past its fill count hold; the other heads are flushed."""
    pool = _partial_pool(gate, seed=13, num_slots=3, counts=torch.tensor([[0, 6], [5, 9]]))
    pool.w[2, 0, :5] = 0.0
    pool.pcum[2, 0] = 0.0 if gate == "kda" else 1.0
    before = parity.snapshot(pool)
    leapquant.flush(pool, _i32(1, 2), backend=_use(backend, monkeypatch), force=True)
    assert parity.untouched_failures(pool, before, torch.tensor([1, 2]), torch.tensor([1, 1]), hcnt=16) == []
    assert pool.hcnt[1].tolist() == [0, 16] and pool.hcnt[2].tolist() == [5, 16]


@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_out_of_domain_fill_counts_are_skipped_without_check(backend, gate, monkeypatch):
    """With ``check=False`` a ring whose fill count lies outside [0, L] is not due (nothing of it is written) and the
    others of the call are flushed as without it; ``check=True`` refuses the call, naming ``pool.hcnt``."""
    pool = _partial_pool(gate, seed=17, num_slots=4, counts=torch.tensor([[4, 16], [2, 11], [8, 1]]))
    pool.hcnt[1, 0] = 17
    pool.hcnt[3, 1] = -3
    twin = parity.twin(pool)
    name = _use(backend, monkeypatch)
    before = parity.snapshot(pool)
    with pytest.raises(ValueError, match=r"pool\.hcnt"):
        leapquant.flush(pool, _i32(1, 2, 3), backend=name, force=True)
    assert [n for n, t in parity.snapshot(pool).items() if not torch.equal(t, before[n])] == []
    leapquant.flush(pool, _i32(1, 2, 3), backend=name, force=True, check=False)
    flushed = [(1, 1), (2, 0), (2, 1), (3, 0)]
    s, h = torch.tensor([p[0] for p in flushed]), torch.tensor([p[1] for p in flushed])
    assert parity.untouched_failures(pool, before, s, h, hcnt=16) == []
    # the flushed programs hold what the flush of those programs alone stores
    twin.hcnt[1, 0], twin.hcnt[3, 1] = 0, 0
    leapquant.flush(twin, _i32(1, 2, 3), backend=name, force=True, check=False)
    twin.hcnt[1, 0], twin.hcnt[3, 1] = 17, -3
    assert [n for n, t in parity.snapshot(pool).items() if not torch.equal(t, parity.snapshot(twin)[n])] == []


# --- the interface ----------------------------------------------------------------------------------------------


def test_backends_without_partial_rings_are_refused(monkeypatch):
    """A backend that flushes full rings only (TileLang; here one registered for the test, whose ``flush`` takes no
    ``force``) is refused for ``force=True`` with the reason, before anything is written; "auto" passes it over; the
    same backend still runs the ordinary flush."""
    registry = importlib.import_module("leapquant.registry")
    monkeypatch.setattr(registry, "_CHOSEN", {})
    calls = []

    class FullOnly(leapquant.Backend):
        name = "full-rings-only-test"
        priority = 10**6
        requirements = leapquant.Requirements(devices=("cpu",), head_dims=None, rings=None)

        def flush(self, pool, idx):
            calls.append(idx.numel())

    monkeypatch.setitem(registry._registry(), FullOnly.name, None)  # removed from the registry afterwards
    leapquant.register(FullOnly())
    pool = _partial_pool("kda", seed=1, num_slots=3, device="cpu")
    before = parity.snapshot(pool)
    with pytest.raises(BackendError, match="full rings only"):
        leapquant.flush(pool, _i32(1, 2, device="cpu"), backend=FullOnly.name, force=True)
    with pytest.raises(BackendError, match="full rings only"):
        leapquant.select(pool, FullOnly.name, op="force_flush")
    assert [n for n, t in parity.snapshot(pool).items() if not torch.equal(t, before[n])] == []
    assert leapquant.select(pool, "auto", op="force_flush").name != FullOnly.name
    assert leapquant.select(pool, "auto").name == FullOnly.name
    leapquant.flush(pool, _i32(1, 2, device="cpu"), backend=FullOnly.name)
    assert calls == [2]
    from leapquant_tilelang.backend import TileLangBackend

    assert not TileLangBackend().implements("force_flush")
    assert leapquant.get_backend("reference").implements("force_flush")


def test_under_torch_compile():
    """``flush(..., force=True)`` compiles with ``fullgraph=True`` into the custom op, which declares ``hcnt`` mutated,
    and stores the bytes of the eager call."""
    pool = _partial_pool("kda", seed=4, num_slots=4, device="cpu")
    twin = parity.twin(pool)
    idx = _i32(3, 1, device="cpu")

    @torch.compile(backend="eager", fullgraph=True)
    def call(idx):
        leapquant.flush(pool, idx, backend="reference", check=True, force=True)

    call(idx)
    leapquant.flush(twin, idx, backend="reference", force=True)
    assert [n for n, t in parity.snapshot(pool).items() if not torch.equal(t, parity.snapshot(twin)[n])] == []
    assert bool((pool.hcnt[[1, 3]] == 16).all())
