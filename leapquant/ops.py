"""The public operations: ``flush``, ``step`` and ``accept`` (in place on a pool), ``run`` (a functional flush),
``select`` (which backend runs one), and the ``torch.library`` ops behind them.

Under ``torch.compile``, ``flush`` goes through the custom op ``leapquant::flush`` (``step``: ``leapquant::step``, or
``leapquant::step_tokens`` for T > 1 tokens a row; ``accept``: ``leapquant::accept``; ``Pool.copy_slots``,
``Pool.states`` and ``Pool.load_states``: ``leapquant::copy_slots``, ``::states`` and ``::load_states``), which declares
the tensors it mutates and has a fake implementation, so the compiled graph holds one opaque op. In eager code (and
under CUDA-graph capture) it calls the backend directly: the custom op's Python dispatch of a mutating op costs more
host time than a sparse flush takes on the GPU (bench/results/host_overhead_h200.md). Either way the backend runs
with the pool's GPU as the current device (:func:`leapquant.registry.launch`).
"""

from __future__ import annotations

import inspect
from typing import Literal, Optional

import torch

from .backends import Backend
from .checks import (POOL_BASE, check_hcnt, check_idx, check_idx_layout, check_in_storage, check_pool_values,
                     check_run_inputs, check_scale, check_step_inputs, check_step_memory, check_step_values, gate_form,
                     token_rows)
from .pool import History, Pool
from .registry import launch, resolve

BackendName = Literal["auto", "reference", "triton", "tilelang"] | str
Op = Literal["flush", "force_flush", "step", "states"]


def select(pool: Pool, backend: BackendName = "auto", op: Op = "flush") -> Backend:
    """The backend that ``flush`` (``op="flush"``; ``"force_flush"``: ``flush(..., force=True)``), ``step``
    (``"step"``) or ``Pool.load_states`` / ``Pool.states`` (``"states"``) would use on ``pool`` with
    ``backend=backend`` (``"auto"``: the fastest that supports the pool and implements the operation).

    Raises:
        TypeError: ``pool`` is not a Pool or ``backend`` not a string.
        leapquant.BackendError: unknown backend, or one that cannot run ``op`` on this pool here (the message says
            why).
    """
    check_pool_type(pool)
    return resolve(backend, pool, op)


def check_pool_type(pool) -> None:
    if not isinstance(pool, Pool):
        raise TypeError(f"pool must be a leapquant.Pool, got {type(pool).__name__}")


def flush(pool: Pool, idx: torch.Tensor, backend: BackendName = "auto", check: bool = True, *,
          force: bool = False) -> None:
    """Flush every due (slot, head) of ``idx`` in place (SPEC §2 due rule, SPEC §3 math).

    Args:
        pool: the slot pool; its checkpoints, ``w``, ``pcum`` and ``gbuf`` are updated in place for due programs
            (``hcnt`` stays at ``L``; with ``force`` it is set to ``L``). Nothing else is written.
        idx: int32 ``[N]`` on the pool's device, the slot of each batch row. Under the vLLM convention 0 pads; under
            SGLang's -1 pads. A program ``(n, h)`` is due iff ``idx[n]`` is a real slot and ``hcnt[idx[n], h] == L``.
        backend: ``"auto"`` (the fastest backend that supports this pool here), ``"reference"`` (fp32 torch, any
            device), ``"triton"`` (CUDA sm_80+; CPU under ``TRITON_INTERPRET=1``), ``"tilelang"`` (CUDA sm_90 /
            sm_100, 32 heads of 128 x 128, ring 16), or the name of a backend registered by another package.
        check: also validate the values (reads ``idx`` and ``q0`` on the host: a synchronisation): ``idx`` in
            range, no real slot named twice, ``q0`` finite. Pass ``False`` on the hot path and under CUDA-graph
            capture: then only metadata is checked (no synchronisation), out-of-range entries are skipped, never
            written, and a slot named twice is flushed once. Under ``torch.compile`` the value checks run inside the
            op, at run time.
        force: flush every ring of ``idx`` that holds an entry (``1 <= hcnt <= L``: partially filled rings too), not
            only the full ones (SPEC §2, "Forced flush"): afterwards each named (slot, head)'s ring is empty and its
            checkpoint holds its whole state, so the checkpoint alone is a snapshot (prefix caching). A flushed
            program's ``hcnt`` becomes ``L`` ("flushed, next entry 0"). Backends: reference and Triton
            (``select(pool, backend, op="force_flush")``).

    Whatever ``check``, the pool's and ``idx``'s metadata is checked (dtypes, shapes, strides, devices, storage
    sizes; the pool's only after one of its attributes was assigned), each (slot, head) is flushed at most once, and
    a program whose ring holds nothing since its last flush is left as it is (SPEC §5, "Guarantees").

    Raises:
        TypeError, ValueError: a wrong type, dtype, shape, device or stride of ``pool``'s tensors or of ``idx``; with
            ``check=True`` also an ``idx`` value out of range, a slot named twice, or a non-finite ``q0``.
        leapquant.BackendError: unknown backend, or one that cannot run here (the message says why; with ``force``
            also one that flushes full rings only, such as TileLang).
    """
    check_pool_type(pool)
    check_idx_layout(pool, idx)
    if torch.compiler.is_compiling():
        # the op resolves the name and checks the pool when it runs (the choice reads entry points and device
        # properties, the checks tensors' storage and values: not traceable)
        torch.ops.leapquant.flush(*op_args(pool, idx, backend), check=bool(check), layout=pool.layout,
                                  force=bool(force))
        return
    _check_call(pool, idx, check)
    _launch_flush(pool, idx, backend, bool(force))


