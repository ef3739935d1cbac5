"""States in and out of a pool (SPEC §5): the checks and the backend dispatch behind :meth:`Pool.load_states` and
:meth:`Pool.states`.

``load_states`` compresses given fp32 states (a chunked prefill's final state) into slots' checkpoints and empties
their rings; ``states`` rebuilds the states of slots from checkpoint and ring (a prefill continuing a cached prefix).
Either takes the V-first layout ``[n, HV, V, K]`` of SPEC §1 or FLA's ``[n, HV, K, V]`` (``state_v_first=False``,
FLA's name). With ``check=False`` only metadata is checked (no host synchronisation), so that a backend without host
synchronisation (Triton's kernels, the reference's torch ops) can be captured in a CUDA graph.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .backends import Backend, resolve_cached

if TYPE_CHECKING:
    from .pool import Pool

SLOT_DTYPES = (torch.int32, torch.int64)


def select_states(pool: "Pool", backend: str = "auto") -> Backend:
    """The backend ``pool.load_states(..., backend=backend)`` and ``pool.states(..., backend=backend)`` use
    (``"auto"``: the fastest that supports the pool and has these two, i.e. Triton on CUDA, else the reference)."""
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a string, got {type(backend).__name__}")
    return resolve_cached(backend, pool, need_states=True)


def state_shape(pool: "Pool", n: int, state_v_first: bool) -> tuple[int, int, int, int]:
    """``[n, HV, V, K]`` (V-first) or ``[n, HV, K, V]`` (FLA's default layout)."""
    HV, K, V = pool.heads, pool.head_k, pool.head_v
    return (n, HV, V, K) if state_v_first else (n, HV, K, V)


def _slots(pool: "Pool", slots, check: bool, distinct: bool) -> torch.Tensor:
    """``slots`` as a 1-D integer tensor on the pool's device. ``check``: any sequence or tensor, values in
    ``[0, NS)`` and (``distinct``) no slot twice, read on the host (a synchronisation); else metadata only."""
    if not check:
        if not isinstance(slots, torch.Tensor):
            raise TypeError(f"slots must be a torch.Tensor with check=False, got {type(slots).__name__}")
        if slots.dtype not in SLOT_DTYPES:
            raise TypeError(f"slots must be int32 or int64, got {slots.dtype}")
        if slots.dim() != 1 or not slots.is_contiguous():
            raise ValueError(f"slots must be 1-D and contiguous, got shape {list(slots.shape)}, "
                             f"strides {slots.stride()}")
        if slots.device != pool.device:
            raise ValueError(f"slots must be on the pool's device {pool.device}, got {slots.device}")
        return slots
    if isinstance(slots, torch.Tensor) and (slots.is_floating_point() or slots.is_complex() or
                                            slots.dtype == torch.bool):
        raise TypeError(f"slots must hold integers, got {slots.dtype}")
    s = torch.as_tensor(slots, dtype=torch.long).reshape(-1).to(pool.device)
    host = s.cpu()
    if host.numel() and (int(host.min()) < 0 or int(host.max()) >= pool.num_slots):
        raise ValueError(f"slots must lie in [0, {pool.num_slots}), got {host.tolist()}")
    if distinct and host.numel() != torch.unique(host).numel():
        vals, counts = torch.unique(host, return_counts=True)
        raise ValueError(f"slots names slots more than once: {vals[counts > 1].tolist()}")
    return s


def _state_tensor(pool: "Pool", t, n: int, state_v_first: bool, name: str, check: bool) -> torch.Tensor:
    """``t`` as fp32 on the pool's device with the layout's shape: converted with ``check`` (a copy where needed),
    required as it is without."""
    want = state_shape(pool, n, state_v_first)
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if tuple(t.shape) != want:
        layout = "[n, HV, V, K]" if state_v_first else "[n, HV, K, V] (state_v_first=False)"
        raise ValueError(f"{name} must be {layout} = {list(want)} for this pool, got {list(t.shape)}")
    if check:
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
        return t.to(device=pool.device, dtype=torch.float32)
    if t.dtype != torch.float32:
        raise TypeError(f"{name} must be float32 with check=False, got {t.dtype}")
    if t.device != pool.device:
        raise ValueError(f"{name} must be on the pool's device {pool.device} with check=False, got {t.device}")
    return t


def _dense_heads(t: torch.Tensor) -> bool:
    """Whether every head's state of ``t`` occupies ``V K`` consecutive words of its own, in the layout's order (a
    kernel keeps scratch words in its head's words, so heads must not share any)."""
    n, HV, A, B = t.shape
    if n * HV == 0:
        return True
    own = (HV == 1 or t.stride(1) >= A * B) and (n == 1 or t.stride(0) >= HV * A * B)
    return t.stride(3) == 1 and t.stride(2) == B and own


def load_states(pool: "Pool", slots, states: torch.Tensor, *, backend: str = "auto", check: bool = True,
                state_v_first: bool = True) -> None:
    """:meth:`Pool.load_states`: compress ``states`` into the checkpoints of ``slots``, rings emptied, ``hcnt = 0``."""
    from .ops import _on_pool_device

    s = _slots(pool, slots, check, distinct=True)
    S = _state_tensor(pool, states, s.numel(), state_v_first, "states", check)
    b = select_states(pool, backend)
    if s.numel():
        _on_pool_device(pool, b.load_states, pool, s, S, bool(state_v_first))


def states(pool: "Pool", slots, out: torch.Tensor | None = None, *, backend: str = "auto", check: bool = True,
           state_v_first: bool = True) -> torch.Tensor:
    """:meth:`Pool.states`: the rebuilt fp32 states of ``slots``, into ``out`` if given, else a new tensor."""
    from .ops import _on_pool_device

    s = _slots(pool, slots, check, distinct=False)
    if out is None:
        out = torch.empty(state_shape(pool, s.numel(), state_v_first), dtype=torch.float32, device=pool.device)
    else:
        if not isinstance(out, torch.Tensor) or out.dtype != torch.float32:
            raise TypeError(f"out must be a float32 tensor, got {getattr(out, 'dtype', type(out).__name__)}")
        if out.device != pool.device:
            raise ValueError(f"out must be on the pool's device {pool.device}, got {out.device}")
        want = state_shape(pool, s.numel(), state_v_first)
        if tuple(out.shape) != want:
            raise ValueError(f"out must have shape {list(want)}, got {list(out.shape)}")
        if not _dense_heads(out):
            raise ValueError(f"out must hold each head's state densely in words of its own (strides [>= "
                             f"{out.shape[1] * out.shape[2] * out.shape[3]}, >= {out.shape[2] * out.shape[3]}, "
                             f"{out.shape[3]}, 1]), got strides {out.stride()}")
    b = select_states(pool, backend)
    if s.numel():
        _on_pool_device(pool, b.states, pool, s, out, bool(state_v_first))
    return out
