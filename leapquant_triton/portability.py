"""Ahead-of-time compile check of the flush, step and states kernels for every CUDA architecture the Triton backend
claims, no GPU needed: ``python -m leapquant_triton.portability [--arch 80,90] [--quick]
[--ops flush,force,step,states,engine]``.

For each (architecture, shape) it runs Triton's own pipeline down to a cubin with ``triton.compile(ASTSource(...),
target=GPUTarget("cuda", cc, 32))``, then reads the resource use back from ``ptxas -v`` (Triton's bundled ptxas, the
same flags Triton uses) and compares it with the architecture's limits. It exits non-zero when a claimed target does
not compile, does not fit (255 registers per thread, the shared memory per block of that architecture, no spills
beyond :data:`MAX_SPILL_BYTES`), or does not take the tensor-core lowering it must: ``mma.sync`` for the flush's
``tl.dot`` and the states kernels' (the backend forces it), ``mma.sync`` or none for the step (:func:`mma_family` of
the PTX), none at all for the engine calls' small kernels (``accept``, ``gates``, ``copy``). The flush's builds
(``grid``, ``list``; the forced flush's ``grid-force``) and the states builds (``load``, ``states``; ``-kv``: FLA's
``[K, V]`` state layout) are claimed on :data:`.targets.SUPPORTED_CAPABILITIES`, the step's (``step``) and the engine calls' on
:data:`.targets.STEP_CAPABILITIES`, sm_75 included; targets not claimed are compiled and reported but cannot fail.
Each line also gives the build's static SASS instruction count (``sass``: :func:`sass_count`), the proxy the design
notes use for an issue-bound kernel's time; it is reported, not checked.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from leapquant.geometry import Geometry

from .flush import SCHEDULES, kernel_constants
from .flush_kernel import leapquant_flush_kernel
from .states import KERNELS as STATES_KERNELS
from .states import states_constants
from .step import UNPACKED, gluon_kernel, gluon_shape, step_build, tokens_per_launch
from .targets import (
    GLUON_RELEASES,
    STEP_CAPABILITIES,
    SUPPORTED_CAPABILITIES,
    compile_options,
    mma_sync_only,
    warps_and_cap,
)

# shared memory per block (opt-in maximum), bytes, from the CUDA programming guide's table of compute capabilities
SMEM_LIMIT = {75: 64 << 10, 80: 163 << 10, 86: 99 << 10, 89: 99 << 10, 90: 227 << 10, 100: 227 << 10, 120: 99 << 10}
MAX_REGS = 255
# spills go to local memory (L1-resident at these sizes): a speed cost, tolerated up to this much, since the 8-warp
# programs are capped at 128 registers for two programs per SM (targets.maxnreg_for)
MAX_SPILL_BYTES = 2048
ARCHS = tuple(SMEM_LIMIT)

# pointer arguments in kernel order, with their element types
_POINTERS = {
    "idx": "*i32", "hcnt": "*i32", "work": "*i32", "codes": "*i8", "skv": "*fp32", "uq": "*fp16", "kbuf": "*bf16",
    "ubuf": "*bf16", "w": "*fp32", "pcum": "*fp32", "gbuf": "*fp16", "q0": "*fp32", "scratch": "*fp32",
    "scratch16": "*fp16",
}
# the step's, with the token tensors in bf16 (an engine's activations)
_STEP_POINTERS = {
    "idx": "*i32", "q": "*bf16", "k": "*bf16", "v": "*bf16", "g": "*bf16", "beta": "*bf16", "out": "*bf16",
    "codes": "*i8", "skv": "*fp32", "uq": "*fp16", "kbuf": "*bf16", "ubuf": "*bf16", "w": "*fp32", "pcum": "*fp32",
    "gbuf": "*fp16", "hcnt": "*i32",
}
# the step's history (SPEC §6.1), beyond its pointers
_HISTORY_POINTERS = {"hstart": "*i32", "hcount": "*i32", "hpcum": "*fp32", "hw": "*fp32"}
# the states kernels' pointers beyond the flush's (the caller's states, in and out)
_STATES_POINTERS = dict(_POINTERS, slots="*i32", states="*fp32", out="*fp32")
# what the step's builds are named in the reports, beside the flush's SCHEDULES: the tl kernel (sm_75's FMA kernel
# there) and the Gluon kernel (claimed where the backend launches it: step.kernel_for)
STEP = "step"
STEP_GLUON = "step-gluon"
# the same kernels as ``step_packed`` launches them: one token, the gates computed in the prologue (SPEC §6.2)
STEP_PACKED = "step-packed"
STEP_GLUON_PACKED = "step-gluon-packed"
# and as it launches them for T tokens a row (as many as a launch takes), with the history
STEP_PACKED_TOKENS = "step-packed-tokens"
STEP_GLUON_PACKED_TOKENS = "step-gluon-packed-tokens"
PACKED_BUILDS = (STEP_PACKED, STEP_GLUON_PACKED, STEP_PACKED_TOKENS, STEP_GLUON_PACKED_TOKENS)
# the states builds: each kernel with the V-first state and (-kv) FLA's [K, V] one
STATES = tuple(f"{which}{lay}" for which in STATES_KERNELS for lay in ("", "-kv"))
# the forced flush's build (FORCE: partially filled rings, SPEC §2; the grid schedule only)
FORCED = ("grid-force",)
# the engine calls' small kernels, no tensor cores: accept's (SPEC §6.1), step_packed's gates (§6.2), copy_slots'
# (§5.3)
ENGINE = ("accept", "gates", "copy")
# the builds of each op, as --ops selects them
OPS = {"flush": SCHEDULES, "force": FORCED, "step": (STEP, STEP_GLUON), "packed": PACKED_BUILDS,
       "states": STATES, "engine": ENGINE}


@dataclass
class Shape:
    head_k: int
    head_v: int
    ring: int
    rank: int
    gate: str
    iters: int = 1

    def __str__(self) -> str:
        it = f" it{self.iters}" if self.iters != 1 else ""
        return f"{self.gate} K{self.head_k} V{self.head_v} L{self.ring} R{self.rank}{it}"


# the default geometry in both gates, the 64-dim and mixed heads, the ring and rank extremes, two iterations
SHAPES = (
    Shape(128, 128, 16, 4, "kda"),
    Shape(128, 128, 16, 4, "gdn"),
    Shape(64, 64, 16, 4, "kda"),
    Shape(64, 64, 16, 4, "gdn"),
    Shape(128, 64, 8, 1, "kda"),
    Shape(64, 128, 32, 2, "gdn"),
    Shape(128, 128, 32, 4, "kda", iters=2),
)
QUICK_SHAPES = SHAPES[:1] + SHAPES[2:3]


@dataclass
class Report:
    arch: int
    shape: Shape
    kernel: str
    num_warps: int
    ok: bool
    regs: int = -1
    spill_bytes: int = -1
    smem: int = -1
    seconds: float = 0.0
    error: str = ""
    mma: str = ""  # the tensor-core instructions of the PTX (mma_family)
    claim: bool = True  # False: a build the backend does not launch here (the Gluon step off its shapes or releases)
    prefetches: int = 0  # bulk L2 prefetches in the PTX (the list build on sm_90 and later: flush.prefetch_ahead)
    sass: int = -1  # static SASS instructions of the cubin, NOPs aside (sass_count; -1: not counted)

    def line(self) -> str:
        if self.error:
            flag = "FAIL" if self.claim else "--  "
            return f"sm_{self.arch:<4} {str(self.shape):<26} {self.kernel:<10} {flag}  {self.error}"
        flag = "ok  " if self.ok else "FAIL"
        return (f"sm_{self.arch:<4} {str(self.shape):<26} {self.kernel:<10} {flag}  warps {self.num_warps:2d}  "
                f"regs {self.regs:3d}/{MAX_REGS}  spill {self.spill_bytes:4d} B  "
                f"smem {self.smem / 1024:6.1f}/{SMEM_LIMIT[self.arch] >> 10} KiB  {self.mma:<8}  "
                f"sass {self.sass if self.sass >= 0 else '?':>5}  ({self.seconds:.1f} s)")


def mma_family(ptx: str) -> str:
    """Which tensor-core instructions the PTX uses: ``mma.sync``, ``wgmma`` (Hopper), ``tcgen05`` (Blackwell), several
    joined by ``+``, or ``none`` (FMA dots)."""
    found = [name for name, pattern in (("mma.sync", r"\bmma\.sync\."), ("wgmma", r"\bwgmma\.mma_async"),
                                        ("tcgen05", r"\btcgen05\.mma")) if re.search(pattern, ptx)]
    return "+".join(found) or "none"


def _ptxas(arch: int) -> str:
    """The ptxas Triton compiles ``sm_<arch>`` with: from Triton 3.6 it is chosen per architecture (a separate one for
    sm_100 and later), in 3.5 one serves all."""
    import inspect

    from triton.backends.nvidia.compiler import get_ptxas

    return (get_ptxas(arch) if inspect.signature(get_ptxas).parameters else get_ptxas()).path


def _ptxas_usage(ptx: str, arch: int) -> tuple[int, int, int]:
    """(registers, spill bytes stores + loads, static shared bytes) from ``ptxas -v`` on Triton's PTX."""
    from triton.backends.nvidia.compiler import sm_arch_from_capability

    gpu = sm_arch_from_capability(arch)
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        res = subprocess.run([_ptxas(arch), "-v", f"--gpu-name={gpu}", src, "-o", os.path.join(tmp, "k.o")],
                             capture_output=True, text=True, check=True)
    log = res.stderr
    regs = int(re.search(r"Used (\d+) registers", log).group(1))
    spills = sum(int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", log))
    m = re.search(r"(\d+) bytes smem", log)
    return regs, spills, int(m.group(1)) if m else 0


# an instruction line of cuobjdump -sass: its address, an optional predicate, the opcode
_SASS_LINE = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]\s+)?([A-Z][A-Z0-9_.]*)")


