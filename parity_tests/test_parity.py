"""Every backend available here against the reference (SPEC §4), on every device under test.

The properties: accuracy per program and over a batch, untouched bytes (bit for bit, on a random-filled pool),
resets, the zero state, the value domain 2^-40 .. 2^40, ``run`` equals ``flush``, in place.
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import leapquant
from leapquant import parity
from leapquant.constants import EPS
from leapquant.tools.workloads import fill, regimes_within

from .strategies import Case, build_case, cases, default_geometry, random_bits


def assert_untouched_and_reset(pool, before, idx, due):
    n, heads = due.cpu().nonzero(as_tuple=True)
    bad = parity.untouched_failures(pool, before, idx.cpu().long()[n], heads)
    assert not bad, bad


def check_case(case: Case, backend: str):
    pool, idx = case.pool, case.idx
    due = pool.due(idx)
    ptrs = {n: getattr(pool, n).data_ptr() for n in ("raw", "w", "pcum")}
    # out-of-range entries are rejected by check=True; the kernels must still skip them with check=False
    pad = 0 if pool.convention == "vllm" else -1
    in_range = bool(((idx >= pad) & (idx < pool.num_slots)).all())
    p = parity.measure(pool, idx, backend, check=in_range)
    assert {n: getattr(pool, n).data_ptr() for n in ptrs} == ptrs, "flush must work in place"
    assert p.count == int(due.sum())
    assert p.backend_ok() and not p.untouched, f"{case}: {p.failures()} {p.summary()}"
    return p


@given(data=st.data())
def test_flush_meets_spec(backend_device, data):
    backend, device = backend_device
    check_case(data.draw(cases(device=device, backend=backend)), backend)


@given(seed=st.integers(0, 2**31 - 1), gate=st.sampled_from(["kda", "gdn"]),
       convention=st.sampled_from(["vllm", "sglang"]))
@settings(max_examples=4)
def test_untouched_bytes_on_random_pool(backend_device, seed, gate, convention):
    """Fill every byte of the pool with random bits (NaNs included), make a few programs valid and due, flush:
    nothing else may change, bit for bit."""
    backend, device = backend_device
    gen = torch.Generator().manual_seed(seed)
    H = default_geometry(backend, 3)["heads"]
    pool = leapquant.Pool(6, H, 128, 128, 16, 4, gate=gate, convention=convention, device=device)
    for name in parity.POOL_TENSORS:
        if name != "hcnt" and getattr(pool, name) is not None:
            random_bits(getattr(pool, name), gen)
    pool.hcnt.copy_(torch.randint(-1000, 1000, pool.hcnt.shape, generator=gen).to(device))
    pool.hcnt[pool.hcnt == pool.ring] = 0
    slots = torch.tensor([2, 4])
    due = torch.zeros(2, H, dtype=torch.bool)
    due[0, 0::2] = True
    due[1, 1] = True
    fill(pool, slots, "gaussian", gen, due=due)
    pool.hcnt[3] = pool.ring  # due counters but a row of idx never names slot 3
    pad = 0 if convention == "vllm" else -1
    idx = torch.tensor([4, pad, 2, 6, -5 if convention == "vllm" else 9], dtype=torch.int32, device=device)
    before = parity.snapshot(pool)
    flush_due = pool.due(idx)
    assert int(flush_due.sum()) == int(due.sum())
    leapquant.flush(pool, idx, backend=backend, check=False)
    assert_untouched_and_reset(pool, before, idx, flush_due)


def test_zero_state(backend_device):
    """S = 0 gives all-zero codes and factors with s_k = s_v = EPS (SPEC §4)."""
    backend, device = backend_device
    for gate in ("kda", "gdn"):
        pool = leapquant.Pool(3, **default_geometry(backend), gate=gate, device=device)
        # the null slot 0 is poisoned and must stay so; the due slots start from scales of 1, not EPS, so the
        # check below sees that they were written
        pool.codes[0].fill_(77)
        pool.s_kv[0].fill_(float("nan"))
        pool.uq[0].fill_(float("nan"))
        pool.s_kv[1:].fill_(1.0)
        # weights on zero entries: the ring adds nothing to S = 0, but it is not empty, so the flush runs (SPEC §2)
        pool.w[1:].fill_(0.5)
        pool.hcnt.fill_(pool.ring)
        idx = torch.tensor([1, 2, 0], dtype=torch.int32, device=device)
        leapquant.flush(pool, idx, backend=backend)
        assert (pool.codes[1:] == 0).all()
        assert (pool.s_kv[1:] == torch.tensor(EPS, dtype=torch.float32)).all()
        assert (pool.uq[1:] == 0).all()
        assert (pool.codes[0] == 77).all() and pool.s_kv[0].isnan().all(), "the null slot was written"


@pytest.mark.parametrize("log2_scale", [-40, -24, -10, 0, 14, 24, 40])
def test_value_domain(backend_device, log2_scale):
    """Finite outputs within the SPEC bounds over the backend's claimed max|S| domain (reference and Triton: 2^-40 to
    2^40, SPEC §4; TileLang: the seed's, up to 2^14), both gates."""
    backend, device = backend_device
    lo, hi = leapquant.get_backend(backend).requirements.magnitude
    if not lo <= 2.0**log2_scale <= hi:
        pytest.skip(f"{backend} claims max|S| in [2^{math.log2(lo):.0f}, 2^{math.log2(hi):.0f}] only")
    for gate in ("kda", "gdn"):
        pool = leapquant.Pool(3, **default_geometry(backend), gate=gate, device=device)
        gen = torch.Generator().manual_seed(log2_scale + 100)
        fill(pool, [1, 2], "gaussian", gen)
        # scale checkpoint (s_v and the factors' u side) and ring alike: S scales exactly by 2^e, up to fp16 range
        e = log2_scale - 3  # gaussian states reach ~2^3
        pool.s_v.mul_(2.0**e)
        pool.ubuf.mul_(2.0**e)
        pool.u.copy_((pool.u.float() * 2.0**e).clamp(-65504, 65504).half())
        p = parity.measure(pool, torch.tensor([1, 2], dtype=torch.int32, device=device), backend)
        assert p.count == 2 * pool.heads and p.finite
        assert p.backend_ok(), (log2_scale, gate, p.failures())
        assert math.isfinite(float(pool.s_kv[1:].abs().max()))


