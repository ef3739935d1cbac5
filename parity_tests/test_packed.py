"""``leapquant.step_packed``, the engines' packed decode call (docs/SPEC.md §6.2): vLLM's ``mixed_qkv`` split as vLLM
splits it; the gates and beta against FLA's own gate functions (its naive torch ones bit for bit, its Triton kernels
within their approximations) and the Triton gate kernel against the torch formulas; ``step_packed`` against
``leapquant.step`` fed those gates (the same output and pool bytes); against FLA's float64 recurrence from the raw
inputs; and its errors.

Where the Triton gate kernel runs through the interpreter (no CUDA) its ``exp`` and ``log1p`` are fp64's, rounded,
where torch's CPU kernels take Sleef's: the gates are held to a few ulps of torch's there (:data:`GATE_ULPS`), and
bitwise on a GPU, where both call libdevice's ``expf`` / ``log1pf``.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import leapquant
from leapquant import packed, parity
from leapquant.tools.workloads import fill

from .conftest import backends_here

fla_kda_gate = pytest.importorskip("fla.ops.kda.gate")
fla_gdn_gate = pytest.importorskip("fla.ops.gated_delta_rule.gate")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TRITON = "triton" in backends_here(DEVICE)
BACKENDS = ["reference"] + (["triton"] if TRITON else [])
# the gate forms under test: (pool gate, KDA lower bound)
GATES = [("kda", None), ("kda", -5.0), ("gdn", None)]
GATE_IDS = ["kda", "kda-lower-bound", "gdn"]
# how far (in spacings of the larger value) the Triton kernel's gates may lie from torch's: the interpreter's exp and
# log1p are correctly rounded, torch's CPU ones (Sleef, within an ulp) not always; on a GPU both are libdevice's
GATE_ULPS = 0 if DEVICE == "cuda" else 4


def _g_ulps(a, A_log, dt_bias, lower_bound):
    """How far (in spacings) the Triton kernel's log decays may lie from torch's, per element: :data:`GATE_ULPS`, and
    for KDA's lower-bound gate that times ``1 + |z|`` (``z = exp(A_log) (a + dt_bias)``, sigmoid's argument: an ulp
    between the two ``exp(A_log)`` moves ``z`` by an ulp and ``sigmoid(z)`` by about ``|z|`` of its own; measured
    under the interpreter, up to 33 ulps at ``z`` near -17, at most 2.8 (1 + |z|))."""
    if lower_bound is None or GATE_ULPS == 0:
        return GATE_ULPS
    HV, K = a.shape[-2:]
    z = A_log.float().view(HV, 1).exp() * (a.float() + dt_bias.float().view(HV, K))
    return GATE_ULPS * (1 + z.abs())


def _spacings(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``|x - y|`` in units of the fp32 spacing at ``max(|x|, |y|)`` (denormals included; 0 where both are equal,
    NaNs and infinities included; infinite against a finite value; NaN against a number)."""
    x, y = x.float(), y.float()
    m = torch.maximum(x.abs(), y.abs())
    d = torch.where((x == y) | (x.isnan() & y.isnan()), 0.0, (x - y).abs())
    spacing = torch.nextafter(m, torch.tensor(float("inf"), device=m.device)) - m
    return torch.where(d == 0, 0.0, torch.where(d.isinf(), float("inf"), d / spacing))


def _raw(gate, B, H, HV, K, V, seed, dtype=torch.float32, spread=2.0):
    """Raw inputs of one packed call: ``mixed_qkv [B, 2 H K + HV V]``, ``a``, ``b`` in ``dtype``; ``A_log``, ``dt_bias``
    fp32 (as the engines keep them)."""
    gen = torch.Generator().manual_seed(seed)
    mixed = torch.randn(B, 2 * H * K + HV * V, generator=gen)
    a = spread * torch.randn(*((B, HV, K) if gate == "kda" else (B, HV)), generator=gen)
    b = spread * torch.randn(B, HV, generator=gen)
    A_log = torch.randn(HV, generator=gen)
    dt_bias = torch.randn(HV * K if gate == "kda" else HV, generator=gen)
    dev = lambda t: t.to(DEVICE)  # noqa: E731
    return (dev(mixed.to(dtype)), dev(a.to(dtype)), dev(b.to(dtype)), dev(A_log), dev(dt_bias))


def _ftz(x: torch.Tensor) -> torch.Tensor:
    """On a GPU, ``x`` with its subnormals flushed to signed zeros: Triton builds libdevice with denormals flushed
    (``nvvm-reflect-ftz``), so a gate deep in softplus' exp tail is -0 there where torch keeps -2e-39 (no gate is
    changed by it: exp(-2e-39) = 1). Elsewhere ``x``."""
    if DEVICE != "cuda":
        return x
    return torch.where(x.abs() < torch.finfo(torch.float32).tiny, x * 0.0, x)


def _triton_gates(pool, a, b, A_log, dt_bias, lower_bound, beta_dtype=torch.float32):
    from leapquant_triton.gates import gates_pool

    ws = packed.packed_workspace(pool, a.shape[0], beta_dtype)
    leapquant.registry.launch(pool, gates_pool, a, b, A_log, dt_bias, lower_bound, ws.g, ws.beta)
    return ws


