"""Argument validation: every failure is a ValueError or TypeError that names the argument and what was expected.

Never ``assert`` (stripped under ``python -O``). The value checks of :func:`check_idx` read ``idx`` on the host, so
they synchronise; ``flush(..., check=False)`` skips them for CUDA-graph capture and runs :func:`check_idx_layout`
(metadata only) instead.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .constants import SUPPORTED_HEAD_DIMS, SUPPORTED_RANKS, SUPPORTED_RINGS

if TYPE_CHECKING:
    from .pool import Geometry, Pool


def check_geometry(geo: "Geometry", convention: str) -> None:
    for name in ("num_slots", "heads", "head_k", "head_v", "ring", "rank"):
        v = getattr(geo, name)
        if not isinstance(v, int) or isinstance(v, bool):
            raise TypeError(f"{name} must be an int, got {type(v).__name__}")
    if geo.num_slots < 1:
        raise ValueError(f"num_slots must be >= 1, got {geo.num_slots}")
    if geo.heads < 1:
        raise ValueError(f"heads must be >= 1, got {geo.heads}")
    if geo.head_k not in SUPPORTED_HEAD_DIMS or geo.head_v not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head_k and head_v must be in {SUPPORTED_HEAD_DIMS}, got {geo.head_k}, {geo.head_v}")
    if geo.ring not in SUPPORTED_RINGS:
        raise ValueError(f"ring must be in {SUPPORTED_RINGS}, got {geo.ring}")
    if geo.rank not in SUPPORTED_RANKS:
        raise ValueError(f"rank must be in {SUPPORTED_RANKS}, got {geo.rank}")
    if geo.gate not in ("kda", "gdn"):
        raise ValueError(f"gate must be 'kda' or 'gdn', got {geo.gate!r}")
    if convention not in ("vllm", "sglang"):
        raise ValueError(f"convention must be 'vllm' or 'sglang', got {convention!r}")
    if geo.checkpoint_bytes > 4 * geo.region_words:
        raise ValueError(f"checkpoint ({geo.checkpoint_bytes} B) does not fit the region ({4 * geo.region_words} B)")


def _expect(t, name: str, dtype: torch.dtype, shape: tuple, device: torch.device) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise TypeError(f"{name} must be {dtype}, got {t.dtype}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {list(shape)}, got {list(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} must be on {device}, got {t.device}")


def check_pool(pool: "Pool") -> None:
    """The pool's tensors still have the dtypes, shapes, strides and aliasing its geometry says."""
    from .constants import BASE_WORDS
    from .pool import Pool

    if not isinstance(pool, Pool):
        raise TypeError(f"pool must be a leapquant.Pool, got {type(pool).__name__}")
    g, dev = pool.geometry, pool.device
    NS, HV, K, V, L, R = g.num_slots, g.heads, g.head_k, g.head_v, g.ring, g.rank
    _expect(pool.raw, "pool.raw", torch.float32, (NS * g.slot_stride + BASE_WORDS,), dev)
    if not pool.raw.is_contiguous():
        raise ValueError("pool.raw must be contiguous")
    for name, dtype, shape in (
        ("codes", torch.int8, (NS, HV, V, K)),
        ("s_k", torch.float32, (NS, HV, K)),
        ("s_v", torch.float32, (NS, HV, V)),
        ("uq", torch.float16, (NS, HV, R, K + V)),
    ):
        t = getattr(pool, name)
        _expect(t, f"pool.{name}", dtype, shape, dev)
        if t.untyped_storage().data_ptr() != pool.raw.untyped_storage().data_ptr():
            raise ValueError(f"pool.{name} must be a view of pool.raw")
    dense = [
        ("kbuf", torch.bfloat16, (NS, HV, L, K)),
        ("ubuf", torch.bfloat16, (NS, HV, L, V)),
        ("w", torch.float32, (NS, HV, L)),
        ("pcum", torch.float32, (NS, HV, K if g.gate == "kda" else 1)),
        ("hcnt", torch.int32, (NS, HV)),
    ]
    if g.gate == "kda":
        dense.append(("gbuf", torch.float16, (NS, HV, L, K)))
    elif pool.gbuf is not None:
        raise ValueError("pool.gbuf must be None for gate 'gdn'")
    for name, dtype, shape in dense:
        t = getattr(pool, name)
        _expect(t, f"pool.{name}", dtype, shape, dev)
        if not t.is_contiguous():
            raise ValueError(f"pool.{name} must be contiguous (strides {t.stride()})")
    _expect(pool.q0, "pool.q0", torch.float32, (V, R), dev)
    if not pool.q0.is_contiguous():
        raise ValueError("pool.q0 must be contiguous")


