"""The Triton decode step (leapquant_triton.step) against the reference's (SPEC §6).

Each case builds a pool whose every byte is random first (the poison), gives the slots under test valid
checkpoints and rings filled to every count (0, mid, L - 1, and L: full, flushed inside the step), with entries at and
past the count left as random bytes or NaN (the step must never read them), then runs one step in two twins:

* ``B``: :func:`step_pool` (the Triton flush of the full rings, then the step kernel);
* ``A``: the same Triton flush, the flushed rings' count set from L to 0 (the same entry 0 next, without a second
  flush), then ``ReferenceBackend().step``, the definition.

So the checkpoints are the same bytes, the flush itself is judged by ``parity.measure`` (SPEC §4), and the step
is compared with the reference: ``out`` within 1e-5 relative per (row, head) (in out's dtype: one ulp), zero for rows
that name no real slot; ``ubuf``'s new entry within one bf16 ulp; every other byte bitwise equal (the new ``kbuf``
entry within one bf16 ulp after the l2 normalisation, whose sums differ in order); and every byte outside the rows'
programs unchanged from before. Under the interpreter (no CUDA) ``exp`` is numpy's, which differs from torch's by up
to 2 ulp: the gates it derives (GDN ``w``, ``pcum``; KDA ``gbuf``) are held to a few ulp there, and bitwise on a GPU.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import leapquant
from leapquant import parity
from leapquant import formulas as ref
from leapquant.reference import ReferenceBackend

triton = pytest.importorskip("triton")

from leapquant_triton.backend import TritonBackend  # noqa: E402
from leapquant_triton.flush import flush_pool  # noqa: E402
from leapquant_triton.step import step_pool  # noqa: E402

from .test_triton_kernel import _fill_program, _randomise  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BACKEND = TritonBackend()
pytestmark = pytest.mark.skipif(
    not BACKEND.supports(leapquant.Pool(2, 1, 64, 64, 8, 1, device=DEVICE))[0],
    reason="Triton backend cannot run here (needs CUDA or TRITON_INTERPRET)")

OUT_RTOL = 1e-5
# the step kernels each test runs: the default (None: the one this device takes, the Gluon kernel for the shapes it
# covers on a GPU), the sm_75 kernel, and on a GPU the tl tensor-core kernel too (on the CPU it is the default)
KERNEL_PARAMS = [None, "fma"] + (["mma"] if DEVICE == "cuda" else [])
# ulps allowed where the interpreter's exp (numpy) is not torch's; on a GPU both are libdevice's expf
EXP_ULPS = {"kda": {"gbuf": 1}, "gdn": {"w": 4, "pcum": 4}} if DEVICE == "cpu" else {"kda": {}, "gdn": {}}
_INT = {torch.float32: (torch.int32, 0x7FFFFFFF), torch.bfloat16: (torch.int16, 0x7FFF),
        torch.float16: (torch.int16, 0x7FFF)}
_MANTISSA = {torch.float32: 24, torch.bfloat16: 8, torch.float16: 11}


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in units in the last place of two float tensors of one dtype (0 where the bits are equal, NaN too)."""
    it, mag = _INT[a.dtype]
    ia, ib = a.contiguous().view(it).long(), b.contiguous().view(it).long()
    order = lambda i: torch.where(i < 0, -(i & mag), i)  # noqa: E731
    return torch.where(ia == ib, torch.zeros_like(ia), (order(ia) - order(ib)).abs())


def _ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One ulp of ``dtype`` at the float64 values ``x`` (the smallest normal's below it)."""
    _, e = torch.frexp(x.abs().clamp_min(torch.finfo(dtype).tiny))
    return torch.ldexp(torch.ones_like(x), e - _MANTISSA[dtype])


def _poison_tail(pool, s: int, h: int, count: int, nan: bool, g: torch.Generator) -> None:
    """Entries ``count..L-1`` of (s, h)'s ring hold NaN or random bytes: the step must read none of them."""
    rows = [pool.kbuf, pool.ubuf, pool.w] + ([pool.gbuf] if pool.gbuf is not None else [])
    for t in rows:
        tail = t[s, h, count:]
        if nan:
            tail.fill_(float("nan"))
        else:
            b = tail.contiguous().view(torch.uint8)
            tail.copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8, generator=g).view(tail.dtype)
                       .view(tail.shape).to(tail.device))


