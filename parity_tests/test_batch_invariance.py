"""Batch invariance (docs/SPEC.md §5.2): what a call writes for a row depends on that row's inputs and its slot's
bytes alone, not on the call's other rows, their number or the row's place among them.

Two pools hold the same bytes. One takes calls of three rows, the other the same calls with those rows at other
places among seven (a padding row and three other slots beside them); every input a row reads is the same tensor
row. After each call (a one-token step that flushes full rings, a verify of three draft tokens, ``accept`` with a
different count per row, a verify with ``num_accepted``, a forced flush, ``load_states``; the packed call, one token
and three) the three rows' outputs and every byte of their slots (checkpoints, rings, counts, the verify's history)
are compared bit for bit, and ``states()`` of those slots. On the Triton backend (any device) and the reference on
the CPU, as SPEC §5.2 promises. Grouped heads (2 key heads, 4 value heads), both gates, the shapes of both Triton
step kernels (64 x 64 with a ring of 8: the ``tl`` kernel; 128 x 128 with a ring of 16: the Gluon kernel on a GPU,
its ``tl`` twin through the interpreter on the CPU).
"""

from __future__ import annotations

import pytest
import torch

import leapquant
from leapquant import packed, parity
from leapquant.tools.workloads import fill

from .conftest import backends_here

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# what SPEC §5.2 promises it for: the Triton backend everywhere, the reference on the CPU (on CUDA its batched torch
# products may take other cuBLAS kernels at other batch sizes)
BACKENDS = (["reference"] if DEVICE == "cpu" else []) + (["triton"] if "triton" in backends_here(DEVICE) else [])
NS, HV, H, R, T = 8, 4, 2, 2, 3
# the small batch's slots, and the large batch (0 pads, vLLM's convention) with them at other places
SMALL = [5, 2, 7]
LARGE = [3, 7, 0, 5, 6, 2, 4]
AT = [LARGE.index(s) for s in SMALL]  # where each small-batch row sits in the large batch
SHAPES = [(64, 8), (128, 16)]


def _pools(gate: str, dim: int, L: int, seed: int):
    """Two pools with the same bytes: every real slot filled by the gaussian workload, a full ring in a third of the
    (slot, head) pairs (the step flushes them), the other counts below L."""
    gen = torch.Generator().manual_seed(seed)
    first = leapquant.Pool(NS, HV, dim, dim, L, R, gate=gate, max_tokens=T, device=DEVICE)
    slots = torch.arange(1, NS)
    fill(first, slots, "gaussian", gen, due=torch.rand(NS - 1, HV, generator=gen) < 1 / 3)
    second = leapquant.Pool(NS, HV, dim, dim, L, R, gate=gate, max_tokens=T, device=DEVICE, q0=first.q0.clone())
    parity.restore(second, parity.snapshot(first))
    return first, second, gen


def _tokens(gate: str, dim: int, tokens: int, gen) -> dict:
    """One call's inputs for the large batch, ``[B, tokens, ...]`` (``tokens = 0``: one token, no token axis)."""
    B = len(LARGE)
    lead = (B, tokens) if tokens else (B,)
    rnd = lambda *s: torch.randn(*lead, *s, generator=gen).to(DEVICE)  # noqa: E731
    g = -0.3 * torch.rand(*lead, *((HV, dim) if gate == "kda" else (HV,)), generator=gen)
    return dict(q=rnd(H, dim), k=torch.nn.functional.normalize(rnd(H, dim), dim=-1), v=rnd(HV, dim),
                g=g.to(DEVICE), beta=torch.rand(*lead, HV, generator=gen).to(DEVICE))


def _rows(x: dict) -> dict:
    """The small batch's rows of the large batch's inputs (the same values, a tensor of their own)."""
    at = torch.tensor(AT, device=DEVICE)
    return {n: t.index_select(0, at) for n, t in x.items()}


def _idx(slots) -> torch.Tensor:
    return torch.tensor(slots, dtype=torch.int32, device=DEVICE)


def _slot_bytes(pool, slots) -> dict:
    """Every byte of ``slots``: their checkpoints (``raw`` under the checkpoint mask of all their heads), rings,
    gates, counts and the verify's history."""
    s = torch.tensor(slots).repeat_interleave(HV)
    h = torch.arange(HV).repeat(len(slots))
    mask = pool.checkpoint_mask(s, h).cpu().view(-1)  # over raw's bytes
    out = {"raw": parity.as_bytes(pool.raw).view(-1)[mask]}
    at = torch.tensor(slots, device=pool.device)
    for name in ("kbuf", "ubuf", "w", "pcum", "gbuf", "hcnt"):
        t = getattr(pool, name)
        if t is not None:
            out[name] = parity.as_bytes(t[at])
    for name in ("start", "count", "pcum", "w"):
        out["history." + name] = parity.as_bytes(getattr(pool.history, name)[at])
    return out


