"""The ``"tilelang"`` backend: the seed's warp-specialised kernel (``kernel.py``) driving a :class:`leapquant.Pool`.

Limits (the kernel is written for them): either layout (SPEC §2), 32 heads per slot, ``head_k = head_v = 128``,
ring 16, rank 1..4, sm_90 or sm_100, at most :data:`~leapquant_tilelang.kernel.DUE_LIST_MAX` due-list entries per CTA
(about 8,400 slots on 132 SMs). Anything else is refused by :meth:`TileLangBackend.supports` with the reason. It
flushes full rings only: ``flush(..., force=True)`` (partially filled rings, SPEC §2) is refused by the registry
(``partial_rings`` is False), since its kernel stages and sums all L ring entries by construction.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

import torch

from leapquant.backends import Backend, Requirements

if TYPE_CHECKING:
    from leapquant.pool import Pool


class TileLangBackend(Backend):
    name = "tilelang"
    priority = 10  # below Triton's (leapquant_triton.backend.TritonBackend.priority says why)
    description = (
        "TileLang, warp-specialised: one persistent CTA per SM, TMA producer warp + 3 consumer groups, mma.sync "
        "tensor-core products, the seed's numerics with an exact ring term in KDA's residual (sm_90 / sm_100; 32 "
        "heads, head dims 128, ring 16)"
    )
    requirements = Requirements(
        devices=("cuda",),
        capabilities=(90, 100),
        gates=("kda", "gdn"),
        heads=(32,),
        head_dims=((128, 128),),
        rings=(16,),
        ranks=(1, 2, 3, 4),
        # both: the layout's slot and head strides go into its TMA descriptors and direct stores, nothing else
        # changes (docs/DESIGN.md, "Compact layout")
        layouts=("engine", "compact"),
        # the seed's domain (SPEC §4): the state is staged fp16 in shared memory, which overflows above it and flushes
        # to zero below it (docs/DESIGN.md, "TileLang: what the port changed")
        magnitude=(2.0**-10, 2.0**14),
    )

    def __init__(self) -> None:
        # compiled kernels by their specialisation tuple; SMS counts per device index (read at first use)
        self._kernels: dict[tuple, object] = {}
        self._sms: dict[int, int] = {}
        self._placeholders: dict[torch.device, torch.Tensor] = {}

    def available(self) -> tuple[bool, str]:
        if importlib.util.find_spec("tilelang") is None:
            return False, "tilelang is not installed (pip install tilelang)"
        if not torch.cuda.is_available():
            return False, "no CUDA device"
        return True, "ok"

    def supports(self, pool: "Pool") -> tuple[bool, str]:
        ok, why = super().supports(pool)
        if not ok:
            return ok, why
        from .kernel import DUE_LIST_MAX, due_list_capacity

        sms = self._sm_count(pool.device)
        need = due_list_capacity(pool.num_slots, pool.heads, pool.first_slot, sms)
        if need > DUE_LIST_MAX:
            return False, (
                f"{pool.num_slots} slots x {pool.heads} heads need {need} due-list entries per CTA on {sms} SMs; "
                f"the shared memory holds {DUE_LIST_MAX}"
            )
        return True, "ok"

    def _sm_count(self, device: torch.device) -> int:
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index not in self._sms:
            self._sms[index] = torch.cuda.get_device_properties(index).multi_processor_count
        return self._sms[index]

    def kernel(self, pool: "Pool"):
        """The compiled kernel for ``pool`` (compiled on first use, then cached by its specialisation)."""
        from .kernel import flush_kernel

        g = pool.geometry
        # flush_kernel's positional arguments, task config then the SM count
        key = (g.num_slots, g.heads, g.head_k, g.head_v, g.ring, g.rank, g.gate, pool.first_slot, pool.iters,
               g.layout, self._sm_count(pool.device))
        kern = self._kernels.get(key)
        if kern is None:
            with torch.cuda.device(pool.device):
                kern = flush_kernel(*key)
            self._kernels[key] = kern
        return kern

    def _gbuf(self, pool: "Pool") -> torch.Tensor:
        if pool.gbuf is not None:
            # fp16 factors reinterpreted as bf16: the kernel's TMA target is a bf16 tile (bits read back as fp16)
            return pool.gbuf.view(torch.bfloat16)
        # GDN: the kernel's gbuf parameter is a [1, 1, 1, 1] placeholder it never touches
        t = self._placeholders.get(pool.device)
        if t is None:
            t = self._placeholders[pool.device] = torch.ones(1, 1, 1, 1, dtype=torch.bfloat16, device=pool.device)
        return t

    def flush(self, pool: "Pool", idx: torch.Tensor) -> None:
        """Flush the due programs of ``idx`` (int32 ``[N]`` on the pool's device) in place: one launch of ``SMS`` CTAs,
        no host synchronisation."""
        if idx.numel() == 0:
            return
        kern = self.kernel(pool)
        kern(pool.codes32, pool.s_k, pool.s_v, pool.s_kv, pool.kbuf, pool.ubuf, pool.w, pool.pcum, self._gbuf(pool),
             pool.hcnt, pool.uq, pool.q0, idx)