def _launch_flush(pool: Pool, idx: torch.Tensor, backend: BackendName, force: bool) -> None:
    """The backend's flush; ``force`` goes to it only when set, so that a backend's ``flush(pool, idx)`` written
    before there was a forced flush keeps working (it is never chosen for one: :attr:`Backend.partial_rings`)."""
    if force:
        launch(pool, resolve(backend, pool, "force_flush").flush, idx, True)
    else:
        launch(pool, resolve(backend, pool, "flush").flush, idx)


def _check_call(pool: Pool, idx: torch.Tensor, check: bool) -> None:
    """The checks of ``flush`` and ``step`` on the pool and ``idx`` (whose layout the caller has checked)."""
    check_in_storage(idx, "idx")
    pool.check_layout(force=check)
    if check:
        check_pool_values(pool)
        check_idx(pool, idx)
        check_hcnt(pool, idx)


def _check_step(pool: Pool, idx: torch.Tensor, q, k, v, g, beta, out, check: bool) -> None:
    """The checks of ``step`` on its tensors (in their ``[B, ...]`` forms, shapes already checked) after
    :func:`_check_call`: their memory on every call (no synchronisation; ``out`` None when the step allocates it);
    with ``check`` their values."""
    check_step_memory(pool, idx, q, k, v, g, beta, out)
    if check:
        check_step_values(pool, idx, q, k, v, g, beta)


