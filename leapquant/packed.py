"""The engines' packed decode call: :func:`step_packed` takes vLLM's packed projection ``mixed_qkv`` and the raw gate
inputs (``a``, ``b``, ``A_log``, ``dt_bias``), derives the log decay and beta with FLA's formulas, and runs
:func:`leapquant.step` on views of ``mixed_qkv`` (docs/SPEC.md §6.2).

The formulas, in torch (the definition; the reference path and the tests' oracle), each FLA's naive function:

* GDN (``fla.ops.gated_delta_rule.gate.naive_gdn_gate``): ``g = -exp(A_log) * softplus(a + dt_bias)``, one log
  decay per value head;
* KDA (``fla.ops.kda.gate.naive_kda_gate``): the same per key channel, ``dt_bias`` ``[HV * K]``; with a
  ``lower_bound`` (``naive_kda_lowerbound_gate``, vLLM's ``lower_bound``): ``g = lower_bound * sigmoid(exp(A_log) *
  (a + dt_bias))``;
* ``beta = sigmoid(b)``; ``softplus`` is ``torch.nn.functional.softplus`` with its defaults (beta 1, threshold 20:
  ``x`` above 20, else ``log1p(exp(x))``); all in fp32 from inputs of any float dtype.

A backend may compute the gates itself (``Backend.packed_gates``: the Triton backend's kernel,
:mod:`leapquant_triton.gates`); otherwise, and under ``torch.compile``, they are these torch functions.
"""

from __future__ import annotations

import math
import numbers
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F

from .checks import (STEP_DTYPES, check_apart, check_finite, check_idx_layout, check_in_storage, check_step_values, spans,
                     token_rows)
from .ops import BackendName, accept, check_pool_type, step, step_operands, tokens_operands
from .pool import Pool
from .registry import launch, resolve


def softplus(x: torch.Tensor) -> torch.Tensor:
    """``log(1 + exp(x))`` as FLA's naive gates take it: ``F.softplus`` with beta 1 and threshold 20."""
    return F.softplus(x)