def _same(small, large, what: str) -> None:
    a, b = _slot_bytes(small, SMALL), _slot_bytes(large, SMALL)
    bad = [n for n in a if not torch.equal(a[n], b[n])]
    assert bad == [], f"after {what}: the slots' bytes differ in {bad}"


def _packed_inputs(gate: str, dim: int, tokens: int, gen) -> dict:
    """The packed call's raw inputs for the large batch: ``mixed_qkv [B, 2 H K + HV V]`` (``[B, tokens, ...]`` with
    ``tokens``), ``a``, ``b``, ``A_log``, ``dt_bias``."""
    lead = (len(LARGE), tokens) if tokens else (len(LARGE),)
    mixed = torch.randn(*lead, 2 * H * dim + HV * dim, generator=gen)
    a = 2.0 * torch.randn(*lead, *((HV, dim) if gate == "kda" else (HV,)), generator=gen)
    b = 2.0 * torch.randn(*lead, HV, generator=gen)
    A_log = torch.randn(HV, generator=gen)
    dt_bias = torch.randn(HV * dim if gate == "kda" else HV, generator=gen)
    return {n: t.to(DEVICE) for n, t in dict(mixed=mixed, a=a, b=b, A_log=A_log, dt_bias=dt_bias).items()}


def _name(x) -> str:
    return ("fused" if x else "apart") if isinstance(x, bool) else str(x)


def _cases(extra=((),), packed_call: bool = False):
    """(backend, gate, dim, L, *extra) for every backend, gate and shape; the Triton ones through the interpreter
    (no GPU) are slow (about 30 s each on 2 cores). ``packed_call``: not the reference's GDN on the CPU, whose gates
    are torch's CPU functions on the batch as given (:func:`test_reference_gdn_gates_on_the_cpu`)."""
    out = []
    for backend in BACKENDS:
        for gate in ("kda", "gdn"):
            if packed_call and backend == "reference" and gate == "gdn" and DEVICE == "cpu":
                continue
            for dim, L in SHAPES:
                for e in extra:
                    marks = [pytest.mark.slow] if backend == "triton" and DEVICE == "cpu" else []
                    tail = list(e)
                    out.append(pytest.param(backend, gate, dim, L, *tail, marks=marks,
                                            id="-".join([backend, gate, f"{dim}x{dim}-ring{L}", *map(_name, tail)])))
    return out


@pytest.mark.parametrize("backend,gate,dim,L", _cases())
def test_rows_do_not_depend_on_the_batch(backend, gate, dim, L):
    """Step, verify, ``accept``, a verify with ``num_accepted``, a forced flush, ``states()`` and ``load_states``: the
    small batch's rows write and return the same bytes in both batches."""
    small, large, gen = _pools(gate, dim, L, seed=dim + L + (gate == "kda"))
    si, li = _idx(SMALL), _idx(LARGE)

    # a one-token step: the full rings are flushed inside
    x = _tokens(gate, dim, 0, gen)
    o_small = leapquant.step(small, si, **_rows(x), backend=backend)
    o_large = leapquant.step(large, li, **x, backend=backend)
    assert torch.equal(o_small, o_large[AT]), "one-token step: outputs"
    assert bool((o_large[LARGE.index(0)] == 0).all()), "a padding row's output is 0"
    _same(small, large, "a one-token step")

    # a verify of T draft tokens (the rings that cannot hold T more flushed first), then each row keeps its own count
    x = _tokens(gate, dim, T, gen)
    o_small = leapquant.step(small, si, **_rows(x), backend=backend)
    o_large = leapquant.step(large, li, **x, backend=backend)
    assert torch.equal(o_small, o_large[AT]), "verify: outputs"
    _same(small, large, f"a verify of {T} tokens")
    n_large = torch.tensor([1, 3, 0, 0, 2, 2, 1], dtype=torch.int32, device=DEVICE)
    leapquant.accept(small, si, n_large[AT], backend=backend)
    leapquant.accept(large, li, n_large, backend=backend)
    _same(small, large, "accept")

    # another verify, the last one's acceptance applied first (num_accepted: the engines' single-call form)
    x = _tokens(gate, dim, T, gen)
    o_small = leapquant.step(small, si, **_rows(x), backend=backend, num_accepted=n_large[AT])
    o_large = leapquant.step(large, li, **x, backend=backend, num_accepted=n_large)
    assert torch.equal(o_small, o_large[AT]), "verify with num_accepted: outputs"
    _same(small, large, "a verify with num_accepted")

    # a forced flush (every ring with an entry), then the states the slots hold
    leapquant.flush(small, si, backend=backend, force=True)
    leapquant.flush(large, li, backend=backend, force=True)
    _same(small, large, "a forced flush")
    x = _tokens(gate, dim, 0, gen)
    leapquant.step(small, si, **_rows(x), backend=backend)
    leapquant.step(large, li, **x, backend=backend)
    s_small = small.states(si, backend=backend)
    s_large = large.states(li, backend=backend)
    assert torch.equal(s_small, s_large[AT]), "states()"

    # those states compressed back into the slots, beside other slots' (load_states takes no padding rows)
    real = [n for n, slot in enumerate(LARGE) if slot != 0]
    small.load_states(si, s_small, backend=backend)
    large.load_states(_idx([LARGE[n] for n in real]), s_large[real], backend=backend)
    _same(small, large, "load_states")


