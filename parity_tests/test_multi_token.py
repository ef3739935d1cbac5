"""Steps of T tokens per row and their rollback (SPEC §6.1), on the reference backend.

The oracle is the one-token step the rest of the suite holds to the contract: a pool that took a T-token call must
hold what a twin holds after the same flush (the rings that cannot hold T more entries) and T one-token
``leapquant.step`` calls; after ``accept(n)``, what a twin holds after that flush and n one-token calls (bit for bit
in every byte something reads: the fill counts, ``pcum``, ``w``, the checkpoints, the ring entries below the count),
and both go on alike: the next step's output, ``states()`` and a forced flush.
"""

from __future__ import annotations

import pytest
import torch

import leapquant
from leapquant import parity
from leapquant.reference import ReferenceBackend
from leapquant.tools.workloads import fill

REF = ReferenceBackend()
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _pool(gate: str, T: int, L: int = 8, HV: int = 4, seed: int = 0, counts=None, max_tokens=None, dim: int = 64):
    """A pool of 6 slots (slot 0 the vLLM null slot) of ``dim`` x ``dim`` heads, rings filled by the gaussian
    workload, counts as given."""
    gen = torch.Generator().manual_seed(seed)
    pool = leapquant.Pool(6, HV, dim, dim, L, 2, gate=gate, max_tokens=max_tokens or T)
    slots = torch.arange(1, 6)
    fill(pool, slots, "gaussian", gen)
    if counts is None:
        counts = torch.randint(0, L + 1, (5, HV), generator=gen)
    pool.hcnt[1:6] = torch.as_tensor(counts, dtype=torch.int32)
    L_ = pool.ring
    past = torch.arange(L_) >= pool.hcnt[..., None]  # entries past the count hold what a flush leaves
    pool.w.masked_fill_(past, 0.0)
    if pool.gbuf is not None:
        pool.gbuf.masked_fill_(past[..., None], 1.0)
    return pool, gen


def _tokens(pool, B: int, T: int, H: int, gen):
    K, V, HV = pool.head_k, pool.head_v, pool.heads
    rnd = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    g = (-0.3 * torch.rand(B, T, HV, K, generator=gen) if pool.gate == "kda"
         else -0.3 * torch.rand(B, T, HV, generator=gen))
    return dict(q=rnd(B, T, H, K), k=torch.nn.functional.normalize(rnd(B, T, H, K), dim=-1), v=rnd(B, T, HV, V),
                g=g, beta=torch.rand(B, T, HV, generator=gen))


def _twin(pool, device=None):
    """A pool holding ``pool``'s bytes and history (parity.twin makes one without), on ``device`` (default
    ``pool``'s)."""
    g = pool.geometry
    other = leapquant.Pool(g.num_slots, g.heads, g.head_k, g.head_v, g.ring, g.rank, gate=g.gate,
                           q0=pool.q0.clone(), max_tokens=pool.history.max_tokens, device=device or pool.device)
    parity.restore(other, parity.snapshot(pool))
    for name in ("start", "count", "pcum", "w"):
        getattr(other.history, name).copy_(getattr(pool.history, name))
    return other


def _one_by_one(pool, idx, tok: dict, n: int):
    """The oracle: the flush of the rings that cannot hold T more (the room rule of SPEC §6.1), then n one-token
    steps through the public API; returns their outputs ``[B, n, HV, V]``."""
    T = tok["q"].shape[1]
    REF.flush(pool, idx, T)
    outs = [leapquant.step(pool, idx, *(tok[x][:, t] for x in ("q", "k", "v", "g", "beta")), backend="reference")
            for t in range(n)]
    return torch.stack(outs, 1) if outs else None


def _read_bytes_equal(a, b) -> list[str]:
    """The names of the tensors whose bytes something reads differ: counts, gates, weights, checkpoints, and the
    ring entries below each count (entries at or past it are never read, SPEC §6)."""
    bad = [n for n in ("hcnt", "pcum", "w", "raw") if not torch.equal(parity.as_bytes(getattr(a, n)),
                                                                       parity.as_bytes(getattr(b, n)))]
    from leapquant.formulas import ring_empty

    L = a.ring
    # a full ring is read whole (by its flush); a flushed one (count L, the state a flush leaves) not at all
    j = torch.where((a.hcnt >= L) & ring_empty(a.w, a.pcum, a.gate), torch.zeros_like(a.hcnt), a.hcnt)
    live = torch.arange(L, device=j.device) < j[..., None]
    for n in ("kbuf", "ubuf", "gbuf"):
        x, y = getattr(a, n), getattr(b, n)
        if x is not None and not torch.equal(x[live], y[live]):
            bad.append(n)
    return bad


