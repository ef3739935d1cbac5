"""What the Triton backend's builds are for: the compute capabilities claimed, the Triton releases checked, the
interpreter switch, and the compile options every launch and the ahead-of-time check share (docs/DESIGN.md, "Triton:
registers and occupancy" and "Triton: mma.sync, not wgmma").

A leaf: it imports nothing from this package, and not Triton (importing the backend must not import Triton).
"""

from __future__ import annotations

import contextlib
import os
import re
import threading

import torch

from leapquant.backends import capability

# Compute capabilities the flush and states kernels are claimed for; ``python -m leapquant_triton.portability``
# compiles each one ahead of time and fails CI if it does not fit. Every target takes the ``mma.sync`` lowering
# (mma_sync_only). Not claimed: sm_75, which has no bf16 tensor cores for the ring and column-sum products.
SUPPORTED_CAPABILITIES = (80, 86, 89, 90, 100, 120)
# The decode step has an FMA kernel for sm_75 (Triton cannot lower its products to tensor cores there): claimed too.
STEP_CAPABILITIES = (75,) + SUPPORTED_CAPABILITIES
# The oldest Triton release the kernels are built and checked with (pyproject's ``triton`` extra; CI tests every
# release from it to the newest). On 3.4 the griddepcontrol helpers do not compile and ring 32 with ITERS 2 spills past
# the limit; an older Triton makes ``available()`` say so, and ``auto`` passes the backend over rather than fail.
MIN_TRITON = (3, 5)
# The Triton releases whose Gluon the decode step's Gluon kernel is written and checked for: 3.5's Gluon has no
# ``mma_v2``; two names changed from 3.6 to 3.9 (``step_gluon``'s aliases). Under the others the ``tl`` kernel serves
# every shape.
GLUON_RELEASES = ((3, 6), (3, 7), (3, 8), (3, 9))
# the most tokens per row the Gluon step kernel takes in one launch: past four its call's tiles spill and its shared
# memory leaves fewer programs per SM, so a call of more runs as launches of at most four, as even as they can be
# (T = 5-8 6-17 % faster than in one launch, docs/DESIGN.md)
GLUON_TOKENS_PER_LAUNCH = 4


def step_kernels_note() -> str:
    """Which decode-step kernel serves which shapes under the installed Triton (read from its metadata: this module
    does not import Triton), for ``python -m leapquant info``."""
    import importlib.metadata as md

    try:
        version = md.version("triton")
    except md.PackageNotFoundError:
        version = None
    try:
        here = triton_release(version) if version else None
    except ValueError:  # a version string of another form: named as it is
        here = None
    gluon = " / ".join(".".join(map(str, r)) for r in GLUON_RELEASES)
    if version is None:  # no Triton kernel runs at all: the backend says so in its status
        now = "Triton is not installed here"
    elif here in GLUON_RELEASES:
        now = "taken here"
    else:
        now = f"not with Triton {'.'.join(map(str, here)) if here else version} here: the tl kernel serves every shape"
    return (f"decode step: the Gluon kernel for K = V = 128, ring 16, rank <= 4 on sm_80+ under Triton {gluon} "
            f"({now}), at most {GLUON_TOKENS_PER_LAUNCH} tokens per row a launch, a longer verify in several; the tl "
            "kernel for the other shapes; sm_75 its FMA kernel; each computes step_packed's gates in its prologue")


def triton_release(version: str) -> tuple[int, int]:
    """(major, minor) of a Triton version string such as ``"3.5.1"`` or ``"3.6.0+git1a2b3c4"``."""
    m = re.match(r"(\d+)\.(\d+)", version)
    if m is None:
        raise ValueError(f"not a Triton version: {version!r}")
    return int(m[1]), int(m[2])


def interpreting() -> bool:
    """Whether Triton runs kernels through its CPU interpreter (``TRITON_INTERPRET`` set and not 0)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def device_capability(device: torch.device) -> int | None:
    """``major * 10 + minor`` of a CUDA device; None off CUDA (the interpreter). A host-side property: no sync."""
    return capability(device) if device.type == "cuda" else None


def num_warps_for(head_k: int, head_v: int) -> int:
    """Warps per program of the kernels that hold the state in registers (flush, load_states, states). The [V, K]
    fp32 state costs V K / (32 num_warps) registers per thread: 64 at 128 x 128 with 8 warps. 64 x 64 fits 4 warps
    (32 per thread); 128 x 64 at 4 warps spills, so it takes 8."""
    return 4 if head_k * head_v <= 64 * 64 else 8


def maxnreg_for(num_warps: int) -> int | None:
    """Register cap per thread: at 8 warps, 128 registers let two programs share an SM, which is faster despite the
    spills than one uncapped program (docs/DESIGN.md, "Triton: registers and occupancy"); 4 warps are uncapped."""
    return 128 if num_warps == 8 else None


def warps_and_cap(head_k: int, head_v: int, num_warps: int | None = None,
                  maxnreg: int | None = None) -> tuple[int, int | None]:
    """(warps, register cap) of a build that holds the [V, K] state in registers: :func:`num_warps_for` and
    :func:`maxnreg_for` unless overridden (experiments; ``maxnreg=0``: no cap)."""
    nw = num_warps or num_warps_for(head_k, head_v)
    cap = maxnreg if maxnreg is not None else maxnreg_for(nw)
    return nw, (cap or None)


# FMA contraction on, as every parity figure was measured: Triton 3.10 turns it off by default, and
# TRITON_DEFAULT_FP_FUSION=0 in the caller's environment would too
FP_FUSION = dict(enable_fp_fusion=True)


def compile_options(num_warps: int, maxnreg: int | None) -> dict:
    """The options of a kernel's build: what the hosts launch and the AOT check compiles."""
    return dict(num_warps=num_warps, num_stages=1, **FP_FUSION, **({"maxnreg": maxnreg} if maxnreg else {}))


_MMA_ENV = ("DISABLE_MMA_V3", "DISABLE_MMA_V5")
_mma_lock = threading.Lock()


@contextlib.contextmanager
def mma_sync_only():
    """Compile with Triton's ``mma.sync`` lowering of ``tl.dot``, not Hopper's ``wgmma`` (which miscompiles the flush
    kernel on sm_90) or Blackwell's ``tcgen05``: docs/DESIGN.md, "Triton: mma.sync, not wgmma".

    Triton reads the switch from the environment while it compiles, and its in-process cache does not see it, so it
    is set (under a lock, then restored) around every launch that may compile."""
    with _mma_lock:
        old = {k: os.environ.get(k) for k in _MMA_ENV}
        os.environ.update({k: "1" for k in _MMA_ENV})
        try:
            yield
        finally:
            for k, v in old.items():
                if v is None:
                    del os.environ[k]
                else:
                    os.environ[k] = v
