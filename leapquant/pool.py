"""The caller-owned slot pool, byte-exact to SPEC §2, and the step semantics of SPEC §6.

One flat fp32 buffer ``raw`` holds every (slot, head) checkpoint; the ring buffer, gates, weights and fill counters
are separate dense tensors. Every view below aliases ``raw`` (``codes``, ``codes32``, ``s_k``, ``s_v``, ``s_kv``,
``uq``, ``u``, ``q``), so a backend may write through whichever view suits it.

Where each view lies in either layout is :mod:`leapquant.geometry`'s.
"""

from __future__ import annotations

import os
from typing import Sequence

import torch

from . import formulas
from .checks import (POOL_BASE, check_append, check_copy_slots, check_device, check_geometry, check_in_storage,
                     check_iters, check_load_apart, check_pool, check_pool_tensors, check_slots, check_state_tensor,
                     check_state_values, check_states_out, check_states_out_apart, slot_list, spans, state_shape)
from .constants import BASE_WORDS, EPS
from .geometry import Convention, Gate, Geometry, Layout, view_layouts
from .memory import ring_bytes
from .registry import launch, resolve


def _restore(tensors: dict, geometry: dict, convention: str, iters: int) -> "Pool":
    """What a pickled :class:`Pool` is rebuilt by: the views of ``raw`` made afresh over the loaded tensors (checked
    by :meth:`Pool.from_tensors`, like any other tensors). ``geometry`` carries the layout (a pickle written before
    there were two has none: the engine layout, then the only one)."""
    return Pool.from_tensors(**tensors, **{"layout": "engine", **geometry}, convention=convention, iters=iters)


# torch.load's default weights_only=True may rebuild a pool: _restore takes only tensors, ints and strings, and checks
# them before it builds anything
if hasattr(torch.serialization, "add_safe_globals"):
    torch.serialization.add_safe_globals([_restore])


def pool_bytes(geo: Geometry) -> int:
    """Bytes a pool of geometry ``geo`` allocates: ``raw`` (checkpoints), the rings with ``hcnt``, and ``q0``."""
    per_head = ring_bytes(geo.head_k, geo.head_v, geo.ring, geo.gate)
    return 4 * geo.raw_words + geo.num_slots * geo.heads * per_head + 4 * geo.head_v * geo.rank


def _device_memory(device: torch.device) -> int | None:
    """The memory of ``device`` in bytes where it is known without allocating (a GPU's total, the host's physical
    memory), else None."""
    try:
        if device.type == "cuda":
            return torch.cuda.get_device_properties(device if device.index is not None else
                                                    torch.cuda.current_device()).total_memory
        if device.type == "cpu":
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError, RuntimeError):
        pass
    return None


def _without_sync(pool: "Pool") -> bool:
    """Whether the pool's own torch operations (:meth:`Pool.copy_slots`) must run without host synchronisation: on
    CUDA, where ``check=False`` promises it (CUDA graphs); on the CPU a host read costs nothing."""
    return pool.device.type != "cpu"


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