CASES = [("kda", 2, 2), ("gdn", 2, 1), ("kda", 4, 2), ("gdn", 3, 4), ("kda", 8, 4), ("gdn", 8, 2)]


@pytest.mark.parametrize("gate,T,H", CASES, ids=[f"{g}-T{t}-H{h}" for g, t, h in CASES])
def test_tokens_match_one_token_steps(gate, T, H):
    """A T-token call (grouped value heads when H < HV; rings full, flushed, partial, empty) equals the room
    flush then T one-token steps: the outputs and every byte read."""
    L = 16 if T > 4 else 8
    pool, gen = _pool(gate, T, L=L, seed=T)
    idx = torch.tensor([2, 0, 5, 1, 3], dtype=torch.int32)  # row 1 pads (vLLM)
    tok = _tokens(pool, idx.numel(), T, H, gen)
    other = _twin(pool)
    o = leapquant.step(pool, idx, **tok, backend="reference")
    want = _one_by_one(other, idx, tok, T)
    assert o.shape == (idx.numel(), T, pool.heads, pool.head_v)
    assert torch.equal(o, want)
    assert bool((o[1] == 0).all()), "a padding row's output is 0"
    assert _read_bytes_equal(pool, other) == []


@pytest.mark.parametrize("gate", ["kda", "gdn"])
def test_room_rule(gate):
    """Exactly the (slot, head) pairs whose ring holds an entry and cannot hold T more are flushed first: their
    checkpoint changes and the call starts them at entry 0; the others keep their checkpoint."""
    T, L = 3, 8
    counts = torch.tensor([[0, 1, 5, 6], [7, 8, 3, 2], [8, 8, 8, 8], [4, 5, 6, 0], [1, 2, 3, 4]])
    pool, gen = _pool(gate, T, L=L, counts=counts)
    before = pool.codes.clone()
    idx = torch.arange(1, 6, dtype=torch.int32)
    leapquant.step(pool, idx, **_tokens(pool, 5, T, 4, gen), backend="reference")
    due = (counts >= 1) & (counts + T > L)
    changed = (pool.codes[1:6] != before[1:6]).flatten(2).any(-1)
    assert torch.equal(changed, due)
    assert torch.equal(pool.history.start[1:6], torch.where(due, torch.full_like(counts, L), counts).int())
    assert torch.equal(pool.hcnt[1:6], torch.where(due, torch.zeros_like(counts), counts).int() + T)


@pytest.mark.parametrize("gate,T", [("kda", 3), ("gdn", 4)])
def test_accept_matches_a_pool_of_the_accepted_tokens(gate, T):
    """After ``accept`` with every ``num_accepted`` in 0..T (one value per row), the pool holds what a twin holds
    after the room flush and that many one-token steps, and both go on alike: the next token's output, the states
    and a forced flush."""
    L = 8
    for n_first in range(T + 1):
        pool, gen = _pool(gate, T, L=L, seed=10 + n_first)
        idx = torch.tensor([4, 1, 0, 3, 2], dtype=torch.int32)
        B = idx.numel()
        n = torch.tensor([n_first, (n_first + 1) % (T + 1), 0, T, (n_first + 2) % (T + 1)], dtype=torch.int32)
        tok = _tokens(pool, B, T, 2, gen)
        other = _twin(pool)
        leapquant.step(pool, idx, **tok, backend="reference")
        leapquant.accept(pool, idx, n)
        # the oracle: each row's own number of one-token steps after the room flush
        REF.flush(other, idx, T)
        for t in range(T):
            rows = (n > t) & (idx != 0)
            if bool(rows.any()):
                sub = idx[rows]
                leapquant.step(other, sub, *(tok[x][rows, t] for x in ("q", "k", "v", "g", "beta")),
                               backend="reference")
        assert _read_bytes_equal(pool, other) == [], n.tolist()
        nxt = _tokens(pool, B, 1, 2, gen)
        args = [nxt[x][:, 0] for x in ("q", "k", "v", "g", "beta")]
        assert torch.equal(leapquant.step(pool, idx, *args, backend="reference"),
                           leapquant.step(other, idx, *args, backend="reference"))
        slots = torch.arange(1, 6)
        assert torch.equal(pool.states(slots, backend="reference"), other.states(slots, backend="reference"))
        leapquant.flush(pool, idx, force=True, backend="reference")
        leapquant.flush(other, idx, force=True, backend="reference")
        assert _read_bytes_equal(pool, other) == []