def check_idx_layout(pool: "Pool", idx) -> None:
    """``idx`` is an int32 ``[N]`` contiguous tensor on the pool's device: its metadata only, no synchronisation.

    ``flush`` runs this even with ``check=False``: the kernels read ``idx`` as consecutive words, so a strided view
    names other slots than the caller's and flushes them without any error (the view [3, 7] of [3, 5, 7, 2] would
    flush slots 3 and 5); and the contract is int32 for every backend.
    """
    if not isinstance(idx, torch.Tensor):
        raise TypeError(f"idx must be a torch.Tensor of int32, got {type(idx).__name__}")
    if idx.dtype != torch.int32:
        raise TypeError(f"idx must be int32, got {idx.dtype}")
    if idx.dim() != 1:
        raise ValueError(f"idx must be 1-D [N], got shape {list(idx.shape)}")
    if idx.device != pool.device:
        raise ValueError(f"idx must be on the pool's device {pool.device}, got {idx.device}")
    if not idx.is_contiguous():
        raise ValueError(f"idx must be contiguous (stride {idx.stride()})")


def check_idx(pool: "Pool", idx) -> None:
    """``idx``: int32 ``[N]`` on the pool's device; real slots distinct; padding as the pool's convention says."""
    check_idx_layout(pool, idx)
    if idx.numel() == 0:
        return
    host = idx.cpu()
    pad = 0 if pool.convention == "vllm" else -1
    lo, hi = int(host.min()), int(host.max())
    if lo < pad or hi >= pool.num_slots:
        raise ValueError(
            f"idx values must lie in [{pad}, {pool.num_slots}) under the {pool.convention} convention "
            f"({pad} pads), got min {lo}, max {hi}"
        )
    real = host[host >= pool.first_slot]
    if real.numel() != torch.unique(real).numel():
        vals, counts = torch.unique(real, return_counts=True)
        raise ValueError(f"idx names slots more than once: {vals[counts > 1].tolist()}")


def check_iters(iters) -> None:
    if not isinstance(iters, int) or isinstance(iters, bool) or not 1 <= iters <= 4:
        raise ValueError(f"iters must be an int in 1..4, got {iters!r}")


STEP_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def token_rows(t, name: str, dims: int, rows: int):
    """``t`` as its ``[B, ...]`` form with ``dims`` dimensions, from that form or the engines' ``[B, 1, ...]`` and
    ``[1, B, ...]`` forms: a view, never a copy. Metadata only (no synchronisation)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() == dims + 1:
        if t.shape[1] == 1:
            t = t[:, 0]
        elif t.shape[0] == 1:
            t = t[0]
        else:
            raise ValueError(f"{name} has {t.dim()} dimensions, so one of its first two must be 1 (one token per "
                             f"row: [B, 1, ...] or [1, B, ...]), got {list(t.shape)}")
    if t.dim() != dims:
        raise ValueError(f"{name} must have {dims} dimensions ([B, ...]) or {dims + 1} ([B, 1, ...] / [1, B, ...]), "
                         f"got {list(t.shape)}")
    if t.shape[0] != rows:
        raise ValueError(f"{name} has {t.shape[0]} rows, idx has {rows}")
    return t


def check_step_inputs(pool: "Pool", q, k, v, g, beta, out) -> None:
    """Shapes, dtypes, devices and unit last strides of ``step``'s token tensors (in their ``[B, ...]`` forms)."""
    HV, K, V = pool.heads, pool.head_k, pool.head_v
    H = q.shape[1] if q.dim() == 3 else -1
    if q.dim() != 3 or q.shape[2] != K or H < 1 or HV % H:
        raise ValueError(f"q must be [B, H, K] with K = {K} and H dividing HV = {HV}, got {list(q.shape)}")
    want = {"k": (k, (q.shape[0], H, K)), "v": (v, (q.shape[0], HV, V)), "beta": (beta, (q.shape[0], HV)),
            "g": (g, (q.shape[0], HV, K) if pool.gate == "kda" else (q.shape[0], HV))}
    if out is not None:
        want["out"] = (out, (q.shape[0], HV, V))
    for name, (t, shape) in [("q", (q, tuple(q.shape)))] + list(want.items()):
        if t.dtype not in STEP_DTYPES:
            raise TypeError(f"{name} must be float32, bfloat16 or float16, got {t.dtype}")
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} must have shape {list(shape)} for this pool ({pool.gate}), got {list(t.shape)}")
        if t.device != pool.device:
            raise ValueError(f"{name} must be on the pool's device {pool.device}, got {t.device}")
        if t.numel() and t.stride(-1) != 1:
            raise ValueError(f"{name} must have a unit stride in its last dimension, got strides {t.stride()}")
    if out is not None and out.dtype != q.dtype:
        raise TypeError(f"out must have q's dtype {q.dtype}, got {out.dtype}")
