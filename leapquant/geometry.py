"""The shape of a pool and where each view of ``raw`` lies (SPEC §2), in both layouts: pure arithmetic, no tensors
of its own, so that every other module can import it.

Region of (slot n, head h): fp32 word ``base + n * slot_stride + h * head_stride``, in either layout:
``"compact"`` (the default: ``head_stride`` = the checkpoint rounded up to 128 bytes, no spare head) or ``"engine"``
(the seed's: ``head_stride = V * K``, the room of an fp32 state, and one spare head per slot). By byte offset
inside a region, in both

    [0, V*K)                      int8 codes, row-major [V, K]
    [V*K, V*K + 4K)               fp32 s_k[K]
    [V*K + 4K, V*K + 4K + 4V)     fp32 s_v[V]
    [.., + 2R(K+V))               fp16 uq[R, K+V], row r = u_r[0:K] | q_r[0:V]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from .constants import BASE_WORDS
from .memory import checkpoint_bytes, compact_checkpoint_bytes

Gate = Literal["kda", "gdn"]
Convention = Literal["vllm", "sglang"]
Layout = Literal["engine", "compact"]
LAYOUTS = ("engine", "compact")


@dataclass(frozen=True)
class Geometry:
    """The shape of a pool: everything a kernel is specialised on."""

    num_slots: int
    heads: int
    head_k: int
    head_v: int
    ring: int
    rank: int
    gate: Gate
    layout: Layout = "compact"

    @property
    def head_stride(self) -> int:
        """fp32 words from one head's region to the next: ``V K`` (engine), the checkpoint rounded up to 128 bytes
        (compact)."""
        if self.layout == "compact":
            return compact_checkpoint_bytes(self.head_k, self.head_v, self.rank) // 4
        return self.head_v * self.head_k

    @property
    def slot_stride(self) -> int:
        # the engine layout keeps one spare head per slot, as in the seed; the compact one nothing between slots
        extra = 1 if self.layout == "engine" else 0
        return (self.heads + extra) * self.head_stride

    @property
    def raw_words(self) -> int:
        """fp32 words of ``raw``: the ``OFF`` prefix and every slot."""
        return self.num_slots * self.slot_stride + BASE_WORDS

    @property
    def checkpoint_bytes(self) -> int:
        return checkpoint_bytes(self.head_k, self.head_v, self.rank)


def view_layouts(geo: Geometry, raw_offset: int = 0) -> dict[str, tuple]:
    """Each view of ``raw`` (SPEC §2) as ``name -> (dtype, shape, strides, storage offset)``, offsets and strides in
    the view's elements, for a ``raw`` starting at fp32 element ``raw_offset`` of its storage."""
    NS, HV, K, V, R = geo.num_slots, geo.heads, geo.head_k, geo.head_v, geo.rank
    SS, HS = geo.slot_stride, geo.head_stride
    CW = V * K // 4  # the codes' words: the scales follow them in both layouts
    w0 = raw_offset + BASE_WORDS  # slot 0's region, in fp32 words of the storage
    uq = (torch.float16, (NS, HV, R, K + V), (2 * SS, 2 * HS, K + V, 1), 2 * (w0 + CW + K + V))
    return {
        "codes": (torch.int8, (NS, HV, V, K), (4 * SS, 4 * HS, K, 1), 4 * w0),
        "codes32": (torch.int32, (NS, HV, V, K // 4), (SS, HS, K // 4, 1), w0),
        "s_k": (torch.float32, (NS, HV, K), (SS, HS, 1), w0 + CW),
        "s_v": (torch.float32, (NS, HV, V), (SS, HS, 1), w0 + CW + K),
        "s_kv": (torch.float32, (NS, HV, K + V), (SS, HS, 1), w0 + CW),
        "uq": uq,
        "u": (torch.float16, (NS, HV, R, K), uq[2], uq[3]),
        "q": (torch.float16, (NS, HV, R, V), uq[2], uq[3] + K),
    }