def test_step_num_accepted_is_accept_then_step():
    """``step(..., num_accepted=n)`` is ``accept(n)`` then the step."""
    pool, gen = _pool("kda", 2, seed=3)
    idx = torch.tensor([1, 2, 3], dtype=torch.int32)
    leapquant.step(pool, idx, **_tokens(pool, 3, 2, 4, gen), backend="reference")
    other = _twin(pool)
    n = torch.tensor([0, 2, 1], dtype=torch.int32)
    tok = _tokens(pool, 3, 2, 4, gen)
    o = leapquant.step(pool, idx, **tok, num_accepted=n, backend="reference")
    leapquant.accept(other, idx, n)
    assert torch.equal(o, leapquant.step(other, idx, **tok, backend="reference"))
    assert _read_bytes_equal(pool, other) == []


@pytest.mark.parametrize("gate,T,backend", [("kda", 3, "reference"), ("gdn", 2, "reference"), ("kda", 2, "triton")])
def test_tokens_and_accept_under_torch_compile(gate, T, backend):
    """A T-token step, ``accept`` and ``step(..., num_accepted=)`` compile with fullgraph=True (the custom ops
    leapquant::step_tokens and leapquant::accept, which declare the history they write) and give the eager calls'
    outputs, pool bytes and history; with ``check=True`` a value out of range raises inside the compiled call."""
    if backend == "triton":
        pytest.importorskip("triton")
    made, gen = _pool(gate, T, seed=50 + T)
    pool, other = _twin(made, DEVICE), _twin(made, DEVICE)
    idx = torch.tensor([2, 0, 5, 1], dtype=torch.int32, device=DEVICE)
    first, second = ({name: t.to(DEVICE) for name, t in _tokens(made, idx.numel(), T, 2, gen).items()}
                     for _ in range(2))
    n = torch.tensor([1, 0, T, 0], dtype=torch.int32, device=DEVICE)

    @torch.compile(backend="eager", fullgraph=True)
    def compiled(tok, n, again):
        o1 = leapquant.step(pool, idx, **tok, backend=backend, check=False)
        leapquant.accept(pool, idx, n, check=False, backend=backend)
        o2 = leapquant.step(pool, idx, **again, num_accepted=n, backend=backend, check=False)
        return o1, o2

    got = compiled(first, n, second)
    want = (leapquant.step(other, idx, **first, backend=backend),)
    leapquant.accept(other, idx, n, backend=backend)
    want += (leapquant.step(other, idx, **second, num_accepted=n, backend=backend),)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert _read_bytes_equal(pool, other) == []
    for name in ("start", "count", "pcum", "w"):
        assert torch.equal(getattr(pool.history, name), getattr(other.history, name)), name

    @torch.compile(backend="eager", fullgraph=True)
    def checked(n):
        leapquant.accept(pool, idx, n, backend=backend)

    with pytest.raises(ValueError, match="outside 0 .. T"):
        checked(torch.tensor([T + 1, 0, 0, 0], dtype=torch.int32, device=DEVICE))


def test_history_from_tensors_checks_each_tensor():
    """How the custom ops rebuild a pool's history: the tensors taken as they are, each one's form checked against
    the pool, a wrong one named."""
    from leapquant.pool import History

    pool, _ = _pool("kda", 3)
    start, count, pcum, w = pool.history.tensors()
    hist = History.from_tensors(pool, start, count, pcum, w)
    assert hist.max_tokens == 3 and hist.pcum is pcum and hist.w is w
    with pytest.raises(ValueError, match="history's count must be a contiguous torch.int32"):
        History.from_tensors(pool, start, count.long(), pcum, w)
    with pytest.raises(ValueError, match="history's w must be"):
        History.from_tensors(pool, start, count, pcum, w[:, :, :3])
    with pytest.raises(ValueError, match="T must lie in 2..L/2 = 4"):
        History.from_tensors(pool, start, count, pcum[:, :, :2], w[:, :, :2])
    with pytest.raises(TypeError, match="history's start must be a torch.Tensor"):
        History.from_tensors(pool, None, count, pcum, w)