def gdn_gate(a: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:
    """GDN's log decay, fp32 ``[..., HV]``: ``-exp(A_log) * softplus(a + dt_bias)`` (FLA's ``naive_gdn_gate``; vLLM's
    ``fused_gdn_gating``). ``a`` ``[..., HV]``, ``A_log`` and ``dt_bias`` ``[HV]``, any float dtypes."""
    return -A_log.float().exp() * softplus(a.float() + dt_bias.float())


def kda_gate(a: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
             lower_bound: Optional[float] = None) -> torch.Tensor:
    """KDA's log decay per key channel, fp32 ``[..., HV, K]``: ``-exp(A_log) * softplus(a + dt_bias)`` (FLA's
    ``naive_kda_gate``) or, with ``lower_bound``, ``lower_bound * sigmoid(exp(A_log) * (a + dt_bias))`` (FLA's
    ``naive_kda_lowerbound_gate``). ``a`` ``[..., HV, K]``, ``A_log`` ``[HV]``, ``dt_bias`` ``[HV * K]``."""
    HV, K = a.shape[-2:]
    x = a.float() + dt_bias.float().view(HV, K)
    A = A_log.float().view(HV, 1).exp()
    if lower_bound is None:
        return -A * softplus(x)
    return lower_bound * torch.sigmoid(A * x)


def beta_gate(b: torch.Tensor) -> torch.Tensor:
    """The write strength from its logit, fp32: ``sigmoid(b)`` (FLA's ``use_beta_sigmoid_in_kernel``)."""
    return torch.sigmoid(b.float())


def packed_gates(gate: str, a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                 lower_bound: Optional[float] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(g, beta)`` in fp32 for a pool of ``gate`` (``"kda"``: ``a`` ``[B, HV, K]``; ``"gdn"``: ``[B, HV]``), the
    formulas of this module."""
    g = kda_gate(a, A_log, dt_bias, lower_bound) if gate == "kda" else gdn_gate(a, A_log, dt_bias)
    return g, beta_gate(b)


class PackedWorkspace(NamedTuple):
    """Where :func:`step_packed` writes the gates before the step reads them: ``g`` fp32 ``[B, HV, K]`` (KDA) or
    ``[B, HV]`` (GDN), ``beta`` ``[B, HV]`` in fp32, bf16 or fp16 (bf16: beta rounded as vLLM's packed GDN decode
    rounds it to ``b``'s dtype), both contiguous."""

    g: torch.Tensor
    beta: torch.Tensor


def packed_workspace(pool: Pool, rows: int, beta_dtype: torch.dtype = torch.float32) -> PackedWorkspace:
    """A :class:`PackedWorkspace` for ``rows`` batch rows on the pool's device (``torch.empty``: allocate it once,
    outside a CUDA graph, and pass it as ``workspace=`` on every call)."""
    check_pool_type(pool)
    shape = (rows, pool.heads, pool.head_k) if pool.gate == "kda" else (rows, pool.heads)
    return PackedWorkspace(torch.empty(shape, dtype=torch.float32, device=pool.device),
                           torch.empty(rows, pool.heads, dtype=beta_dtype, device=pool.device))


def packed_heads(pool: Pool, width: int) -> int:
    """The key heads ``H`` of a packed row ``width`` wide: ``width = 2 H K + HV V`` with ``H`` dividing ``HV``, else a
    ValueError listing the widths this pool takes."""
    HV, K, V = pool.heads, pool.head_k, pool.head_v
    qk = width - HV * V
    H = qk // (2 * K) if qk > 0 and qk % (2 * K) == 0 else 0
    if H < 1 or HV % H:
        ok = ", ".join(f"{2 * h * K + HV * V} (H = {h})" for h in range(1, HV + 1) if HV % h == 0)
        raise ValueError(f"mixed_qkv must be [B, 2 * H * K + HV * V] (q | k | v, as vLLM packs them) with K = {K}, "
                         f"V = {V}, HV = {HV} and H dividing HV: a width of {ok}; got {width}")
    return H


def split_qkv(mixed_qkv: torch.Tensor, H: int, K: int, HV: int, V: int) -> tuple[torch.Tensor, ...]:
    """Views ``q, k`` ``[..., H, K]`` and ``v`` ``[..., HV, V]`` of ``mixed_qkv`` ``[..., 2 H K + HV V]`` (``[B, D]``,
    or ``[B, T, D]`` for T tokens a row; unit last stride, any other strides): vLLM's order, ``q`` at channel 0, ``k``
    at ``H K``, ``v`` at ``2 H K``. No copy."""
    q = mixed_qkv[..., : H * K].unflatten(-1, (H, K))
    k = mixed_qkv[..., H * K: 2 * H * K].unflatten(-1, (H, K))
    v = mixed_qkv[..., 2 * H * K:].unflatten(-1, (HV, V))
    return q, k, v


def _expect_float(t, name: str, pool: Pool) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in STEP_DTYPES:
        raise TypeError(f"{name} must be float32, bfloat16 or float16, got {t.dtype}")
    if t.device != pool.device:
        raise ValueError(f"{name} must be on the pool's device {pool.device}, got {t.device}")
    if t.numel() and t.stride(-1) != 1:
        raise ValueError(f"{name} must have a unit stride in its last dimension, got strides {t.stride()}")


def _check_param(t, name: str, pool: Pool, shapes: tuple, what: str) -> torch.Tensor:
    """A layer parameter (``A_log``, ``dt_bias``): a contiguous float tensor of one of ``shapes`` on the pool's
    device, returned flat."""
    _expect_float(t, name, pool)
    if tuple(t.shape) not in shapes:
        raise ValueError(f"{name} must be {' or '.join(str(list(s)) for s in shapes)} ({what}) for this pool "
                         f"({pool.gate}, HV = {pool.heads}, K = {pool.head_k}), got {list(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {t.stride()}")
    return t.reshape(-1)


def check_lower_bound(pool: Pool, lower_bound) -> Optional[float]:
    """``lower_bound``: None, or for a KDA pool a finite real ``<= 0`` on the host (the gate then lies in
    ``[lower_bound, 0]``), returned as a float."""
    if lower_bound is None:
        return None
    if pool.gate != "kda":
        raise ValueError("lower_bound is KDA's bounded gate (FLA's fused_kda_gate); a GDN pool takes none, got "
                         f"{lower_bound!r}")
    if isinstance(lower_bound, bool) or not isinstance(lower_bound, numbers.Real):
        raise TypeError(f"lower_bound must be a real number (a host float) or None, got {type(lower_bound).__name__}")
    lb = float(lower_bound)
    if not math.isfinite(lb) or lb > 0:
        raise ValueError(f"lower_bound must be finite and <= 0 (the gate lower_bound * sigmoid(...) is a log decay), "
                         f"got {lb}")
    return lb


def check_packed_inputs(pool: Pool, B: int, mixed_qkv, a, b, A_log, dt_bias) -> tuple:
    """Metadata of :func:`step_packed`'s inputs (no synchronisation). Returns ``(mixed_qkv [B, D], a, b, A_log,
    dt_bias)``: the token tensors in their ``[B, ...]`` forms (KDA's ``a`` as ``[B, HV, K]``), the parameters flat."""
    HV, K = pool.heads, pool.head_k
    mixed_qkv = token_rows(mixed_qkv, "mixed_qkv", 2, B, "; mixed_qkv is the packed projection [B, 2 * H * K + HV * V]")
    _expect_float(mixed_qkv, "mixed_qkv", pool)
    packed_heads(pool, mixed_qkv.shape[1])
    kda = pool.gate == "kda"
    if kda and isinstance(a, torch.Tensor) and a.dim() in (2, 3) and a.shape[-1] == HV * K and (HV > 1 or a.dim() == 2):
        a = a.unflatten(-1, (HV, K))  # the projection's flat [B, HV * K] row
    form = ("; a is KDA's gate input here, [B, HV, K] or [B, HV * K]" if kda
            else "; a is GDN's gate input here, [B, HV]")
    a = token_rows(a, "a", 3 if kda else 2, B, form)
    b = token_rows(b, "b", 2, B, "; b is beta's logit, [B, HV]")
    for name, t, shape in (("a", a, (B, HV, K) if kda else (B, HV)), ("b", b, (B, HV))):
        _expect_float(t, name, pool)
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} must have shape {list(shape)} for this pool ({pool.gate}), got {list(t.shape)}"
                             f"{form if name == 'a' else ''}")
    A_log = _check_param(A_log, "A_log", pool, ((HV,),), "one per value head")
    dt_bias = _check_param(dt_bias, "dt_bias", pool, ((HV * K,), (HV, K)) if kda else ((HV,),),
                           "one per key channel of each value head" if kda else "one per value head")
    return mixed_qkv, a, b, A_log, dt_bias


def _check_workspace(pool: Pool, workspace, B: int, inputs: Optional[tuple]) -> PackedWorkspace:
    """``workspace``: a :class:`PackedWorkspace` (or a ``(g, beta)`` pair) of the right shapes, dtypes and device,
    contiguous and, unless ``inputs`` is None (under ``torch.compile``: no addresses), sharing no byte with the pool,
    ``inputs`` (:func:`spans`) or itself: it is written. Metadata only."""
    if not isinstance(workspace, tuple) or len(workspace) != 2:
        raise TypeError(f"workspace must be a leapquant.PackedWorkspace (g, beta), got {type(workspace).__name__}")
    g, beta = workspace
    g_shape = (B, pool.heads, pool.head_k) if pool.gate == "kda" else (B, pool.heads)
    for name, t, dtypes, shape in (("workspace.g", g, (torch.float32,), g_shape),
                                   ("workspace.beta", beta, STEP_DTYPES, (B, pool.heads))):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in dtypes:
            raise TypeError(f"{name} must be {' or '.join(str(d) for d in dtypes)}, got {t.dtype}")
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} must have shape {list(shape)} for this pool ({pool.gate}), got {list(t.shape)}")
        if t.device != pool.device:
            raise ValueError(f"{name} must be on the pool's device {pool.device}, got {t.device}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous, got strides {t.stride()}")
    if inputs is None:
        return PackedWorkspace(g, beta)
    why = "step_packed writes the workspace while it reads the pool and its inputs"
    check_apart(g, "workspace.g", pool.tensor_spans() + inputs + spans({"workspace.beta": beta}), why)
    check_apart(beta, "workspace.beta", pool.tensor_spans() + inputs, why)
    return PackedWorkspace(g, beta)


