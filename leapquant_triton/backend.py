"""The Triton backend: availability and what it supports; each op's launch is in its host module (:mod:`.flush`,
:mod:`.step`, :mod:`.states`), imported when first called so that importing the backend does not import Triton."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from leapquant.backends import Backend, Requirements, capability
from leapquant.constants import SUPPORTED_HEAD_DIMS, SUPPORTED_RANKS, SUPPORTED_RINGS

from .targets import MIN_TRITON, SUPPORTED_CAPABILITIES, interpreting, step_kernels_note, triton_release

if TYPE_CHECKING:
    from leapquant.pool import Pool


class TritonBackend(Backend):
    """One Triton program per (row of ``idx``, head): the state is rebuilt, compressed and stored in registers.

    Any number of heads; head dims 64 / 128 (K and V independently); ring 8 / 16 / 32; rank 1-4; ITERS 1-2; both
    gates and both slot conventions. On CUDA sm_80, 86, 89, 90, 100 and 120 (run on sm_90, compiled ahead of time for
    the others); on CPU only under ``TRITON_INTERPRET=1`` (slow: the CI path against the reference).
    """

    name = "triton"
    # above TileLang's: faster in the steady state (1/16 of the heads due) and whenever at most 2,048 programs are due
    # (docs/DESIGN.md, "TileLang against Triton: where each wins"); it also takes any head count and keeps SPEC §4's
    # wider domain
    priority = 20
    @property
    def description(self) -> str:
        return ("Triton kernels, one program per (row, head); CUDA sm_80-120 (CPU under TRITON_INTERPRET=1). "
                + step_kernels_note())
    requirements = Requirements(
        devices=("cuda", "cpu"),
        capabilities=SUPPORTED_CAPABILITIES,
        heads=None,
        head_dims=tuple((k, v) for k in SUPPORTED_HEAD_DIMS for v in SUPPORTED_HEAD_DIMS),
        rings=SUPPORTED_RINGS,
        ranks=SUPPORTED_RANKS,
    )
    max_iters = 2
    partial_rings = True  # flush(..., force=True): the FORCE build of the flush kernels
    multi_token = True  # steps of T tokens per row: one launch, the checkpoint read once (SPEC §6.1)
    not_for_auto = {"cpu": "the interpreter checks the kernel; it is far slower than the reference"}

    def available(self) -> tuple[bool, str]:
        try:
            import triton
        except ImportError as e:
            return False, f"triton is not installed ({e}); pip install 'leapquant[triton]'"
        if triton_release(triton.__version__) < MIN_TRITON:
            oldest = ".".join(map(str, MIN_TRITON))
            return False, (f"triton {triton.__version__} is older than {oldest}, the oldest release this backend is "
                           f"built and checked with; install triton>={oldest} with a torch that allows it")
        if torch.cuda.is_available() or interpreting():
            return True, "ok"
        return False, ("no CUDA device; on a CPU the Triton backend runs through Triton's interpreter: set "
                       "TRITON_INTERPRET=1 before importing triton (correct, but far slower than the reference)")

    def supports(self, pool: "Pool") -> tuple[bool, str]:
        ok, why = self.available()
        if not ok:
            return ok, why
        if pool.device.type == "cpu" and not interpreting():
            return False, "pool is on the CPU; the Triton backend runs there only with TRITON_INTERPRET=1 set"
        if pool.device.type == "cuda" and interpreting():
            return False, "TRITON_INTERPRET=1 is set: the interpreter cannot run on CUDA tensors at speed; unset it"
        if pool.device.type == "cuda" and capability(pool.device) < 80:
            return False, f"needs sm_80 or newer (bf16 tensor cores); this GPU is sm_{capability(pool.device)}"
        if not 1 <= pool.iters <= self.max_iters:
            return False, f"iters={pool.iters} not supported (1..{self.max_iters})"
        return self.requirements.check(pool)

    def flush(self, pool: "Pool", idx: torch.Tensor, force: bool = False) -> None:
        from .flush import flush_pool

        flush_pool(pool, idx, force=force)

    def step(self, pool: "Pool", idx: torch.Tensor, q, k, v, g, beta, scale: float, use_qk_l2norm: bool,
             out: torch.Tensor) -> None:
        from .step import step_pool

        step_pool(pool, idx, q, k, v, g, beta, scale, use_qk_l2norm, out)

    def step_packed(self, pool: "Pool", idx: torch.Tensor, q, k, v, a, b, A_log, dt_bias, lower_bound: float | None,
                    beta_dtype: torch.dtype, scale: float, use_qk_l2norm: bool, out: torch.Tensor) -> None:
        """``leapquant.step_packed`` in one step launch (after the flush of the full rings): the gates computed from
        ``a``, ``b``, ``A_log``, ``dt_bias`` in the step kernel's prologue, beta rounded to ``beta_dtype``; the bytes
        of :meth:`packed_gates` then :meth:`step`."""
        from .step import packed_args, step_pool

        step_pool(pool, idx, q, k, v, a, b, scale, use_qk_l2norm, out,
                  packed=packed_args(A_log, dt_bias, lower_bound, beta_dtype))

    def packed_gates(self, pool: "Pool", a, b, A_log, dt_bias, lower_bound: float | None, g: torch.Tensor,
                     beta: torch.Tensor) -> None:
        """``leapquant.step_packed``'s gates into ``g`` and ``beta`` (:mod:`.gates`: a kernel launched before the
        step)."""
        from .gates import gates_pool

        gates_pool(pool, a, b, A_log, dt_bias, lower_bound, g, beta)

    def accept(self, pool: "Pool", idx: torch.Tensor, num_accepted: torch.Tensor) -> None:
        """:func:`leapquant.accept` (checked) in one kernel launch (:mod:`.accept`); in torch where the pool's
        tensors are not dense."""
        from .accept import accept_pool, dense

        if dense(pool):
            accept_pool(pool, idx, num_accepted)
        else:
            from leapquant.ops import accept_torch

            accept_torch(pool, idx, num_accepted)

    def copy_slots(self, pool: "Pool", src: torch.Tensor, dst: torch.Tensor) -> None:
        """``Pool.copy_slots`` (checked) in two kernel launches (:mod:`.copy`)."""
        from .copy import copy_slots_pool

        copy_slots_pool(pool, src, dst)

    def load_states(self, pool: "Pool", slots: torch.Tensor, states: torch.Tensor, state_v_first: bool) -> None:
        from .states import load_states_pool

        load_states_pool(pool, slots, states, state_v_first)

    def states(self, pool: "Pool", slots: torch.Tensor, out: torch.Tensor, state_v_first: bool) -> None:
        from .states import states_pool

        states_pool(pool, slots, out, state_v_first)
