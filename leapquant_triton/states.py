"""States in and out of a pool on the GPU: :func:`load_states_pool` (compress given fp32 states into checkpoints,
SPEC §3 steps 5-10, rings emptied, ``hcnt = 0``) and :func:`states_pool` (rebuild states from checkpoint and ring,
SPEC §3 steps 1-4), as Triton kernels built from the flush kernel's phase functions (:mod:`.kernel`), so a state
goes through exactly the arithmetic of a flush (docs/DESIGN.md, "Triton: states in and out").

Both kernels run one program per (row n of ``slots``, head h), grid ``(n, HV)``, the state ``[V, K]`` in registers as
in the flush. The caller's state tensor is read or written through its four strides, so both layouts, V-first
``[n, HV, V, K]`` and FLA's ``[n, HV, K, V]``, are one build each (Triton specialises a unit stride). A row whose slot
lies outside ``[0, NS)`` is skipped: ``load_states`` writes nothing for it, ``states`` writes zeros.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.utils.weak import WeakIdKeyDictionary

from .host import compile_options, kernel_constants, maxnreg_for, mma_sync_only, num_warps_for
from .kernel import (
    _column_scales,
    _new_factors,
    _pair_pointers,
    _q16_tile,
    _quantise,
    _ranges,
    _rebuild,
    _region_and_scratch,
    _reset_ring,
    _residual,
    _store_checkpoint,
    _subspace_iteration,
)
from .launcher import Launcher


@triton.jit
def _state_tile(p, i_n, i_h, s_n, s_h, s_v, s_k, K: tl.constexpr, V: tl.constexpr):
    """Pointers of row n, head h's ``[V, K]`` state in a caller's tensor of strides (s_n, s_h, s_v, s_k)."""
    o_k, o_v = tl.arange(0, K), tl.arange(0, V)
    return p + i_n.to(tl.int64) * s_n + i_h.to(tl.int64) * s_h + o_v[:, None] * s_v + o_k[None, :] * s_k


@triton.jit
def load_states_kernel(slots, states, hcnt, codes, skv, uq, w, pcum, gbuf, q0, scratch, scratch16, NS, HV, SS, HS,
                       s_n, s_h, s_v, s_k, K: tl.constexpr, V: tl.constexpr, L: tl.constexpr, R: tl.constexpr,
                       BL: tl.constexpr, BR: tl.constexpr, ITERS: tl.constexpr, IS_KDA: tl.constexpr,
                       SCR: tl.constexpr, BF16_DOTS: tl.constexpr):
    """Grid (n, HV): the state of (row n, head h) compressed into the checkpoint of (slots[n], h) by the flush's
    steps 5-10, its ring reset as a flush resets it, and ``hcnt = 0``. ``scratch``, ``scratch16``: SCR words per
    program, as the flush's."""
    i_n, i_h = tl.program_id(0), tl.program_id(1)
    i_s = tl.load(slots + i_n).to(tl.int64)
    if (i_s < 0) | (i_s >= NS):
        return
    i_sh = i_s * HV + i_h
    o_scr = (i_n.to(tl.int64) * HV + i_h) * SCR
    o_k, o_v, o_l, o_r, m_l, m_r = _ranges(K, V, L, R, BL, BR)
    o_reg, p_y, p_gram, p_cn, p_q16, p_e = _region_and_scratch(scratch, scratch16, o_scr, i_s, i_h, SS, HS, K, V,
                                                               ITERS)
    p_qt, m_q = _q16_tile(p_q16, V, BR)
    # kbuf and ubuf are not touched: the emptied ring voids their entries (placeholders for their pointers)
    p_c, p_skv, p_uq, _, _, p_w, p_pc, p_g = _pair_pointers(codes, skv, uq, w, w, w, pcum, gbuf, o_reg, i_sh, K, V,
                                                            L, IS_KDA)
    b_q0 = tl.load(q0 + o_v[:, None] * R + o_r[None, :], mask=m_r[None, :], other=0.0)
    b_s = tl.load(_state_tile(states, i_n, i_h, s_n, s_h, s_v, s_k, K, V))
    # the subspace iteration starts from fp16(Q0) in scratch, as the flush's rebuild leaves it
    tl.store(p_qt, b_q0.to(tl.float16), mask=m_q)
    tl.debug_barrier()
    _subspace_iteration(b_s, p_y, p_gram, p_cn, p_q16, p_qt, m_q, V, R, BR, ITERS)
    b_q16, b_ut16 = _new_factors(b_s, p_cn, p_qt, m_q)
    b_s = _residual(b_s, b_q16, b_ut16)
    b_s = _column_scales(b_s, p_skv, p_e, p_y, K, V, BF16_DOTS)
    b_c, b_sv = _quantise(b_s)
    _store_checkpoint(p_c, p_skv, p_uq, b_c, b_sv, b_ut16, b_q16, o_k, o_v, o_r, m_r, K, V)
    _reset_ring(p_w, p_pc, p_g, o_k, o_l, m_l, K, BL, IS_KDA)
    tl.store(hcnt + i_sh, 0)


