"""``leapquant.step``, the decode step (SPEC §6), through the reference backend: its output against FLA's exact
recurrences, against the state the pool holds after the token, its in-place effects, and its interface (the engines'
tensor forms as views, ``out=``, padding rows, errors, ``torch.compile``)."""

import pytest
import torch

import leapquant
from leapquant import parity
from leapquant import formulas as ref
from leapquant.checks import token_rows
from leapquant.tools.workloads import fill

fla_kda = pytest.importorskip("fla.ops.kda.naive")
fla_gdn = pytest.importorskip("fla.ops.gated_delta_rule.naive")


def _stream(gate, B, T, H, HV, K, V, seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, HV, V, generator=gen)
    shape = (B, T, HV, K) if gate == "kda" else (B, T, HV)
    g = -0.2 * torch.rand(*shape, generator=gen)
    beta = torch.rand(B, T, HV, generator=gen)
    return q, k, v, g, beta


def _exact(gate, q, k, v, g, beta, l2norm):
    """FLA's float64 recurrence over the stream, from a zero state: the output per token [B, T, HV, V]."""
    if l2norm:
        q, k = ref.l2norm(q.double()), ref.l2norm(k.double())
    d = [t.double() for t in (q, k, v, g, beta)]
    if gate == "kda":
        o, _ = fla_kda.naive_recurrent_kda(*d)
    else:
        G = v.shape[2] // q.shape[2]
        qq, kk = d[0].repeat_interleave(G, 2), d[1].repeat_interleave(G, 2)
        o, _ = fla_gdn.naive_recurrent_gated_delta_rule(qq, kk, d[2], d[4], d[3])
    return o


@pytest.mark.parametrize("gate,H,l2norm", [("kda", 2, False), ("kda", 1, True), ("gdn", 2, True), ("gdn", 4, False)])
def test_decode_tracks_the_exact_recurrence(gate, H, l2norm):
    """Two and a half rings of tokens (flushed inside the step) track FLA's float64 recurrence: the output's relative
    error stays at the bf16 ring's and int8 checkpoint's level, and does not grow with the flushes."""
    B, T, HV, K, V = 2, 40, 4, 128, 128
    q, k, v, g, beta = _stream(gate, B, T, H, HV, K, V, seed=11)
    exact = _exact(gate, q, k, v, g, beta, l2norm)
    pool = leapquant.Pool(B + 1, HV, K, V, gate=gate)
    idx = torch.arange(1, B + 1, dtype=torch.int32)
    errs = []
    for t in range(T):
        o = leapquant.step(pool, idx, q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], use_qk_l2norm=l2norm,
                           backend="reference")
        errs.append(float((o.double() - exact[:, t]).norm() / exact[:, t].norm()))
        assert int(pool.hcnt[1, 0]) == t % pool.ring + 1
    assert max(errs) < 0.02, errs
    assert sum(errs[-8:]) / 8 < 2 * sum(errs[8:16]) / 8 + 1e-3, errs  # no upward trend across two flushes


