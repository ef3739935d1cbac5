"""Targeted tests of the Triton flush kernel against the fp32 reference (SPEC §3, §4).

On a machine without CUDA the kernel runs in Triton's interpreter (``TRITON_INTERPRET=1``, set by conftest), so
the shapes are small: few heads and rows, every supported head dim, ring, rank, gate, convention and ITERS at least
once. Each test builds a pool whose every byte is random first (the poison: stale bytes that a missed store would
leave), writes valid checkpoints and rings for the programs under test, flushes with the Triton backend and checks:

* per due program, ``err_triton <= 1.02 err_ref + 1e-6`` against the float64 rebuild, and the batch RMS ratio;
* every byte of the pool outside the due programs' checkpoints and ring rows bitwise unchanged (random garbage in
  non-due programs, in the spare head, past the checkpoint inside a region, and in slots named by no row of idx);
* the resets of the due programs (``w = 0``; KDA ``pcum = 0``, ``gbuf = 1``; GDN ``pcum[0] = 1``; ``hcnt`` kept).
"""

from __future__ import annotations

import os
import zlib

import pytest
import torch

import leapquant
from leapquant import parity
from leapquant import formulas as ref
from leapquant.constants import EPS

triton = pytest.importorskip("triton")

from leapquant_triton.backend import TritonBackend  # noqa: E402
from leapquant_triton.flush import flush_pool, schedule_for  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BACKEND = TritonBackend()


def _usable() -> bool:
    return BACKEND.supports(leapquant.Pool(2, 1, 64, 64, 8, 1, device=DEVICE))[0]


pytestmark = pytest.mark.skipif(not _usable(), reason="Triton backend cannot run here (needs CUDA or TRITON_INTERPRET)")


def _randomise(pool: leapquant.Pool, g: torch.Generator) -> None:
    """Every byte of every pool tensor random (finite or not), as a stale pool would be."""
    for t in (pool.raw, pool.kbuf, pool.ubuf, pool.w, pool.pcum, pool.hcnt) + ((pool.gbuf,) if pool.gbuf is not None
                                                                               else ()):
        b = t.view(torch.uint8) if t.dim() else t
        b.copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8, generator=g).to(b.device))
    # fill counts in [0, L) (not due): a count outside [0, L] is refused by check=True
    pool.hcnt.copy_(torch.remainder(pool.hcnt, pool.ring))


def _fill_program(pool, s: int, h: int, g: torch.Generator, scale: float = 1.0, zero: bool = False) -> None:
    """A valid checkpoint and a full ring for (slot s, head h), state magnitude about ``scale``."""
    V, K, L = pool.head_v, pool.head_k, pool.ring
    rnd = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    if zero:
        S = torch.zeros(V, K)
    else:
        # low rank plus noise with a few large columns: where fp16 vs bf16 subspace numerics differ most
        S = rnd(V, 3) @ rnd(3, K) + 0.3 * rnd(V, K)
        S[:, :3] *= 8.0
        S = S * (scale / S.abs().max())
    codes, s_k, s_v, u, q = ref.compress(S[None, None], pool.q0.cpu(), iters=pool.iters)
    dev = pool.device
    pool.codes[s, h] = codes[0, 0].to(dev)
    pool.s_k[s, h] = s_k[0, 0].to(dev)
    pool.s_v[s, h] = s_v[0, 0].to(dev)
    pool.u[s, h] = u[0, 0].to(dev)
    pool.q[s, h] = q[0, 0].to(dev)
    if zero:
        pool.w[s, h] = 0.0
        pool.kbuf[s, h] = 0.0
        pool.ubuf[s, h] = 0.0
    else:
        pool.kbuf[s, h] = torch.nn.functional.normalize(rnd(L, K), dim=-1).to(dev, torch.bfloat16)
        pool.ubuf[s, h] = (scale * 0.2 * rnd(L, V)).to(dev, torch.bfloat16)
        pool.w[s, h] = torch.rand(L, generator=g).to(dev)
    if pool.gate == "kda":
        pool.gbuf[s, h] = (0.8 + 0.2 * torch.rand(L, K, generator=g)).to(dev, torch.float16)
        pool.pcum[s, h] = (-0.5 * torch.rand(K, generator=g)).to(dev)
    else:
        pool.pcum[s, h] = (0.5 + 0.5 * torch.rand(1, generator=g)).to(dev)
    pool.hcnt[s, h] = L