# --- the layout ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("H,HV", [(2, 2), (1, 4), (2, 4)])
def test_split_is_vllms(H, HV):
    """``split_qkv`` gives views of ``mixed_qkv`` equal to vLLM's ``torch.split(mixed_qkv, [H K, H K, HV V])``
    reshaped, also of a row-strided slice of a wider projection (as vLLM's tests pass it)."""
    B, K, V = 3, 64, 32
    proj = torch.randn(B, 2 * H * K + HV * V + 24)
    mixed = proj[:, : 2 * H * K + HV * V]
    q, k, v = packed.split_qkv(mixed, H, K, HV, V)
    want = torch.split(mixed, [H * K, H * K, HV * V], dim=-1)
    assert torch.equal(q, want[0].reshape(B, H, K)) and torch.equal(k, want[1].reshape(B, H, K))
    assert torch.equal(v, want[2].reshape(B, HV, V))
    for t in (q, k, v):
        assert t.untyped_storage().data_ptr() == proj.untyped_storage().data_ptr() and t.stride(-1) == 1


# --- the gates -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gate,lower_bound", GATES, ids=GATE_IDS)
def test_torch_gates_are_flas_naive_gates(gate, lower_bound, dtype):
    """The torch formulas are FLA's naive gate functions bit for bit (``naive_kda_gate``,
    ``naive_kda_lowerbound_gate``, ``naive_gdn_gate``), beta torch's ``sigmoid`` of the fp32 logit."""
    _, a, b, A_log, dt_bias = _raw(gate, 4, 2, 4, 64, 64, seed=1, dtype=dtype, spread=8.0)
    g, beta = packed.packed_gates(gate, a, b, A_log, dt_bias, lower_bound)
    if gate == "gdn":
        want = fla_gdn_gate.naive_gdn_gate(a, A_log, dt_bias)
    elif lower_bound is None:
        want = fla_kda_gate.naive_kda_gate(a, A_log, dt_bias)
    else:
        want = fla_kda_gate.naive_kda_lowerbound_gate(a, A_log, dt_bias, lower_bound)
    assert g.dtype == torch.float32 and torch.equal(g, want)
    assert torch.equal(beta, torch.sigmoid(b.float()))


def _fla_triton_gate(gate, a, A_log, dt_bias, lower_bound, b):
    """FLA's Triton gate kernels (``kda_gate_fwd_kernel`` with its beta, ``gdn_gate_fwd_kernel``) on their own: through
    the interpreter on the CPU, called past their autotuners (which time on a GPU) with one of their configs."""
    from triton.runtime.autotuner import Autotuner, Heuristics

    def kernel(k):
        while isinstance(k, (Autotuner, Heuristics)):
            k = k.fn
        return k

    T, H = a.shape[0], a.shape[1]
    yg = torch.empty(a.shape, dtype=torch.float32, device=a.device)
    # its sigmoid's exp overflows (to the right limit) for large logits, which numpy reports under the interpreter
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "overflow encountered in exp", RuntimeWarning)
        if gate == "gdn":
            kernel(fla_gdn_gate.gdn_gate_fwd_kernel)[(1, H)](g=a, A_log=A_log, dt_bias=dt_bias, yg=yg, T=T, H=H,
                                                             BT=32, HAS_BIAS=True)
            return yg, None
        yb = torch.empty(b.shape, dtype=torch.float32, device=a.device)
        D = a.shape[2]
        kernel(fla_kda_gate.kda_gate_fwd_kernel)[(1, H)](
            g=a, A_log=A_log, dt_bias=dt_bias, beta=b, yg=yg, yb=yb, lower_bound=lower_bound, T=T, H=H, D=D, BT=32,
            BD=D, HAS_A=True, HAS_BIAS=True, HAS_BETA=True, USE_LOWER_BOUND=lower_bound is not None)
    return yg, yb


@pytest.mark.skipif(not TRITON, reason="the Triton backend cannot run here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gate,lower_bound", GATES, ids=GATE_IDS)
def test_triton_gates(gate, lower_bound, dtype):
    """The Triton gate kernel against the torch formulas (:data:`GATE_ULPS`; bitwise on a GPU) over inputs from deep
    in softplus' exp tail to past its threshold, and against FLA's own Triton gates, which take ``log(1 + exp(x))``
    with approximate exp2 / log2: within 2^-21 exp(A_log) absolutely (the rounding of ``1 + exp(x)``), 2^-20
    relatively."""
    HV, K = 4, 64
    pool = leapquant.Pool(2, HV, K, K, 8, 2, gate=gate, device=DEVICE)
    _, a, b, A_log, dt_bias = _raw(gate, 32, 1, HV, K, K, seed=2, dtype=dtype, spread=12.0)
    ws = _triton_gates(pool, a, b, A_log, dt_bias, lower_bound)
    g, beta = packed.packed_gates(gate, a, b, A_log, dt_bias, lower_bound)
    assert bool((_spacings(ws.g, g) <= _g_ulps(a, A_log, dt_bias, lower_bound)).all())
    assert int(_spacings(ws.beta, beta).max()) <= GATE_ULPS
    fg, fb = _fla_triton_gate(gate, a, A_log, dt_bias, lower_bound, b)
    A = A_log.float().exp().view((HV, 1) if gate == "kda" else (HV,))
    assert bool(((ws.g - fg).abs() <= 2.0**-21 * A + 2.0**-20 * fg.abs()).all())
    if fb is not None:
        assert bool(((ws.beta - fb).abs() <= 2.0**-20 * fb.abs() + 2.0**-24).all())