class History:
    """What a step of T tokens per row keeps so that :func:`leapquant.accept` can take back the tokens a verifier
    rejects (SPEC §6.1): per (slot, head) the fill count after the call's flush (``start``, int32 ``[NS, HV]``), the
    call's T (``count``), and ``pcum`` and ``w`` after each of its first 0 .. T tokens (``pcum [NS, HV, T + 1, K or
    1]``, ``w [NS, HV, T + 1, L]``, fp32). Everything else a rejected token wrote lies past the fill count that
    :func:`leapquant.accept` sets, where nothing reads it."""

    def __init__(self, pool: "Pool", max_tokens: int):
        NS, HV, dev = pool.num_slots, pool.heads, pool.device
        self.max_tokens = max_tokens
        self.start = torch.zeros(NS, HV, dtype=torch.int32, device=dev)
        self.count = torch.zeros(NS, HV, dtype=torch.int32, device=dev)
        self.pcum = pool.pcum[:, :, None].repeat(1, 1, max_tokens + 1, 1)
        self.w = pool.w[:, :, None].repeat(1, 1, max_tokens + 1, 1)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.start, self.count, self.pcum, self.w))

    def tensors(self) -> tuple:
        """``(start, count, pcum, w)``, the order the custom ops and :meth:`from_tensors` take them in."""
        return self.start, self.count, self.pcum, self.w

    @classmethod
    def from_tensors(cls, pool: "Pool", start, count, pcum, w) -> "History":
        """A history of ``pool`` over existing tensors (no copy), as the custom ops rebuild one: each tensor's type,
        dtype, shape, device and contiguity checked against the pool (no synchronisation), else a ValueError or
        TypeError naming it."""
        NS, HV, L = pool.num_slots, pool.heads, pool.ring
        if not isinstance(pcum, torch.Tensor) or pcum.dim() != 4:
            raise ValueError(f"the history's pcum must be a 4-D tensor [NS, HV, T + 1, {pool.pcum.shape[-1]}], got "
                             f"{type(pcum).__name__} {list(getattr(pcum, 'shape', []))}")
        T1 = pcum.shape[2]
        if not 2 <= T1 - 1 <= L // 2:
            raise ValueError(f"the history's pcum keeps T + 1 = {T1} rows; T must lie in 2..L/2 = {L // 2}")
        want = {"start": (start, torch.int32, (NS, HV)), "count": (count, torch.int32, (NS, HV)),
                "pcum": (pcum, torch.float32, (NS, HV, T1, pool.pcum.shape[-1])),
                "w": (w, torch.float32, (NS, HV, T1, L))}
        for name, (t, dtype, shape) in want.items():
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"the history's {name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dtype != dtype or tuple(t.shape) != shape or t.device != pool.device or not t.is_contiguous():
                raise ValueError(f"the history's {name} must be a contiguous {dtype} tensor {list(shape)} on "
                                 f"{pool.device}, got {t.dtype} {list(t.shape)} on {t.device}"
                                 f"{'' if t.is_contiguous() else ', not contiguous'}")
        hist = cls.__new__(cls)
        hist.max_tokens = T1 - 1
        hist.start, hist.count, hist.pcum, hist.w = start, count, pcum, w
        return hist


