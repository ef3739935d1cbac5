"""The caller-owned slot pool, byte-exact to SPEC §2, and the step semantics of SPEC §6.

One flat fp32 buffer ``raw`` holds every (slot, head) checkpoint; the ring buffer, gates, weights and fill counters
are separate dense tensors. Every view below aliases ``raw`` (``codes``, ``codes32``, ``s_k``, ``s_v``, ``s_kv``,
``uq``, ``u``, ``q``), so a backend may write through whichever view suits it.

Region of (slot n, head h): fp32 word ``base + n * slot_stride + h * V * K``; by byte offset inside it

    [0, V*K)                      int8 codes, row-major [V, K]
    [V*K, V*K + 4K)               fp32 s_k[K]
    [V*K + 4K, V*K + 4K + 4V)     fp32 s_v[V]
    [.., + 2R(K+V))               fp16 uq[R, K+V], row r = u_r[0:K] | q_r[0:V]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Sequence

import torch

from . import reference
from .constants import BASE_WORDS, EPS

Gate = Literal["kda", "gdn"]
Convention = Literal["vllm", "sglang"]


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

    @property
    def region_words(self) -> int:
        return self.head_v * self.head_k

    @property
    def slot_stride(self) -> int:
        # one spare head per slot, as in the seed
        return (self.heads + 1) * self.region_words

    @property
    def checkpoint_bytes(self) -> int:
        K, V, R = self.head_k, self.head_v, self.rank
        return V * K + 4 * K + 4 * V + 2 * R * (K + V)


def start_matrix(head_v: int, rank: int) -> torch.Tensor:
    """The fixed start matrix ``Q0 [V, R]`` of the subspace iteration (fp32, orthonormal columns).

    Formula, identical on every machine: ``M[v, r] = h(v * 4 + r) / 2**32 - 1/2`` with the integer hash
    ``h(i) = ((i + 1) * 2654435761) mod 2**32`` (Knuth's multiplicative hash), for ``r < 4``; modified Gram-Schmidt in
    float64 over the columns in order; rounded to fp32; the first ``rank`` columns. Every step is an exactly rounded
    IEEE operation, so the bits do not depend on the platform, and ``Q0`` for rank r is the prefix of rank 4's.
    """
    if not 1 <= rank <= 4:
        raise ValueError(f"rank must be in 1..4, got {rank}")
    i = torch.arange(head_v * 4, dtype=torch.int64)
    h = ((i + 1) * 2654435761) % (1 << 32)
    m = (h.to(torch.float64) / float(1 << 32) - 0.5).reshape(head_v, 4)
    cols = []
    for r in range(4):
        c = m[:, r].clone()
        for prev in cols:
            c = c - (prev * c).sum() * prev
        cols.append(c / c.norm())
    return torch.stack(cols, dim=1)[:, :rank].to(torch.float32).contiguous()


class Pool:
    """Caller-owned state pool for ``num_slots`` sequence slots of ``heads`` heads each.

    Args:
        num_slots: NS, slots in the pool (including the null slot 0 under the vLLM convention).
        heads: HV, value heads per slot on this device (any positive number; the TileLang backend needs 32).
        head_k, head_v: K and V, the state is ``[V, K]`` per head (64 or 128).
        ring: L, ring-buffer entries between flushes (8, 16 or 32).
        rank: R, Compensator Tokens per head (1..4).
        gate: ``"kda"`` (per-key-channel decay, ``gbuf`` and ``pcum[K]``) or ``"gdn"`` (scalar gate, ``pcum[1]``).
        convention: ``"vllm"`` (slot 0 is the null slot, CUDA-graph padding is 0; real slots are ``1 <= idx < NS``)
            or ``"sglang"`` (padding is -1, slot 0 holds a sequence; real slots are ``0 <= idx < NS``).
        device: where every tensor lives.
        q0: the start matrix ``[V, R]`` fp32; default :func:`start_matrix`.
        iters: ITERS, rounds of subspace iteration per flush (1 is the seed's; 2 buys accuracy on slowly decaying
            spectra at twice the products).

    A new pool holds zero states with empty rings: codes 0, ``s_k = s_v = EPS``, factors 0, ``w = 0``,
    ``gbuf = 1``, ``pcum = 0`` (GDN: 1), ``hcnt = 0``.
    """

    def __init__(
        self,
        num_slots: int,
        heads: int = 32,
        head_k: int = 128,
        head_v: int = 128,
        ring: int = 16,
        rank: int = 4,
        gate: Gate = "kda",
        convention: Convention = "vllm",
        device: torch.device | str = "cpu",
        q0: torch.Tensor | None = None,
        iters: int = 1,
    ):
        from .checks import check_geometry, check_iters

        geo = Geometry(num_slots, heads, head_k, head_v, ring, rank, gate)
        check_geometry(geo, convention)
        check_iters(iters)
        NS, HV, K, V, L = num_slots, heads, head_k, head_v, ring
        device = torch.device(device)
        raw = torch.zeros(NS * geo.slot_stride + BASE_WORDS, dtype=torch.float32, device=device)
        kbuf = torch.zeros(NS, HV, L, K, dtype=torch.bfloat16, device=device)
        ubuf = torch.zeros(NS, HV, L, V, dtype=torch.bfloat16, device=device)
        w = torch.zeros(NS, HV, L, dtype=torch.float32, device=device)
        if gate == "kda":
            pcum = torch.zeros(NS, HV, K, dtype=torch.float32, device=device)
            gbuf = torch.ones(NS, HV, L, K, dtype=torch.float16, device=device)
        else:
            pcum = torch.ones(NS, HV, 1, dtype=torch.float32, device=device)
            gbuf = None
        hcnt = torch.zeros(NS, HV, dtype=torch.int32, device=device)
        if q0 is None:
            q0 = start_matrix(V, rank)
        q0 = q0.to(device=device, dtype=torch.float32).contiguous()
        self._bind(geo, convention, iters, raw, kbuf, ubuf, w, pcum, gbuf, hcnt, q0)
        self.s_kv.fill_(EPS)

    @classmethod
    def from_tensors(cls, raw, kbuf, ubuf, w, pcum, gbuf, hcnt, q0, *, num_slots, heads, head_k, head_v, ring, rank,
                     gate, convention="vllm", iters=1) -> "Pool":
        """A pool over existing tensors (no copy): how the custom op rebuilds its argument. Views of ``raw`` are
        made afresh; the caller guarantees the shapes (``flush(check=True)`` has checked them)."""
        pool = cls.__new__(cls)
        geo = Geometry(num_slots, heads, head_k, head_v, ring, rank, gate)
        pool._bind(geo, convention, iters, raw, kbuf, ubuf, w, pcum, gbuf, hcnt, q0)
        return pool

    def _bind(self, geo, convention, iters, raw, kbuf, ubuf, w, pcum, gbuf, hcnt, q0) -> None:
        self.geometry = geo
        self.convention: Convention = convention
        self.iters = iters
        NS, HV, K, V, R = geo.num_slots, geo.heads, geo.head_k, geo.head_v, geo.rank
        SS, OFF, VK = geo.slot_stride, BASE_WORDS, geo.region_words
        self.raw = raw
        st = raw.untyped_storage()

        def view(dtype, shape, strides, offset):
            return torch.empty(0, dtype=dtype, device=raw.device).set_(st, offset, shape, strides)

        self.codes = view(torch.int8, (NS, HV, V, K), (4 * SS, 4 * VK, K, 1), 4 * OFF)
        self.codes32 = view(torch.int32, (NS, HV, V, K // 4), (SS, VK, K // 4, 1), OFF)
        self.s_k = view(torch.float32, (NS, HV, K), (SS, VK, 1), OFF + VK // 4)
        self.s_v = view(torch.float32, (NS, HV, V), (SS, VK, 1), OFF + VK // 4 + K)
        self.s_kv = view(torch.float32, (NS, HV, K + V), (SS, VK, 1), OFF + VK // 4)
        self.uq = view(torch.float16, (NS, HV, R, K + V), (2 * SS, 2 * VK, K + V, 1), 2 * (OFF + VK // 4 + K + V))
        self.u = self.uq[..., :K]
        self.q = self.uq[..., K:]
        self.kbuf, self.ubuf, self.w, self.pcum, self.gbuf, self.hcnt, self.q0 = kbuf, ubuf, w, pcum, gbuf, hcnt, q0

    # geometry shorthands, named as in the SPEC
    num_slots = property(lambda self: self.geometry.num_slots)
    heads = property(lambda self: self.geometry.heads)
    head_k = property(lambda self: self.geometry.head_k)
    head_v = property(lambda self: self.geometry.head_v)
    ring = property(lambda self: self.geometry.ring)
    rank = property(lambda self: self.geometry.rank)
    gate = property(lambda self: self.geometry.gate)
    slot_stride = property(lambda self: self.geometry.slot_stride)
    base = BASE_WORDS

    @property
    def device(self) -> torch.device:
        return self.raw.device

    @property
    def first_slot(self) -> int:
        """The smallest real slot: 1 under the vLLM convention, 0 under SGLang's."""
        return 1 if self.convention == "vllm" else 0

    def __repr__(self) -> str:
        g = self.geometry
        return (
            f"Pool(num_slots={g.num_slots}, heads={g.heads}, head_k={g.head_k}, head_v={g.head_v}, ring={g.ring}, "
            f"rank={g.rank}, gate={g.gate!r}, convention={self.convention!r}, iters={self.iters}, "
            f"device={str(self.device)!r})"
        )

    def _slots(self, slots: Sequence[int] | torch.Tensor) -> torch.Tensor:
        s = torch.as_tensor(slots, dtype=torch.long, device=self.device).reshape(-1)
        if s.numel() and (int(s.min()) < 0 or int(s.max()) >= self.num_slots):
            raise ValueError(f"slots must lie in [0, {self.num_slots}), got {s.tolist()}")
        return s

    def checkpoint(self, slots) -> dict[str, torch.Tensor]:
        """The checkpoint and ring of ``slots`` gathered into fresh dense tensors, keyed by the names of ``run``."""
        return self._gather(self._slots(slots))

    def _gather(self, s: torch.Tensor) -> dict[str, torch.Tensor]:
        # no range check (a host sync): the reference backend calls this under CUDA-graph capture
        out = {
            "codes": self.codes[s],
            "s_k": self.s_k[s],
            "s_v": self.s_v[s],
            "u": self.u[s],
            "q": self.q[s],
            "kbuf": self.kbuf[s],
            "ubuf": self.ubuf[s],
            "w": self.w[s],
            "pcum": self.pcum[s],
            "gbuf": self.gbuf[s] if self.gbuf is not None else None,
        }
        return out

    def states(self, slots, *, out: torch.Tensor | None = None, backend: str = "auto", check: bool = True,
               state_v_first: bool = True) -> torch.Tensor:
        """The rebuilt fp32 states of ``slots`` (SPEC §3 step 4, §5), checkpoint plus ring as it stands:
        ``[len(slots), HV, V, K]``, or FLA's ``[len(slots), HV, K, V]`` with ``state_v_first=False``; written into
        ``out`` if given (each head dense), else a new tensor. ``backend`` (``"auto"``: Triton on CUDA, else the
        reference) and ``check`` (``False``: metadata only, no host sync) as for :func:`leapquant.flush`."""
        from . import states as _states

        return _states.states(self, slots, out, backend=backend, check=check, state_v_first=state_v_first)

    def _states_reference(self, s: torch.Tensor) -> torch.Tensor:
        """The reference path of :meth:`states`, V-first, for validated slots ``s``."""
        c = self._gather(s)
        return reference.rebuild(**c, gate=self.gate)

    def load_states(self, slots, states: torch.Tensor, *, backend: str = "auto", check: bool = True,
                    state_v_first: bool = True) -> None:
        """Compress fp32 ``states`` (``[len(slots), HV, V, K]``, or FLA's ``[len(slots), HV, K, V]`` with
        ``state_v_first=False``) into those slots' checkpoints (SPEC §3 steps 5-10, §5) and empty their rings
        (``hcnt = 0``). ``backend`` and ``check`` as for :meth:`states`."""
        from . import states as _states

        _states.load_states(self, slots, states, backend=backend, check=check, state_v_first=state_v_first)

    def _load_states_reference(self, s: torch.Tensor, S: torch.Tensor) -> None:
        """The reference path of :meth:`load_states`, for validated slots ``s`` and fp32 V-first states ``S``."""
        codes, s_k, s_v, u, q = reference.compress(S, self.q0, iters=self.iters)
        self.codes[s] = codes
        self.s_k[s] = s_k
        self.s_v[s] = s_v
        self.u[s] = u
        self.q[s] = q
        self._reset_rings(s)
        self.hcnt[s] = 0

    def _reset_rings(self, s: torch.Tensor) -> None:
        self.w[s] = 0.0
        if self.gate == "kda":
            self.pcum[s] = 0.0
            self.gbuf[s] = 1.0
        else:
            self.pcum[s] = 1.0

    def append(self, slots, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor) -> None:
        """One token per slot into the ring (SPEC §6 steps 1-4): the decode step's ring update, in plain torch.

        Args:
            slots: ``[B]`` distinct slots.
            k: keys ``[B, HV, K]``; v: values ``[B, HV, V]``; beta: ``[B, HV]`` write strengths.
            g: log-gates, ``[B, HV, K]`` for KDA (decay ``exp(g)`` per key channel) or ``[B, HV]`` for GDN (scalar
                decay ``a = exp(g)``).

        A slot whose ``hcnt == L`` is taken as flushed (its next entry is 0): unlike :func:`leapquant.step`, this does
        not flush, so flush due slots before appending.
        """
        s = self._slots(slots)
        B, HV, K, V = s.numel(), self.heads, self.head_k, self.head_v
        dev = self.device
        k = k.to(dev, torch.float32)
        v = v.to(dev, torch.float32)
        g = g.to(dev, torch.float32)
        beta = beta.to(dev, torch.float32)
        if k.shape != (B, HV, K) or v.shape != (B, HV, V) or beta.shape != (B, HV):
            raise ValueError("append: k, v, beta must be [B, HV, K], [B, HV, V], [B, HV]")
        want_g = (B, HV, K) if self.gate == "kda" else (B, HV)
        if g.shape != want_g:
            raise ValueError(f"append: g must be {list(want_g)} for gate {self.gate!r}, got {list(g.shape)}")
        c = self.checkpoint(s)
        c["hcnt"] = self.hcnt[s]
        # the decode step's ring update (its output is not needed here)
        ring, _ = reference.step_rows(c, k, k, v, g, beta, gate=self.gate, scale=1.0)
        for name, new in ring.items():
            getattr(self, name)[s] = new

    def checkpoint_mask(self, slots: torch.Tensor, heads: torch.Tensor) -> torch.Tensor:
        """bool over ``raw``'s bytes, on the pool's device: True on the checkpoint bytes of the programs
        ``(slots[i], heads[i])``, the only bytes of ``raw`` a flush of those programs may write (SPEC §2)."""
        g = self.geometry
        mask = torch.zeros(self.raw.numel() * 4, dtype=torch.bool, device=self.device)
        starts = 4 * (self.base + slots.long().to(self.device) * g.slot_stride
                      + heads.long().to(self.device) * g.region_words)
        span = torch.arange(g.checkpoint_bytes, device=self.device)
        mask[(starts[:, None] + span[None, :]).reshape(-1)] = True
        return mask

    def due(self, idx: torch.Tensor) -> torch.Tensor:
        """``[N, HV]`` bool: which programs a flush over ``idx`` would take (SPEC §2 due rule)."""
        idx = idx.to(self.device).long()
        real = (idx >= self.first_slot) & (idx < self.num_slots)
        safe = torch.where(real, idx, torch.zeros_like(idx))
        return real[:, None] & (self.hcnt[safe] == self.ring)