def _check_flush(pool, idx: list[int], due_progs: list[tuple[int, int]],
                 schedule: str | None = None) -> parity.Parity:
    """Flush ``idx`` with the Triton backend (its default schedule, or ``schedule``: flush.flush_pool's "grid" or
    "list") and judge it by leapquant.parity: SPEC §4 per program and over the batch, untouched bytes, resets."""
    idx_t = torch.tensor(idx, dtype=torch.int32, device=pool.device)
    rows, heads = pool.due(idx_t).cpu().nonzero(as_tuple=True)
    assert sorted(zip(idx_t.cpu().long()[rows].tolist(), heads.tolist())) == sorted(due_progs)
    if schedule is None:
        p = parity.measure(pool, idx_t, "triton", flush_fn=lambda pool_, idx_: BACKEND.flush(pool_, idx_))
    else:
        p = parity.measure(pool, idx_t, "triton",
                           flush_fn=lambda pool_, idx_: flush_pool(pool_, idx_, schedule=schedule))
    assert p.ok(), p.failures()
    return p


def _pool(heads=2, head_k=64, head_v=64, ring=8, rank=2, gate="kda", convention="vllm", iters=1, num_slots=5,
          seed=0):
    g = torch.Generator().manual_seed(seed)
    # the engine layout, named: these tests poison its spare heads and region tails (the compact layout's own tests,
    # test_compact.py, run the kernel on it)
    pool = leapquant.Pool(num_slots, heads, head_k, head_v, ring, rank, gate=gate, convention=convention,
                          device=DEVICE, iters=iters, layout="engine")
    _randomise(pool, g)
    return pool, g


# Every supported value of each dimension at least once, kept to a few programs each for the interpreter.
SHAPES = [
    # (head_k, head_v, ring, rank, gate, iters)
    (128, 128, 16, 4, "kda", 1),
    (128, 128, 16, 4, "gdn", 1),
    (64, 64, 8, 1, "kda", 1),
    (64, 64, 32, 3, "gdn", 2),
    (64, 128, 8, 2, "kda", 2),
    (128, 64, 32, 1, "gdn", 1),
    (128, 64, 16, 3, "kda", 1),
    (64, 128, 16, 4, "gdn", 1),
    (64, 64, 32, 2, "kda", 1),  # the ring in two chunks of 16 entries, decays across them
]


@pytest.mark.parametrize("schedule", ["grid", "list"])
@pytest.mark.parametrize("head_k,head_v,ring,rank,gate,iters", SHAPES,
                         ids=[f"{g}-K{k}V{v}-L{l}-R{r}-it{i}" for k, v, l, r, g, i in SHAPES])
def test_shapes_parity_untouched_resets(head_k, head_v, ring, rank, gate, iters, schedule):
    """Rows: a due slot, padding, a slot with a due and a non-due head, a due slot named by no row (untouched); both
    schedules of the launcher (one program per (row, head), or the due list first)."""
    pool, g = _pool(heads=2, head_k=head_k, head_v=head_v, ring=ring, rank=rank, gate=gate, iters=iters,
                    seed=zlib.crc32(repr((head_k, head_v, ring, rank, gate, iters)).encode()) % 1000)
    for s, h in [(1, 0), (1, 1), (3, 1), (4, 0)]:
        _fill_program(pool, s, h, g)
    # slot 4 is due but no row names it; slot 3 head 0 is not due (random hcnt), slot 2 is not due at all
    p = _check_flush(pool, idx=[3, 0, 1, 2], due_progs=[(1, 0), (1, 1), (3, 1)], schedule=schedule)
    assert p.count == 3 and p.code_diff_max <= 127


