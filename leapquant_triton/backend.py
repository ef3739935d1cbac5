"""The Triton backend: availability, what it supports, and the launch (the kernel is in :mod:`.kernel`)."""

from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING

import torch

from leapquant.backends import Backend, Requirements, capability
from leapquant.constants import SUPPORTED_HEAD_DIMS, SUPPORTED_RANKS, SUPPORTED_RINGS

if TYPE_CHECKING:
    from leapquant.pool import Pool

# Compute capabilities the kernel is claimed for; ``python -m leapquant_triton.portability`` compiles each one ahead
# of time and fails CI if it does not fit that architecture's registers and shared memory. Every target takes the
# ``mma.sync`` lowering of ``tl.dot`` (kernel.mma_sync_only: Hopper's wgmma path miscompiles this kernel, and
# Blackwell's tcgen05 path crashes Triton 3.6's TritonNvidiaGPUOptimizeTMemLayoutsPass). Not claimed: sm_75 (no bf16
# tensor cores for the ring and column-sum products: Triton falls back to FMA dots and spills 1-24 KB).
SUPPORTED_CAPABILITIES = (80, 86, 89, 90, 100, 120)
# The oldest Triton release the kernel is built and checked with (pyproject's ``triton`` extra; CI runs the Triton
# tests on every release from it to the newest). Triton 3.4, which torch 2.8 pins, fails the build: its
# griddepcontrol helpers, which the list schedule takes on sm_90 and later, do not compile, and ring 32 with ITERS 2
# spills 2.1-2.9 KB on every claimed architecture (bench/NOTES.md, session 14). An engine whose torch pins an older
# Triton gets this reason from ``leapquant.backends()`` and ``auto`` passes the backend over, rather than a compile
# error at its first large flush.
MIN_TRITON = (3, 5)


def triton_release(version: str) -> tuple[int, int]:
    """(major, minor) of a Triton version string such as ``"3.5.1"`` or ``"3.6.0+git1a2b3c4"``."""
    m = re.match(r"(\d+)\.(\d+)", version)
    if m is None:
        raise ValueError(f"not a Triton version: {version!r}")
    return int(m[1]), int(m[2])


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


class TritonBackend(Backend):
    """One Triton program per (row of ``idx``, head): the state is rebuilt, compressed and stored in registers.

    Any number of heads; head dims 64 / 128 (K and V independently); ring 8 / 16 / 32; rank 1-4; ITERS 1-2; both
    gates and both slot conventions. On CUDA sm_80, 86, 89, 90, 100 and 120 (run on sm_90, compiled ahead of time for
    the others); on CPU only under ``TRITON_INTERPRET=1`` (slow: the CI path against the reference).
    """

    name = "triton"
    # above TileLang's: on the H200 (bench/results/flush_h200.md, KDA, 32 heads) it is faster with 1/16 of the heads
    # due, a ring of 16 in steady state (41.5 against 56.6 us at 256 rows; and at every batch measured, up to 512
    # rows), and whenever at most 2,048 programs are due; TileLang is faster only from 4,096 due programs (1-6 % in
    # that run, 4-9 % in earlier ones). It also takes any head count and keeps SPEC §4's wider domain (max|S|
    # 2^-40 .. 2^40; TileLang's fp16 state 2^-10 .. 2^14)
    priority = 20
    description = "Triton kernel, one program per (row, head); CUDA sm_80-120 (CPU under TRITON_INTERPRET=1)"
    requirements = Requirements(
        devices=("cuda", "cpu"),
        capabilities=SUPPORTED_CAPABILITIES,
        heads=None,
        head_dims=tuple((k, v) for k in SUPPORTED_HEAD_DIMS for v in SUPPORTED_HEAD_DIMS),
        rings=SUPPORTED_RINGS,
        ranks=SUPPORTED_RANKS,
        notes=(
            "sm_75 is not claimed: no bf16 tensor cores for the ring and column-sum products",
            "CPU runs only through the Triton interpreter (TRITON_INTERPRET=1), for tests",
        ),
    )
    max_iters = 2
    not_for_auto = {"cpu": "the interpreter is for tests: hundreds of times slower than the reference"}

    def available(self) -> tuple[bool, str]:
        try:
            import triton
        except ImportError as e:
            return False, f"triton is not installed ({e}); pip install 'leapquant[triton]'"
        if triton_release(triton.__version__) < MIN_TRITON:
            oldest = ".".join(map(str, MIN_TRITON))
            return False, (f"triton {triton.__version__} is older than {oldest}, the oldest release this backend is "
                           f"built and checked with; install triton>={oldest} with a torch that allows it")
        if torch.cuda.is_available() or _interpreting():
            return True, "ok"
        return False, "no CUDA device; on CPU the Triton backend runs only with TRITON_INTERPRET=1 set (tests)"

    def supports(self, pool: "Pool") -> tuple[bool, str]:
        ok, why = self.available()
        if not ok:
            return ok, why
        if pool.device.type == "cpu" and not _interpreting():
            return False, "pool is on the CPU; the Triton backend runs there only with TRITON_INTERPRET=1 set"
        if pool.device.type == "cuda" and _interpreting():
            return False, "TRITON_INTERPRET=1 is set: the interpreter cannot run on CUDA tensors at speed; unset it"
        if pool.device.type == "cuda" and capability(pool.device) < 80:
            return False, f"needs sm_80 or newer (bf16 tensor cores); this GPU is sm_{capability(pool.device)}"
        if not 1 <= pool.iters <= self.max_iters:
            return False, f"iters={pool.iters} not supported (1..{self.max_iters})"
        return self.requirements.check(pool)

    def flush(self, pool: "Pool", idx: torch.Tensor) -> None:
        from .kernel import flush_pool

        flush_pool(pool, idx)