def sass_count(cubin: bytes, arch: int) -> int:
    """Static SASS instructions of a cubin, the padding NOPs aside, by the ``cuobjdump`` beside Triton's ptxas: a
    proxy for what an issue-bound kernel's time follows (docs/DESIGN.md counts the flush and the step so), not a
    count of what runs (loops count once)."""
    cuobjdump = os.path.join(os.path.dirname(_ptxas(arch)), "cuobjdump")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        out = subprocess.run([cuobjdump, "-sass", path], capture_output=True, text=True, check=True).stdout
    return sum(1 for m in _SASS_LINE.finditer(out) if m.group(1) != "NOP")


def _geometry(shape: Shape) -> Geometry:
    return Geometry(2, 32, shape.head_k, shape.head_v, shape.ring, shape.rank, shape.gate)


# the builds are checked for vLLM's slot convention (real slots from 1), the engines' default
FIRST_SLOT = 1


def compile_one(arch: int, shape: Shape, kernel: str = "grid", num_warps: int | None = None,
                maxnreg: int | None = None) -> Report:
    """Compile the flush kernel as one of its schedules launches it (``kernel``: ``"grid"`` or ``"list"``, the
    ``LIST`` switch of :func:`leapquant_flush_kernel`; ``"-force"`` appended: its forced-flush build), the step
    kernels (``kernel="step"``, ``"step-gluon"``: :func:`compile_step`) or a states kernel (``kernel`` in
    :data:`STATES`: :func:`compile_states`), for ``sm_<arch>`` at ``shape`` and check it against the architecture's
    limits."""
    if kernel in (STEP, STEP_GLUON) + PACKED_BUILDS:
        return compile_step(arch, shape, num_warps, gluon="gluon" in kernel, packed=kernel in PACKED_BUILDS,
                            tokens=None if kernel.endswith("-tokens") else 1)
    if kernel in STATES:
        return compile_states(arch, shape, kernel.removesuffix("-kv"), not kernel.endswith("-kv"))
    if kernel in ENGINE:
        return compile_engine(arch, shape, kernel)
    if kernel not in SCHEDULES + FORCED:
        raise ValueError(f"kernel must be one of {SCHEDULES + FORCED + OPS['step'] + OPS['packed'] + STATES + ENGINE}, "
                         f"not {kernel!r}")
    force = kernel in FORCED
    schedule = kernel.removesuffix("-force")
    nw, maxnreg = warps_and_cap(shape.head_k, shape.head_v, num_warps, maxnreg)  # the backend's launch
    # as flush_pool launches it (griddepcontrol and the bulk L2 prefetch need sm_90; the prefetch distance, two
    # programs per SM of the GPU at hand, only moves a constant: the H200's is taken)
    sm90_list = schedule == "list" and arch >= 90
    constexprs = dict(kernel_constants(_geometry(shape), FIRST_SLOT, shape.iters, force), LIST=schedule == "list",
                      PDL=sm90_list, AHEAD=264 if sm90_list else 0)
    signature = dict(_POINTERS, NS="i32", HV="i32", SS="i32", HS="i32", **{k: "constexpr" for k in constexprs})
    rep = _build(leapquant_flush_kernel, signature, constexprs, _POINTERS, arch, compile_options(nw, maxnreg),
                 Report(arch, shape, kernel, nw, ok=False))
    # every claimed build must take the mma.sync lowering (targets.mma_sync_only): a Triton release that stops
    # honouring the switch would hand the H200 the wgmma build that miscompiles this kernel
    rep.ok = rep.ok and rep.mma == "mma.sync"
    return rep


