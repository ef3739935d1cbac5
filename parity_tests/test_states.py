"""States in and out of a pool (SPEC §5): ``Pool.load_states`` and ``Pool.states`` through the Triton kernels
(``leapquant_triton.states``) against the reference, and the checks and dispatch in front of them.

On a machine without CUDA the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, set by conftest), so the
pools are small (K, V in {64, 128}, a few heads). Every pool starts as random bytes (the poison a missed or stray
store would show):

* ``load_states`` meets the flush's accuracy criteria (SPEC §4, judged by ``leapquant.parity``) against the float64
  model of the given state, in both layouts and both gates; writes nothing outside the given slots' checkpoints and
  ring rows; resets their rings and sets ``hcnt = 0`` exactly as the reference path does;
* ``states`` agrees with the reference to fp32 rounding, into a new or a caller's tensor, in both layouts, and writes
  nothing in the pool;
* from the same pool, ``load_states(states(pool))`` stores the bytes a flush stores, on each backend: the same
  arithmetic, split in two.
"""

from __future__ import annotations

import zlib

import pytest
import torch

import leapquant
from leapquant import parity
from leapquant import formulas as ref
from leapquant.backends import Backend, BackendError, Requirements
from leapquant.constants import EPS
from leapquant.tools.workloads import fill, target_states

from .conftest import compute_devices

triton = pytest.importorskip("triton")

from leapquant_triton.backend import TritonBackend  # noqa: E402

DEVICE = compute_devices()[0]


def _usable() -> bool:
    return TritonBackend().supports(leapquant.Pool(2, 1, 64, 64, 8, 1, device=DEVICE))[0]


pytestmark = pytest.mark.skipif(not _usable(), reason="Triton backend cannot run here (needs CUDA or TRITON_INTERPRET)")


def _poisoned(num_slots=5, heads=2, head_k=64, head_v=64, ring=8, rank=2, gate="kda", iters=1, seed=0):
    """A pool whose every byte is random (finite or not), and the generator that made it."""
    g = torch.Generator().manual_seed(seed)
    pool = leapquant.Pool(num_slots, heads, head_k, head_v, ring, rank, gate=gate, device=DEVICE, iters=iters)
    for name in parity.POOL_TENSORS:
        t = getattr(pool, name)
        if t is not None:
            b = t.view(torch.uint8)
            b.copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8, generator=g).to(b.device))
    return pool, g


def _states(pool, n: int, regime: str, g: torch.Generator, scale: float | None = None) -> torch.Tensor:
    """fp32 V-first states ``[n, HV, V, K]`` of a regime of :mod:`leapquant.tools.workloads` (max|S| rescaled to
    ``scale``)."""
    S = target_states(regime, n, pool.heads, pool.head_v, pool.head_k, g)
    if scale is not None:
        S = S * (scale / S.abs().amax(dim=(-2, -1), keepdim=True).clamp_min(1e-30))
    return S.to(DEVICE)


# (head_k, head_v, ring, rank, gate, iters): both gates, every head dim, ring 8 / 16 / 32, ranks 1-4, ITERS 1 and 2
SHAPES = [
    (64, 64, 8, 2, "kda", 1),
    (64, 64, 16, 4, "gdn", 1),
    (128, 64, 32, 1, "kda", 2),
    (64, 128, 16, 3, "gdn", 2),
    (128, 128, 16, 4, "kda", 1),
]


@pytest.mark.parametrize("state_v_first", [True, False], ids=["v_first", "k_first"])
@pytest.mark.parametrize("head_k,head_v,ring,rank,gate,iters", SHAPES,
                         ids=[f"{g}-K{k}V{v}-L{l}-R{r}-it{i}" for k, v, l, r, g, i in SHAPES])