def test_accept_leaves_padding_and_unnamed_slots():
    """Rows that name no real slot, and slots no row names, keep every byte."""
    pool, gen = _pool("gdn", 2, seed=4)
    idx = torch.tensor([1, 0, 2], dtype=torch.int32)
    leapquant.step(pool, idx, **_tokens(pool, 3, 2, 4, gen), backend="reference")
    before = parity.snapshot(pool)
    leapquant.accept(pool, idx, torch.tensor([1, 0, 0], dtype=torch.int32))
    after = parity.snapshot(pool)
    for name in ("hcnt", "w", "pcum"):
        shape = getattr(pool, name).shape
        b, a = (x.view(shape[0], -1) for x in (before[name], after[name]))
        assert torch.equal(a[[0, 3, 4, 5]], b[[0, 3, 4, 5]]), name


@pytest.mark.parametrize("gate", ["kda", "gdn"])
def test_triton_accept_writes_the_torch_bytes(gate):
    """The Triton backend's accept kernel (the interpreter on a CPU) writes what the torch form writes, bit for bit:
    a slot named twice (the first row's values), padding rows, values outside 0..T clamped (``check=False``), rings
    that were full before the call, and no byte of any other slot."""
    pytest.importorskip("triton")
    T = 3
    made, gen = _pool(gate, T, L=8, seed=40, counts=torch.tensor([[8, 2, 0, 5]] * 5))
    idx = torch.tensor([2, 0, 5, 1, 3], dtype=torch.int32)
    leapquant.step(made, idx, **_tokens(made, idx.numel(), T, 2, gen), backend="reference")
    pool = _twin(made, DEVICE)
    other = _twin(made, DEVICE)
    again = torch.tensor([3, 0, 5, 1, 3, 2, 0], dtype=torch.int32, device=DEVICE)  # slot 3 twice
    n = torch.tensor([1, 2, 9, -4, 0, 3, 1], dtype=torch.int32, device=DEVICE)
    leapquant.accept(pool, again, n, check=False, backend="triton")
    leapquant.accept(other, again, n, check=False, backend="reference")
    a, b = parity.snapshot(pool), parity.snapshot(other)
    assert [k for k in a if not torch.equal(parity.as_bytes(a[k]), parity.as_bytes(b[k]))] == []
    for name in ("start", "count", "pcum", "w"):
        assert torch.equal(getattr(pool.history, name), getattr(other.history, name)), name
    # the accepted counts themselves, from the oracle's rule: slot 3 takes its first row's 1, slot 1 takes 0
    hist = made.history
    start = hist.start.to(DEVICE)
    j0 = torch.where(start >= 8, torch.zeros_like(start), start)
    assert torch.equal(pool.hcnt[3], (j0[3] + 1).int()) and torch.equal(pool.hcnt[1], start[1])
    assert torch.equal(pool.hcnt[5], (j0[5] + T).int())  # 9 clamped to T


def test_errors():
    pool, gen = _pool("kda", 2, L=8, seed=5)
    idx = torch.tensor([1, 2], dtype=torch.int32)
    with pytest.raises(ValueError, match="at most L / 2 = 4 tokens"):
        leapquant.step(pool, idx, **_tokens(pool, 2, 5, 4, gen), backend="reference")
    with pytest.raises(ValueError, match="history for 2 tokens"):
        leapquant.step(pool, idx, **_tokens(pool, 2, 3, 4, gen), backend="reference")
    tok = _tokens(pool, 2, 2, 4, gen)
    tok["v"] = tok["v"][:, :1]
    with pytest.raises(ValueError, match="v must be \\[B, T, ...\\]"):
        leapquant.step(pool, idx, **tok, backend="reference")
    leapquant.step(pool, idx, **_tokens(pool, 2, 2, 4, gen), backend="reference")
    with pytest.raises(ValueError, match="outside 0 .. T = 2"):
        leapquant.accept(pool, idx, torch.tensor([3, 0], dtype=torch.int32))
    with pytest.raises(ValueError, match="int32 or int64"):
        leapquant.accept(pool, idx, torch.tensor([1.0, 0.0]))
    with pytest.raises(ValueError, match="max_tokens"):
        leapquant.Pool(3, 2, 64, 64, 8, 2, max_tokens=5)
    plain = leapquant.Pool(3, 2, 64, 64, 8, 2)
    with pytest.raises(ValueError, match="max_tokens=T"):
        leapquant.accept(plain, idx, torch.tensor([1, 0], dtype=torch.int32))