def step(pool: Pool, idx: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
         beta: torch.Tensor, *, scale: Optional[float] = None, use_qk_l2norm: bool = False,
         out: Optional[torch.Tensor] = None, backend: BackendName = "auto", check: bool = True,
         num_accepted: Optional[torch.Tensor] = None) -> torch.Tensor:
    """One decode token per batch row, in place on the pool; returns the attention output (SPEC §6).

    Per row n and value head hv: if the ring of ``(idx[n], hv)`` is full it is flushed first (as :func:`flush`);
    then the token enters the ring (prediction ``p = S' k`` from the checkpoint and the ring, ``ubuf = bf16(v - p)``,
    ``kbuf = bf16(k)``, ``w = beta``, the gates, the fill count advanced) and ``o = scale S_t q`` with ``S_t`` the
    state after the token: FLA's ``fused_recurrent_kda`` / ``fused_recurrent_gated_delta_rule`` output, V-first.

    Args:
        pool: the slot pool; its checkpoints (when a ring was full), rings and fill counts change in place.
        idx: int32 ``[B]``, the slot of each row; rows that name no real slot (padding) get ``o = 0`` and touch
            nothing.
        q, k: ``[B, H, K]``, ``H`` dividing the pool's ``HV`` (value head hv reads key head ``hv // (HV / H)``).
        v: ``[B, HV, V]``. g: the log decay, ``[B, HV, K]`` (KDA) or ``[B, HV]`` (GDN). beta: ``[B, HV]``.
            Every token tensor may also come as the engines' ``[B, 1, ...]`` or ``[1, B, ...]`` (taken as a view),
            in float32, bfloat16 or float16, with a unit stride in its last dimension.
        scale: multiplies the output; default ``K ** -0.5``.
        use_qk_l2norm: normalise q and k first, ``x / sqrt(sum x^2 + 1e-6)`` (FLA's ``use_qk_l2norm_in_kernel``).
        out: ``[B, HV, V]`` (or ``[B, 1, HV, V]``) in q's dtype to write ``o`` into; default a new tensor.
        backend: ``"auto"`` (the fastest backend with a decode step that supports the pool), ``"reference"``,
            ``"triton"``, or a registered backend's name.
        check: as for :func:`flush` (with ``False``: metadata only, no host synchronisation, graph-capturable). A
            slot named twice with ``check=False`` is flushed once; its ring update and output are undefined.
        num_accepted: int32 ``[B]``: first apply :func:`accept` to the previous call's tokens (the engines' single
            call, as FLA's ``num_accepted_tokens``), then step.

    T tokens per row (speculative decoding, SPEC §6.1): ``q``, ``k`` ``[B, T, H, K]``, ``v`` ``[B, T, HV, V]``, ``g``
    ``[B, T, HV, K]`` or ``[B, T, HV]``, ``beta`` ``[B, T, HV]`` with ``2 <= T <= L / 2`` return ``o`` ``[B, T, HV,
    V]`` (``out`` likewise): the rings that cannot hold T more entries are flushed first (partially filled ones
    too), then T one-token steps, token t's output from the state after it. On a pool made with ``max_tokens >= T``
    the call keeps what :func:`accept` needs.

    Returns:
        ``o`` ``[B, HV, V]`` in q's dtype (``out``'s ``[B, HV, V]`` view when given), accumulated in fp32.

    Raises:
        TypeError, ValueError: a tensor of the wrong type, dtype, shape, device or stride (named); with
            ``check=True`` also the pool's tensors, an ``idx`` value out of range or a slot named twice.
        leapquant.BackendError: an unknown backend, or one that cannot decode this pool here.
    """
    check_pool_type(pool)
    check_idx_layout(pool, idx)
    B = idx.numel()
    T = _tokens_per_row(q, B)
    if num_accepted is not None:
        accept(pool, idx, num_accepted, check=check, backend=backend)
    if T > 1:
        return _step_tokens(pool, idx, T, q, k, v, g, beta, scale, use_qk_l2norm, out, backend, check)
    eager = not torch.compiler.is_compiling()  # compiled, the op checks the pool and the values when it runs
    q, k, v, g, beta, o, scale = step_operands(pool, idx, q, k, v, g, beta, scale, out, check, eager=eager)
    if eager:
        launch(pool, resolve(backend, pool, "step").step, idx, q, k, v, g, beta, scale, bool(use_qk_l2norm), o)
        return o
    torch.ops.leapquant.step(*op_args(pool, idx, backend)[:-1], q, k, v, g, beta, o, scale, bool(use_qk_l2norm),
                             backend, check=bool(check), layout=pool.layout)
    return o


def step_operands(pool: Pool, idx: torch.Tensor, q, k, v, g, beta, scale, out, check: bool, values: bool = True,
                  eager: bool = True):
    """The checks of a one-token :func:`step` in their order (``eager``: the pool and ``idx``; the token tensors'
    forms, shapes, dtypes and memory, ``scale``; ``eager`` with ``check`` and ``values``: the token values) and its
    operands: ``(q, k, v, g, beta, out, scale)`` in their ``[B, ...]`` forms, ``out`` allocated where None."""
    B = idx.numel()
    if eager:
        _check_call(pool, idx, check)
    q, k, v, beta = (token_rows(t, n, d, B) for t, n, d in ((q, "q", 3), (k, "k", 3), (v, "v", 3), (beta, "beta", 2)))
    g = token_rows(g, "g", 3 if pool.gate == "kda" else 2, B, gate_form(pool.gate))
    o = None if out is None else token_rows(out, "out", 3, B)
    check_step_inputs(pool, q, k, v, g, beta, o)
    scale = check_scale(pool.head_k ** -0.5 if scale is None else scale)
    if eager:
        _check_step(pool, idx, q, k, v, g, beta, o, check and values)
    if o is None:
        o = torch.empty(B, pool.heads, pool.head_v, dtype=q.dtype, device=pool.device)
    return q, k, v, g, beta, o, scale