def test_load_states_parity(head_k, head_v, ring, rank, gate, iters, state_v_first):
    """SPEC §4 on every loaded (slot, head), both layouts of the given state; nothing written outside the given slots'
    checkpoints and ring rows (slots 0, 2, 4 and 10 keep their random bytes), their rings reset, ``hcnt = 0``.

    Four states of each regime, 16 programs: the batch criterion (RMS of the ratios <= 1.003) judges a batch's mean,
    and single programs' ratios spread by about 1 % either way at 64 x 64 (int8 rounding boundaries move with the
    summation order), so over 4 programs one such program decided it."""
    pool, g = _poisoned(12, 2, head_k, head_v, ring, rank, gate, iters,
                        seed=zlib.crc32(repr((head_k, head_v, ring, rank, gate, iters)).encode()) % 1000)
    S = torch.cat([_states(pool, 4, r, g) for r in ("lowrank", "large_columns")])
    if not state_v_first:
        S = S.transpose(-1, -2).contiguous()  # FLA's [n, HV, K, V]
    slots = torch.tensor([3, 1, 5, 7, 9, 11, 6, 8], dtype=torch.int32, device=DEVICE)
    p = parity.measure_load_states(pool, slots, S, "triton", state_v_first=state_v_first, check=False)
    assert p.count == 8 * pool.heads
    assert p.reference_ok() and p.ok(), p.failures()


@pytest.mark.parametrize("gate", ["kda", "gdn"])
def test_load_states_zero_domain_and_bytes_of_the_reference(gate):
    """A zero state gives the reference's bytes (zero codes and factors, s_k = s_v = EPS); the ring resets and hcnt
    are the reference path's bit for bit; max|S| at 2^-40 and 2^40 stays finite and within SPEC §4."""
    pool, g = _poisoned(6, 3, 64, 128, 8, 2, gate, seed=11)
    other = leapquant.Pool(6, 3, 64, 128, 8, 2, gate=gate, device=DEVICE)
    parity.restore(other, parity.snapshot(pool))
    S = torch.cat([torch.zeros(1, 3, 128, 64, device=DEVICE), _states(pool, 1, "gaussian", g, 2.0**-40),
                   _states(pool, 1, "large_columns", g, 2.0**40)])
    slots = torch.tensor([5, 0, 2], dtype=torch.int32, device=DEVICE)
    p = parity.measure_load_states(pool, slots, S, "triton")
    assert p.ok(), p.failures()
    other.load_states(slots, S, backend="reference")
    assert (pool.codes[5] == 0).all() and (pool.uq[5].float() == 0).all()
    assert (pool.s_kv[5] == torch.tensor(EPS)).all()
    after, want = parity.snapshot(pool), parity.snapshot(other)
    for name in ("kbuf", "ubuf", "w", "pcum", "gbuf", "hcnt"):
        if name in want:
            assert torch.equal(after[name], want[name]), name
    for name in ("codes", "s_k", "s_v", "u", "q"):  # the zero state's checkpoint, as the reference stores it
        assert torch.equal(parity.as_bytes(getattr(pool, name)[5]), parity.as_bytes(getattr(other, name)[5])), name
    assert (pool.u[2].float().abs() == 65504).any(), "expected saturated factors at 2^40"


def _filled(gate: str, head_k=64, head_v=64, ring=8, rank=3, seed=0):
    """A pool of random bytes whose slots 1-3 hold checkpoints and full rings: slot 1 by a token stream, slot 2 of a
    low-rank state, slot 3 of a fully decayed one (the regimes of :func:`leapquant.tools.workloads.fill`)."""
    pool, g = _poisoned(5, 2, head_k, head_v, ring, rank, gate, seed=seed)
    for slot, regime in ((1, "realistic"), (2, "lowrank"), (3, "decayed")):
        fill(pool, [slot], regime, g)
    return pool


@pytest.mark.parametrize("gate", ["kda", "gdn"])
def test_states_agree_with_the_reference(gate):
    """Within fp32 rounding of the reference (relative 1e-6 per head, Frobenius; each element within 2^-20 of the
    head's largest), in both layouts, into a new tensor or a caller's (its other rows untouched); the pool unchanged;
    with check=False a slot outside [0, NS) gives a zero row."""
    pool = _filled(gate, 128, 64, 16, 4, seed=3)
    slots = torch.tensor([2, 1, 3], device=DEVICE)
    want = pool.states(slots, backend="reference").cpu().double()
    before = parity.snapshot(pool)
    got = pool.states(slots, backend="triton").cpu().double()
    peak = want.abs().amax(dim=(-2, -1), keepdim=True)
    assert float(ref.relative_error(got, want).max()) < 1e-6
    assert bool(((got - want).abs() <= 2.0**-20 * peak).all())
    # FLA's layout into a caller's buffer: rows of a larger tensor, NaN-poisoned
    buf = torch.full((5, pool.heads, pool.head_k, pool.head_v), float("nan"), device=DEVICE)
    out = buf[1:4]
    assert pool.states(slots, out=out, backend="triton", state_v_first=False) is out
    assert torch.equal(buf[1:4].cpu().transpose(-1, -2).double(), got)
    assert buf[0].isnan().all() and buf[4].isnan().all()
    pad = torch.tensor([1, -1, pool.num_slots], dtype=torch.int32, device=DEVICE)
    z = pool.states(pad, backend="triton", check=False).cpu()
    assert torch.equal(z[0].double(), got[1]) and (z[1:] == 0).all()
    after = parity.snapshot(pool)
    assert all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("gate", ["kda", "gdn"])