# (gate, T, key heads, kernel, K = V, ring, tokens per launch): the Gluon kernel's cases need a GPU (it has no
# interpreter); it takes at most 4 tokens a launch, so T = 5, 6 and 8 run as two launches (as the CPU's cases with a
# smaller bound). KDA T = 8 with 4 key heads (seed 28) draws a row whose output cancels: the fp32 reference is 1.9e-5
# from both Triton kernels, which agree with each other to 1e-10 (their checkpoint sums are exact); 2 key heads draw
# other tokens
TRITON_CASES = [("kda", 3, 2, None, 64, 8, None), ("gdn", 2, 1, None, 64, 8, None), ("kda", 2, 4, "fma", 64, 8, None),
                ("kda", 3, 2, None, 64, 8, 2), ("gdn", 4, 2, "fma", 64, 8, 3),
                ("kda", 4, 2, "gluon", 128, 16, None), ("gdn", 8, 4, "gluon", 128, 16, None),
                ("kda", 8, 2, "gluon", 128, 16, None), ("kda", 5, 2, "gluon", 128, 16, None),
                ("gdn", 6, 2, "gluon", 128, 16, None), ("kda", 8, 2, "gluon", 128, 16, 8)]


@pytest.mark.parametrize("gate,T,H,kernel,dim,L,per_launch", TRITON_CASES,
                         ids=[f"{c[0]}-T{c[1]}-{c[3] or 'auto'}" + (f"-by{c[6]}" if c[6] else "")
                              for c in TRITON_CASES])