def _case(gate, K, V, L, R, HV, convention, seed, counts, num_slots=5, layout="engine"):
    """A poisoned pool (of ``layout``, SPEC §2) whose slots 1..3 have valid checkpoints and rings with the fill counts
    ``counts`` over their (slot, head)s in turn."""
    g = torch.Generator().manual_seed(seed)
    pool = leapquant.Pool(num_slots, HV, K, V, L, R, gate=gate, convention=convention, device=DEVICE, layout=layout)
    _randomise(pool, g)
    i = 0
    for s in (1, 2, 3):
        for h in range(HV):
            _fill_program(pool, s, h, g)
            count = counts[i % len(counts)]
            pool.hcnt[s, h] = count
            if count < L:
                _poison_tail(pool, s, h, count, nan=i % 2 == 0, g=g)
            i += 1
    return pool, g


def _view(t: torch.Tensor, layout: str) -> torch.Tensor:
    """``t`` ``[N, X, D]`` (or ``[N, X]``) as a strided view with a unit last stride: ``padded`` (rows and heads
    spaced out), ``heads_first`` (stored ``[X, N, D]``) or ``contiguous``."""
    if layout == "padded":
        big = torch.full((t.shape[0], t.shape[1] + 1) + ((t.shape[2] + 8,) if t.dim() == 3 else ()), float("nan"),
                         dtype=t.dtype, device=t.device)
        v = big[:, :t.shape[1], :t.shape[2]] if t.dim() == 3 else big[:, :t.shape[1]]
    elif layout == "heads_first" and t.dim() == 3:
        v = torch.empty(t.shape[1], t.shape[0], t.shape[2], dtype=t.dtype, device=t.device).transpose(0, 1)
    else:
        v = torch.empty_like(t)
    v.copy_(t)
    return v


def _tokens(pool, N: int, H: int, dtype, layout: str, g: torch.Generator):
    """q, k [N, H, K], v [N, HV, V], g, beta in ``dtype``, as strided views."""
    K, V, HV = pool.head_k, pool.head_v, pool.heads
    rnd = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    q, k = rnd(N, H, K), torch.nn.functional.normalize(rnd(N, H, K), dim=-1)
    gate = -0.5 * torch.rand(N, HV, K, generator=g) if pool.gate == "kda" else -0.5 * torch.rand(N, HV, generator=g)
    raw = dict(q=q, k=k, v=rnd(N, HV, V), g=gate, beta=torch.rand(N, HV, generator=g))
    return {n: _view(t.to(DEVICE, dtype), layout) for n, t in raw.items()}


def _run_step(pool, idx: list[int], H: int, dtype, use_qk_l2norm: bool, layout: str, g: torch.Generator,
              out_dtype=None, scale: float = 0.3, kernel: str | None = None):
    """Both twins of the module docstring from ``pool``: ``(before, A, B, tokens, idx, out_ref32, out)``; ``kernel``:
    the step kernel B steps through (:data:`leapquant_triton.step.KERNELS`; None: the one this device takes)."""
    idx_t = torch.tensor(idx, dtype=torch.int32, device=DEVICE)
    tok = _tokens(pool, len(idx), H, dtype, layout, g)
    before = parity.snapshot(pool)
    A, B = parity.twin(pool), parity.twin(pool)
    flush_pool(A, idx_t)
    A.hcnt.copy_(torch.where(A.hcnt == A.ring, torch.zeros_like(A.hcnt), A.hcnt))  # flushed: entry 0 next
    out_ref = torch.full((len(idx), pool.heads, pool.head_v), float("nan"), device=DEVICE)
    ReferenceBackend().step(A, idx_t, **tok, scale=scale, use_qk_l2norm=use_qk_l2norm, out=out_ref)
    out = _view(torch.full_like(out_ref, float("nan"), dtype=out_dtype or dtype), layout)
    step_pool(B, idx_t, **tok, scale=scale, use_qk_l2norm=use_qk_l2norm, out=out, kernel=kernel)
    return before, A, B, tok, idx_t, out_ref, out


def _programs(pool, idx_t: torch.Tensor, hcnt_before: torch.Tensor):
    """(rows, slots, heads, entries j) of the programs the step runs: every head of each row with a real slot."""
    idxl = idx_t.long().cpu()
    real = (idxl >= pool.first_slot) & (idxl < pool.num_slots)
    rows = real.nonzero().flatten().repeat_interleave(pool.heads)
    heads = torch.arange(pool.heads).repeat(int(real.sum()))
    slots = idxl[rows]
    j = hcnt_before[slots, heads].long()
    return rows, slots, heads, torch.where(j >= pool.ring, torch.zeros_like(j), j), real