@pytest.mark.skipif(not TRITON, reason="the Triton backend cannot run here")
def test_triton_gates_at_the_edges():
    """softplus' branch point (20 and its neighbours), its exp tail down to denormal and zero gates, overflowing
    logits, infinities and NaN: as torch's formulas (a NaN stays a NaN; nothing overflows to a NaN; on a GPU a
    subnormal gate is a signed zero, :func:`_ftz`)."""
    edges = torch.tensor([-1e30, -200.0, -104.0, -89.0, -20.0, -1e-8, 0.0, 1e-8, 19.999998, 20.0, 20.000002, 25.0,
                          88.0, 100.0, 1e30, float("inf"), float("-inf"), float("nan")])
    HV, K = 2, 64
    pool = leapquant.Pool(2, HV, K, K, 8, 2, gate="kda", device=DEVICE)
    x = torch.zeros(1, HV, K)
    x.view(-1)[: edges.numel()] = edges
    x.view(-1)[K: K + edges.numel()] = -edges
    a, b = x.to(DEVICE), x[:, :, 0].contiguous().to(DEVICE)
    A_log, dt_bias = torch.zeros(HV, device=DEVICE), torch.zeros(HV * K, device=DEVICE)
    b[0, 1] = float("nan")
    for lb in (None, -5.0):
        ws = _triton_gates(pool, a, b, A_log, dt_bias, lb)
        g, beta = (_ftz(x) for x in packed.packed_gates("kda", a, b, A_log, dt_bias, lb))
        assert torch.equal(ws.g.isnan(), g.isnan()) and torch.equal(ws.beta.isnan(), beta.isnan())
        assert int(_spacings(ws.g, g).max()) <= GATE_ULPS and int(_spacings(ws.beta, beta).max()) <= GATE_ULPS


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("beta_dtype", [torch.bfloat16, torch.float16])
def test_workspace_dtype_rounds_beta(beta_dtype, backend):
    """A ``beta`` workspace in bf16 / fp16 holds the fp32 ``sigmoid(b)`` rounded to nearest (as vLLM's packed GDN
    decode rounds beta to ``b``'s dtype), on both paths (the step reads beta in any of its dtypes)."""
    pool = leapquant.Pool(3, 4, 64, 64, 8, 2, gate="gdn", device=DEVICE)
    _, a, b, A_log, dt_bias = _raw("gdn", 16, 4, 4, 64, 64, seed=5, spread=6.0)
    if backend == "triton":
        ws32 = _triton_gates(pool, a, b, A_log, dt_bias, None)
        ws = _triton_gates(pool, a, b, A_log, dt_bias, None, beta_dtype)
    else:
        ws32, ws = packed.packed_workspace(pool, 16), packed.packed_workspace(pool, 16, beta_dtype)
        for w in (ws32, ws):
            packed._torch_gates(pool, a, b, A_log, dt_bias, None, *w)
    assert ws.beta.dtype == beta_dtype and torch.equal(ws.beta, ws32.beta.to(beta_dtype))


# --- step_packed is step ---------------------------------------------------------------------------------------------


def _pool(gate, HV, K, V, L, seed, full=True):
    """Slots 1-4 with checkpoints and rings at fills 0, L - 1, ``L`` if ``full`` (flushed inside the step, slot 3)
    and below L."""
    pool = leapquant.Pool(6, HV, K, V, L, 2, gate=gate, device=DEVICE)
    fill(pool, [1, 2, 3, 4], "gaussian", torch.Generator().manual_seed(seed),
         due=torch.tensor([[False] * HV, [False] * HV, [full] * HV, [False] * HV]))
    pool.hcnt[1] = 0
    pool.hcnt[2] = L - 1
    return pool