@triton.jit
def states_kernel(slots, out, codes, skv, uq, kbuf, ubuf, w, pcum, gbuf, q0, NS, HV, SS, HS, s_n, s_h, s_v, s_k,
                  K: tl.constexpr, V: tl.constexpr, L: tl.constexpr, R: tl.constexpr, BL: tl.constexpr,
                  BR: tl.constexpr, IS_KDA: tl.constexpr, BF16_DOTS: tl.constexpr):
    """Grid (n, HV): ``out[n, h]`` = the state of (slots[n], h) rebuilt by the flush's steps 1-4 (zeros for a slot
    outside [0, NS)). ``out`` is dense per head (either layout): the program's own ``[V, K]`` words are its scratch
    for exp(pcum) (the flush keeps it in scratch words) until the state overwrites them."""
    i_n, i_h = tl.program_id(0), tl.program_id(1)
    p_o = _state_tile(out, i_n, i_h, s_n, s_h, s_v, s_k, K, V)
    i_s = tl.load(slots + i_n).to(tl.int64)
    if (i_s < 0) | (i_s >= NS):
        tl.store(p_o, tl.zeros([V, K], dtype=tl.float32))
        return
    i_sh = i_s * HV + i_h
    o_reg = i_s * SS + i_h * HS
    o_k, o_v, _, o_r, _, _ = _ranges(K, V, L, R, BL, BR)
    p_e = out + i_n.to(tl.int64) * s_n + i_h.to(tl.int64) * s_h
    # the rebuild also stores fp16(Q0) for the subspace iteration, which does not follow here: masked off
    p_qt = p_e + o_v[:, None] * BR + o_r[None, :]
    m_none = (o_v[:, None] < 0) & (o_r[None, :] < 0)
    p_c, p_skv, p_uq, p_k, p_u, p_w, p_pc, p_g = _pair_pointers(codes, skv, uq, kbuf, ubuf, w, pcum, gbuf, o_reg,
                                                                i_sh, K, V, L, IS_KDA)
    b_s = _rebuild(p_c, p_skv, p_uq, p_k, p_u, p_w, p_pc, p_g, q0, p_e, p_qt, m_none, K, V, L, R, BL, BR, IS_KDA,
                   BF16_DOTS)
    tl.debug_barrier()  # every warp has read exp(pcum) back before the state overwrites it
    tl.store(p_o, b_s)


# compiled inside mma_sync_only, as the flush (wgmma miscompiles these phases on sm_90), then launched directly
_launch_load = Launcher(load_states_kernel, mma_sync_only)
_launch_states = Launcher(states_kernel, mma_sync_only)
# per pool memory (keyed weakly by the pool's raw tensor, as the flush's plans): {(kernel, geometry, iters, warps,
# cap): (the tensors' (address, dtype)s, Prepared)}
_PREPARED = WeakIdKeyDictionary()


def _build(head_k: int, head_v: int, num_warps: int | None, maxnreg: int | None) -> tuple[int, int | None]:
    """(warps, register cap): the flush's (the same state in registers), unless overridden (``maxnreg=0``: none)."""
    nw = num_warps or num_warps_for(head_k, head_v)
    cap = maxnreg if maxnreg is not None else maxnreg_for(nw)
    return nw, (cap or None)


def state_strides(t: torch.Tensor, state_v_first: bool) -> dict:
    """The kernels' strides (s_n, s_h, s_v, s_k) of a state tensor ``[n, HV, V, K]`` (``state_v_first``) or
    ``[n, HV, K, V]``."""
    s = t.stride()
    return dict(s_n=s[0], s_h=s[1], s_v=s[2] if state_v_first else s[3], s_k=s[3] if state_v_first else s[2])


def _constants(pool, which: str) -> dict:
    c = kernel_constants(pool.geometry, pool.convention, pool.iters)
    keep = ("K", "V", "L", "R", "BL", "BR", "IS_KDA", "BF16_DOTS") + (("ITERS", "SCR") if which == "load" else ())
    return {k: c[k] for k in keep}