def test_load_of_states_is_the_flush(gate, backend):
    """From the same pool, ``load_states(states(pool))`` stores a flush's checkpoint and ring resets bit for bit (the
    flush's own arithmetic, split in two), and sets ``hcnt = 0`` where the flush keeps L."""
    pool = _filled(gate, seed=5)
    loaded = leapquant.Pool(5, 2, 64, 64, 8, 3, gate=gate, device=DEVICE)
    start = parity.snapshot(pool)
    parity.restore(loaded, start)
    slots = torch.tensor([1, 2, 3], dtype=torch.int32, device=DEVICE)
    S = loaded.states(slots, backend=backend)
    loaded.load_states(slots, S, backend=backend)
    leapquant.flush(pool, slots, backend=backend)
    a, b = parity.snapshot(pool), parity.snapshot(loaded)
    for name in a:
        if name != "hcnt":
            assert torch.equal(a[name], b[name]), name
    assert not torch.equal(a["raw"], start["raw"])  # the flush stored new checkpoints
    assert (loaded.hcnt[1:4] == 0).all() and (pool.hcnt[1:4] == pool.ring).all()


def test_checks_and_dispatch():
    """What check=True converts and check=False refuses; repeated or out-of-range slots; wrong shapes and output
    strides; a backend without states is passed over by auto and refused by name."""
    pool = leapquant.Pool(4, 2, 64, 64, 8, 2, device=DEVICE)
    S = torch.randn(2, 2, 64, 64, generator=torch.Generator().manual_seed(0))
    pool.load_states([2, 3], S.double())  # check=True: any float dtype, any device, converted
    assert (pool.hcnt[2:] == 0).all()
    with pytest.raises(ValueError, match="more than once"):
        pool.load_states([1, 1], S)
    with pytest.raises(ValueError, match="lie in"):
        pool.load_states([1, 4], S)
    with pytest.raises(ValueError, match=r"\[n, HV, K, V\]"):
        pool.load_states([1], S[:1, :, :32], state_v_first=False)
    with pytest.raises(TypeError, match="torch.Tensor"):
        pool.load_states([1, 2], S.to(DEVICE), check=False)
    with pytest.raises(TypeError, match="float32"):
        pool.load_states(torch.tensor([1, 2], device=DEVICE), S.double().to(DEVICE), check=False)
    with pytest.raises(TypeError, match="int32 or int64"):
        pool.states(torch.tensor([1.0], device=DEVICE), check=False)
    assert pool.states([1, 1]).shape == (2, 2, 64, 64)  # reading a slot twice is fine
    with pytest.raises(ValueError, match="densely"):
        pool.states([1], out=torch.empty(1, 2, 64, 128, device=DEVICE)[..., :64])
    with pytest.raises(ValueError, match="densely"):  # heads sharing words
        pool.states([1], out=torch.empty(1, 1, 64, 64, device=DEVICE).expand(1, 2, 64, 64))
    with pytest.raises(ValueError, match="shape"):
        pool.states([1], out=torch.empty(2, 2, 64, 64, device=DEVICE))

    class FlushOnly(Backend):
        name = "flush-only-states-test"
        priority = 1000
        requirements = Requirements(devices=("cpu", "cuda"), head_dims=None, rings=None, ranks=None)

        def flush(self, pool, idx):
            raise AssertionError("not called")

    leapquant.register(FlushOnly())
    try:
        assert leapquant.select(pool, op="states").name == ("triton" if DEVICE == "cuda" else "reference")
        with pytest.raises(BackendError, match="no load_states"):
            pool.states([1], backend="flush-only-states-test")
    finally:
        from leapquant.registry import _CHOSEN, _registry

        del _registry()["flush-only-states-test"]
        _CHOSEN.clear()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize("gate", ["kda", "gdn"])