# (id, token dtype, H, HV, use_qk_l2norm, a ring flushed inside: the interpreter's flush takes seconds, once is enough)
CASES = [("fp32, H = HV", torch.float32, 2, 2, False, True),
         ("bf16, grouped H = 1", torch.bfloat16, 1, 2, True, False)]


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "apart"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", [c[0] for c in CASES])
@pytest.mark.parametrize("gate,lower_bound", GATES, ids=GATE_IDS)
def test_step_packed_is_step(gate, lower_bound, case, backend, fused):
    """``step_packed`` gives ``leapquant.step``'s output and pool bytes, bit for bit, on the same backend, fed the
    views of ``mixed_qkv`` and the gates in torch (on a GPU; through the interpreter, the Triton gate kernel's own,
    which are torch's within :data:`GATE_ULPS`); padding rows get 0; ``out`` is written in place, and the workspace
    too where the gates are computed apart (the reference, ``fused=False``), else left as it was (the Triton step
    computes them in its prologue)."""
    _, dtype, H, HV, l2norm, full = next(c for c in CASES if c[0] == case)
    K = V = 64
    pool = _pool(gate, HV, K, V, 8, seed=7, full=full)
    twin = parity.twin(pool)
    idx = torch.tensor([3, 1, 0, 2, 4], dtype=torch.int32, device=DEVICE)  # row 2 pads
    B = idx.numel()
    mixed, a, b, A_log, dt_bias = _raw(gate, B, H, HV, K, V, seed=8, dtype=dtype)
    a[2] = float("nan")  # a padding row is never read
    out = torch.full((B, HV, V), float("nan"), dtype=dtype, device=DEVICE)
    ws = packed.packed_workspace(pool, B)
    ws.g.fill_(float("nan"))
    ws.beta.fill_(float("nan"))
    o = leapquant.step_packed(pool, idx, mixed, a, b, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
                              use_qk_l2norm=l2norm, out=out, workspace=ws, backend=backend, check=True, fused=fused)
    assert o.data_ptr() == out.data_ptr() and o.dtype == dtype
    g, beta = packed.packed_gates(gate, a, b, A_log, dt_bias, lower_bound)
    real = torch.tensor([True, True, False, True, True], device=DEVICE)
    if backend == "triton" and fused:
        assert bool(ws.g.isnan().all()) and bool(ws.beta.isnan().all())
        ws = _triton_gates(pool, a, b, A_log, dt_bias, lower_bound)  # the same functions as the kernel's prologue
    ulps = _g_ulps(a, A_log, dt_bias, lower_bound) if backend == "triton" else 0
    assert bool((_spacings(ws.g, g)[real] <= (ulps[real] if isinstance(ulps, torch.Tensor) else ulps)).all())
    if backend == "triton" and DEVICE == "cpu":
        g, beta = ws.g.clone(), ws.beta.clone()
    q, k, v = packed.split_qkv(mixed, H, K, HV, V)
    want = leapquant.step(twin, idx, q, k, v, g, beta, use_qk_l2norm=l2norm, backend=backend)
    assert torch.equal(o, want)
    assert bool((o[2] == 0).all())
    for name, bytes_ in parity.snapshot(twin).items():
        assert torch.equal(parity.snapshot(pool)[name], bytes_), name