def test_triton_tokens_and_accept(gate, T, H, kernel, dim, L, per_launch):
    """The Triton step of T tokens (one launch, the checkpoint read once; the interpreter on a CPU), token by token
    against the reference's one-token step on the state the kernel itself left before that token (its checkpoint, its
    ring entries, its recorded ``pcum`` and ``w``): SPEC §6's criteria per token (``o`` within 1e-5, the new ``ubuf``
    entry within one bf16 ulp, the new ``kbuf`` / ``gbuf`` entries, ``pcum`` and ``w`` as the reference writes them).
    Not against a whole reference call: an entry one ulp apart moves every later token's output by what it
    contributes (SPEC §6.1). Then ``accept`` leaves the counts of a pool that took only the accepted tokens.
    ``per_launch``: the call taken in launches of at most that many tokens, its history as one launch's."""
    pytest.importorskip("triton")
    if kernel == "gluon" and DEVICE == "cpu":
        pytest.skip("the Gluon kernel runs on a GPU only (Gluon has no interpreter)")
    from leapquant_triton.flush import flush_pool
    from leapquant_triton.step import step_pool

    made, gen = _pool(gate, T, L=L, seed=20 + T, dim=dim)
    # the kernels and the oracle on DEVICE: the gates bit for bit needs the same expf (libdevice on a GPU)
    pool = _twin(made, DEVICE)
    idx = torch.tensor([3, 0, 1, 5], dtype=torch.int32, device=DEVICE)
    tok = {n: x.to(DEVICE) for n, x in _tokens(pool, idx.numel(), T, H, gen).items()}
    flush_pool(pool, idx, force=T)  # the flush inside, done first: what follows checks the tokens alone
    out = torch.full((idx.numel(), T, pool.heads, pool.head_v), float("nan"), device=DEVICE)
    step_pool(pool, idx, **tok, scale=pool.head_k ** -0.5, use_qk_l2norm=False, out=out, kernel=kernel,
              per_launch=per_launch)
    assert bool((out[1] == 0).all()), "a padding row's output is 0"
    hist, L = pool.history, pool.ring
    rows = idx[idx != 0].long()
    start = hist.start[rows]
    j0 = torch.where(start >= L, torch.zeros_like(start), start)
    assert torch.equal(hist.count[rows], torch.full_like(start, T))
    for t in range(T):
        # the state the kernel stepped token t from: its checkpoint and entries, pcum and w after t tokens
        ref = _twin(pool)
        ref.hcnt[rows] = torch.where(torch.full_like(start, t) == 0, start, j0 + t).int()
        ref.pcum[rows] = hist.pcum[rows, :, t]
        ref.w[rows] = hist.w[rows, :, t]
        want = leapquant.step(ref, idx, *(tok[x][:, t] for x in ("q", "k", "v", "g", "beta")), backend="reference")
        got = out[:, t]
        rel = (got - want).norm(dim=-1) / want.norm(dim=-1).clamp_min(1e-30)
        assert float(rel[want.norm(dim=-1) > 0].max()) <= 1e-5, t
        j = (j0 + t).long()
        heads = torch.arange(pool.heads, device=DEVICE)
        for name in ("kbuf", "gbuf"):
            if getattr(pool, name) is not None:
                got_e, want_e = getattr(pool, name), getattr(ref, name)
                assert torch.equal(got_e[rows[:, None], heads, j], want_e[rows[:, None], heads, j]), name
        a_u, b_u = pool.ubuf[rows[:, None], heads, j], ref.ubuf[rows[:, None], heads, j]
        d = (a_u.view(torch.int16).int() - b_u.view(torch.int16).int()).abs()
        floor = 2.0 ** -18 * (tok["v"].abs().max() + b_u.float().abs().max())  # v - p cancelling below fp32's p
        assert bool(((d <= 1) | ((a_u.float() - b_u.float()).abs() <= floor)).all()), t
        assert torch.allclose(hist.pcum[rows, :, t + 1], ref.pcum[rows], rtol=4e-7, atol=0), t
        assert torch.allclose(hist.w[rows, :, t + 1], ref.w[rows], rtol=4e-7, atol=0), t
    n = torch.tensor([1, 0, T, 0], dtype=torch.int32, device=DEVICE)
    leapquant.accept(pool, idx, n)
    kept = torch.tensor([1, T, 0], device=DEVICE)[:, None]
    want_h = torch.where(kept == 0, start, j0 + kept).int()
    assert torch.equal(pool.hcnt[rows], want_h)


def test_launches_of_a_call_are_as_even_as_they_can_be():
    """A call of T tokens taken in launches of at most ``per_launch`` (the Gluon kernel's 4): as few launches as
    that allows, sizes differing by at most one, the larger first, covering the tokens in order."""
    from leapquant_triton.step import _launches

    assert _launches(4, 4) == [(0, 4)]
    assert _launches(5, 4) == [(0, 3), (3, 2)]
    assert _launches(6, 4) == [(0, 3), (3, 3)]
    assert _launches(7, 4) == [(0, 4), (4, 3)]
    assert _launches(8, 4) == [(0, 4), (4, 4)]
    assert _launches(8, None) == [(0, 8)]
    assert _launches(7, 3) == [(0, 3), (3, 2), (5, 2)]
    for T in range(1, 17):
        for per in (1, 2, 3, 4, 5, None):
            got = _launches(T, per)
            assert [t0 for t0, _ in got] == [sum(n for _, n in got[:i]) for i in range(len(got))]
            assert sum(n for _, n in got) == T and len(got) == (-(-T // per) if per else 1)
            assert max(n for _, n in got) - min(n for _, n in got) <= 1
    for bad in (0, -1, 2.0):
        with pytest.raises(ValueError, match="per_launch"):
            _launches(4, bad)


def test_a_backend_of_one_token_refuses_several():
    """A backend whose step takes one token per row is refused T > 1 with a clear BackendError."""
    from leapquant.backends import BackendError
    from leapquant.registry import _fits

    class OneToken(ReferenceBackend):
        multi_token = False

    ok, why = _fits(OneToken(), _pool("kda", 2, seed=6)[0], "step_tokens")
    assert not ok and "one token per row" in why
    assert BackendError