@pytest.mark.parametrize("schedule", ["grid", "list"])
@pytest.mark.parametrize("heads", [1, 3])
@pytest.mark.parametrize("convention", ["vllm", "sglang"])
def test_heads_and_conventions(heads, convention, schedule):
    """Odd head counts; slot 0 is real only under SGLang, padding is 0 (vLLM) or -1 (SGLang); out-of-range rows
    are skipped by the kernel itself (flush with check=False does not filter them)."""
    pool, g = _pool(heads=heads, convention=convention, num_slots=4, seed=heads)
    progs = [(0, h) for h in range(heads)] + [(2, heads - 1)]
    for s, h in progs:
        _fill_program(pool, s, h, g)
    pad = 0 if convention == "vllm" else -1
    due = [p for p in progs if p[0] != 0 or convention == "sglang"]
    _check_flush(pool, idx=[pad, 2, 0 if convention == "sglang" else pad, 4, 2 ** 31 - 1, -7], due_progs=due,
                 schedule=schedule)


def test_schedules_agree_bytewise():
    """The two schedules run the same program body: from the same pool they leave the same bytes everywhere; and
    the default picks the list only for large flushes."""
    pool, g = _pool(heads=3, head_k=64, head_v=64, ring=16, rank=3, gate="kda", seed=21)
    for s, h in [(1, 0), (1, 2), (2, 1), (4, 0), (4, 1), (4, 2)]:
        _fill_program(pool, s, h, g)
    idx = torch.tensor([4, 0, 1, 3, 2], dtype=torch.int32, device=pool.device)
    out = {}
    for schedule in ("grid", "list"):
        p = parity.twin(pool)
        flush_pool(p, idx, schedule=schedule)
        out[schedule] = parity.snapshot(p)
    for name in out["grid"]:
        assert torch.equal(out["grid"][name], out["list"][name]), name
    assert not torch.equal(out["grid"]["raw"], parity.as_bytes(pool.raw))  # the flush did something
    assert schedule_for(8, 32) == "grid" and schedule_for(256, 32) == "list"
    with pytest.raises(ValueError, match="schedule"):
        flush_pool(pool, idx, schedule="persistent")


def test_zero_state_and_empty_ring():
    """S = 0 gives all-zero codes, s_k = s_v = EPS and zero factors, the reference's answer."""
    pool, g = _pool(heads=2, head_k=128, head_v=64, ring=16, rank=3, gate="kda", seed=7)
    _fill_program(pool, 1, 0, g, zero=True)
    _fill_program(pool, 1, 1, g)
    _check_flush(pool, idx=[1], due_progs=[(1, 0), (1, 1)])
    assert (pool.codes[1, 0] == 0).all()
    assert (pool.s_k[1, 0] == torch.tensor(EPS, dtype=torch.float32)).all()
    assert (pool.s_v[1, 0] == torch.tensor(EPS, dtype=torch.float32)).all()
    assert (pool.uq[1, 0].float() == 0).all()


@pytest.mark.parametrize("gate", ["kda", "gdn"])
@pytest.mark.parametrize("log2_scale", [-40, -20, 14, 40])
def test_input_domain(gate, log2_scale):
    """Finite and within the parity bound over 2^-40 <= max|S| <= 2^40 (at 2^40 the factors saturate at 65504)."""
    pool, g = _pool(heads=2, head_k=64, head_v=128, ring=8, rank=2, gate=gate, seed=40 + log2_scale)
    for h in range(2):
        _fill_program(pool, 2, h, g, scale=2.0 ** log2_scale)
    _check_flush(pool, idx=[2], due_progs=[(2, 0), (2, 1)])
    if log2_scale == 40:
        assert (pool.u[2].float().abs() == 65504).any(), "expected saturated factors at 2^40"


def test_repeated_flushes_match_reference_backend():
    """Three flush rounds through the public API with appends in between, against the reference backend on a copy:
    the per-head state error stays within the bound of the reference's."""
    g = torch.Generator().manual_seed(11)
    pools = {b: leapquant.Pool(3, 2, 64, 64, 8, 2, gate="kda", device=DEVICE) for b in ("triton", "reference")}
    S0 = 0.5 * torch.randn(2, 2, 64, 64, generator=g)
    for p in pools.values():
        p.load_states([1, 2], S0)
    for _ in range(3):
        for _ in range(8):
            k = torch.nn.functional.normalize(torch.randn(2, 2, 64, generator=g), dim=-1)
            v = torch.randn(2, 2, 64, generator=g)
            gt = -0.05 * torch.rand(2, 2, 64, generator=g)
            beta = torch.rand(2, 2, generator=g)
            for p in pools.values():
                p.append([1, 2], k, v, gt, beta)
        for name, p in pools.items():
            leapquant.flush(p, torch.tensor([2, 1, 0], dtype=torch.int32, device=DEVICE), backend=name)
    e = {b: ref.relative_error(p.states([1, 2]).cpu(), pools["reference"].states([1, 2]).cpu()) for b, p in
         pools.items()}
    assert (e["triton"] < 0.05).all(), e["triton"]
    assert (pools["triton"].hcnt[1:] == 8).all()