def _tokens_per_row(q, B: int) -> int:
    """T of a step's token tensors: ``q`` ``[B, T, H, K]`` with T > 1 is a step of T tokens per row; every other form
    (``[B, H, K]``, ``[B, 1, H, K]``, ``[1, B, H, K]``) one token."""
    if isinstance(q, torch.Tensor) and q.dim() == 4 and q.shape[0] == B and q.shape[1] > 1:
        return int(q.shape[1])
    return 1


def _step_tokens(pool: Pool, idx, T: int, q, k, v, g, beta, scale, use_qk_l2norm, out, backend, check):
    """:func:`step` with T > 1 tokens per row (SPEC §6.1): the checks of every token's tensors, then the backend."""
    eager = not torch.compiler.is_compiling()  # compiled, the op checks the pool, memory and values when it runs
    out, scale = tokens_operands(pool, idx, T, q, k, v, g, beta, scale, out, check, eager=eager)
    if eager:
        _launch_tokens(pool, idx, q, k, v, g, beta, scale, bool(use_qk_l2norm), out, backend)
    else:
        torch.ops.leapquant.step_tokens(*op_args(pool, idx, backend)[:-1], *_history_args(pool), q, k, v, g, beta,
                                        out, scale, bool(use_qk_l2norm), backend, check=bool(check),
                                        layout=pool.layout)
    return out


def tokens_operands(pool: Pool, idx: torch.Tensor, T: int, q, k, v, g, beta, scale, out, check: bool,
                    values: bool = True, eager: bool = True):
    """The checks of a T-token :func:`step` (T > 1) in their order (``eager``: the pool and ``idx``; T against the
    ring and the history; the token tensors' forms, every token's shapes, dtypes and strides, ``scale``; ``eager``:
    every token's memory, with ``check`` and ``values`` its values): ``(out, scale)``, ``out`` allocated where None."""
    L = pool.ring
    if T > L // 2:
        raise ValueError(f"a step takes at most L / 2 = {L // 2} tokens per row (ring {L}), got T = {T}")
    if pool.history is not None and T > pool.history.max_tokens:
        raise ValueError(f"the pool keeps history for {pool.history.max_tokens} tokens per row (Pool(max_tokens=...)),"
                         f" got T = {T}")
    B = idx.numel()
    if eager:
        _check_call(pool, idx, check)
    gdims = 4 if pool.gate == "kda" else 3
    named = dict(q=(q, 4), k=(k, 4), v=(v, 4), g=(g, gdims), beta=(beta, 3))
    if out is not None:
        named["out"] = (out, 4)
    for name, (t, dims) in named.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != dims or t.shape[0] != B or t.shape[1] != T:
            raise ValueError(f"{name} must be [B, T, ...] with B = {B} rows and T = {T} tokens (as q) and {dims} "
                             f"dimensions, got {list(t.shape)}" + (gate_form(pool.gate) if name == "g" else ""))
    scale = check_scale(pool.head_k ** -0.5 if scale is None else scale)
    for t in range(T):  # each token's tensors as one token's: shapes, dtypes, strides
        check_step_inputs(pool, *(x[:, t] for x in (q, k, v, g, beta)), None if out is None else out[:, t])
    if eager:  # the memory checks see out as the caller gave it (None: the step allocates it)
        _check_tokens(pool, idx, q, k, v, g, beta, out, check and values)
    if out is None:
        out = torch.empty(B, T, pool.heads, pool.head_v, dtype=q.dtype, device=pool.device)
    return out, scale


