"""The host side of the Triton decode step: the builds of :mod:`.step_kernel` and :mod:`.step_gluon`, and
:func:`step_pool`, which flushes the full rings of ``idx`` (:func:`.flush.flush_pool`) and then launches the step.

Three kernels, one contract (SPEC §6): ``"gluon"`` (:mod:`.step_gluon`, explicit layouts: K = V = 128, ring 16, rank
at most 4, sm_80 and later, the Triton releases of :data:`.targets.GLUON_RELEASES`), ``"mma"``
(:func:`.step_kernel.leapquant_step_kernel`: every other shape on sm_80 and later, and the CPU's interpreter) and
``"fma"`` (:func:`.step_kernel.leapquant_step_fma_kernel`: sm_75). :func:`kernel_for` picks one."""

from __future__ import annotations

import torch
import triton

from .flush import flush_pool
from .launcher import Launcher, per_pool
from .step_kernel import leapquant_step_fma_kernel, leapquant_step_kernel
from .targets import (
    GLUON_RELEASES,
    GLUON_TOKENS_PER_LAUNCH,
    compile_options,
    device_capability,
    interpreting,
    mma_sync_only,
    triton_release,
)

# two warps capped at 128 registers: eight programs per SM, faster than fewer, wider programs (docs/DESIGN.md)
NUM_WARPS = 2
MAXNREG = 128
# but the tl kernel at 128 x 128 with a ring of 32 spills over 2 KB at two warps; four warps at the same cap spill
# under 1 KB and ran 1.42x (KDA) / 1.10x (GDN) faster at fill 16 (docs/DESIGN.md)
WIDE_RING_WARPS = 4
# sm_75's kernel: BV x K = FMA_CHUNK codes in registers at a time, 32 fp32 registers per thread at FMA_WARPS warps,
# the fastest build of that kernel (docs/DESIGN.md)
FMA_CHUNK = 4096
FMA_WARPS = 4
# the Gluon kernel: two warps capped at 128 registers, as the mma kernel (eight programs per SM)
GLUON_WARPS = 2
GLUON_MAXNREG = 128


def uses_fma(capability: int | None) -> bool:
    """Whether a GPU of compute capability ``capability`` (``major * 10 + minor``) runs
    :func:`.step_kernel.leapquant_step_fma_kernel`: sm_75, where Triton cannot lower the int8 product to the tensor
    cores."""
    return capability is not None and capability < 80


KERNELS = ("gluon", "mma", "fma")


def mma_warps(geometry) -> int:
    """Warps a program of the ``tl`` (``mma``) step kernel takes for ``geometry``."""
    g = geometry
    return WIDE_RING_WARPS if g.head_k == g.head_v == 128 and g.ring > 16 else NUM_WARPS


def gluon_kernel():
    """The Gluon step kernel under a Triton release of :data:`.targets.GLUON_RELEASES`, else None (imported only
    there: other releases' Gluon lacks what it uses)."""
    if triton_release(triton.__version__) not in GLUON_RELEASES:
        return None
    from .step_gluon import leapquant_step_gluon_kernel
    return leapquant_step_gluon_kernel


def gluon_shape(geometry) -> bool:
    """Whether the Gluon kernel covers ``geometry``: K = V = 128, ring 16, rank at most 4 (its layouts are built
    for two warps over 128 channels and 16 ring entries; SPEC §2 allows rank up to 4)."""
    g = geometry
    return g.head_k == 128 and g.head_v == 128 and g.ring == 16 and g.rank <= 4


def kernel_for(geometry, capability: int | None) -> str:
    """The step kernel :func:`step_pool` launches by default for ``geometry`` on compute capability ``capability``
    (None: the interpreter, which runs the ``mma`` kernel's fp32 twin). Every kernel takes T tokens per row and writes
    a pool's history (SPEC §6.1)."""
    if uses_fma(capability):
        return "fma"
    if capability is None or interpreting() or not gluon_shape(geometry) or gluon_kernel() is None:
        return "mma"
    return "gluon"