def _check_packed_values(pool: Pool, idx: torch.Tensor, a, b, A_log, dt_bias) -> None:
    """``check=True``: the gate inputs finite (a synchronisation each), ``a`` and ``b`` on the rows that name a real
    slot only (padding rows are not read)."""
    real = (idx.long() >= pool.first_slot) & (idx.long() < pool.num_slots)
    for name, t in (("a", a), ("b", b)):
        check_finite(torch.where(real.view((-1,) + (1,) * (t.dim() - 1)), t.detach(), 0), name, bound=None)
    check_finite(A_log, "A_log", bound=None)
    check_finite(dt_bias, "dt_bias", bound=None)


def _torch_gates(pool: Pool, a, b, A_log, dt_bias, lower_bound, g_out, beta_out) -> None:
    """The gates in torch, written into ``g_out``, ``beta_out`` (a backend's ``packed_gates`` signature)."""
    g, beta = packed_gates(pool.gate, a, b, A_log, dt_bias, lower_bound)
    g_out.copy_(g)
    beta_out.copy_(beta)


def step_packed(pool: Pool, idx: torch.Tensor, mixed_qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *,
                A_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: Optional[float] = None,
                scale: Optional[float] = None, use_qk_l2norm: bool = False, out: Optional[torch.Tensor] = None,
                workspace: Optional[PackedWorkspace] = None, backend: BackendName = "auto",
                check: bool = True, fused: bool = True,
                num_accepted: Optional[torch.Tensor] = None) -> torch.Tensor:
    """One decode token per batch row (or T, speculative decoding) from the engine's packed projection and raw gate
    inputs, in place on the pool; returns the attention output (docs/SPEC.md §6.2). vLLM's
    ``fused_recurrent_gated_delta_rule_packed_decode`` and ``fused_recurrent_kda_packed_decode`` over a LeapQuant pool.

    The gates are GDN ``g = -exp(A_log) * softplus(a + dt_bias)`` per value head; KDA the same per key channel, or
    ``lower_bound * sigmoid(exp(A_log) * (a + dt_bias))``; ``beta = sigmoid(b)`` (FLA's formulas, this module's
    functions). On the Triton backend the step kernel computes them in its prologue (one launch after the flush of
    the full rings, nothing written but the pool and ``out``); elsewhere (the reference, ``torch.compile``,
    ``fused=False``) they are computed first, into ``workspace`` (by the Triton backend in a small kernel of its own,
    by the reference in torch), and :func:`leapquant.step` runs on them. Either way the step reads views of
    ``mixed_qkv`` (no copy), with ``use_qk_l2norm`` normalising q and k inside the step kernel, and writes the same
    bytes.

    Args:
        pool, idx: as for :func:`leapquant.step` (``idx`` int32 ``[B]``; vLLM's ``ssm_state_indices``: rows naming
            no real slot get ``o = 0``).
        mixed_qkv: ``[B, 2 * H * K + HV * V]``, q | k | v as vLLM packs them (``H`` dividing the pool's ``HV``, read
            from the width), unit last stride, any row stride; also ``[B, 1, D]`` / ``[1, B, D]``.
        a: the decay's raw input: GDN ``[B, HV]``; KDA ``[B, HV, K]`` or the flat ``[B, HV * K]``.
        b: beta's logit ``[B, HV]``. Token tensors in float32, bfloat16 or float16, unit last stride.
        A_log: ``[HV]``. dt_bias: GDN ``[HV]``, KDA ``[HV * K]`` (or ``[HV, K]``). Contiguous, any float dtype.
        lower_bound: KDA only: the bounded gate above (vLLM's and FLA's ``lower_bound``, e.g. -5.0); None: softplus.
        scale, use_qk_l2norm, out, backend, check: as for :func:`leapquant.step` (``use_qk_l2norm=True`` is vLLM's
            ``use_qk_l2norm_in_kernel=True``; its KDA call always normalises).
        workspace: where the gates go when they are computed apart (:func:`packed_workspace`); default new buffers
            (``torch.empty``; none on the fused path). Pass one to keep a CUDA graph free of allocations; its ``beta``
            dtype is what beta is rounded to, on the fused path too (which reads only that dtype of it).
        fused: compute the gates inside the step kernel where the backend can (Triton); False: apart, into
            ``workspace``, then the step (one more launch; the same bytes).
        num_accepted: as for :func:`leapquant.step`: int32 ``[B]``, the previous call's accepted tokens per row,
            applied first (:func:`leapquant.accept`).

    T tokens a row (SPEC §6.1, §6.2): ``mixed_qkv`` ``[B, T, D]`` with T > 1, ``a`` ``[B, T, HV]`` (GDN) or ``[B, T,
    HV, K]`` / ``[B, T, HV * K]`` (KDA), ``b`` ``[B, T, HV]``, ``out`` and the result ``[B, T, HV, V]``; ``workspace``
    then holds ``B * T`` rows (``packed_workspace(pool, B * T)``), row ``n T + t`` the gates of row n's token t,
    where the gates are computed apart; the Triton step computes them token by token in the T-token step's launches.

    With ``check=False`` nothing synchronises with the host and the Triton path allocates nothing but ``out`` when it
    is not given (and a default workspace with ``fused=False``): graph-capturable. Under ``torch.compile`` the gates
    are the torch formulas, apart.

    Returns:
        ``o`` ``[B, HV, V]`` (T tokens: ``[B, T, HV, V]``) in ``mixed_qkv``'s dtype (``out``'s view when given).

    Raises:
        TypeError, ValueError: a tensor of the wrong type, dtype, shape (``mixed_qkv``'s width names the widths this
            pool takes), device or stride, a bad ``lower_bound`` or workspace; everything :func:`leapquant.step`
            raises; with ``check=True`` also non-finite gate inputs. No pool byte is written before every check
            passed; the workspace is scratch and may hold the gates when the step's own checks raise.
        leapquant.BackendError: an unknown backend, or one that cannot decode this pool here.
    """
    check_pool_type(pool)
    check_idx_layout(pool, idx)
    B = idx.numel()
    T = _packed_tokens(mixed_qkv, B)
    if T > 1:
        mixed_qkv, a, b, A_log, dt_bias = _token_inputs(pool, B, T, mixed_qkv, a, b, A_log, dt_bias)
    else:
        mixed_qkv, a, b, A_log, dt_bias = check_packed_inputs(pool, B, mixed_qkv, a, b, A_log, dt_bias)
    lower_bound = check_lower_bound(pool, lower_bound)
    H = packed_heads(pool, mixed_qkv.shape[-1])
    q, k, v = split_qkv(mixed_qkv, H, pool.head_k, pool.heads, pool.head_v)
    workspace, chosen = _checks_and_backend(pool, idx, T, mixed_qkv, a, b, A_log, dt_bias, out, workspace, backend,
                                            check)
    if chosen is not None:
        backend = chosen.name
    if num_accepted is not None:  # the previous call's acceptance first, as step applies it
        accept(pool, idx, num_accepted, check=check, backend=backend)
    if fused and getattr(chosen, "step_packed", None) is not None:
        return _step_packed_fused(pool, chosen, idx, T, q, k, v, a, b, A_log, dt_bias, lower_bound,
                                  torch.float32 if workspace is None else workspace.beta.dtype, scale,
                                  use_qk_l2norm, out, check)
    # apart: the gates of every (row, token) into the workspace (row n T + t), then the step on them
    g, beta = packed_workspace(pool, B * T) if workspace is None else workspace
    gates = getattr(chosen, "packed_gates", None) or _torch_gates
    if chosen is None:  # under torch.compile: the torch formulas, traced
        gates(pool, _rows(a, T), _rows(b, T), A_log, dt_bias, lower_bound, g, beta)
    else:
        launch(pool, gates, _rows(a, T), _rows(b, T), A_log, dt_bias, lower_bound, g, beta)
    if T > 1:
        g, beta = g.unflatten(0, (B, T)), beta.unflatten(0, (B, T))
    return step(pool, idx, q, k, v, g, beta, scale=scale, use_qk_l2norm=use_qk_l2norm, out=out, backend=backend,
                check=check)