@pytest.mark.skipif(not TRITON, reason="the Triton backend is not available here")
@pytest.mark.parametrize("shape", ["64x64 ring 8", "128x128 ring 16", "128x128 ring 32"])
@pytest.mark.parametrize("beta_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("gate,lower_bound", GATES, ids=GATE_IDS)
def test_fused_gates_are_the_gates_apart(gate, lower_bound, beta_dtype, shape):
    """The Triton step's own gates (``fused=True``, one launch) and the gates apart (the gate kernel into a workspace,
    then the step; ``fused=False``) give the same output and pool bytes, bit for bit, beta rounded to the
    workspace's dtype on both: the kernel's prologue evaluates the gate kernel's operations, each product and sum
    rounded on its own although the step is compiled with FMA contraction on. 128 x 128 with ring 16 is the Gluon
    kernel's shape on a GPU (the ``tl`` kernel elsewhere), with a ring flushed inside, and ring 32 the ``tl`` kernel's
    four-warp build; grouped heads, bf16 tokens, a padding row."""
    K, L = (64, 8) if shape.startswith("64") else (128, int(shape.split()[-1]))
    H, HV = 1, 2
    pool = _pool(gate, HV, K, K, L, seed=11)
    twin = parity.twin(pool)
    idx = torch.tensor([3, 0, 1, 2, 4], dtype=torch.int32, device=DEVICE)  # row 1 pads
    mixed, a, b, A_log, dt_bias = _raw(gate, idx.numel(), H, HV, K, K, seed=12, dtype=torch.bfloat16, spread=4.0)
    a[1] = float("nan")
    outs = []
    for p, fused in ((pool, True), (twin, False)):
        ws = packed.packed_workspace(p, idx.numel(), beta_dtype)
        outs.append(leapquant.step_packed(p, idx, mixed, a, b, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
                                          use_qk_l2norm=True, workspace=ws, backend="triton", check=False,
                                          fused=fused))
    assert bool(outs[0].isfinite().all()) and bool((outs[0][1] == 0).all())
    assert torch.equal(outs[0], outs[1])
    for name, bytes_ in parity.snapshot(twin).items():
        assert torch.equal(parity.snapshot(pool)[name], bytes_), name


@pytest.mark.skipif(not TRITON, reason="the Triton backend is not available here")
@pytest.mark.parametrize("T", [2, 4, 6])
@pytest.mark.parametrize("gate,lower_bound", GATES, ids=GATE_IDS)
def test_fused_gates_are_the_gates_apart_for_tokens(gate, lower_bound, T):
    """As :func:`test_fused_gates_are_the_gates_apart` for T tokens a row at 128 x 128, ring 16 (the Gluon kernel's
    shape on a GPU, which parks the gates it computed for its second phase; T = 6 is two launches of three): the
    same output, pool bytes and history, bit for bit, beta rounded to bf16, the rings flushed first where they
    cannot hold T more; grouped heads, bf16 tokens, a padding row."""
    H, HV, K, L = 1, 2, 128, 16
    pool, twin = (_tokens_pool(gate, HV, K, K, L, T, seed=13) for _ in range(2))
    idx = torch.tensor([3, 0, 1, 2, 4], dtype=torch.int32, device=DEVICE)  # row 1 pads
    B = idx.numel()
    mixed, a, b, A_log, dt_bias = _raw_tokens(gate, B, T, H, HV, K, K, seed=14)
    mixed = mixed.to(torch.bfloat16)
    a[1] = float("nan")
    outs = []
    for p, fused in ((pool, True), (twin, False)):
        ws = packed.packed_workspace(p, B * T, torch.bfloat16)
        outs.append(leapquant.step_packed(p, idx, mixed, a, b, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
                                          use_qk_l2norm=True, workspace=ws, backend="triton", check=False,
                                          fused=fused))
    assert outs[0].shape == (B, T, HV, K) and bool(outs[0].isfinite().all()) and bool((outs[0][1] == 0).all())
    assert torch.equal(outs[0], outs[1])
    for name, bytes_ in parity.snapshot(twin).items():
        assert torch.equal(parity.snapshot(pool)[name], bytes_), name
    for name in ("start", "count", "pcum", "w"):
        assert torch.equal(getattr(pool.history, name), getattr(twin.history, name)), name


@pytest.mark.parametrize("gate,lower_bound,H", [("kda", None, 2), ("kda", -5.0, 1), ("gdn", None, 1)])
def test_step_packed_tracks_flas_recurrence(gate, lower_bound, H):
    """From the raw inputs of 20 tokens (a flush inside), the outputs track FLA's float64 recurrence fed FLA's naive
    gates and its l2 norm (``naive_recurrent_kda`` / ``naive_recurrent_gated_delta_rule`` with q, k normalised): the
    layout, the gates and ``use_qk_l2norm`` mean what vLLM's call means. Reference backend."""
    from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule
    from fla.ops.kda.naive import naive_recurrent_kda

    B, HV, K, V, T = 2, 4, 64, 64, 20
    pool = leapquant.Pool(B + 1, HV, K, V, 16, 4, gate=gate)
    idx = torch.arange(1, B + 1, dtype=torch.int32)
    steps = [tuple(x.cpu() for x in _raw(gate, B, H, HV, K, V, seed=100 + t)) for t in range(T)]
    A_log, dt_bias = steps[0][3], steps[0][4]
    outs, qs, ks, vs, gs, betas = [], [], [], [], [], []
    for mixed, a, b, _, _ in steps:
        outs.append(leapquant.step_packed(pool, idx, mixed, a, b, A_log=A_log, dt_bias=dt_bias,
                                          lower_bound=lower_bound, use_qk_l2norm=True, backend="reference"))
        q, k, v = packed.split_qkv(mixed, H, K, HV, V)
        G = HV // H
        norm = lambda x: (x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)).repeat_interleave(G, 1)  # noqa: E731
        qs.append(norm(q.double()))
        ks.append(norm(k.double()))
        vs.append(v.double())
        if gate == "kda":
            f = fla_kda_gate.naive_kda_gate if lower_bound is None else (
                lambda x, A, d: fla_kda_gate.naive_kda_lowerbound_gate(x, A, d, lower_bound))
            gs.append(f(a, A_log, dt_bias).double())
        else:
            gs.append(fla_gdn_gate.naive_gdn_gate(a, A_log, dt_bias).double())
        betas.append(torch.sigmoid(b.double()))
    st = lambda xs: torch.stack(xs, 1)  # noqa: E731
    if gate == "kda":
        exact, _ = naive_recurrent_kda(st(qs), st(ks), st(vs), st(gs), st(betas))
    else:
        exact, _ = naive_recurrent_gated_delta_rule(st(qs), st(ks), st(vs), st(betas), st(gs))
    for t, o in enumerate(outs):
        err = float((o.double() - exact[:, t]).norm() / exact[:, t].norm())
        assert err < 0.02, (t, err)


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a GPU")
def test_step_packed_captures_into_a_cuda_graph():
    """``step_packed(..., check=False)`` with a workspace and ``out`` captures into a CUDA graph (the gate kernel and
    the step, no synchronisation, no allocation); a replay gives the eager call's output and pool bytes."""
    gate, HV, K, V = "kda", 4, 128, 128
    pools = [_pool(gate, HV, K, V, 16, seed=11) for _ in range(2)]
    idx = torch.tensor([3, 1, 0, 2], dtype=torch.int32, device=DEVICE)
    mixed, a, b, A_log, dt_bias = _raw(gate, 4, 2, HV, K, V, seed=12, dtype=torch.bfloat16)
    ws = packed.packed_workspace(pools[0], 4)
    out = torch.empty(4, HV, V, dtype=torch.bfloat16, device=DEVICE)
    kw = dict(A_log=A_log, dt_bias=dt_bias, lower_bound=-5.0, use_qk_l2norm=True, backend="triton")
    scratch = parity.twin(pools[0])  # the warm-up call compiles the kernels
    leapquant.step_packed(scratch, idx, mixed, a, b, **kw, check=False)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        leapquant.step_packed(pools[0], idx, mixed, a, b, **kw, out=out, workspace=ws, check=False)
    graph.replay()
    want = leapquant.step_packed(pools[1], idx, mixed, a, b, **kw)
    torch.cuda.synchronize()
    assert torch.equal(out, want)
    for name, b_ in parity.snapshot(pools[1]).items():
        assert torch.equal(b_, parity.snapshot(pools[0])[name]), name


