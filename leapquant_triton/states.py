"""The host side of states in and out of a pool (SPEC §5): :func:`load_states_pool` and :func:`states_pool`, which
launch the kernels of :mod:`.states_kernel` with the flush's build (:func:`.targets.warps_and_cap`: the same state in
registers)."""

from __future__ import annotations

import torch

from .flush import kernel_constants, scratch_words
from .launcher import Launcher, per_pool
from .states_kernel import load_states_kernel, states_kernel
from .targets import compile_options, mma_sync_only, warps_and_cap

# the two kernels by the names the hosts, the cache and the AOT check use
KERNELS = {"load": load_states_kernel, "states": states_kernel}
# compiled inside mma_sync_only, as the flush (wgmma miscompiles these phases on sm_90), then launched directly
_LAUNCHERS = {which: Launcher(fn, mma_sync_only) for which, fn in KERNELS.items()}


def states_constants(geometry, iters: int, which: str) -> dict:
    """The constexpr arguments of ``which`` (``"load"`` or ``"states"``): the flush's that its kernel takes."""
    c = kernel_constants(geometry, 0, iters)
    keep = ("K", "V", "L", "R", "BL", "BR", "IS_KDA", "BF16_DOTS") + (("ITERS", "SCR") if which == "load" else ())
    return {k: c[k] for k in keep}


def state_strides(t: torch.Tensor, state_v_first: bool) -> dict:
    """The kernels' strides (s_n, s_h, s_v, s_k) of a state tensor ``[n, HV, V, K]`` (``state_v_first``) or
    ``[n, HV, K, V]``."""
    s = t.stride()
    return dict(s_n=s[0], s_h=s[1], s_v=s[2] if state_v_first else s[3], s_k=s[3] if state_v_first else s[2])


def _prepared(pool, which: str, nw: int, cap: int | None):
    """The launch of ``which`` ("load" or "states") with the pool's tensors and constants bound once, prepared again
    when a tensor of the pool moved (:func:`.launcher.per_pool`)."""
    g = pool.geometry
    gbuf = pool.gbuf if pool.gbuf is not None else pool.w  # GDN never reads it
    if which == "load":
        tensors = dict(hcnt=pool.hcnt, codes=pool.codes, skv=pool.s_kv, uq=pool.uq, w=pool.w, pcum=pool.pcum,
                       gbuf=gbuf, q0=pool.q0)
    else:
        tensors = dict(codes=pool.codes, skv=pool.s_kv, uq=pool.uq, kbuf=pool.kbuf, ubuf=pool.ubuf, w=pool.w,
                       pcum=pool.pcum, gbuf=gbuf, q0=pool.q0)

    def make():
        static = dict(tensors, NS=g.num_slots, HV=g.heads, SS=g.slot_stride, HS=g.head_stride,
                      **states_constants(g, pool.iters, which))
        return _LAUNCHERS[which].prepare(static, compile_options(nw, cap))

    return per_pool(pool.raw, (which, g, pool.iters, nw, cap), tensors.values(), make)


def scratch_words_per_program(pool) -> int:
    """fp32 scratch words one program of :func:`load_states_pool` takes (the flush's, :func:`.flush.scratch_words`)."""
    return scratch_words(pool.head_k, pool.head_v, pool.iters)


def load_states_pool(pool, slots: torch.Tensor, states: torch.Tensor, state_v_first: bool = True,
                     num_warps: int | None = None, maxnreg: int | None = None) -> None:
    """Compress ``states`` (fp32 ``[n, HV, V, K]``, or ``[n, HV, K, V]`` with ``state_v_first=False``, any strides)
    into the checkpoints of ``slots`` (integer ``[n]`` on the pool's device, distinct), empty their rings and set
    their ``hcnt`` to 0, in place (SPEC §5). No host synchronisation; the only allocation is the scratch, from the
    caching allocator (under CUDA-graph capture, the graph's pool), as the flush's. ``num_warps``, ``maxnreg``
    override the build (experiments; ``maxnreg=0`` lifts the cap)."""
    n = slots.numel()
    if n == 0:
        return
    nw, cap = warps_and_cap(pool.head_k, pool.head_v, num_warps, maxnreg)
    launch = _prepared(pool, "load", nw, cap)
    scratch = torch.empty(n * pool.heads * scratch_words_per_program(pool), dtype=torch.float32,
                          device=states.device)
    launch((n, pool.heads), dict(slots=slots, states=states, scratch=scratch,
                                 scratch16=scratch.view(torch.float16), **state_strides(states, state_v_first)))


def states_pool(pool, slots: torch.Tensor, out: torch.Tensor, state_v_first: bool = True,
                num_warps: int | None = None, maxnreg: int | None = None) -> torch.Tensor:
    """Rebuild the states of ``slots`` (integer ``[n]`` on the pool's device) into ``out`` (fp32 ``[n, HV, V, K]``, or
    ``[n, HV, K, V]`` with ``state_v_first=False``; each head's ``V K`` words dense, any strides between heads and
    rows) and return it. No host synchronisation and no allocation: graph-capturable."""
    n = slots.numel()
    if n == 0:
        return out
    nw, cap = warps_and_cap(pool.head_k, pool.head_v, num_warps, maxnreg)
    _prepared(pool, "states", nw, cap)((n, pool.heads), dict(slots=slots, out=out,
                                                              **state_strides(out, state_v_first)))
    return out