@pytest.mark.parametrize("gate", ["kda", "gdn"])
def test_output_is_the_state_after_the_token_times_q(gate):
    """o = scale S_t q, with S_t rebuilt independently from the pool after the step (SPEC §3 steps 1-4), for rings
    at every fill; and the ring update is Pool.append's."""
    HV, K, V, L = 2, 64, 64, 8
    pool = leapquant.Pool(4, HV, K, V, L, 2, gate=gate)
    gen = torch.Generator().manual_seed(5)
    fill(pool, [1, 2, 3], "gaussian", gen)
    pool.hcnt[1:] = torch.tensor([[0, 3], [7, 1], [L, L]], dtype=torch.int32)  # slot 3's rings full: flushed first
    for s, h in ((1, 0), (1, 1), (2, 0), (2, 1)):  # entries past the fill hold what a flush leaves
        j = int(pool.hcnt[s, h])
        pool.w[s, h, j:] = 0
        if gate == "kda":
            pool.gbuf[s, h, j:] = 1
    twin = leapquant.Pool(4, HV, K, V, L, 2, gate=gate)
    parity.restore(twin, parity.snapshot(pool))
    idx = torch.tensor([3, 1, 2], dtype=torch.int32)
    q, k, v, g, beta = (t[:, 0] for t in _stream(gate, 3, 1, HV, HV, K, V, seed=6))
    o = leapquant.step(pool, idx, q, k, v, g, beta, scale=0.5, backend="reference")
    S = ref.rebuild(**pool.checkpoint(idx.long()), gate=gate)  # [3, HV, V, K]
    want = 0.5 * torch.einsum("nhvk,nhk->nhv", S, q)
    assert torch.allclose(o, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    assert pool.hcnt[1:].tolist() == [[1, 4], [8, 2], [1, 1]]
    leapquant.flush(twin, torch.tensor([3], dtype=torch.int32), backend="reference")
    twin.append(idx, k, v, g, beta)
    assert parity.snapshot(twin).keys() == parity.snapshot(pool).keys()
    for name, b in parity.snapshot(twin).items():
        assert torch.equal(b, parity.snapshot(pool)[name]), name


def test_padding_rows_and_untouched_slots():
    """Padding rows (0 under vLLM's convention, out-of-range values with check=False) get o = 0; nothing of any slot
    that no row names changes, bit for bit."""
    pool = leapquant.Pool(6, 2, 64, 64, 8, 2, gate="kda")
    fill(pool, [1, 2, 3, 4, 5], "lowrank", torch.Generator().manual_seed(2))
    pool.hcnt[1:] = 3
    before = parity.snapshot(pool)
    idx = torch.tensor([0, 4, 9, 2], dtype=torch.int32)
    q, k, v, g, beta = (t[:, 0] for t in _stream("kda", 4, 1, 1, 2, 64, 64, seed=3))
    o = leapquant.step(pool, idx, q, k, v, g, beta, backend="reference", check=False)
    assert (o[[0, 2]] == 0).all() and (o[[1, 3]] != 0).any()
    after = parity.snapshot(pool)
    for name in ("kbuf", "ubuf", "w", "pcum", "gbuf", "hcnt"):
        per_slot = after[name].view(pool.num_slots, -1)
        old = before[name].view(pool.num_slots, -1)
        for s in (0, 1, 3, 5):
            assert torch.equal(per_slot[s], old[s]), (name, s)
    assert torch.equal(after["raw"], before["raw"])  # no ring was full: no checkpoint written


def test_engine_forms_are_views_and_out_is_written_in_place():
    """[B, 1, H, K] and [1, B, H, K] inputs are taken as views, give the [B, H, K] result bit for bit; out= (also
    [B, 1, HV, V]) receives o in place and the call returns a view of it."""
    B, H, HV, K, V = 3, 1, 2, 64, 64
    x = torch.randn(B, 1, H, K)
    assert token_rows(x, "q", 3, B).data_ptr() == x.data_ptr()
    assert token_rows(x.transpose(0, 1), "q", 3, B).data_ptr() == x.data_ptr()
    q, k, v, g, beta = (t[:, 0] for t in _stream("gdn", B, 1, H, HV, K, V, seed=8))
    results = []
    for form in ("plain", "b1", "1b"):
        pool = leapquant.Pool(B + 1, HV, K, V, 8, 2, gate="gdn")
        idx = torch.arange(1, B + 1, dtype=torch.int32)
        args = [q, k, v, g, beta]
        if form == "b1":
            args = [a.unsqueeze(1) for a in args]
        elif form == "1b":
            args = [a.unsqueeze(0) for a in args]
        out = torch.full((B, 1, HV, V), float("nan"))
        o = leapquant.step(pool, idx, *args, out=out, backend="reference")
        assert o.data_ptr() == out.data_ptr() and torch.equal(o, out[:, 0])
        results.append(o.clone())
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_inputs_give_output_in_their_dtype(dtype):
    B, HV, K, V = 2, 2, 64, 64
    q, k, v, g, beta = (t[:, 0] for t in _stream("kda", B, 1, HV, HV, K, V, seed=9))
    pool = leapquant.Pool(B + 1, HV, K, V, 8, 2, gate="kda")
    twin = leapquant.Pool(B + 1, HV, K, V, 8, 2, gate="kda")
    idx = torch.arange(1, B + 1, dtype=torch.int32)
    o = leapquant.step(pool, idx, *(t.to(dtype) for t in (q, k, v, g, beta)), backend="reference")
    o32 = leapquant.step(twin, idx, *(t.to(dtype).float() for t in (q, k, v, g, beta)), backend="reference")
    assert o.dtype == dtype and torch.equal(o, o32.to(dtype))


def test_bad_inputs_are_named():
    pool = leapquant.Pool(3, 2, 64, 64, 8, 2, gate="kda")
    idx = torch.tensor([1, 2], dtype=torch.int32)
    q, k, v, g, beta = (t[:, 0] for t in _stream("kda", 2, 1, 2, 2, 64, 64, seed=1))
    cases = [
        (dict(q=q[:, :, :32]), ValueError, "q must be"),
        (dict(k=k[:1]), ValueError, "k has 1 rows"),
        (dict(v=v.to(torch.int32)), TypeError, "v must be float32"),
        (dict(g=g[..., 0]), ValueError, "g must have 3 dimensions"),
        (dict(beta=beta.t().contiguous().t()), ValueError, "beta must have a unit stride"),
        (dict(q=torch.randn(3, 2, 2, 64)), ValueError, "one of its first two must be 1"),
        # [B, T, H, K] with T > 1 is a step of T tokens (SPEC §6.1): every token tensor then has the axis
        (dict(q=torch.randn(2, 2, 2, 64)), ValueError, "k must be \\[B, T, ...\\] with B = 2 rows and T = 2"),
        (dict(out=torch.empty(2, 2, 64, dtype=torch.bfloat16)), TypeError, "out must have q's dtype"),
        (dict(q=torch.randn(2, 3, 64)), ValueError, "H dividing HV"),
    ]
    for change, err, msg in cases:
        args = dict(q=q, k=k, v=v, g=g, beta=beta) | change
        with pytest.raises(err, match=msg):
            leapquant.step(pool, idx, backend="reference", **args)
    with pytest.raises(ValueError, match="more than once"):
        leapquant.step(pool, torch.tensor([1, 1], dtype=torch.int32), q, k, v, g, beta, backend="reference")
    with pytest.raises(leapquant.BackendError):
        leapquant.step(pool, idx, q, k, v, g, beta, backend="tilelang")


@pytest.mark.parametrize("pool_gate", ["kda", "gdn"])
def test_a_gate_of_the_other_kind_is_named(pool_gate):
    """A KDA-shaped ``g`` on a GDN pool (and the reverse) is refused with a message that says which gate the pool
    takes and its shape, whatever form the tensor's dimensions happen to fit."""
    B, HV, K = 2, 2, 64
    pool = leapquant.Pool(B + 1, HV, K, K, 8, 2, gate=pool_gate)
    idx = torch.tensor([1, 2], dtype=torch.int32)
    q, k, v, beta = torch.randn(B, HV, K), torch.randn(B, HV, K), torch.randn(B, HV, K), torch.rand(B, HV)
    want = r"the GDN gate here, \[B, HV\]" if pool_gate == "gdn" else r"the KDA gate here, \[B, HV, K\]"
    other = [torch.zeros(B, HV, K), torch.zeros(B, 1, HV, K)] if pool_gate == "gdn" else [torch.zeros(B, HV)]
    for g in other:
        with pytest.raises(ValueError, match=want):
            leapquant.step(pool, idx, q, k, v, g, beta, backend="reference")


def test_step_under_torch_compile():
    """``leapquant.step(..., check=False)`` compiles with fullgraph=True (the custom op leapquant::step) and gives the
    eager call's output and pool bytes."""
    B, HV, K, V = 2, 2, 64, 64
    q, k, v, g, beta = (t[:, 0] for t in _stream("kda", B, 1, HV, HV, K, V, seed=4))
    pools = [leapquant.Pool(B + 1, HV, K, V, 8, 2, gate="kda") for _ in range(2)]
    idx = torch.arange(1, B + 1, dtype=torch.int32)

    @torch.compile(backend="eager", fullgraph=True)
    def compiled(q):
        return leapquant.step(pools[0], idx, q, k, v, g, beta, backend="reference", check=False)

    o_c = compiled(q)
    o_e = leapquant.step(pools[1], idx, q, k, v, g, beta, backend="reference")
    assert torch.equal(o_c, o_e)
    for name, b in parity.snapshot(pools[1]).items():
        assert torch.equal(b, parity.snapshot(pools[0])[name]), name


def test_demo_decodes_against_the_exact_recurrence(capsys):
    """``python -m leapquant demo``, the main job, on a small batch: it decodes through leapquant.step, flushes
    inside, and reports the output error against the float64 recurrence (exit 0 only under 5 %)."""
    from leapquant.__main__ import main

    assert main(["demo", "--seqs", "2", "--heads", "4", "--key-heads", "2", "--tokens", "20", "--gate", "gdn"]) == 0
    text = capsys.readouterr().out
    assert "tokens/s" in text and "1 flush inside" in text and "output error against the exact recurrence" in text