PACKED_PATHS = [(True,), (False,)]


@pytest.mark.parametrize("backend,gate,dim,L,fused", _cases(PACKED_PATHS, packed_call=True))
def test_packed_rows_do_not_depend_on_the_batch(backend, gate, dim, L, fused):
    """``step_packed``, one token a row and then T with the gates (the Triton step kernel's or computed apart) and the
    q / k l2 norm: the small batch's rows as in the large one."""
    small, large, gen = _pools(gate, dim, L, seed=3 * dim + L + (gate == "kda"))
    si, li = _idx(SMALL), _idx(LARGE)
    at = torch.tensor(AT, device=DEVICE)
    for tokens in (0, T):
        p = _packed_inputs(gate, dim, tokens, gen)
        kw = dict(A_log=p["A_log"], dt_bias=p["dt_bias"], use_qk_l2norm=True, backend=backend, fused=fused)
        o_small = leapquant.step_packed(small, si, p["mixed"][at], p["a"][at], p["b"][at], **kw)
        o_large = leapquant.step_packed(large, li, p["mixed"], p["a"], p["b"], **kw)
        what = f"a packed call of {max(tokens, 1)} token(s)"
        assert torch.equal(o_small, o_large[AT]), f"{what}: outputs"
        _same(small, large, what)


@pytest.mark.skipif(DEVICE != "cpu", reason="the reference's promise is the CPU's (SPEC §5.2)")
def test_reference_gdn_gates_on_the_cpu():
    """The one exception, on the CPU: the reference computes the packed call's gates with torch's CPU functions on
    the batch as given (FLA's naive gates bit for bit), and those take a vector or a scalar path by an element's
    place in the tensor, so ``softplus`` (``log1p``) can differ in the last bits by a row's place. With KDA's rows of
    K elements every row takes the same paths; GDN's gate is one element a head. The gates stay within a few fp32
    spacings of each other, the outputs within SPEC §6's 1e-5."""
    small, large, gen = _pools("gdn", 64, 8, seed=7)
    si, li = _idx(SMALL), _idx(LARGE)
    at = torch.tensor(AT)
    p = _packed_inputs("gdn", 64, 0, gen)
    g_small, beta_small = packed.packed_gates("gdn", p["a"][at], p["b"][at], p["A_log"], p["dt_bias"])
    g_large, beta_large = packed.packed_gates("gdn", p["a"], p["b"], p["A_log"], p["dt_bias"])
    torch.testing.assert_close(g_small, g_large[at], rtol=4 * 2.0 ** -23, atol=0.0)
    torch.testing.assert_close(beta_small, beta_large[at], rtol=4 * 2.0 ** -23, atol=0.0)
    kw = dict(A_log=p["A_log"], dt_bias=p["dt_bias"], use_qk_l2norm=True, backend="reference")
    o_small = leapquant.step_packed(small, si, p["mixed"][at], p["a"][at], p["b"][at], **kw)
    o_large = leapquant.step_packed(large, li, p["mixed"], p["a"], p["b"], **kw)
    # SPEC §6's criterion: 1e-5 relative per (row, head), Frobenius
    err = (o_small - o_large[at]).flatten(2).norm(dim=-1) / o_large[at].flatten(2).norm(dim=-1)
    assert float(err.max()) <= 1e-5