def test_cuda_graph_capture(gate):
    """With check=False both capture into a CUDA graph (no host sync, no allocation but the load's scratch from the
    graph's pool) and a replay gives the eager bytes."""
    pool = _filled(gate, 128, 128, 16, 4, seed=9)
    twin = leapquant.Pool(5, 2, 128, 128, 16, 4, gate=gate, device=DEVICE)
    start = parity.snapshot(pool)
    slots = torch.tensor([1, 2, 3], dtype=torch.int32, device=DEVICE)
    out = torch.empty(3, 2, 128, 128, device=DEVICE)
    pool.states(slots, out=out, check=False, state_v_first=False)  # eager first: compiles the builds captured
    pool.load_states(slots, out, check=False, state_v_first=False)
    parity.restore(pool, start)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        pool.states(slots, out=out, check=False, state_v_first=False)
        pool.load_states(slots, out, check=False, state_v_first=False)
    parity.restore(pool, start)
    graph.replay()
    torch.cuda.synchronize()
    parity.restore(twin, start)
    eager = twin.states(slots, check=False, state_v_first=False)
    twin.load_states(slots, eager, check=False, state_v_first=False)
    assert torch.equal(out, eager)
    a, b = parity.snapshot(pool), parity.snapshot(twin)
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow  # python -m pytest -m slow (CI runs it)
def test_ahead_of_time_builds_fit():
    """Both kernels in both layouts compile for sm_90 (the H200) with Triton's own pipeline and fit as the flush's
    builds must (registers, spills <= 2 KB, shared memory, mma.sync): ``python -m leapquant_triton.portability
    --ops states`` checks every claimed architecture. In a subprocess without TRITON_INTERPRET, which conftest sets on
    a CPU."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton.backends.nvidia.compiler")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    res = subprocess.run([sys.executable, "-m", "leapquant_triton.portability", "--ops", "states", "--quick",
                          "--arch", "90"], cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]
    rows = [line for line in res.stdout.splitlines() if line.startswith("sm_90")]
    assert len(rows) == 2 * 2 * 2 and all(" ok " in line and "mma.sync" in line for line in rows), res.stdout


@pytest.mark.parametrize("compiler", ["eager", "aot_eager"])
@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_under_torch_compile(backend, compiler):
    """``states`` and ``load_states`` compile with fullgraph=True into the custom ops ``leapquant::states`` and
    ``leapquant::load_states`` (``aot_eager``: through functionalisation, as Inductor takes them): the states and the
    pool bytes of the eager calls, into a new tensor or a caller's, in either layout; with check=True a non-finite
    state raises inside the compiled call and writes nothing."""
    pool = _filled("gdn", seed=9)
    twin = parity.twin(pool)
    slots = torch.tensor([3, 1], dtype=torch.int32, device=DEVICE)

    @torch.compile(backend=compiler, fullgraph=True)
    def round_trip(s, buf):
        S = pool.states(s, backend=backend, check=False)
        pool.states(s, out=buf, backend=backend, check=False, state_v_first=False)
        pool.load_states([2, 4], 0.5 * S, backend=backend)
        return S

    buf = torch.full((2, pool.heads, pool.head_k, pool.head_v), float("nan"), device=DEVICE)
    got = round_trip(slots, buf)
    want = twin.states(slots, backend=backend)
    twin.load_states([2, 4], 0.5 * want, backend=backend)
    assert torch.equal(got, want)
    assert torch.equal(buf.transpose(-1, -2), want)
    a, b = parity.snapshot(pool), parity.snapshot(twin)
    assert [n for n in a if not torch.equal(a[n], b[n])] == []

    @torch.compile(backend=compiler, fullgraph=True)
    def load(S):
        pool.load_states(slots, S, backend=backend)

    bad = want.clone()
    bad[1, 0, 3, 5] = float("inf")
    with pytest.raises(ValueError, match="states must be finite"):
        load(bad)
    a = parity.snapshot(pool)
    assert [n for n in a if not torch.equal(a[n], b[n])] == []