def test_backend_reasons(monkeypatch):
    """available()/supports() say why not, instead of failing at launch."""
    ok, why = BACKEND.available()
    assert ok, why
    pool = leapquant.Pool(2, 1, 64, 64, 8, 1, device=DEVICE)
    assert BACKEND.supports(pool)[0]
    if DEVICE == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        ok, why = BACKEND.supports(pool)
        assert not ok and "TRITON_INTERPRET" in why
    assert 75 not in BACKEND.requirements.capabilities and 90 in BACKEND.requirements.capabilities
    assert os.environ.get("TRITON_INTERPRET") or torch.cuda.is_available()


def test_triton_older_than_the_checked_range_is_refused(monkeypatch):
    """An engine's torch may pin a Triton older than the oldest this backend is checked with (torch 2.8: Triton 3.4,
    whose build of the list schedule fails on sm_90): the backend is then unavailable, with the version in the reason,
    rather than failing at its first large flush. Versions compare by (major, minor), a local suffix ignored."""
    from leapquant_triton.targets import MIN_TRITON, triton_release

    assert triton_release(triton.__version__) >= MIN_TRITON, "this run's Triton is below the declared range"
    assert triton_release("3.6.0+git1a2b3c4") == (3, 6) and triton_release("3.10.0") > (3, 9)
    monkeypatch.setattr(triton, "__version__", "3.4.0")
    ok, why = TritonBackend().available()
    assert not ok and "triton 3.4.0 is older than 3.5" in why, why
    monkeypatch.setattr(triton, "__version__", "3.5.0")
    assert TritonBackend().available()[0]


def test_mma_sync_switch_is_scoped(monkeypatch):
    """The wgmma / tcgen05 switches are set while a launch compiles and put back as they were afterwards, also after
    an exception, so other Triton code in the engine's process keeps its own lowering."""
    from leapquant_triton.targets import mma_sync_only

    monkeypatch.delenv("DISABLE_MMA_V3", raising=False)
    monkeypatch.setenv("DISABLE_MMA_V5", "0")
    with mma_sync_only():
        assert os.environ["DISABLE_MMA_V3"] == "1" and os.environ["DISABLE_MMA_V5"] == "1"
    assert "DISABLE_MMA_V3" not in os.environ and os.environ["DISABLE_MMA_V5"] == "0"
    with pytest.raises(RuntimeError):
        with mma_sync_only():
            raise RuntimeError("launch failed")
    assert "DISABLE_MMA_V3" not in os.environ and os.environ["DISABLE_MMA_V5"] == "0"


@pytest.mark.skipif(DEVICE != "cuda", reason="direct launches exist on the GPU only (the interpreter always binds)")
@pytest.mark.parametrize("schedule", ["grid", "list"])
def test_direct_launches_write_what_bound_launches_write(schedule, monkeypatch):
    """Launches of the kept compiled kernel (launcher.py) leave the same bytes as launches through Triton's
    argument binding, for an idx at a 16-byte boundary and one 4 bytes past it (which Triton specialises apart). The
    runs share one pool object, so that they share its plan (flush._plan), whose prepared launches keep the
    kernels."""
    from leapquant_triton import flush, launcher

    pool, g = _pool(heads=3, head_k=128, head_v=128, ring=16, rank=4, gate="kda", seed=77)
    for s, h in [(1, 0), (1, 2), (2, 1), (3, 0), (4, 1), (4, 2)]:
        _fill_program(pool, s, h, g)
    start = parity.snapshot(pool)
    p = parity.twin(pool)
    buf = torch.tensor([0, 4, 0, 1, 3, 2], dtype=torch.int32, device=DEVICE)
    for idx in (buf[:5], buf[1:]):
        out = []
        for direct in (False, True, True):  # bound; first through the plan's launcher (binds, keeps); then direct
            monkeypatch.setattr(flush._launch_flush, "direct", direct)
            monkeypatch.setattr(flush._launch_due_list, "direct", direct)
            parity.restore(p, start)
            flush_pool(p, idx, schedule=schedule)
            out.append(parity.snapshot(p))
        for name in out[0]:
            for o in out[1:]:
                assert torch.equal(out[0][name], o[name]), (idx.data_ptr() % 16, name)
        assert not torch.equal(out[0]["raw"], start["raw"])  # the flush did something
    (plan,) = [plan for key, (_, plan) in launcher._PER_POOL[p.raw].items() if key[0] == "flush"]
    keys = [k for k in plan.flush.kernels if k[0] == torch.cuda.current_device()]
    idx_aligned = {k[2 + plan.flush.dynamic.index("idx")][1] for k in keys}
    assert idx_aligned == {True, False}