def _check_tokens(pool: Pool, idx: torch.Tensor, q, k, v, g, beta, out, check: bool) -> None:
    """:func:`_check_step` for each token of a T-token call: memory, and with ``check`` the values."""
    for t in range(q.shape[1]):
        _check_step(pool, idx, q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], None if out is None else out[:, t],
                    check)


def _launch_tokens(pool: Pool, idx: torch.Tensor, q, k, v, g, beta, scale: float, use_qk_l2norm: bool, out,
                   backend: BackendName) -> None:
    """The backend's T-token step, the call checked: what the eager call and the op ``leapquant::step_tokens`` run."""
    launch(pool, resolve(backend, pool, "step_tokens").step, idx, q, k, v, g, beta, scale, use_qk_l2norm, out)


def _history_args(pool: Pool) -> tuple:
    """The history's tensors as the custom ops take them (``start, count, pcum, w``; None where the pool keeps none)."""
    return pool.history.tensors() if pool.history is not None else (None,) * 4


def accept(pool: Pool, idx: torch.Tensor, num_accepted: torch.Tensor, check: bool = True,
           backend: BackendName = "auto") -> None:
    """Keep the first ``num_accepted[n]`` of the tokens the last step gave row n, and take the others back (SPEC
    §6.1): afterwards the pool behaves as if only those tokens had been stepped after that call's flush (the flush
    stays). A cursor move: the fill count, ``pcum`` and ``w`` of each named slot's heads go back to what the call
    recorded after its first ``num_accepted[n]`` tokens, and (KDA) the gates of the entries past the new count to 1,
    what a flush leaves there; the keys and values the others wrote lie past the count under zero weights, unread.

    Args:
        pool: a pool made with ``max_tokens > 1`` (it keeps the history this needs).
        idx: int32 ``[B]``, the rows' slots, as the step's; padding rows are left alone.
        num_accepted: int32 or int64 ``[B]`` on the pool's device, each in ``0 .. T`` of the row's last step.
        check: also check the values (a host synchronisation): ``idx`` in range, no slot twice, every
            ``num_accepted`` within its row's last T. With ``False`` (graph-capturable, no synchronisation) a value
            outside ``0 .. T`` is clamped into it.
        backend: the step's (``select(pool, backend)``): the Triton backend writes the pool in one kernel launch,
            the others in torch; the bytes written are the same.

    Raises:
        TypeError, ValueError: a wrong type, dtype, shape or device; a pool without history; with ``check`` also
            the values above.
    """
    check_pool_type(pool)
    check_idx_layout(pool, idx)
    hist = pool.history
    if hist is None:
        raise ValueError("accept needs a pool that keeps a history of its steps: make it with Pool(..., "
                         "max_tokens=T) for steps of up to T tokens per row")
    if not isinstance(num_accepted, torch.Tensor):
        raise TypeError(f"num_accepted must be a torch.Tensor, got {type(num_accepted).__name__}")
    if num_accepted.dtype not in (torch.int32, torch.int64) or num_accepted.shape != idx.shape:
        raise ValueError(f"num_accepted must be int32 or int64 of idx's shape {list(idx.shape)}, got "
                         f"{num_accepted.dtype} {list(num_accepted.shape)}")
    if num_accepted.device != pool.device:
        raise ValueError(f"num_accepted is on {num_accepted.device}, the pool on {pool.device}")
    if torch.compiler.is_compiling():  # the op checks the pool and the values when it runs
        torch.ops.leapquant.accept(*op_args(pool, idx, backend)[:-1], *hist.tensors(), num_accepted, backend,
                                   check=bool(check), layout=pool.layout)
        return
    _check_call(pool, idx, check)
    _accept(pool, idx, num_accepted, check, backend)


def _accept(pool: Pool, idx: torch.Tensor, num_accepted: torch.Tensor, check: bool, backend: BackendName) -> None:
    """:func:`accept` after its checks of the arguments' forms and of the pool: the values' check, the backend."""
    hist = pool.history
    if idx.numel() == 0:
        return
    if check:
        from .reference import _rows

        real, safe = _rows(pool, idx)[:2]
        count = hist.count[safe]  # [B, HV]: T of each head's last step
        n = num_accepted.long()[:, None].expand_as(count)
        if bool((real[:, None] & ((n < 0) | (n > count))).any()):
            bad = int(torch.nonzero((real[:, None] & ((n < 0) | (n > count))).any(1))[0])
            raise ValueError(f"num_accepted[{bad}] = {int(num_accepted[bad])} is outside 0 .. T = "
                             f"{int(count[bad].max())} of its row's last step")
    launch(pool, getattr(resolve(backend, pool, "step"), "accept", None) or accept_torch, idx, num_accepted)