def _checks_and_backend(pool: Pool, idx, T: int, mixed_qkv, a, b, A_log, dt_bias, out, workspace, backend,
                        check: bool) -> tuple:
    """What :func:`step_packed` checks after its inputs' metadata, for T tokens a row: the workspace (``B T`` rows)
    apart from the pool and every input, the inputs inside their storage, with ``check`` the gate inputs' values;
    then the backend. Returns ``(workspace, backend)``,
    the backend None under ``torch.compile`` (which resolves it in the op), where addresses are not checked."""
    compiling = torch.compiler.is_compiling()
    named = {"mixed_qkv": mixed_qkv, "a": a, "b": b, "A_log": A_log, "dt_bias": dt_bias}
    if workspace is not None:
        inputs = None if compiling else spans({"idx": idx, **named,
                                               "out": out if isinstance(out, torch.Tensor) else None})
        workspace = _check_workspace(pool, workspace, idx.numel() * T, inputs)
    if compiling:
        return workspace, None
    for name, t in named.items():
        check_in_storage(t, name)
    if check:
        _check_packed_values(pool, idx if T == 1 else idx.repeat_interleave(T), _rows(a, T), _rows(b, T), A_log,
                             dt_bias)
    return workspace, resolve(backend, pool, "step")


def _packed_tokens(mixed_qkv, B: int) -> int:
    """T of a packed call: ``mixed_qkv`` ``[B, T, D]`` with T > 1 is T tokens a row; every other form one token (as
    :func:`leapquant.step` reads ``q``)."""
    if isinstance(mixed_qkv, torch.Tensor) and mixed_qkv.dim() == 3 and mixed_qkv.shape[0] == B and \
            mixed_qkv.shape[1] > 1:
        return int(mixed_qkv.shape[1])
    return 1