@pytest.mark.parametrize("T", [1, 3])
def test_step_packed_under_torch_compile(T):
    """``step_packed(..., check=False)`` compiles with fullgraph=True (the gates as the torch formulas, then the op
    ``leapquant::step``, or ``leapquant::step_tokens`` for T tokens a row) and gives the eager call's output and pool
    bytes."""
    pools = [leapquant.Pool(3, 2, 64, 64, 8, 2, gate="kda") for _ in range(2)]
    idx = torch.tensor([1, 2], dtype=torch.int32)
    mixed, a, b, A_log, dt_bias = (t.cpu() for t in _raw("kda", 2 * T, 1, 2, 64, 64, seed=9))
    if T > 1:
        mixed, a, b = (t.unflatten(0, (2, T)) for t in (mixed, a, b))

    @torch.compile(backend="eager", fullgraph=True)
    def compiled(mixed):
        return leapquant.step_packed(pools[0], idx, mixed, a, b, A_log=A_log, dt_bias=dt_bias, use_qk_l2norm=True,
                                     backend="reference", check=False)

    o_c = compiled(mixed)
    o_e = leapquant.step_packed(pools[1], idx, mixed, a, b, A_log=A_log, dt_bias=dt_bias, use_qk_l2norm=True,
                                backend="reference")
    assert torch.equal(o_c, o_e)
    for name, b_ in parity.snapshot(pools[1]).items():
        assert torch.equal(b_, parity.snapshot(pools[0])[name]), name


# --- T tokens a row (speculative decoding) --------------------------------------------------------------------------


def _tokens_pool(gate, HV, K, V, L, T, seed):
    """Slots 1-4 with checkpoints and rings at fills 0, L - 1 (flushed first: it cannot hold T more), 2 and L - T, a
    history for T tokens a row."""
    pool = leapquant.Pool(6, HV, K, V, L, 2, gate=gate, device=DEVICE, max_tokens=T)
    fill(pool, [1, 2, 3, 4], "gaussian", torch.Generator().manual_seed(seed))
    pool.hcnt[1:5] = torch.tensor([0, L - 1, 2, L - T], dtype=torch.int32, device=DEVICE)[:, None]
    return pool


def _raw_tokens(gate, B, T, H, HV, K, V, seed):
    """Raw inputs of a T-token packed call: ``mixed_qkv`` ``[B, T, D]`` a view of a wider buffer (row and token
    strides past ``T D`` and ``D``, as an engine's slice of a larger projection), ``a``, ``b`` ``[B, T, ...]``."""
    mixed, a, b, A_log, dt_bias = _raw(gate, B * T, H, HV, K, V, seed=seed)
    D = mixed.shape[1]
    wide = torch.full((B, T, D + 8), float("nan"), device=DEVICE)
    wide[..., :D] = mixed.view(B, T, D)
    return wide[..., :D], a.unflatten(0, (B, T)), b.unflatten(0, (B, T)), A_log, dt_bias


# (backend, fused): the reference computes the gates apart whatever ``fused`` says
TOKEN_PATHS = [("reference", False)] + ([("triton", True), ("triton", False)] if TRITON else [])


@pytest.mark.parametrize("backend,fused", TOKEN_PATHS, ids=[f"{b}-{'fused' if f else 'apart'}" for b, f in TOKEN_PATHS])
@pytest.mark.parametrize("gate,lower_bound", GATES, ids=GATE_IDS)
def test_step_packed_tokens_is_step(gate, lower_bound, backend, fused):
    """T = 3 tokens a row (``mixed_qkv [B, T, D]``): ``step_packed`` gives the T-token ``leapquant.step``'s output and
    pool bytes (history included) bit for bit, fed the views of ``mixed_qkv`` and the gates: computed apart (the
    workspace holds row n T + t's; torch's on the reference, the Triton gate kernel's within :func:`_g_ulps` of
    torch's), or by the Triton step kernel itself (``fused``: the workspace untouched, the gate kernel's functions);
    a padding row gets 0 and its NaN inputs are not read; a second call with ``num_accepted`` is ``accept`` and then
    that call."""
    H, HV, K, V, L, T = 1, 2, 64, 64, 8, 3
    pool, other = (_tokens_pool(gate, HV, K, V, L, T, seed=31) for _ in range(2))
    idx = torch.tensor([2, 1, 0, 4, 3], dtype=torch.int32, device=DEVICE)  # row 2 pads
    B = idx.numel()
    real = (idx != 0).repeat_interleave(T)
    n = torch.tensor([1, 3, 0, 0, 2], dtype=torch.int32, device=DEVICE)
    for call, accepted in enumerate((None, n)):
        mixed, a, b, A_log, dt_bias = _raw_tokens(gate, B, T, H, HV, K, V, seed=40 + call)
        a[2] = float("nan")
        b[2] = float("nan")
        out = torch.full((B, T, HV, V), float("nan"), device=DEVICE)
        ws = packed.packed_workspace(pool, B * T)
        ws.g.fill_(float("nan"))
        ws.beta.fill_(float("nan"))
        a_in = a.flatten(-2) if gate == "kda" and call else a  # KDA's flat [B, T, HV * K] form too
        o = leapquant.step_packed(pool, idx, mixed, a_in, b, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
                                  use_qk_l2norm=True, out=out, workspace=ws, backend=backend, check=True,
                                  num_accepted=accepted, fused=fused)
        assert o.data_ptr() == out.data_ptr() and o.shape == (B, T, HV, V)
        a_rows, b_rows = a.flatten(0, 1), b.flatten(0, 1)
        if fused:
            assert bool(ws.g.isnan().all()) and bool(ws.beta.isnan().all())
            ws = _triton_gates(pool, a_rows, b_rows, A_log, dt_bias, lower_bound)  # the kernel's functions
        g, beta = packed.packed_gates(gate, a_rows, b_rows, A_log, dt_bias, lower_bound)
        ulps = _g_ulps(a_rows, A_log, dt_bias, lower_bound) if backend == "triton" else 0
        assert bool((_spacings(ws.g, g)[real] <= (ulps[real] if isinstance(ulps, torch.Tensor) else ulps)).all())
        assert int(_spacings(ws.beta[real], beta[real]).max()) <= (GATE_ULPS if backend == "triton" else 0)
        if backend == "triton" and DEVICE == "cpu":
            g, beta = ws.g.clone(), ws.beta.clone()
        q, k, v = packed.split_qkv(mixed, H, K, HV, V)
        if accepted is not None:
            leapquant.accept(other, idx, accepted, backend=backend)
        want = leapquant.step(other, idx, q, k, v, g.unflatten(0, (B, T)), beta.unflatten(0, (B, T)),
                              use_qk_l2norm=True, backend=backend)
        assert torch.equal(o, want)
        assert bool((o[2] == 0).all())
        for name, bytes_ in parity.snapshot(other).items():
            assert torch.equal(parity.snapshot(pool)[name], bytes_), name
        for name in ("start", "count", "pcum", "w"):
            assert torch.equal(getattr(pool.history, name), getattr(other.history, name)), name
    # one token with the last call's acceptance (the fused step on the Triton backend): accept, then that step
    mixed, a, b, A_log, dt_bias = _raw(gate, B, H, HV, K, V, seed=50)
    n = torch.tensor([2, 0, 0, 3, 1], dtype=torch.int32, device=DEVICE)
    o = leapquant.step_packed(pool, idx, mixed, a, b, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
                              backend=backend, num_accepted=n)
    leapquant.accept(other, idx, n, backend=backend)
    want = leapquant.step_packed(other, idx, mixed, a, b, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
                                 backend=backend)
    assert torch.equal(o, want)
    for name, bytes_ in parity.snapshot(other).items():
        assert torch.equal(parity.snapshot(pool)[name], bytes_), name


