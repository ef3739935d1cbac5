"""Bytes per sequence of each way to keep a recurrent state, counted from the formats (SPEC §1, §2), and how many
sequences fit a memory budget: what ``python -m leapquant info`` prints and README's "Memory per sequence" states.

Per (sequence, head), at head dims K, V, ring L, rank R:

* **fp32** / **bf16** state: ``4 V K`` / ``2 V K``;
* the **ring** (both layouts): ``kbuf`` 2 L K, ``ubuf`` 2 L V, ``w`` 4 L, ``pcum`` 4 K (KDA) or 4 (GDN), ``gbuf`` 2 L K
  (KDA only), ``hcnt`` 4;
* the **checkpoint**: ``V K`` codes + ``4 K`` s_k + ``4 V`` s_v + ``2 R (K + V)`` factors;
* **LeapQuant, engine layout** (SPEC §2, ``Pool(..., layout="engine")``): a region of ``4 V K`` per head plus one
  spare region per slot, ``(HV + 1) 4 V K`` per sequence, plus the rings;
* **LeapQuant, compact layout** (SPEC §2, the default ``Pool``): the checkpoint rounded up to a multiple of 128 bytes
  per head, plus the rings.

The pool's fixed prefix (``OFF`` words, 48 KiB per pool) is not per sequence and is left out.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 1 << 30
COMPACT_ALIGN = 128  # bytes: each compact checkpoint starts on a 128-byte boundary


def checkpoint_bytes(head_k: int, head_v: int, rank: int) -> int:
    K, V, R = head_k, head_v, rank
    return V * K + 4 * K + 4 * V + 2 * R * (K + V)


def ring_bytes(head_k: int, head_v: int, ring: int, gate: str) -> int:
    """One head's ring tensors and fill counter (SPEC §2's table)."""
    K, V, L = head_k, head_v, ring
    kda = gate == "kda"
    return 2 * L * K + 2 * L * V + 4 * L + (4 * K if kda else 4) + (2 * L * K if kda else 0) + 4


def compact_checkpoint_bytes(head_k: int, head_v: int, rank: int) -> int:
    c = checkpoint_bytes(head_k, head_v, rank)
    return -(-c // COMPACT_ALIGN) * COMPACT_ALIGN


@dataclass(frozen=True)
class Format:
    name: str
    per_sequence: int  # bytes

    def per_head(self, heads: int) -> float:
        return self.per_sequence / heads

    def sequences_in(self, gib: float) -> int:
        return int(gib * GIB // self.per_sequence)


def formats(heads: int = 32, head_k: int = 128, head_v: int = 128, ring: int = 16, rank: int = 4,
            gate: str = "kda") -> list[Format]:
    """fp32, bf16, LeapQuant engine layout and LeapQuant compact layout, bytes per sequence of ``heads`` heads."""
    HV, VK = heads, head_v * head_k
    rings = HV * ring_bytes(head_k, head_v, ring, gate)
    return [
        Format("fp32 state", HV * 4 * VK),
        Format("bf16 state", HV * 2 * VK),
        Format("LeapQuant, engine layout", (HV + 1) * 4 * VK + rings),
        Format("LeapQuant, compact layout", HV * compact_checkpoint_bytes(head_k, head_v, rank) + rings),
    ]


def table(gib: float = 80.0, **geometry) -> list[str]:
    """The lines ``python -m leapquant info`` prints: per head, per sequence, sequences in ``gib`` GiB."""
    g = {**dict(heads=32, head_k=128, head_v=128, ring=16, rank=4, gate="kda"), **geometry}
    fs = formats(**g)
    lines = [f"memory per sequence: {g['gate'].upper()}, {g['heads']} heads of K = {g['head_k']}, V = {g['head_v']}, "
             f"ring {g['ring']}, rank {g['rank']} (checkpoint {checkpoint_bytes(g['head_k'], g['head_v'], g['rank']):,}"
             f" B, compact {compact_checkpoint_bytes(g['head_k'], g['head_v'], g['rank']):,} B; ring "
             f"{ring_bytes(g['head_k'], g['head_v'], g['ring'], g['gate']):,} B per head)",
             f"{'format':<28} {'per head':>12} {'per sequence':>14} {f'sequences in {gib:g} GiB':>22}"]
    for f in fs:
        lines.append(f"{f.name:<28} {f.per_head(g['heads']):>12,.0f} {f.per_sequence:>14,} {f.sequences_in(gib):>22,}")
    return lines