def accept_torch(pool: Pool, idx: torch.Tensor, num_accepted: torch.Tensor) -> None:
    """:func:`accept` in torch, its arguments checked (the form of the backends without a kernel for it)."""
    from .reference import _record, _rows  # the reference's row rules: each slot written once, padding never

    hist = pool.history
    real, safe, first, src = _rows(pool, idx)
    count = hist.count[safe]  # [B, HV]: T of each head's last step
    n = torch.minimum(num_accepted.long()[:, None].expand_as(count).clamp_min(0), count.long())
    L = pool.ring
    start = hist.start[safe].long()
    j0 = torch.where(start >= L, torch.zeros_like(start), start)
    hcnt = torch.where(n == 0, start, j0 + n).to(torch.int32)
    heads = torch.arange(pool.heads, device=idx.device)
    pcum = hist.pcum[safe[:, None], heads[None, :], n]  # [B, HV, K or 1]: after the first n tokens
    w = hist.w[safe[:, None], heads[None, :], n]
    writes = [(pool.hcnt, hcnt), (pool.pcum, pcum), (pool.w, w), (hist.count, n.to(torch.int32))]
    if pool.gbuf is not None:
        # the gates of the entries taken back return to what a flush leaves and no step has written since (1): a
        # rebuild (states, a flush) multiplies over every entry's gate
        past = (torch.arange(L, device=idx.device) >= (j0 + n)[..., None])[..., None]  # past the entries in use
        writes.append((pool.gbuf, torch.where(past, torch.ones((), dtype=pool.gbuf.dtype, device=idx.device),
                                              pool.gbuf[safe])))
    for dst, new in writes:
        _record(pool, dst, None, new, real, safe, first, src, per_row=True)


def op_args(pool: Pool, idx: torch.Tensor, backend: BackendName = "auto") -> tuple:
    """The positional arguments of ``torch.ops.leapquant.flush`` for ``flush(pool, idx, backend)``: the pool's tensors,
    ``idx``, its geometry and the backend's name; the layout goes as the keyword ``layout`` (default "compact", the
    pool's)."""
    own = pool.op_args()
    return own[:8] + (idx,) + own[8:] + (backend,)


# the custom ops' arguments: the pool's tensors and geometry, as ``op_args`` lists them, then each op's own; the
# schema (with the mutated tensors marked) is written from this one table
_POOL_PARAMS = (("raw", "Tensor"), ("kbuf", "Tensor"), ("ubuf", "Tensor"), ("w", "Tensor"), ("pcum", "Tensor"),
                ("gbuf", "Tensor?"), ("hcnt", "Tensor"), ("q0", "Tensor"), ("idx", "Tensor"), ("num_slots", "SymInt"),
                ("heads", "SymInt"), ("head_k", "SymInt"), ("head_v", "SymInt"), ("ring", "SymInt"), ("rank", "SymInt"),
                ("gate", "str"), ("convention", "str"), ("iters", "SymInt"))
_STEP_PARAMS = (("q", "Tensor"), ("k", "Tensor"), ("v", "Tensor"), ("g", "Tensor"), ("beta", "Tensor"),
                ("out", "Tensor"), ("scale", "float"), ("use_qk_l2norm", "bool"))
# the layout last, a keyword whose default is the pool's default layout (flush and step always pass it)
_TAIL_PARAMS = (("backend", "str"), ("check", "bool", False), ("layout", "str", "compact"))


