"""The host side of the Triton decode step: the builds of :mod:`.step_kernel` and :func:`step_pool`, which flushes the
full rings of ``idx`` (:func:`.flush.flush_pool`) and then launches the step."""

from __future__ import annotations

import torch

from .flush import flush_pool
from .launcher import Launcher, per_pool
from .step_kernel import leapquant_step_fma_kernel, leapquant_step_kernel
from .targets import compile_options, device_capability, interpreting, mma_sync_only

# two warps capped at 128 registers: eight programs per SM, faster than fewer, wider programs (docs/DESIGN.md)
NUM_WARPS = 2
MAXNREG = 128
# sm_75's kernel: BV x K = FMA_CHUNK codes in registers at a time, 32 fp32 registers per thread at FMA_WARPS warps,
# the fastest build of that kernel (docs/DESIGN.md)
FMA_CHUNK = 4096
FMA_WARPS = 4


def uses_fma(capability: int | None) -> bool:
    """Whether a GPU of compute capability ``capability`` (``major * 10 + minor``) runs
    :func:`.step_kernel.leapquant_step_fma_kernel`: sm_75, where Triton cannot lower the int8 product to the tensor
    cores."""
    return capability is not None and capability < 80


def step_build(geometry, first_slot: int, use_qk_l2norm: bool, capability: int | None, fma: bool | None = None):
    """(kernel, constexpr arguments, compile options) of the step for a pool whose real slots start at ``first_slot``
    on a GPU of compute capability ``capability`` (None: the interpreter, which runs the tensor-core kernel's fp32 twin
    unless ``fma``): what :func:`step_pool` launches and the AOT check compiles."""
    g = geometry
    fma = uses_fma(capability) if fma is None else fma
    consts = dict(FIRST=first_slot, K=g.head_k, V=g.head_v, L=g.ring, R=g.rank, BR=4, IS_KDA=g.gate == "kda",
                  USE_QK_L2NORM=bool(use_qk_l2norm), NATIVE=capability is not None and not interpreting())
    if fma:
        return leapquant_step_fma_kernel, dict(consts, BV=min(g.head_v, FMA_CHUNK // g.head_k)), \
            compile_options(FMA_WARPS, None)
    return leapquant_step_kernel, dict(consts, BL=max(g.ring, 16)), compile_options(NUM_WARPS, MAXNREG)


# compiled inside mma_sync_only, as the flush, then launched directly (launcher.py)
_LAUNCHERS = {leapquant_step_kernel: Launcher(leapquant_step_kernel, mma_sync_only),
              leapquant_step_fma_kernel: Launcher(leapquant_step_fma_kernel, mma_sync_only)}


def _prepared(pool, use_qk_l2norm: bool, fma: bool | None):
    """The step's launch with the pool's tensors and constants bound once (:meth:`.launcher.Launcher.prepare`),
    prepared again when a tensor of the pool moved (:func:`.launcher.per_pool`)."""
    g = pool.geometry
    hist = pool.history
    tensors = dict(codes=pool.codes, skv=pool.s_kv, uq=pool.uq, kbuf=pool.kbuf, ubuf=pool.ubuf, w=pool.w,
                   pcum=pool.pcum, gbuf=pool.gbuf if pool.gbuf is not None else pool.w,  # GDN never reads it
                   hcnt=pool.hcnt,
                   # the history of SPEC §6.1 where the pool keeps one (else pointers never written: HIST off)
                   hstart=hist.start if hist is not None else pool.hcnt,
                   hcount=hist.count if hist is not None else pool.hcnt,
                   hpcum=hist.pcum if hist is not None else pool.pcum,
                   hw=hist.w if hist is not None else pool.w)

    def make():
        kernel, consts, options = step_build(g, pool.first_slot, use_qk_l2norm, device_capability(pool.raw.device),
                                             fma)
        static = dict(tensors, NS=g.num_slots, HV=g.heads, SS=g.slot_stride, HS=g.head_stride, **consts,
                      HIST=hist is not None, HT=hist.max_tokens + 1 if hist is not None else 1)
        return _LAUNCHERS[kernel].prepare(static, options)

    key = ("step", g, pool.first_slot, bool(use_qk_l2norm), fma)
    return per_pool(pool.raw, key, tensors.values(), make)


def step_pool(pool, idx: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
              beta: torch.Tensor, scale: float, use_qk_l2norm: bool, out: torch.Tensor,
              fma: bool | None = None) -> None:
    """One decode token per row of ``idx`` (int32 ``[N]``) on ``pool`` in place, ``out`` written (SPEC §6); with
    token tensors of a token axis (``q`` ``[N, T, H, K]``, ..., ``out`` ``[N, T, HV, V]``), T tokens per row (SPEC
    §6.1: the rings that cannot hold T more flushed first, then the tokens one after the other in one launch, the
    checkpoint read once), and the pool's history written where it keeps one.

    Flushes the full rings of ``idx`` first (:func:`.flush.flush_pool`; stream order makes the step see the new
    checkpoints), then launches :func:`.step_kernel.leapquant_step_kernel`
    (:func:`.step_kernel.leapquant_step_fma_kernel` on sm_75, or where ``fma`` asks: the tests run both) on grid
    ``(N, HV)``. ``q``, ``k`` ``[N, H, K]`` (H dividing HV), ``v`` ``[N, HV, V]``, ``g`` ``[N, HV, K]`` (KDA) or
    ``[N, HV]`` (GDN), ``beta`` ``[N, HV]``, ``out`` ``[N, HV, V]``: float32, bfloat16 or float16, unit last stride. No
    host synchronisation and no allocation beyond the flush's: graph-capturable."""
    N = idx.numel()
    if N == 0:
        return
    T = q.shape[1] if q.dim() == 4 else 1
    dims = "nth" if T > 1 else "nh"  # the token axis second; one token: no axis, its stride unused
    strides = {f"s{name}_{d}": t.stride(i) for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("b", beta),
                                                             ("o", out)) for i, d in enumerate(dims)}
    if T == 1:
        strides.update({f"s{name}_t": 0 for name in "qkvgbo"})
    dynamic = dict(idx=idx, q=q, k=k, v=v, g=g, beta=beta, out=out, **strides, scale=float(scale),
                   G=pool.heads // q.shape[-2], T=T)
    flush_pool(pool, idx, force=T if T > 1 else False)
    _prepared(pool, use_qk_l2norm, fma)((N, pool.heads), dynamic)