def compile_step(arch: int, shape: Shape, num_warps: int | None = None, gluon: bool = False,
                 packed: bool = False, tokens: int | None = 1) -> Report:
    """Compile a step kernel (q / k l2-normalised: the larger build) as :func:`.step.step_pool` launches it for
    ``sm_<arch>`` at ``shape`` (:func:`.step.step_build`). ``gluon`` False: from sm_80
    :func:`.step_kernel.leapquant_step_kernel`, its int8 and bf16 products as ``mma.sync``; on sm_75
    :func:`.step_kernel.leapquant_step_fma_kernel`, no tensor cores. True: :mod:`.step_gluon`'s kernel (``mma.sync``,
    its explicit ``mma_v2``), claimed where :func:`.step.kernel_for` takes it; elsewhere not built. Never wgmma or
    tcgen05. ``packed``: ``step_packed``'s build (the softplus gates and a bf16 beta computed in the prologue) of
    ``tokens`` tokens a row (None: as many as a launch takes, at most L / 2, with the history); else T = L / 2 tokens
    (at most what one launch of the kernel takes) with the history."""
    geometry = _geometry(shape)
    per_launch = min(shape.ring // 2, tokens_per_launch("gluon" if gluon else "mma") or shape.ring // 2)
    if packed and tokens is None:
        tokens = per_launch
    name = ((STEP_GLUON_PACKED if gluon else STEP_PACKED) + ("-tokens" if tokens > 1 else "") if packed
            else STEP_GLUON if gluon else STEP)
    if gluon:
        if arch < 80 or not gluon_shape(geometry) or gluon_kernel() is None:
            return Report(arch, shape, name, 0, ok=False, claim=False,
                          error="not built: the Gluon step covers 128 x 128, ring 16, rank <= 4, sm_80+, Triton "
                                + " / ".join(".".join(map(str, r)) for r in GLUON_RELEASES))
        kernel, constexprs, options = step_build(geometry, FIRST_SLOT, True, arch, "gluon")
    else:
        kernel, constexprs, options = step_build(geometry, FIRST_SLOT, True, arch, "fma" if arch < 80 else "mma")
        constexprs.update(NATIVE=True)
    pointers = dict(_STEP_POINTERS, **_HISTORY_POINTERS)
    if packed:  # step_packed: the gates from a, b (g's and beta's places), A_log and dt_bias
        constexprs.update(HIST=tokens > 1, HT=shape.ring // 2 + 1 if tokens > 1 else 1, T=tokens, PACKED=1,
                          BETA_ROUND=1, TOFF=0)
        pointers.update(a_log="*fp32", dt_bias="*fp32")
    else:  # the larger build: T tokens per row with the history of SPEC §6.1 (at most L / 2 tokens, as many as a
        # launch of this kernel takes)
        constexprs.update(HIST=True, HT=shape.ring // 2 + 1, T=per_launch, TOFF=0, **UNPACKED)
    if num_warps:
        options["num_warps"] = num_warps
    names = ("sq_n", "sq_h", "sk_n", "sk_h", "sv_n", "sv_h", "sg_n", "sg_h", "sb_n", "sb_h", "so_n", "so_h",
             "sq_t", "sk_t", "sv_t", "sg_t", "sb_t", "so_t")
    ints = {k: "i32" for k in names}
    signature = {a: pointers.get(a) or ints.get(a) or ("constexpr" if a in constexprs else None)
                 for a in kernel.arg_names}
    signature.update(scale="fp32", NS="i32", HV="i32", G="i32", SS="i32", HS="i32")
    if packed:
        signature.update(lower_bound="fp32")
    rep = _build(kernel, signature, constexprs, pointers, arch, options,
                 Report(arch, shape, name, options["num_warps"], ok=False))
    rep.ok = rep.ok and rep.mma == ("none" if arch < 80 else "mma.sync")
    return rep


def compile_states(arch: int, shape: Shape, which: str, state_v_first: bool = True) -> Report:
    """Compile ``which`` (``"load"`` or ``"states"``) as :func:`.states.load_states_pool` /
    :func:`.states.states_pool` launch it for ``sm_<arch>`` at ``shape``, the state's unit stride specialised as
    Triton does for a dense tensor of that layout, and check it as the flush's builds are checked (registers, spills,
    shared memory, ``mma.sync``)."""
    fn = STATES_KERNELS[which]
    constexprs = dict(states_constants(_geometry(shape), shape.iters, which), BF16_DOTS=True,
                      **{"s_k" if state_v_first else "s_v": 1})
    pointers = {k: v for k, v in _STATES_POINTERS.items() if k in fn.arg_names}
    signature = {a: pointers.get(a) or ("constexpr" if a in constexprs else "i32") for a in fn.arg_names}
    nw, cap = warps_and_cap(shape.head_k, shape.head_v)
    name = f"{which}{'' if state_v_first else '-kv'}"
    rep = _build(fn, signature, constexprs, pointers, arch, compile_options(nw, cap),
                 Report(arch, shape, name, nw, ok=False))
    rep.ok = rep.ok and rep.mma == "mma.sync"
    return rep


def compile_engine(arch: int, shape: Shape, which: str) -> Report:
    """Compile ``which`` (:data:`ENGINE`) as the Triton backend launches it for a pool of ``shape`` (accept: the
    history of a pool made with ``max_tokens = L / 2``; gates: 32 value heads, no lower bound) and check it as the
    other builds, with no tensor-core instruction at all."""
    from .accept import OPTIONS as ACCEPT_OPTIONS
    from .accept import leapquant_accept_kernel
    from .gates import OPTIONS as GATES_OPTIONS
    from .gates import leapquant_gates_kernel

    kda = shape.gate == "kda"
    if which == "accept":
        fn, options = leapquant_accept_kernel, ACCEPT_OPTIONS
        constexprs = dict(FIRST=FIRST_SLOT, L=shape.ring, K=shape.head_k, PK=shape.head_k if kda else 1,
                          HT=shape.ring // 2 + 1, IS_KDA=kda)
        pointers = dict(idx="*i32", nacc="*i32", start="*i32", count="*i32", hpcum="*fp32", hw="*fp32", hcnt="*i32",
                        pcum="*fp32", w="*fp32", gbuf="*fp16")
        scalars = {}
    elif which == "copy":
        from .copy import BLOCK as COPY_BLOCK
        from .copy import OPTIONS as COPY_OPTIONS
        from .copy import leapquant_copy_slots_kernel

        g = _geometry(shape)
        fn, options = leapquant_copy_slots_kernel, COPY_OPTIONS
        # the first launch (both copies in it: straight and into the temporary), the words of a pool of ``shape``
        constexprs = dict(FIRST=FIRST_SLOT, CW=g.checkpoint_bytes // 4, KW=shape.ring * shape.head_k // 2,
                          UW=shape.ring * shape.head_v // 2, WW=shape.ring, PW=shape.head_k if kda else 1,
                          GW=shape.ring * shape.head_k // 2 if kda else 0, BLOCK=COPY_BLOCK, SECOND=False)
        pointers = dict(src="*i32", dst="*i32", tmp="*i32", ckpt="*i32", kbuf="*i32", ubuf="*i32", w="*i32",
                        pcum="*i32", gbuf="*i32", hcnt="*i32")
        scalars = {}
    elif which == "gates":
        fn, options = leapquant_gates_kernel, GATES_OPTIONS
        constexprs = dict(HV=32, K=shape.head_k, IS_KDA=kda, USE_LOWER_BOUND=False, NATIVE=True)
        pointers = dict(a="*bf16", b="*bf16", A_log="*fp32", dt_bias="*fp32", g="*fp32", beta="*fp32")
        scalars = dict(lower_bound="fp32")
    else:
        raise ValueError(f"which must be one of {ENGINE}, not {which!r}")
    signature = {a: pointers.get(a) or scalars.get(a) or ("constexpr" if a in constexprs else "i32")
                 for a in fn.arg_names}
    rep = _build(fn, signature, constexprs, pointers, arch, dict(options),
                 Report(arch, shape, which, options["num_warps"], ok=False))
    rep.ok = rep.ok and rep.mma == "none"
    return rep


def _build(fn, signature: dict, constexprs: dict, pointers: dict, arch: int, options: dict, rep: Report) -> Report:
    """``fn`` through Triton's pipeline for ``sm_<arch>``, its resources into ``rep``; ``rep.ok``: it fits the
    architecture's registers, spill allowance and shared memory (the caller adds its lowering's condition)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if not isinstance(fn, triton.runtime.jit.JITFunction):
        raise RuntimeError("the kernel was decorated under TRITON_INTERPRET=1; run the AOT check without it")
    if type(fn).__name__ == "GluonJITFunction":  # Gluon's frontend: its own AST source
        from triton.experimental.gluon._runtime import GluonASTSource as ASTSource
    # every pointer of a pool is 16-byte aligned (torch allocations; the raw views start at multiples of 16 bytes)
    attrs = {(fn.arg_names.index(k),): [["tt.divisibility", 16]] for k in pointers}
    t0 = time.time()
    try:
        src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
        with mma_sync_only():  # the build the backend launches (see flush_pool)
            ck = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
        regs, spills, static_smem = _ptxas_usage(ck.asm["ptx"], arch)
    except Exception as e:  # a compile failure is a result of this check, reported per target
        rep.error = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:160] if str(e).strip() else ''}"
        rep.seconds = time.time() - t0
        return rep
    rep.regs, rep.spill_bytes, rep.smem = regs, spills, ck.metadata.shared + static_smem
    rep.mma = mma_family(ck.asm["ptx"])
    rep.prefetches = ck.asm["ptx"].count("cp.async.bulk.prefetch.L2")
    try:
        rep.sass = sass_count(ck.asm["cubin"], arch)
    except (OSError, subprocess.CalledProcessError):  # informational: a release without cuobjdump still checks
        rep.sass = -1
    rep.seconds = time.time() - t0
    rep.ok = regs <= MAX_REGS and spills <= MAX_SPILL_BYTES and rep.smem <= SMEM_LIMIT[arch]
    return rep


def claimed(rep: Report) -> bool:
    """Whether the backend claims ``rep``'s build on its architecture (only claimed builds can fail the check)."""
    step_claims = rep.kernel in (STEP, STEP_PACKED, STEP_PACKED_TOKENS) + ENGINE
    return rep.claim and rep.arch in (STEP_CAPABILITIES if step_claims else SUPPORTED_CAPABILITIES)


def check(archs=ARCHS, shapes=SHAPES, out=sys.stdout, ops=tuple(OPS)) -> list[Report]:
    reports = []
    for arch in archs:
        for shape in shapes:
            for kernel in (k for op in ops for k in OPS[op]):
                rep = compile_one(arch, shape, kernel)
                print(rep.line() + ("" if claimed(rep) else "  (not claimed)"), file=out, flush=True)
                reports.append(rep)
    return reports


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m leapquant_triton.portability",
                                 description="ahead-of-time compile check of the Triton backend's kernels")
    ap.add_argument("--arch", default=",".join(map(str, ARCHS)), help="comma-separated compute capabilities")
    ap.add_argument("--quick", action="store_true", help="only the default 128x128 KDA shape and 64x64 KDA")
    ap.add_argument("--ops", default=",".join(OPS), help=f"comma-separated ops to check ({', '.join(OPS)})")
    a = ap.parse_args(argv)
    archs = [int(x) for x in a.arch.split(",") if x]
    unknown = [x for x in archs if x not in SMEM_LIMIT]
    if unknown:
        ap.error(f"unknown architectures {unknown}; known: {list(SMEM_LIMIT)}")
    ops = [x for x in a.ops.split(",") if x]
    if not ops or any(x not in OPS for x in ops):
        ap.error(f"--ops takes {', '.join(OPS)}, not {a.ops!r}")
    reports = check(archs, QUICK_SHAPES if a.quick else SHAPES, ops=ops)
    bad = [r for r in reports if claimed(r) and not r.ok]
    if bad:
        print(f"{len(bad)} claimed target(s) do not fit:", file=sys.stderr)
        for r in bad:
            print("  " + r.line(), file=sys.stderr)
        return 1
    print(f"all {sum(map(claimed, reports))} claimed targets fit")
    return 0


if __name__ == "__main__":
    sys.exit(main())