def _traced_slots(slots, name: str, check: bool) -> torch.Tensor:
    """Slots as the ops on slots take them while ``torch.compile`` traces: a tensor as it is (the op checks it when
    the graph runs); a sequence of ints (``check`` only, as in eager code) as an int64 tensor on the CPU, its items
    checked now (:func:`.checks.slot_list`: a float or a bool is refused, not cast)."""
    if isinstance(slots, torch.Tensor):
        return slots
    if not check:
        raise TypeError(f"{name} must be a torch.Tensor with check=False, got {type(slots).__name__}")
    return torch.tensor(slot_list(slots, name), dtype=torch.long)


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
        layout: how ``raw`` holds the checkpoints (SPEC §2): ``"compact"`` (the default: each checkpoint rounded up
            to 128 bytes, back to back) or ``"engine"`` (the seed's, an fp32 state's room per head and a spare head per
            slot: about 3.5x more ``raw`` at the defaults, for engines and kernels that address it). Every backend
            takes both.
        max_tokens: the most tokens per row a step will take (speculative decoding, SPEC §6.1; 1..L/2). Above 1 the
            pool keeps a :class:`History` so that :func:`leapquant.accept` can take rejected tokens back.

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
        layout: Layout = "compact",
        max_tokens: int = 1,
    ):
        geo = Geometry(num_slots, heads, head_k, head_v, ring, rank, gate, layout)
        check_geometry(geo, convention)
        check_iters(iters)
        NS, HV, K, V, L = num_slots, heads, head_k, head_v, ring
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or not 1 <= max_tokens <= L // 2:
            raise ValueError(f"max_tokens must be an int in 1..L/2 = {L // 2} (tokens per row of a speculative "
                             f"step, SPEC §6.1), got {max_tokens!r}")
        device = check_device(device)
        need = pool_bytes(geo)
        have = _device_memory(device)
        if have is not None and need > have:
            raise ValueError(f"num_slots={NS} needs a pool of {need:,} bytes ({need / 2**30:.1f} GiB), more than "
                             f"{device}'s {have:,} bytes of memory")
        try:
            raw = torch.zeros(geo.raw_words, dtype=torch.float32, device=device)
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
        except (RuntimeError, MemoryError) as e:  # torch.OutOfMemoryError is a RuntimeError
            raise ValueError(f"num_slots={NS} needs a pool of {need:,} bytes ({need / 2**30:.1f} GiB), which "
                             f"{device} could not allocate: {e}") from e
        if q0 is None:
            q0 = start_matrix(V, rank)
        if not isinstance(q0, torch.Tensor):
            raise TypeError(f"q0 must be a torch.Tensor, got {type(q0).__name__}")
        # a copy of the caller's matrix, never its autograd history (a flush would record one in the pool)
        q0 = q0.detach().to(device=device, dtype=torch.float32).contiguous()
        self._bind(geo, convention, iters, raw, kbuf, ubuf, w, pcum, gbuf, hcnt, q0)
        self.s_kv.fill_(EPS)
        # the history accept() needs, only where steps of several tokens are asked for
        self.history = History(self, max_tokens) if max_tokens > 1 else None
        self.check_layout()  # q0 came from the caller

    @classmethod
    def from_tensors(cls, raw, kbuf, ubuf, w, pcum, gbuf, hcnt, q0, *, num_slots, heads, head_k, head_v, ring, rank,
                     gate, convention="vllm", iters=1, layout="compact") -> "Pool":
        """A pool over existing tensors (no copy): how the custom op and unpickling rebuild one. Views of ``raw`` are
        made afresh, in ``layout``; ``raw`` must hold exactly that layout's words (``Geometry.raw_words``). Every
        tensor's metadata is checked first (no synchronisation): a wrong dtype, shape, device, stride, alignment, a
        storage too short, or two tensors sharing bytes raise a ValueError or TypeError naming it; the caller's
        storage is never resized."""
        pool = cls.__new__(cls)
        geo = Geometry(num_slots, heads, head_k, head_v, ring, rank, gate, layout)
        check_geometry(geo, convention)
        check_iters(iters)
        tensors = dict(zip(POOL_BASE, (raw, kbuf, ubuf, w, pcum, gbuf, hcnt, q0)))
        check_pool_tensors(geo, tensors)  # before the views are set up: set_ would grow a storage too short
        pool._bind(geo, convention, iters, raw, kbuf, ubuf, w, pcum, gbuf, hcnt, q0)
        object.__setattr__(pool, "_checked", True)  # the views were just made to the layout
        return pool

    def _bind(self, geo, convention, iters, raw, kbuf, ubuf, w, pcum, gbuf, hcnt, q0) -> None:
        self.geometry = geo
        self.convention: Convention = convention
        self.iters = iters
        self.raw = raw
        st = raw.untyped_storage()
        for name, (dtype, shape, strides, offset) in view_layouts(geo, raw.storage_offset()).items():
            setattr(self, name, torch.empty(0, dtype=dtype, device=raw.device).set_(st, offset, shape, strides))
        self.kbuf, self.ubuf, self.w, self.pcum, self.gbuf, self.hcnt, self.q0 = kbuf, ubuf, w, pcum, gbuf, hcnt, q0
        self.history = None

    def __setattr__(self, name, value) -> None:
        # a replaced tensor (or geometry) is checked again before the next launch (check_layout)
        if not name.startswith("_"):
            object.__setattr__(self, "_checked", False)
            object.__setattr__(self, "_spans", None)
        object.__setattr__(self, name, value)

    def check_layout(self, force: bool = False) -> None:
        """Check the metadata of every tensor against the geometry (:func:`.checks.check_pool`: dtypes, shapes,
        strides, devices, storage, aliasing; no synchronisation), unless it passed and no attribute was assigned
        since (a flag read: the full check costs tens of microseconds of host time on the hot path) or ``force``."""
        if force or not getattr(self, "_checked", False):
            check_pool(self)
            object.__setattr__(self, "_checked", True)
            object.__setattr__(self, "_spans", None)  # the tensors' address ranges, taken again when needed

    def tensor_spans(self) -> tuple:
        """The address ranges of the pool's base tensors (:func:`.checks.spans`, named ``pool.raw`` ...), what the
        tensors a call writes or reads while it writes the pool must stay clear of; computed once after the metadata
        was checked (:meth:`check_layout`) and kept until an attribute is assigned."""
        sp = getattr(self, "_spans", None)
        if sp is None:
            sp = spans({n: getattr(self, n) for n in POOL_BASE}, prefix="pool.")
            object.__setattr__(self, "_spans", sp)
        return sp

    def __reduce__(self):
        """Pickling and ``torch.save``: the base tensors and the geometry; loading rebuilds the pool through
        :meth:`from_tensors`, so its views alias the loaded ``raw`` again (a pickled view would be a detached copy)."""
        g = self.geometry
        geometry = dict(num_slots=g.num_slots, heads=g.heads, head_k=g.head_k, head_v=g.head_v, ring=g.ring,
                        rank=g.rank, gate=g.gate, layout=g.layout)
        return _restore, ({n: getattr(self, n) for n in POOL_BASE}, geometry, self.convention, self.iters)

    # geometry shorthands, named as in the SPEC
    num_slots = property(lambda self: self.geometry.num_slots)
    heads = property(lambda self: self.geometry.heads)
    head_k = property(lambda self: self.geometry.head_k)
    head_v = property(lambda self: self.geometry.head_v)
    ring = property(lambda self: self.geometry.ring)
    rank = property(lambda self: self.geometry.rank)
    gate = property(lambda self: self.geometry.gate)
    layout = property(lambda self: self.geometry.layout)
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
            f"layout={g.layout!r}, device={str(self.device)!r})"
        )

    def op_args(self) -> tuple:
        """The pool's tensors (:data:`.checks.POOL_BASE`) and geometry, as the ``torch.ops.leapquant`` ops take them
        (those of a flush or step with ``idx`` after the tensors)."""
        g = self.geometry
        return (self.raw, self.kbuf, self.ubuf, self.w, self.pcum, self.gbuf, self.hcnt, self.q0,
                g.num_slots, g.heads, g.head_k, g.head_v, g.ring, g.rank, g.gate, self.convention, self.iters)

    def checkpoint(self, slots) -> dict[str, torch.Tensor]:
        """The checkpoint and ring of ``slots`` (checked: in range) gathered into fresh dense tensors, keyed by the
        names of ``run``."""
        return self.gather(check_slots(self, slots))

    def gather(self, s: torch.Tensor) -> dict[str, torch.Tensor]:
        """:meth:`checkpoint` for slots ``s`` (an integer tensor on the pool's device) taken as they are: no range
        check, so no host synchronisation (the reference backend gathers under CUDA-graph capture)."""
        names = ("codes", "s_k", "s_v", "u", "q", "kbuf", "ubuf", "w", "pcum")
        out = {n: getattr(self, n)[s] for n in names}
        out["gbuf"] = self.gbuf[s] if self.gbuf is not None else None
        return out

    def states(self, slots, *, out: torch.Tensor | None = None, backend: str = "auto", check: bool = True,
               state_v_first: bool = True) -> torch.Tensor:
        """The rebuilt fp32 states of ``slots`` (SPEC §3 step 4, §5), checkpoint plus ring as it stands:
        ``[len(slots), HV, V, K]``, or FLA's ``[len(slots), HV, K, V]`` with ``state_v_first=False``; written into
        ``out`` if given (each head dense), else a new tensor. ``backend`` (``"auto"``: Triton on CUDA, else the
        reference) and ``check`` (``False``: metadata only, no host sync) as for :func:`leapquant.flush`. Under
        ``torch.compile`` the call is the op ``leapquant::states``, whose checks run when the graph runs."""
        if torch.compiler.is_compiling():
            s = _traced_slots(slots, "slots", check)
            if out is None:
                out = torch.empty(state_shape(self, s.numel(), state_v_first), dtype=torch.float32,
                                  device=self.device)
            torch.ops.leapquant.states(*self.op_args(), s, out, bool(state_v_first), backend, check=bool(check),
                                       layout=self.layout)
            return out
        self.check_layout(force=check)
        s = check_slots(self, slots, check=check)
        if out is None:
            out = torch.empty(state_shape(self, s.numel(), state_v_first), dtype=torch.float32, device=self.device)
        else:
            check_states_out(self, out, s.numel(), state_v_first)
            check_states_out_apart(self, out, s)
        b = resolve(backend, self, "states")
        if s.numel():
            launch(self, b.states, s, out, bool(state_v_first))
        return out

    def load_states(self, slots, states: torch.Tensor, *, backend: str = "auto", check: bool = True,
                    state_v_first: bool = True) -> None:
        """Compress fp32 ``states`` (``[len(slots), HV, V, K]``, or FLA's ``[len(slots), HV, K, V]`` with
        ``state_v_first=False``) into those slots' checkpoints (SPEC §3 steps 5-10, §5) and empty their rings
        (``hcnt = 0``). ``backend`` and ``check`` as for :meth:`states`; ``check=True`` also refuses a slot named
        twice, non-finite states and ``max|S| > 2^64`` (:func:`.checks.check_state_values`). Under ``torch.compile``
        the call is the op ``leapquant::load_states``, whose checks run when the graph runs."""
        if torch.compiler.is_compiling():
            if not isinstance(states, torch.Tensor):
                raise TypeError(f"states must be a torch.Tensor, got {type(states).__name__}")
            torch.ops.leapquant.load_states(*self.op_args(), _traced_slots(slots, "slots", check), states,
                                            bool(state_v_first), backend, check=bool(check), layout=self.layout)
            return
        self.check_layout(force=check)
        if isinstance(states, torch.Tensor):
            check_in_storage(states, "states")  # before anything reads it
        s = check_slots(self, slots, distinct=True, check=check)
        S = check_state_tensor(self, states, s.numel(), state_v_first, "states", check)
        check_load_apart(self, S, s)
        if check:
            check_state_values(states)
        b = resolve(backend, self, "states")
        if s.numel():
            launch(self, b.load_states, s, S, bool(state_v_first))

    def copy_slots(self, src, dst, *, check: bool = True, backend: str = "auto") -> None:
        """Copy slot ``src[i]`` into slot ``dst[i]`` for every ``i`` (SPEC §5.3): every head's checkpoint (its
        ``checkpoint_bytes`` in ``raw``), ring (``kbuf``, ``ubuf``, ``w``, ``gbuf``), ``pcum`` and ``hcnt``, bit for
        bit. Prefix caching: a sequence's state at a block boundary copied into a cache slot, or a cached one into a
        new sequence's slot (after :func:`leapquant.flush` with ``force=True`` the checkpoint alone is the state).

        Every value is read before any is written, so ``src`` may repeat (one prefix into several slots) and may name
        slots of ``dst`` (a permutation of slots moves them). Nothing else is written: not the rest of an engine
        layout's region or its spare head, not ``q0``, no other slot.

        Args:
            src, dst: ``[n]`` slots. With ``check=True`` (one host read: a synchronisation) sequences of ints or integer
                tensors, every value a real slot (the vLLM convention's null slot 0 refused in both), ``dst``
                distinct, the same length; a ValueError or TypeError names the argument, before anything is written.
                With ``check=False``: int32 or int64 tensors, 1-D, contiguous, on the pool's device, of one length
                (metadata only, no synchronisation: graph-capturable); a pair whose ``src`` or ``dst`` is not a real
                slot is skipped (nothing written for it), and a ``dst`` named twice gets one of its copies.
            backend: the step's (``leapquant.select(pool, backend, op="step")``): the Triton backend copies in two
                kernel launches (``leapquant_triton.copy``); the others in torch (:meth:`copy_slots_torch`).

        Under ``torch.compile`` the call is the op ``leapquant::copy_slots``, whose checks run when the graph runs.
        """
        if torch.compiler.is_compiling():
            torch.ops.leapquant.copy_slots(*self.op_args(), _traced_slots(src, "src", check),
                                           _traced_slots(dst, "dst", check), backend, check=bool(check),
                                           layout=self.layout)
            return
        self.check_layout(force=check)
        s, d = check_copy_slots(self, src, dst, check)
        if s.numel() == 0:
            return
        fn = getattr(resolve(backend, self, "step"), "copy_slots", None)
        launch(self, fn or Pool.copy_slots_torch, s, d)

    def copy_slots_torch(self, s: torch.Tensor, d: torch.Tensor) -> None:
        """:meth:`copy_slots` in torch, ``s`` and ``d`` checked: every tensor's rows gathered into temporaries, then
        scattered (the form of the backends without a kernel for it)."""
        s, d = s.long(), d.long()
        ok = self._real(s) & self._real(d)
        if not _without_sync(self):
            # a host read costs nothing here: copy exactly the valid pairs, so no other byte is even rewritten
            rows = ok.nonzero().reshape(-1)
            s, d = s[rows], d[rows]
            if s.numel() == 0:
                return
        else:
            # without a synchronisation: a skipped pair copies the first valid pair again (the same bytes to the
            # same slot), or with none slot 0 onto itself, so that the launches do not depend on the values
            first = torch.argmax(ok.to(torch.int32)).view(1)  # indexed as a tensor: a 0-d index would be read
            some = ok.any()
            zero = torch.zeros_like(s)
            s = torch.where(ok, s, torch.where(some, s.index_select(0, first), zero))
            d = torch.where(ok, d, torch.where(some, d.index_select(0, first), zero))
        # gather every tensor's rows into temporaries before the first write: a permutation reads only old values
        parts = [(t, t.index_select(0, s)) for t in self._slot_rows()]
        for t, taken in parts:
            t.index_copy_(0, d, taken)

    def _real(self, slots: torch.Tensor) -> torch.Tensor:
        """bool per entry of ``slots``: a real slot of the pool's convention (SPEC §2), on the device."""
        return (slots >= self.first_slot) & (slots < self.num_slots)

    def _slot_rows(self) -> list[torch.Tensor]:
        """What a slot holds, each as an integer view with the slot as its first dimension (bits copied as they are,
        NaN payloads included): the checkpoints, ``[NS, HV, checkpoint_bytes / 4]`` words of ``raw`` at the
        layout's strides, and the ring tensors, ``pcum`` and ``hcnt`` (also what the Triton copy kernels move)."""
        g = self.geometry
        words = self.raw.view(torch.int32)
        ckpt = words.as_strided((g.num_slots, g.heads, g.checkpoint_bytes // 4), (g.slot_stride, g.head_stride, 1),
                                words.storage_offset() + BASE_WORDS)
        ints = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32,
                torch.int32: torch.int32}
        return [ckpt] + [t.view(ints[t.dtype]) for t in (self.kbuf, self.ubuf, self.w, self.pcum, self.gbuf, self.hcnt)
                         if t is not None]

    def append(self, slots, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor) -> None:
        """One token per slot into the ring (SPEC §6 steps 1-4): the decode step's ring update, in plain torch.

        Args:
            slots: ``[B]`` distinct slots.
            k: keys ``[B, HV, K]``; v: values ``[B, HV, V]``; beta: ``[B, HV]`` write strengths.
            g: log-gates, ``[B, HV, K]`` for KDA (decay ``exp(g)`` per key channel) or ``[B, HV]`` for GDN (scalar
                decay ``a = exp(g)``).

        A slot whose ``hcnt == L`` is taken as flushed (its next entry is 0): unlike :func:`leapquant.step`, this does
        not flush, so flush due slots before appending. Raises ValueError for a repeated slot, a fill count outside
        ``[0, L]``, non-finite inputs or a gate whose stored form would overflow (:func:`.checks.check_append`).
        """
        self.check_layout()
        s, k, v, g, beta = check_append(self, slots, k, v, g, beta)
        with torch.no_grad():  # tokens that require grad leave no autograd history in the pool
            c = self.gather(s)
            c["hcnt"] = self.hcnt[s]
            # the decode step's ring update (its output is not needed here)
            ring, _ = formulas.step_rows(c, k, k, v, g, beta, gate=self.gate, scale=1.0)
            for name, new in ring.items():
                getattr(self, name)[s] = new

    def checkpoint_mask(self, slots: torch.Tensor, heads: torch.Tensor) -> torch.Tensor:
        """bool over ``raw``'s bytes, on the pool's device: True on the checkpoint bytes of the programs
        ``(slots[i], heads[i])``, the only bytes of ``raw`` a flush of those programs may write (SPEC §2)."""
        g = self.geometry
        mask = torch.zeros(self.raw.numel() * 4, dtype=torch.bool, device=self.device)
        starts = 4 * (self.base + slots.long().to(self.device) * g.slot_stride
                      + heads.long().to(self.device) * g.head_stride)
        span = torch.arange(g.checkpoint_bytes, device=self.device)
        mask[(starts[:, None] + span[None, :]).reshape(-1)] = True
        return mask

    def due(self, idx: torch.Tensor, force: bool = False) -> torch.Tensor:
        """``[N, HV]`` bool: which programs a flush over ``idx`` would take (SPEC §2 due rule: ``hcnt == L``; with
        ``force``, as ``flush(..., force=True)``, ``1 <= hcnt <= L``). A due program whose ring is empty is taken
        and left as it is."""
        idx = idx.to(self.device).long()
        real = (idx >= self.first_slot) & (idx < self.num_slots)
        safe = torch.where(real, idx, torch.zeros_like(idx))
        h = self.hcnt[safe]
        return real[:, None] & (((h >= 1) & (h <= self.ring)) if force else h == self.ring)