def _prepared(pool, which: str, nw: int, cap: int | None):
    """The launch of ``which`` ("load" or "states") with the pool's tensors and constants bound once, prepared again
    when a tensor of the pool moved."""
    g = pool.geometry
    gbuf = pool.gbuf if pool.gbuf is not None else pool.w  # GDN never reads it
    if which == "load":
        tensors = dict(hcnt=pool.hcnt, codes=pool.codes, skv=pool.s_kv, uq=pool.uq, w=pool.w, pcum=pool.pcum,
                       gbuf=gbuf, q0=pool.q0)
    else:
        tensors = dict(codes=pool.codes, skv=pool.s_kv, uq=pool.uq, kbuf=pool.kbuf, ubuf=pool.ubuf, w=pool.w,
                       pcum=pool.pcum, gbuf=gbuf, q0=pool.q0)
    memory = [(t.data_ptr(), t.dtype) for t in tensors.values()]
    cache = _PREPARED.get(pool.raw)
    if cache is None:
        cache = _PREPARED[pool.raw] = {}
    key = (which, g, pool.iters, nw, cap)
    entry = cache.get(key)
    if entry is None or entry[0] != memory:
        launcher = _launch_load if which == "load" else _launch_states
        static = dict(tensors, NS=g.num_slots, HV=g.heads, SS=g.slot_stride, HS=g.head_stride,
                      **_constants(pool, which))
        entry = cache[key] = (memory, launcher.prepare(static, compile_options(nw, cap)))
    return entry[1]


def scratch_words_per_program(pool) -> int:
    """fp32 scratch words one program of :func:`load_states_pool` takes (the flush's, :func:`.host.scratch_words`)."""
    return _constants(pool, "load")["SCR"]


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
    nw, cap = _build(pool.head_k, pool.head_v, num_warps, maxnreg)
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
    nw, cap = _build(pool.head_k, pool.head_v, num_warps, maxnreg)
    _prepared(pool, "states", nw, cap)((n, pool.heads), dict(slots=slots, out=out,
                                                              **state_strides(out, state_v_first)))
    return out


# --- ahead-of-time check (no GPU needed): ``python -m leapquant_triton.states [--arch 80,90]`` -------------------------

_AOT_POINTERS = {"slots": "*i32", "states": "*fp32", "out": "*fp32", "hcnt": "*i32", "codes": "*i8", "skv": "*fp32",
                 "uq": "*fp16", "kbuf": "*bf16", "ubuf": "*bf16", "w": "*fp32", "pcum": "*fp32", "gbuf": "*fp16",
                 "q0": "*fp32", "scratch": "*fp32", "scratch16": "*fp16"}
KERNELS = ("load", "states")


def compile_one(arch: int, shape, which: str, state_v_first: bool = True):
    """Compile ``which`` (``"load"`` or ``"states"``) as :func:`load_states_pool` / :func:`states_pool` launch it for
    ``sm_<arch>`` at ``shape`` (a :class:`.portability.Shape`), the state's unit stride specialised as Triton does
    for a dense tensor of that layout, and check it as the flush's builds are checked (registers, spills, shared
    memory, ``mma.sync``): a :class:`.portability.Report`."""
    from leapquant.geometry import Geometry

    from . import portability as aot

    fn = load_states_kernel if which == "load" else states_kernel
    geo = Geometry(2, 32, shape.head_k, shape.head_v, shape.ring, shape.rank, shape.gate)
    consts = kernel_constants(geo, "vllm", shape.iters)
    keep = ("K", "V", "L", "R", "BL", "BR", "IS_KDA") + (("ITERS", "SCR") if which == "load" else ())
    constexprs = dict({k: consts[k] for k in keep}, BF16_DOTS=True, **{"s_k" if state_v_first else "s_v": 1})
    pointers = {k: v for k, v in _AOT_POINTERS.items() if k in fn.arg_names}
    signature = {a: pointers.get(a) or ("constexpr" if a in constexprs else "i32") for a in fn.arg_names}
    nw, cap = _build(shape.head_k, shape.head_v, None, None)
    name = f"{which}{'' if state_v_first else '-kv'}"
    rep = aot._build(fn, signature, constexprs, pointers, arch, compile_options(nw, cap),
                     aot.Report(arch, shape, name, nw, ok=False))
    rep.ok = rep.ok and rep.mma == "mma.sync"
    return rep


def main(argv=None) -> int:
    import argparse
    import sys

    from . import portability as aot
    from .backend import SUPPORTED_CAPABILITIES

    ap = argparse.ArgumentParser(description="ahead-of-time compile check of the load_states and states kernels")
    ap.add_argument("--arch", default=",".join(map(str, SUPPORTED_CAPABILITIES)), help="compute capabilities")
    ap.add_argument("--quick", action="store_true", help="only the default 128x128 KDA shape and 64x64 KDA")
    a = ap.parse_args(argv)
    bad = 0
    for arch in (int(x) for x in a.arch.split(",") if x):
        for shape in aot.QUICK_SHAPES if a.quick else aot.SHAPES:
            for which in KERNELS:
                for v_first in (True, False):
                    rep = compile_one(arch, shape, which, v_first)
                    print(rep.line(), flush=True)
                    bad += not rep.ok
    print(f"{bad} build(s) do not fit" if bad else "all builds fit")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