def test_plans_follow_the_pools_memory():
    """flush.flush_pool keeps one plan per pool memory, N and build (flush._plan): a second flush of the same pool
    takes it again, and so does a pool made afresh over the same tensors (the custom op's way); a pool whose tensor
    was replaced by another gets a new plan, and its flush reads the new tensor; the plans go with the pool."""
    import gc

    from leapquant_triton import flush, launcher

    pool, g = _pool(heads=1, head_k=64, head_v=64, ring=8, rank=1, gate="kda", num_slots=3, seed=5)
    _fill_program(pool, 1, 0, g)
    start = parity.snapshot(pool)
    idx = torch.tensor([1], dtype=torch.int32, device=DEVICE)
    flush_pool(pool, idx)
    first = flush._plan(pool, 1, schedule_for(1, 1), 4, None, idx.device)
    assert flush._plan(pool, 1, schedule_for(1, 1), 4, None, idx.device) is first
    twin = leapquant.Pool.from_tensors(pool.raw, pool.kbuf, pool.ubuf, pool.w, pool.pcum, pool.gbuf, pool.hcnt,
                                       pool.q0, num_slots=3, heads=1, head_k=64, head_v=64, ring=8, rank=1,
                                       gate="kda", layout="engine")
    assert flush._plan(twin, 1, schedule_for(1, 1), 4, None, idx.device) is first
    assert len(launcher._PER_POOL[pool.raw]) == 1

    # the same pool with another ring in a new tensor: the flush must read it, as a pool built with it does
    parity.restore(pool, start)
    pool.ubuf = 2 * pool.ubuf
    want = leapquant.Pool(3, 1, 64, 64, 8, 1, gate="kda", device=DEVICE, layout="engine")
    parity.restore(want, start)
    want.ubuf.copy_(pool.ubuf)
    flush_pool(pool, idx)
    flush_pool(want, idx)
    assert torch.equal(parity.as_bytes(pool.raw), parity.as_bytes(want.raw))
    assert not torch.equal(parity.as_bytes(pool.raw), start["raw"])
    assert flush._plan(pool, 1, schedule_for(1, 1), 4, None, idx.device) is not first

    n = len(launcher._PER_POOL)
    del pool, twin, first
    gc.collect()
    assert len(launcher._PER_POOL) == n - 1


@pytest.mark.xfail(strict=DEVICE == "cpu", reason="known: the fp16 subspace iteration (the seed's numerics) loses to the fp32 "
                   "reference by 3.1 % on one program of this large-column rank-2 state, past SPEC §4's 1.02")
def test_known_large_columns_rank2_case():
    """A case a random draw of ``test_parity.py::test_flush_meets_spec`` found (KDA 128 x 128, L = 8, R = 2,
    ``large_columns``, seed 4360): program ratios 1.031 and 0.998, batch RMS 1.015. The tree before the reliability
    changes gives the same ratios, so it is the kernel's arithmetic, not a regression. Kept strict so that a fix shows
    up here as an unexpected pass."""
    from .strategies import build_case

    case = build_case(heads=2, head_k=128, head_v=128, ring=8, rank=2, gate="kda", convention="vllm",
                      regime="large_columns", rows=1, due_frac=1.0, padding=0, seed=4360, device=DEVICE,
                      num_slots=8)
    p = parity.measure(case.pool, case.idx, "triton")
    assert p.count == 2
    assert p.backend_ok(), p.summary()