def _token_inputs(pool: Pool, B: int, T: int, mixed_qkv, a, b, A_log, dt_bias) -> tuple:
    """The metadata of a T-token packed call (T > 1): ``a`` and ``b`` ``[B, T, ...]``, and every token's inputs
    checked as one token's (the first token's views carry the metadata all share). Returns ``(mixed_qkv, a, b, A_log,
    dt_bias)``, ``a`` in its ``[B, T, ...]`` form (KDA's ``[B, T, HV, K]``, a view)."""
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() < 3 or tuple(t.shape[:2]) != (B, T):
            raise ValueError(f"{name} must be [B, T, ...] with B = {B} rows and T = {T} tokens (as mixed_qkv), got "
                             f"{list(t.shape)}")
    _, a1, _, A_log, dt_bias = check_packed_inputs(pool, B, mixed_qkv[:, 0], a[:, 0], b[:, 0], A_log, dt_bias)
    a = a.unflatten(-1, tuple(a1.shape[-2:])) if a.dim() == 3 and a1.dim() == 3 else a  # KDA's flat form
    return mixed_qkv, a, b, A_log, dt_bias


def _rows(x: torch.Tensor, T: int) -> torch.Tensor:
    """A gate input of a T-token call as ``B T`` gate rows, row ``n T + t`` row n's token t (one token: ``x``). Only
    where the rows are read (the gates apart, the value checks): an engine's strided ``a`` or ``b`` cannot always be
    viewed so, and the fused call reads them in place."""
    return x if T == 1 else x.flatten(0, 1)