def _custom_op(name: str, params: tuple, mutated: tuple[str, ...], body, with_idx: bool = True):
    """``torch.library`` op ``leapquant::<name>`` over ``params`` (``(name, type[, default])``), declaring
    ``mutated`` as written, run by ``body(pool, args)`` with ``args`` the bound arguments by name. ``with_idx``: the
    op takes ``idx`` and checks it and the pool as ``flush`` does; without, ``body`` checks what it takes (the ops on
    slots call the pool's own method, which does)."""
    fields, sig = [], []
    for i, (pname, typ, *default) in enumerate(params):
        if pname in mutated:
            typ = f"Tensor(a{i}!)" + ("?" if typ.endswith("?") else "")
        fields.append(f"{typ} {pname}" + (f"={default[0]!r}".replace("'", '"') if default else ""))
        sig.append(inspect.Parameter(pname, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                     default=default[0] if default else inspect.Parameter.empty))
    signature = inspect.Signature(sig)

    def run_op(*args, **kwargs) -> None:
        a = signature.bind(*args, **kwargs)
        a.apply_defaults()
        a = a.arguments
        pool = Pool.from_tensors(*(a[n] for n in POOL_BASE), layout=a["layout"],
                                 **{n: a[n] for n, _ in _POOL_PARAMS[9:]})
        if with_idx:
            check_idx_layout(pool, a["idx"])
            _check_call(pool, a["idx"], a["check"])
        body(pool, a)

    op = torch.library.custom_op(f"leapquant::{name}", run_op, mutates_args=mutated, device_types=None,
                                 schema=f"({', '.join(fields)}) -> ()")
    op.register_fake(lambda *args, **kwargs: None)
    return op


# force last, after the layout: the op's positional form is unchanged; hcnt is written by a forced flush
_flush_op = _custom_op(
    "flush", _POOL_PARAMS + _TAIL_PARAMS + (("force", "bool", False),),
    ("raw", "kbuf", "ubuf", "w", "pcum", "gbuf", "hcnt"),
    lambda pool, a: _launch_flush(pool, a["idx"], a["backend"], a["force"]))


def _run_step_op(pool: Pool, a: dict) -> None:
    check_scale(a["scale"])
    _check_step(pool, *(a[n] for n in ("idx", "q", "k", "v", "g", "beta", "out", "check")))
    launch(pool, resolve(a["backend"], pool, "step").step,
           *(a[n] for n in ("idx", "q", "k", "v", "g", "beta", "scale", "use_qk_l2norm", "out")))


_step_op = _custom_op(
    "step", _POOL_PARAMS + _STEP_PARAMS + _TAIL_PARAMS, ("raw", "kbuf", "ubuf", "w", "pcum", "gbuf", "hcnt", "out"),
    _run_step_op)

# a pool's history (SPEC §6.1), after the pool's own tensors: None where the pool keeps none
_HISTORY_PARAMS = (("hstart", "Tensor?"), ("hcount", "Tensor?"), ("hpcum", "Tensor?"), ("hw", "Tensor?"))


def _with_history(pool: Pool, a: dict) -> None:
    if a["hstart"] is not None:
        # not through Pool.__setattr__: the pool's layout check covers its own tensors, History.from_tensors these
        object.__setattr__(pool, "history", History.from_tensors(pool, a["hstart"], a["hcount"], a["hpcum"], a["hw"]))


def _run_step_tokens_op(pool: Pool, a: dict) -> None:
    _with_history(pool, a)
    check_scale(a["scale"])
    q, k, v, g, beta, out = (a[n] for n in ("q", "k", "v", "g", "beta", "out"))
    _check_tokens(pool, a["idx"], q, k, v, g, beta, out, a["check"])
    _launch_tokens(pool, a["idx"], q, k, v, g, beta, a["scale"], a["use_qk_l2norm"], out, a["backend"])


_step_tokens_op = _custom_op(
    "step_tokens", _POOL_PARAMS + _HISTORY_PARAMS + _STEP_PARAMS + _TAIL_PARAMS,
    ("raw", "kbuf", "ubuf", "w", "pcum", "gbuf", "hcnt", "hstart", "hcount", "hpcum", "hw", "out"), _run_step_tokens_op)


def _run_accept_op(pool: Pool, a: dict) -> None:
    _with_history(pool, a)
    if pool.history is None:
        raise ValueError("leapquant::accept needs the pool's history tensors")
    _accept(pool, a["idx"], a["num_accepted"], a["check"], a["backend"])


