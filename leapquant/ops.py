"""The public flush: ``flush`` (in place on a pool) and ``run`` (functional), and the ``torch.library`` op behind them.

Under ``torch.compile``, ``flush`` goes through the custom op ``leapquant::flush``, which declares the pool tensors it
mutates and has a fake implementation, so the compiled graph holds one opaque op. In eager code (and under CUDA-graph
capture) it calls the backend directly: the custom op's Python dispatch of a mutating op costs more host time than a
sparse flush takes on the GPU (bench/results/host_overhead_h200.md).

Either way the backend runs with the pool's GPU as the current device: Triton launches on the current device (with a
pool on another GPU it refuses the pointers), and some torch ops of the reference fault there.
"""

from __future__ import annotations

from typing import Literal, Optional

import torch

from .backends import Backend, resolve_cached
from .checks import check_idx, check_idx_layout, check_pool
from .pool import Pool

BackendName = Literal["auto", "reference", "triton", "tilelang"] | str


def select(pool: Pool, backend: BackendName = "auto") -> Backend:
    """The backend ``flush(pool, ..., backend=backend)`` would use (``"auto"``: the fastest that supports the pool).

    Raises:
        leapquant.BackendError: unknown backend, or one that cannot flush this pool here (the message says why).
    """
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a string, got {type(backend).__name__}")
    return resolve_cached(backend, pool)


def flush(pool: Pool, idx: torch.Tensor, backend: BackendName = "auto", check: bool = True) -> None:
    """Flush every due (slot, head) of ``idx`` in place (SPEC §2 due rule, SPEC §3 math).

    Args:
        pool: the slot pool; its checkpoints, ``w``, ``pcum`` and ``gbuf`` are updated in place for due programs
            (``hcnt`` stays at ``L``). Nothing else is written.
        idx: int32 ``[N]`` on the pool's device, the slot of each batch row. Under the vLLM convention 0 pads; under
            SGLang's -1 pads. A program ``(n, h)`` is due iff ``idx[n]`` is a real slot and ``hcnt[idx[n], h] == L``.
        backend: ``"auto"`` (the fastest backend that supports this pool here), ``"reference"`` (fp32 torch, any
            device), ``"triton"`` (CUDA sm_80+; CPU under ``TRITON_INTERPRET=1``), ``"tilelang"`` (CUDA sm_90 /
            sm_100, 32 heads of 128 x 128, ring 16), or the name of a backend registered by another package.
        check: validate the pool and the values of ``idx`` first (reads ``idx`` on the host: a synchronisation).
            Pass ``False`` on the hot path and under CUDA-graph capture: then only ``idx``'s dtype, shape, device and
            contiguity are checked (metadata, no synchronisation), and out-of-range entries are skipped, never written.

    Raises:
        TypeError, ValueError: a wrong dtype, shape, device or stride of ``idx``; with ``check=True`` also of the
            pool's tensors, an ``idx`` value out of range, or a slot named twice.
        leapquant.BackendError: unknown backend, or one that cannot run here (the message says why).
    """
    if check:
        check_pool(pool)
        check_idx(pool, idx)
    else:
        check_idx_layout(pool, idx)
    if not torch.compiler.is_compiling():
        _launch(select(pool, backend), pool, idx)
        return
    # the op resolves the name when it runs (the choice reads entry points and device properties: not traceable)
    torch.ops.leapquant.flush(*op_args(pool, idx, backend))


def op_args(pool: Pool, idx: torch.Tensor, backend: BackendName = "auto") -> tuple:
    """The arguments of ``torch.ops.leapquant.flush`` for ``flush(pool, idx, backend)``: the pool's tensors, ``idx``,
    its geometry and the backend's name."""
    g = pool.geometry
    return (pool.raw, pool.kbuf, pool.ubuf, pool.w, pool.pcum, pool.gbuf, pool.hcnt, pool.q0, idx,
            g.num_slots, g.heads, g.head_k, g.head_v, g.ring, g.rank, g.gate, pool.convention, pool.iters, backend)


def _launch(b: Backend, pool: Pool, idx: torch.Tensor) -> None:
    """``b.flush(pool, idx)`` with the pool's GPU current (restored afterwards), so that its launches go to the pool's
    device and that device's current stream."""
    if pool.device.type != "cuda":
        b.flush(pool, idx)
        return
    with torch.cuda.device(pool.device):
        b.flush(pool, idx)


@torch.library.custom_op(
    "leapquant::flush", mutates_args=("raw", "kbuf", "ubuf", "w", "pcum", "gbuf"), device_types=None
)
def _flush_op(
    raw: torch.Tensor,
    kbuf: torch.Tensor,
    ubuf: torch.Tensor,
    w: torch.Tensor,
    pcum: torch.Tensor,
    gbuf: Optional[torch.Tensor],
    hcnt: torch.Tensor,
    q0: torch.Tensor,
    idx: torch.Tensor,
    num_slots: int,
    heads: int,
    head_k: int,
    head_v: int,
    ring: int,
    rank: int,
    gate: str,
    convention: str,
    iters: int,
    backend: str,
) -> None:
    pool = Pool.from_tensors(
        raw, kbuf, ubuf, w, pcum, gbuf, hcnt, q0,
        num_slots=num_slots, heads=heads, head_k=head_k, head_v=head_v, ring=ring, rank=rank, gate=gate,
        convention=convention, iters=iters,
    )
    _launch(select(pool, backend), pool, idx)


@_flush_op.register_fake
def _flush_fake(raw, kbuf, ubuf, w, pcum, gbuf, hcnt, q0, idx, *args) -> None:
    return None


def run(codes, s_k, s_v, u, q, kbuf, ubuf, gbuf, w, pcum, q0, backend: BackendName = "auto", iters: int = 1):
    """Functional flush (SPEC §5): every program due, fresh outputs.

    Args (``B`` programs-rows of ``HV`` heads): codes int8 ``[B, HV, V, K]``; s_k fp32 ``[B, HV, K]``; s_v fp32
    ``[B, HV, V]``; u fp16 ``[B, HV, R, K]``; q fp16 ``[B, HV, R, V]``; kbuf bf16 ``[B, HV, L, K]``; ubuf bf16
    ``[B, HV, L, V]``; gbuf fp16 ``[B, HV, L, K]`` (KDA) or None (GDN); w fp32 ``[B, HV, L]``; pcum fp32
    ``[B, HV, K]`` (KDA) or ``[B, HV, 1]`` (GDN); q0 fp32 ``[V, R]``.

    Returns:
        ``(codes, s_k, s_v, u, q)``, new tensors of the input shapes.
    """
    if not isinstance(codes, torch.Tensor) or codes.dim() != 4:
        raise ValueError("codes must be an int8 tensor [B, HV, V, K]")
    B, HV, V, K = codes.shape
    R, L = u.shape[-2], kbuf.shape[-2]
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