def _step_packed_fused(pool: Pool, chosen, idx, T: int, q, k, v, a, b, A_log, dt_bias, lower_bound, beta_dtype,
                       scale, use_qk_l2norm, out, check: bool) -> torch.Tensor:
    """:func:`step_packed` on a backend whose step computes the gates (``chosen.step_packed``), T tokens a row:
    ``step``'s checks with ``a`` and ``b`` in the places of ``g`` and ``beta`` (their shapes and dtypes are those;
    ``out`` first checked apart from every raw input, so that an overlap is named as such), with ``check`` the gates'
    values computed in torch (bit for bit the kernel's on a GPU) held to ``step``'s range, then the step's launches."""
    if isinstance(out, torch.Tensor):
        check_apart(out, "out", spans({"a": a, "b": b, "A_log": A_log, "dt_bias": dt_bias}),
                    "step_packed writes out while it reads its inputs")
    if T == 1:
        q, k, v, a, b, o, scale = step_operands(pool, idx, q, k, v, a, b, scale, out, check, values=False)
    else:
        o, scale = tokens_operands(pool, idx, T, q, k, v, a, b, scale, out, check, values=False)
    if check:
        g, beta = packed_gates(pool.gate, a, b, A_log, dt_bias, lower_bound)
        check_step_values(pool, idx, q, k, v, g, beta.to(beta_dtype))
    launch(pool, chosen.step_packed, idx, q, k, v, a, b, A_log, dt_bias, lower_bound, beta_dtype, scale,
           bool(use_qk_l2norm), o)
    return o