def test_step_packed_tokens_bad_input():
    """A T-token call's ``a`` or ``b`` of another T, and a workspace of B rows instead of B T, are refused by name
    before the pool is written."""
    pool = _tokens_pool("kda", 2, 64, 64, 8, 2, seed=3)
    before = parity.snapshot(pool)
    idx = torch.tensor([1, 2], dtype=torch.int32, device=DEVICE)
    mixed, a, b, A_log, dt_bias = _raw_tokens("kda", 2, 2, 1, 2, 64, 64, seed=5)
    kw = dict(A_log=A_log, dt_bias=dt_bias, backend="reference")
    with pytest.raises(ValueError, match=r"\ba must be \[B, T, \.\.\.\] with B = 2 rows and T = 2 tokens"):
        leapquant.step_packed(pool, idx, mixed, a[:, :1], b, **kw)
    with pytest.raises(ValueError, match=r"\bb must be \[B, T, \.\.\.\]"):
        leapquant.step_packed(pool, idx, mixed, a, b[:, 0], **kw)
    with pytest.raises(ValueError, match=r"workspace.g must have shape \[4, 2, 64\]"):
        leapquant.step_packed(pool, idx, mixed, a, b, workspace=packed.packed_workspace(pool, 2), **kw)
    for name, b_ in before.items():
        assert torch.equal(parity.snapshot(pool)[name], b_), name


# --- bad input ---------------------------------------------------------------------------------------------------


def _args(gate):
    """``step_packed``'s arguments on a 2-head pool of 64 x 64 with H = 1 and three rows."""
    mixed, a, b, A_log, dt_bias = (t.cpu() for t in _raw(gate, 3, 1, 2, 64, 64, seed=4))
    return dict(idx=torch.tensor([1, 2, 3], dtype=torch.int32), mixed_qkv=mixed, a=a, b=b, A_log=A_log,
                dt_bias=dt_bias, backend="reference")