_accept_op = _custom_op(
    "accept", _POOL_PARAMS + _HISTORY_PARAMS + (("num_accepted", "Tensor"),) + _TAIL_PARAMS,
    ("w", "pcum", "gbuf", "hcnt", "hcount"), _run_accept_op)


# the ops on slots (``Pool.copy_slots``, ``Pool.states``, ``Pool.load_states``, routed here under torch.compile by
# the pool's methods): the pool's tensors and geometry without ``idx`` (``Pool.op_args``), then each op's own; the op
# runs the pool's method, whose checks (with ``check``, host reads of the slots and values) run when the graph runs
_SLOT_POOL_PARAMS = _POOL_PARAMS[:8] + _POOL_PARAMS[9:]
_WRITES_POOL = ("raw", "kbuf", "ubuf", "w", "pcum", "gbuf", "hcnt")  # every pool tensor but q0, as flush declares

_copy_slots_op = _custom_op(
    "copy_slots", _SLOT_POOL_PARAMS + (("src", "Tensor"), ("dst", "Tensor")) + _TAIL_PARAMS, _WRITES_POOL,
    lambda pool, a: pool.copy_slots(a["src"], a["dst"], check=a["check"], backend=a["backend"]), with_idx=False)

_states_op = _custom_op(
    "states", _SLOT_POOL_PARAMS + (("slots", "Tensor"), ("out", "Tensor"), ("state_v_first", "bool"))
    + _TAIL_PARAMS, ("out",),
    lambda pool, a: pool.states(a["slots"], out=a["out"], backend=a["backend"], check=a["check"],
                                state_v_first=a["state_v_first"]), with_idx=False)

_load_states_op = _custom_op(
    "load_states", _SLOT_POOL_PARAMS + (("slots", "Tensor"), ("states", "Tensor"), ("state_v_first", "bool"))
    + _TAIL_PARAMS, _WRITES_POOL,
    lambda pool, a: pool.load_states(a["slots"], a["states"], backend=a["backend"], check=a["check"],
                                     state_v_first=a["state_v_first"]), with_idx=False)


def run(codes, s_k, s_v, u, q, kbuf, ubuf, gbuf, w, pcum, q0, backend: BackendName = "auto", iters: int = 1):
    """Functional flush (SPEC §5): every program due, fresh outputs.

    Args (``B`` programs-rows of ``HV`` heads): codes int8 ``[B, HV, V, K]``; s_k fp32 ``[B, HV, K]``; s_v fp32
    ``[B, HV, V]``; u fp16 ``[B, HV, R, K]``; q fp16 ``[B, HV, R, V]``; kbuf bf16 ``[B, HV, L, K]``; ubuf bf16
    ``[B, HV, L, V]``; gbuf fp16 ``[B, HV, L, K]`` (KDA) or None (GDN); w fp32 ``[B, HV, L]``; pcum fp32
    ``[B, HV, K]`` (KDA) or ``[B, HV, 1]`` (GDN); q0 fp32 ``[V, R]``.

    Returns:
        ``(codes, s_k, s_v, u, q)``, new tensors of the input shapes.
    """
    B, HV, V, K, R, L = check_run_inputs(codes, s_k, s_v, u, q, kbuf, ubuf, gbuf, w, pcum, q0)
    gate = "kda" if gbuf is not None else "gdn"
    pool = Pool(B + 1, HV, K, V, L, R, gate=gate, device=codes.device, q0=q0, iters=iters)
    rows = slice(1, B + 1)
    pool.codes[rows] = codes
    pool.s_k[rows] = s_k
    pool.s_v[rows] = s_v
    pool.u[rows] = u
    pool.q[rows] = q
    pool.kbuf[rows] = kbuf
    pool.ubuf[rows] = ubuf
    pool.w[rows] = w
    pool.pcum[rows] = pcum
    if gbuf is not None:
        pool.gbuf[rows] = gbuf
    pool.hcnt[rows] = L
    flush(pool, torch.arange(1, B + 1, dtype=torch.int32, device=codes.device), backend=backend)
    return (pool.codes[rows].clone(), pool.s_k[rows].clone(), pool.s_v[rows].clone(),
            pool.u[rows].clone(), pool.q[rows].clone())