@pytest.mark.slow  # python -m pytest -m slow (CI runs it)
@pytest.mark.parametrize("gate", ["kda", "gdn"])
def test_batch_rms(backend_device, gate):
    """Over a batch of every regime, the RMS of err_backend / err_ref stays <= 1.003 (SPEC §4)."""
    backend, device = backend_device
    parts = []
    regimes = regimes_within(leapquant.get_backend(backend).requirements.magnitude)
    for i, regime in enumerate(regimes):
        case = build_case(**default_geometry(backend, 4), head_k=128, head_v=128, ring=16, rank=4, gate=gate, convention="vllm",
                          regime=regime, rows=2, due_frac=1.0, padding=1, seed=1000 + i, device=device)
        parts.append(check_case(case, backend))
    p = parity.Parity.concat(parts)
    assert p.count == 2 * case.pool.heads * len(regimes)
    assert p.rms_ratio() <= parity.BACKEND_RMS, p.summary()


def test_run_equals_flush(backend_device):
    backend, device = backend_device
    gen = torch.Generator().manual_seed(7)
    for gate in ("kda", "gdn"):
        pool = leapquant.Pool(4, **default_geometry(backend), gate=gate, device=device)
        fill(pool, [1, 2, 3], "lowrank", gen)
        c = pool.checkpoint([1, 2, 3])
        c = {k: (v.clone() if v is not None else None) for k, v in c.items()}
        out = leapquant.run(c["codes"], c["s_k"], c["s_v"], c["u"], c["q"], c["kbuf"], c["ubuf"], c["gbuf"],
                            c["w"], c["pcum"], pool.q0, backend=backend)
        for t in out:
            assert t.data_ptr() != pool.raw.data_ptr()
        leapquant.flush(pool, torch.tensor([1, 2, 3], dtype=torch.int32, device=device), backend=backend)
        mine = (pool.codes[1:4], pool.s_k[1:4], pool.s_v[1:4], pool.u[1:4], pool.q[1:4])
        for a, b in zip(out, mine):
            assert torch.equal(a.view(torch.uint8), b.contiguous().view(torch.uint8))