def _check(pool_before: dict, A, B, tok: dict, idx_t, out_ref, out, use_qk_l2norm: bool, scale: float = 0.3):
    """Every comparison of the module docstring; returns the number of programs checked."""
    gate, L = B.gate, B.ring
    hcnt0 = pool_before["hcnt"].view(torch.int32).view(B.num_slots, B.heads)
    rows, slots, heads, j, real = _programs(B, idx_t, hcnt0)
    a, b = parity.snapshot(A), parity.snapshot(B)

    # the checkpoints: the same Triton flush in both twins
    assert torch.equal(a["raw"], b["raw"]), "raw differs from the twin flushed by flush_pool"
    assert torch.equal(a["hcnt"], b["hcnt"]), "hcnt"

    # the ring: bitwise, but the new entries of ubuf (and of kbuf after l2norm) and the exp-derived gates
    entry = torch.zeros(B.num_slots, B.heads, L, dtype=torch.bool)
    entry[slots, heads, j] = True
    for name in ("kbuf", "ubuf", "w", "pcum", "gbuf"):
        ta, tb = getattr(A, name), getattr(B, name)
        if ta is None:
            continue
        d = _ulps(ta.cpu(), tb.cpu())
        tol = EXP_ULPS[gate].get(name, 0)
        if name == "ubuf" or (name == "kbuf" and use_qk_l2norm):
            at_entry = d[entry]
            assert int(d[~entry].max()) == 0, f"{name}: bytes off the new entries differ"
            if name == "ubuf":
                # one bf16 ulp; a floor where v - p cancels below the fp32 rounding of p
                va = ta.cpu()[entry].double()
                floor = 2.0 ** -18 * (tok["v"].float().abs().amax().item() + va.abs().amax().item())
                ok = (at_entry <= 1) | ((va - tb.cpu()[entry].double()).abs() <= floor)
            else:
                ok = at_entry <= 1
            assert bool(ok.all()), f"{name}: new entries off by up to {int(at_entry.max())} ulp"
        else:
            assert int(d.max()) <= tol, f"{name}: off by up to {int(d.max())} ulp (allowed {tol})"

    # out: rows without a real slot exactly 0; the others against the reference's, corrected for the new entry's
    # bf16 values where the twins' differ (o is linear in them: scale beta ubuf[j] (kbuf[j] . q))
    o = out.cpu().double()
    assert bool((o[~real] == 0).all()), "out of a row that names no real slot is not 0"
    q = tok["q"].float().cpu()
    if use_qk_l2norm:
        q = ref.l2norm(q)
    q = q.repeat_interleave(B.heads // q.shape[1], 1).double()[rows, heads]
    beta = tok["beta"].float().cpu().double()[rows, heads]
    kb = {n: t.kbuf.cpu()[slots, heads, j].double() for n, t in (("a", A), ("b", B))}
    ub = {n: t.ubuf.cpu()[slots, heads, j].double() for n, t in (("a", A), ("b", B))}
    corr = scale * beta[:, None] * (ub["b"] * (kb["b"] * q).sum(-1, keepdim=True)
                                    - ub["a"] * (kb["a"] * q).sum(-1, keepdim=True))
    want = out_ref.cpu().double()[rows, heads] + corr
    got = o[rows, heads]
    norm = want.norm(dim=-1)
    assert bool((got[norm == 0] == 0).all()), "out not 0 where the reference's is"
    if out.dtype == torch.float32:
        rel = (got - want).norm(dim=-1) / norm.clamp_min(1e-300)
        assert bool((rel[norm > 0] <= OUT_RTOL).all()), f"out: relative error up to {float(rel.max()):.3g}"
    else:  # rounded to out's dtype: one ulp of it
        err = (got - want).abs()
        bound = _ulp(want, out.dtype) + OUT_RTOL * want.abs().amax(-1, keepdim=True)
        assert bool((err <= bound).all()), f"out: off by up to {float((err / bound).max()):.3g} of one ulp"

    # nothing outside the programs changed: raw outside the flushed checkpoints, the ring rows of other programs,
    # kbuf / ubuf off the new entries
    due = hcnt0[slots, heads] == L
    may = B.checkpoint_mask(slots[due], heads[due]).cpu()
    assert torch.equal(b["raw"][~may], pool_before["raw"][~may]), "raw bytes outside the flushed checkpoints changed"
    prog = torch.zeros(B.num_slots, B.heads, dtype=torch.bool)
    prog[slots, heads] = True
    for name, keep in (("w", ~prog), ("pcum", ~prog), ("gbuf", ~prog), ("hcnt", ~prog), ("kbuf", ~entry),
                       ("ubuf", ~entry)):
        if name in b:
            now, was = (x.view(*keep.shape, -1) for x in (b[name], pool_before[name]))
            assert torch.equal(now[keep], was[keep]), f"{name} changed outside the step's programs"
    return rows.numel()


def _measure_flush(pool, idx_t):
    """SPEC §4 for the flush inside the step, on a twin."""
    p = parity.measure(parity.twin(pool), idx_t, "triton", flush_fn=flush_pool)
    assert p.ok(), p.failures()
    return p


CASES = [
    # gate, K, V, L, R, HV, H, convention, dtype, l2norm, layout
    ("kda", 64, 64, 8, 2, 2, 1, "vllm", torch.float32, False, "padded"),
    ("gdn", 64, 64, 8, 2, 2, 1, "sglang", torch.bfloat16, True, "heads_first"),
    ("kda", 128, 128, 16, 4, 4, 2, "sglang", torch.bfloat16, True, "padded"),
    ("gdn", 128, 128, 16, 3, 2, 2, "vllm", torch.float32, True, "contiguous"),
    ("kda", 128, 64, 32, 1, 2, 2, "vllm", torch.float16, False, "heads_first"),
    ("gdn", 64, 128, 32, 4, 4, 2, "sglang", torch.bfloat16, False, "padded"),
    # the tl kernel's four-warp build (128 x 128, ring 32)
    ("kda", 128, 128, 32, 4, 2, 1, "vllm", torch.bfloat16, False, "contiguous"),
]


@pytest.mark.parametrize("kernel", KERNEL_PARAMS)
@pytest.mark.parametrize("gate,K,V,L,R,HV,H,convention,dtype,l2,layout", CASES,
                         ids=[f"{c[0]}-K{c[1]}V{c[2]}-L{c[3]}-R{c[4]}-HV{c[5]}H{c[6]}-{c[7]}-{str(c[8])[6:]}"
                              f"{'-l2' if c[9] else ''}" for c in CASES])
def test_step_matches_reference(gate, K, V, L, R, HV, H, convention, dtype, l2, layout, kernel):
    """Rings at every fill over slots 1..3 (one of them full: flushed inside, judged by SPEC §4); rows: padding, a
    slot out of range either way, slot 0 (real under SGLang), and slot 4 named by no row (untouched). Both kernels:
    the tensor-core one and sm_75's."""
    pool, g = _case(gate, K, V, L, R, HV, convention, seed=K + V + L + R + HV, counts=[0, L // 2, L - 1, L])
    pad = 0 if convention == "vllm" else -1
    idx = [2, pad, 3, 5, 1, 2 ** 31 - 1, -7] + ([0] if convention == "sglang" else [])
    for h in range(HV if convention == "sglang" else 0):
        _fill_program(pool, 0, h, g)
        pool.hcnt[0, h] = L // 2 - 1
        _poison_tail(pool, 0, h, L // 2 - 1, nan=True, g=g)
    before, A, B, tok, idx_t, out_ref, out = _run_step(pool, idx, H, dtype, l2, layout, g, kernel=kernel)
    n = _check(before, A, B, tok, idx_t, out_ref, out, l2)
    assert n == HV * (4 if convention == "sglang" else 3)
    p = _measure_flush(pool, idx_t)
    assert p.count >= 1


@given(seed=st.integers(0, 2 ** 31 - 1), gate=st.sampled_from(["kda", "gdn"]),
       shape=st.sampled_from([(64, 64, 8, 1, 1, 1), (64, 64, 16, 3, 2, 1), (64, 64, 16, 2, 2, 2)]
                             + ([(128, 128, 16, 4, 2, 2), (128, 128, 16, 1, 2, 1)] if DEVICE == "cuda" else [])),
       convention=st.sampled_from(["vllm", "sglang"]),
       dtypes=st.sampled_from([(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                               (torch.float16, torch.float32)]),
       l2=st.booleans(), layout=st.sampled_from(["padded", "heads_first", "contiguous"]),
       kernel=st.sampled_from(KERNEL_PARAMS))
def test_step_random_fills(seed, gate, shape, convention, dtypes, l2, layout, kernel):
    """Random fill counts and token values at 64 x 64; out in another dtype than the tokens once; either kernel."""
    K, V, L, R, HV, H = shape
    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, L + 1, (6,), generator=g).tolist()
    pool, g = _case(gate, K, V, L, R, HV, convention, seed=seed, counts=counts, num_slots=4)
    pad = 0 if convention == "vllm" else -1
    idx = [3, pad, 1, 2]
    before, A, B, tok, idx_t, out_ref, out = _run_step(pool, idx, H, dtypes[0], l2, layout, g, out_dtype=dtypes[1],
                                                       scale=float(K) ** -0.5, kernel=kernel)
    _check(before, A, B, tok, idx_t, out_ref, out, l2, scale=float(K) ** -0.5)


def test_backend_step_and_empty_batch():
    """``TritonBackend.step`` is the step (``implements("step")``); an empty idx does nothing; steps of a whole ring in a row
    through the backend keep matching the reference step's ring (same checkpoint: no flush in between)."""
    assert BACKEND.implements("step")
    pool, g = _case("kda", 64, 64, 8, 2, 2, "vllm", seed=3, counts=[0])
    before = parity.snapshot(pool)
    empty = torch.zeros(0, dtype=torch.int32, device=DEVICE)
    tok = _tokens(pool, 0, 1, torch.float32, "contiguous", g)
    BACKEND.step(pool, empty, **tok, scale=1.0, use_qk_l2norm=False, out=torch.empty(0, 2, 64, device=DEVICE))
    assert all(torch.equal(before[n], parity.snapshot(pool)[n]) for n in before)

    A = parity.twin(pool)
    idx = torch.tensor([1, 3], dtype=torch.int32, device=DEVICE)
    for _ in range(pool.ring):
        tok = _tokens(pool, 2, 1, torch.bfloat16, "contiguous", g)
        o_b, o_a = (torch.empty(2, 2, 64, device=DEVICE) for _ in range(2))
        BACKEND.step(pool, idx, **tok, scale=0.125, use_qk_l2norm=True, out=o_b)
        ReferenceBackend().step(A, idx, **tok, scale=0.125, use_qk_l2norm=True, out=o_a)
        rel = (o_b - o_a).double().norm(dim=-1) / o_a.double().norm(dim=-1)
        assert float(rel.max()) < 1e-4, float(rel.max())  # (the new entries' bf16 may differ by an ulp)
    assert bool((pool.hcnt[[1, 3]] == pool.ring).all())
    e = (pool.states([1, 3]) - A.states([1, 3])).norm() / A.states([1, 3]).norm()
    assert float(e) < 1e-4, float(e)


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a GPU")
def test_cuda_graph_capture():
    """The step (flush included) launches without host synchronisation: captured in a CUDA graph, a replay writes
    what an eager step writes."""
    pool, g = _case("kda", 128, 128, 16, 4, 4, "vllm", seed=9, counts=[0, 8, 15, 16])
    idx = torch.tensor([2, 0, 1, 3], dtype=torch.int32, device=DEVICE)
    tok = _tokens(pool, 4, 2, torch.bfloat16, "padded", g)
    before = parity.snapshot(pool)
    eager = parity.twin(pool)
    o_eager = torch.empty(4, 4, 128, dtype=torch.bfloat16, device=DEVICE)
    step_pool(eager, idx, **tok, scale=0.1, use_qk_l2norm=True, out=o_eager)
    o = torch.empty_like(o_eager)
    step_pool(pool, idx, **tok, scale=0.1, use_qk_l2norm=True, out=o)  # compiles outside the capture
    parity.restore(pool, before)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        step_pool(pool, idx, **tok, scale=0.1, use_qk_l2norm=True, out=o)
    parity.restore(pool, before)
    o.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(o, o_eager)
    after, want = parity.snapshot(pool), parity.snapshot(eager)
    assert all(torch.equal(after[n], want[n]) for n in want)


@pytest.mark.parametrize("version, taken", [("3.6.0", True), ("3.6.1+git1a2b3c4", True), ("3.7.1", True),
                                            ("3.9.0", True), ("3.5.1", False), ("3.10.0", False)])
def test_kernels_note_says_whether_the_gluon_kernel_is_taken(monkeypatch, version, taken):
    """`python -m leapquant info`'s line on the step kernels, as each Triton release's metadata makes it: "(taken
    here)" exactly under the Gluon kernel's releases, else the release named and the tl kernel serving every shape."""
    import importlib.metadata as md
    from leapquant_triton.targets import GLUON_TOKENS_PER_LAUNCH, step_kernels_note

    real = md.version
    monkeypatch.setattr(md, "version", lambda name: version if name == "triton" else real(name))
    note = step_kernels_note()
    assert ("(taken here)" in note) is taken, note
    release = ".".join(version.split(".")[:2])
    assert (f"(not with Triton {release} here: the tl kernel serves every shape)" in note) is (not taken), note
    assert f"at most {GLUON_TOKENS_PER_LAUNCH} tokens per row a launch" in note


def test_kernels_note_without_triton(monkeypatch):
    """Without Triton installed the note says so, and names no release and no kernel serving anything here."""
    import importlib.metadata as md
    from leapquant_triton.targets import step_kernels_note

    real = md.version

    def version(name):
        if name == "triton":
            raise md.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(md, "version", version)
    note = step_kernels_note()
    assert "(Triton is not installed here)" in note, note
    assert "taken here" not in note and "serves every shape" not in note, note


def test_kernel_choice():
    """The default step kernel per shape, capability and Triton release (step.kernel_for): the Gluon kernel only for
    128 x 128, ring 16, rank <= 4 on sm_80+ under its releases; sm_75 its FMA kernel; the interpreter the tl kernel.
    Asking for the Gluon kernel where it does not apply is a clear error."""
    from leapquant.geometry import Geometry
    from leapquant_triton import step as st
    from leapquant_triton.targets import GLUON_RELEASES, interpreting, step_kernels_note, triton_release

    fast = Geometry(2, 4, 128, 128, 16, 4, "kda")
    # what `python -m leapquant info` says of it: whether the installed release takes the Gluon kernel
    note = step_kernels_note()
    assert ("(taken here)" in note) == (triton_release(triton.__version__) in GLUON_RELEASES), note
    assert "step_packed's gates in its prologue" in note
    assert "at most 4 tokens per row a launch" in note
    # the interpreter runs no Gluon: there the tl kernel's twin serves every shape
    here = triton_release(triton.__version__) in GLUON_RELEASES and not interpreting()
    assert st.kernel_for(fast, 90) == ("gluon" if here else "mma")
    assert st.kernel_for(fast, 120) == ("gluon" if here else "mma")
    assert st.kernel_for(fast, 75) == "fma"
    assert st.kernel_for(fast, None) == "mma"
    for other in (Geometry(2, 4, 64, 64, 16, 4, "kda"), Geometry(2, 4, 128, 128, 32, 4, "gdn"),
                  Geometry(2, 4, 128, 64, 16, 2, "kda")):
        assert st.kernel_for(other, 90) == "mma", other
    with pytest.raises(ValueError, match="K = V = 128, ring 16"):
        st.step_build(Geometry(2, 4, 64, 64, 16, 4, "kda"), 1, False, 90, "gluon")
    # the tl kernel: two warps, four at 128 x 128 with a ring of 32 (where two spill 2 KB), the same register cap
    for geo, warps in ((fast, 2), (Geometry(2, 4, 128, 128, 32, 4, "kda"), 4),
                       (Geometry(2, 4, 128, 128, 32, 1, "gdn"), 4), (Geometry(2, 4, 64, 128, 32, 2, "gdn"), 2),
                       (Geometry(2, 4, 128, 128, 8, 4, "kda"), 2)):
        _, _, options = st.step_build(geo, 1, False, 90, "mma")
        assert (options["num_warps"], options["maxnreg"]) == (warps, 128), geo
    if here or triton_release(triton.__version__) in GLUON_RELEASES:  # the kernel exists: its build's arguments
        fn, consts, options = st.step_build(fast, 1, True, 90, "gluon")
        assert consts["NW"] == options["num_warps"] == 2 and consts["USE_QK_L2NORM"] is True
    else:
        with pytest.raises(ValueError, match="Triton 3.6"):
            st.step_build(fast, 1, False, 90, "gluon")
    with pytest.raises(ValueError, match="kernel must be one of"):
        st.step_build(fast, 1, False, 90, "wgmma")