# case: (the pool's gate, the arguments replaced, the error, what its message says)
BAD = {
    "width": ("kda", lambda: dict(mixed_qkv=torch.zeros(3, 255)), ValueError,
              r"mixed_qkv must be \[B, 2 \* H \* K \+ HV \* V\].* a width of 256 \(H = 1\), 384 \(H = 2\); got 255"),
    "rows": ("kda", lambda: dict(mixed_qkv=torch.zeros(2, 256)), ValueError, r"mixed_qkv has 2 rows, idx has 3"),
    "mixed_qkv int": ("kda", lambda: dict(mixed_qkv=torch.zeros(3, 256, dtype=torch.int32)), TypeError,
                      r"mixed_qkv must be float32, bfloat16 or float16"),
    "mixed_qkv column-strided": ("kda", lambda: dict(mixed_qkv=torch.zeros(256, 3).t()), ValueError,
                                 r"mixed_qkv must have a unit stride"),
    "mixed_qkv elsewhere": ("kda", lambda: dict(mixed_qkv=torch.zeros(3, 256, device="meta")), ValueError,
                            r"mixed_qkv must be on the pool's device cpu, got meta"),
    "a of GDN's shape": ("kda", lambda: dict(a=torch.zeros(3, 2)), ValueError,
                         r"a must have 3 dimensions.*KDA's gate input here, \[B, HV, K\] or \[B, HV \* K\]"),
    "a of KDA's shape": ("gdn", lambda: dict(a=torch.zeros(3, 2, 64)), ValueError,
                         r"GDN's gate input here, \[B, HV\]"),
    "a fp64": ("kda", lambda: dict(a=torch.zeros(3, 2, 64, dtype=torch.float64)), TypeError, r"\ba must be float32"),
    "b elsewhere": ("kda", lambda: dict(b=torch.zeros(3, 2, device="meta")), ValueError,
                    r"\bb must be on the pool's device"),
    "b of the wrong heads": ("kda", lambda: dict(b=torch.zeros(3, 4)), ValueError, r"\bb must have shape \[3, 2\]"),
    "A_log per channel": ("kda", lambda: dict(A_log=torch.zeros(2 * 64)), ValueError,
                          r"A_log must be \[2\] \(one per value head\)"),
    "A_log int": ("kda", lambda: dict(A_log=torch.zeros(2, dtype=torch.int64)), TypeError, r"A_log must be float32"),
    "A_log a list": ("kda", lambda: dict(A_log=[0.0, 0.0]), TypeError, r"A_log must be a torch.Tensor"),
    "dt_bias per head for KDA": ("kda", lambda: dict(dt_bias=torch.zeros(2)), ValueError,
                                 r"dt_bias must be \[128\] or \[2, 64\] \(one per key channel"),
    "dt_bias per channel for GDN": ("gdn", lambda: dict(dt_bias=torch.zeros(128)), ValueError,
                                    r"dt_bias must be \[2\] \(one per value head\)"),
    "dt_bias strided": ("kda", lambda: dict(dt_bias=torch.zeros(2, 128)[:, :64]), ValueError,
                        r"dt_bias must be contiguous"),
    "lower_bound for GDN": ("gdn", lambda: dict(lower_bound=-5.0), ValueError, r"a GDN pool takes none"),
    "lower_bound positive": ("kda", lambda: dict(lower_bound=1.0), ValueError, r"lower_bound must be finite and <= 0"),
    "lower_bound NaN": ("kda", lambda: dict(lower_bound=float("nan")), ValueError, r"lower_bound must be finite"),
    "lower_bound a tensor": ("kda", lambda: dict(lower_bound=torch.tensor(-5.0)), TypeError,
                             r"lower_bound must be a real number"),
    "workspace g bf16": ("kda", lambda: dict(workspace=packed.PackedWorkspace(
        torch.zeros(3, 2, 64, dtype=torch.bfloat16), torch.zeros(3, 2))), TypeError,
        r"workspace.g must be torch.float32"),
    "workspace of GDN's shape": ("kda", lambda: dict(workspace=(torch.zeros(3, 2), torch.zeros(3, 2))), ValueError,
                                 r"workspace.g must have shape \[3, 2, 64\]"),
    "workspace a list": ("kda", lambda: dict(workspace=[1, 2]), TypeError,
                         r"workspace must be a leapquant.PackedWorkspace"),
    "NaN a with check": ("kda", lambda: dict(a=torch.full((3, 2, 64), float("nan"))), ValueError,
                         r"\ba must be finite"),
    "infinite A_log with check": ("gdn", lambda: dict(A_log=torch.tensor([0.0, float("inf")])), ValueError,
                                  r"A_log must be finite"),
    "idx int64": ("kda", lambda: dict(idx=torch.tensor([1, 2, 3])), TypeError, r"idx must be int32"),
    "idx out of range with check": ("kda", lambda: dict(idx=torch.tensor([1, 2, 9], dtype=torch.int32)), ValueError,
                                    r"idx values must lie in \[0, 4\)"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_refused(case):
    """Each bad argument raises the error that names it, and the pool keeps every byte."""
    gate, over, exc, words = BAD[case]
    pool = leapquant.Pool(4, 2, 64, 64, 8, 2, gate=gate)
    fill(pool, [1, 2, 3], "gaussian", torch.Generator().manual_seed(1))
    before = parity.snapshot(pool)
    with pytest.raises(exc, match=words):
        leapquant.step_packed(pool, **{**_args(gate), **over()})
    for name, b_ in before.items():
        assert torch.equal(parity.snapshot(pool)[name], b_), name


def test_step_packed_without_a_pool():
    with pytest.raises(TypeError, match=r"pool must be a leapquant.Pool"):
        leapquant.step_packed("pool", **_args("kda"))


@pytest.mark.parametrize("target", ["pool.w", "mixed_qkv", "a"])
def test_workspace_that_aliases_is_refused(target):
    """A workspace over bytes the call reads (a pool tensor, an input) is refused before anything is written."""
    pool = leapquant.Pool(4, 2, 64, 64, 8, 2, gate="gdn")
    mixed, a, b, A_log, dt_bias = (t.cpu() for t in _raw("gdn", 3, 1, 2, 64, 64, seed=4))
    over = {"pool.w": pool.w.view(-1)[:6].view(3, 2), "mixed_qkv": mixed.view(-1)[:6].view(3, 2), "a": a}[target]
    with pytest.raises(ValueError, match=r"workspace.g and .* share memory"):
        leapquant.step_packed(pool, torch.tensor([1, 2, 3], dtype=torch.int32), mixed, a, b, A_log=A_log,
                              dt_bias=dt_bias, workspace=(over, torch.zeros(3, 2)), backend="reference")