def step_build(geometry, first_slot: int, use_qk_l2norm: bool, capability: int | None, kernel: str | None = None):
    """(kernel, constexpr arguments, compile options) of the step for a pool whose real slots start at ``first_slot``
    on a GPU of compute capability ``capability`` (None: the interpreter): ``kernel`` (one of :data:`KERNELS`;
    default :func:`kernel_for`), what :func:`step_pool` launches and the AOT check compiles."""
    g = geometry
    kernel = kernel or kernel_for(g, capability)
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, not {kernel!r}")
    consts = dict(FIRST=first_slot, K=g.head_k, V=g.head_v, L=g.ring, R=g.rank, IS_KDA=g.gate == "kda",
                  USE_QK_L2NORM=bool(use_qk_l2norm))
    if kernel == "gluon":
        fn = gluon_kernel()
        if fn is None or not gluon_shape(g) or capability is None or capability < 80:
            raise ValueError(f"the Gluon step kernel needs K = V = 128, ring 16, rank <= 4, sm_80+ and Triton "
                             f"{' or '.join('.'.join(map(str, r)) for r in GLUON_RELEASES)}; "
                             f"have {g.head_k}x{g.head_v}, ring {g.ring}, rank {g.rank}, capability {capability}, "
                             f"Triton {triton.__version__}")
        return fn, dict(consts, NW=GLUON_WARPS), compile_options(GLUON_WARPS, GLUON_MAXNREG)
    consts.update(BR=4, NATIVE=capability is not None and not interpreting())
    if kernel == "fma":
        return leapquant_step_fma_kernel, dict(consts, BV=min(g.head_v, FMA_CHUNK // g.head_k)), \
            compile_options(FMA_WARPS, None)
    return leapquant_step_kernel, dict(consts, BL=max(g.ring, 16)), compile_options(mma_warps(g), MAXNREG)


# compiled inside mma_sync_only, as the flush, then launched directly (launcher.py)
_LAUNCHERS = {leapquant_step_kernel: Launcher(leapquant_step_kernel, mma_sync_only),
              leapquant_step_fma_kernel: Launcher(leapquant_step_fma_kernel, mma_sync_only)}


def _launcher(fn) -> Launcher:
    """The launcher of ``fn`` (the Gluon kernel's made on first use)."""
    if fn not in _LAUNCHERS:
        _LAUNCHERS[fn] = Launcher(fn, mma_sync_only)
    return _LAUNCHERS[fn]


def _prepared(pool, use_qk_l2norm: bool, kernel: str | None):
    """The step's launch with the pool's tensors and constants bound once (:meth:`.launcher.Launcher.prepare`),
    prepared again when a tensor of the pool moved (:func:`.launcher.per_pool`)."""
    g = pool.geometry
    hist = pool.history
    capability = device_capability(pool.raw.device)
    tensors = dict(codes=pool.codes, skv=pool.s_kv, uq=pool.uq, kbuf=pool.kbuf, ubuf=pool.ubuf, w=pool.w,
                   pcum=pool.pcum, gbuf=pool.gbuf if pool.gbuf is not None else pool.w,  # GDN never reads it
                   hcnt=pool.hcnt)
    # the history of SPEC §6.1 where the pool keeps one (else pointers never written: HIST off)
    history = dict(hstart=hist.start if hist is not None else pool.hcnt,
                   hcount=hist.count if hist is not None else pool.hcnt,
                   hpcum=hist.pcum if hist is not None else pool.pcum,
                   hw=hist.w if hist is not None else pool.w)

    def make():
        fn, consts, options = step_build(g, pool.first_slot, use_qk_l2norm, capability, kernel)
        static = dict(tensors, NS=g.num_slots, HV=g.heads, SS=g.slot_stride, HS=g.head_stride, **consts)
        # every kernel takes T tokens and writes the history (SPEC §6.1)
        static.update(history, HIST=hist is not None, HT=hist.max_tokens + 1 if hist is not None else 1)
        return _launcher(fn).prepare(static, options)

    key = ("step", g, pool.first_slot, bool(use_qk_l2norm), kernel)
    return per_pool(pool.raw, key, list(tensors.values()) + list(history.values()), make)


# no packed gates: the kernels' PACKED inputs unused (None arguments are compile-time constants)
UNPACKED = dict(a_log=None, dt_bias=None, lower_bound=None, PACKED=0, BETA_ROUND=0)
# the BETA_ROUND code of each beta dtype (a workspace's ``beta`` dtype): what beta is rounded to
BETA_ROUND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def packed_args(A_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float | None,
                beta_dtype: torch.dtype) -> dict:
    """The step kernels' arguments that make them compute ``step_packed``'s gates (SPEC §6.2) in their prologue, ``g``
    and ``beta`` then being ``a`` and ``b``: ``PACKED`` 1 (softplus) or 2 (KDA's lower bound), beta rounded to
    ``beta_dtype``."""
    return dict(a_log=A_log, dt_bias=dt_bias, lower_bound=0.0 if lower_bound is None else float(lower_bound),
                PACKED=1 if lower_bound is None else 2, BETA_ROUND=BETA_ROUND[beta_dtype])


def tokens_per_launch(kernel: str) -> int | None:
    """The most tokens per row ``kernel`` takes in one launch (None: any number)."""
    return GLUON_TOKENS_PER_LAUNCH if kernel == "gluon" else None


def _launches(T: int, per_launch: int | None) -> list[tuple[int, int]]:
    """(first token, tokens) of each launch of a call of ``T`` tokens per row: as few launches as take at most
    ``per_launch`` tokens each (None: one), their sizes as even as can be, the larger first (5 = 3 + 2, 7 = 4 + 3)."""
    if per_launch is not None and (not isinstance(per_launch, int) or per_launch < 1):
        raise ValueError(f"per_launch must be a positive int or None, got {per_launch!r}")
    n = -(-T // per_launch) if per_launch else 1
    sizes = [T // n + (i < T % n) for i in range(n)]
    return [(sum(sizes[:i]), m) for i, m in enumerate(sizes)]


def step_pool(pool, idx: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
              beta: torch.Tensor, scale: float, use_qk_l2norm: bool, out: torch.Tensor,
              kernel: str | None = None, packed: dict | None = None, per_launch: int | None = None) -> None:
    """One decode token per row of ``idx`` (int32 ``[N]``) on ``pool`` in place, ``out`` written (SPEC §6); with
    token tensors of a token axis (``q`` ``[N, T, H, K]``, ..., ``out`` ``[N, T, HV, V]``), T tokens per row (SPEC
    §6.1: the rings that cannot hold T more flushed first, then the tokens one after the other, the checkpoint read
    once per launch), and the pool's history written where it keeps one. ``packed`` (:func:`packed_args`): ``g`` and
    ``beta`` are ``step_packed``'s raw ``a`` (``[N, (T,) HV, K]`` / ``[N, (T,) HV]``) and ``b``, the gates computed
    inside the step kernel, token by token.

    Flushes the full rings of ``idx`` first (:func:`.flush.flush_pool`; stream order makes the step see the new
    checkpoints), then launches the step kernel ``kernel`` (default :func:`kernel_for`; the tests run each) on grid
    ``(N, HV)``. ``q``, ``k`` ``[N, H, K]`` (H dividing HV), ``v`` ``[N, HV, V]``, ``g`` ``[N, HV, K]`` (KDA) or
    ``[N, HV]`` (GDN), ``beta`` ``[N, HV]``, ``out`` ``[N, HV, V]``: float32, bfloat16 or float16, unit last stride. A
    call of more tokens than the kernel takes in one launch (``per_launch``, default :func:`tokens_per_launch`) runs
    as consecutive launches over the tokens, each the next one's start, the history written as by one. No host
    synchronisation and no allocation beyond the flush's: graph-capturable."""
    N = idx.numel()
    if N == 0:
        return
    T = q.shape[1] if q.dim() == 4 else 1
    kernel = kernel or kernel_for(pool.geometry, device_capability(pool.raw.device))
    flush_pool(pool, idx, force=T if T > 1 else False)
    launch = _prepared(pool, use_qk_l2norm, kernel)
    tensors = dict(q=q, k=k, v=v, g=g, beta=beta, out=out)
    for t0, n in _launches(T, per_launch or tokens_per_launch(kernel)):
        # this launch's tokens: a token axis of n, or one token without the axis
        part = tensors if T == 1 else {name: x[:, t0:t0 + n] if n > 1 else x[:, t0] for name, x in tensors.items()}
        dims = "nth" if n > 1 else "nh"  # the token axis second; one token: no axis, its stride unused
        # the kernel's stride arguments take the tensors' initials: sq_n, ..., sb_n (beta), so_n (out)
        strides = {f"s{name[0]}_{d}": x.stride(i) for name, x in part.items() for i, d in enumerate(dims)}
        if n == 1:
            strides.update({f"s{name}_t": 0 for name in "qkvgbo"})
        launch((N, pool.heads), dict(idx=idx, **part, **strides, scale=float(scale), G=pool.heads // q.shape[-2],
                                     **(packed or UNPACKED), T=n, TOFF=t0))
