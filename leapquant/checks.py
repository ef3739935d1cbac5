"""Argument validation: every failure is a ValueError or TypeError that names the argument and what was expected.

Never ``assert`` (stripped under ``python -O``). Two kinds of check (SPEC §5, "Guarantees"):

* **metadata** (types, dtypes, shapes, strides, devices, storage sizes, alignment, aliasing): read from the tensors'
  descriptors, never from their data, so no synchronisation. ``Pool.from_tensors`` and every ``flush`` / ``step``
  run them, ``check=False`` included: a tensor a kernel would index out of bounds is refused before any launch.
* **values** (the slots ``idx`` names, ``q0`` finite, the inputs of ``append`` and ``load_states``): read on the host,
  so they synchronise; ``check=True`` only (``append`` and ``load_states`` always check theirs).
"""

from __future__ import annotations

import math
import numbers
import operator
from typing import TYPE_CHECKING

import torch

from .constants import BASE_WORDS, SUPPORTED_HEAD_DIMS, SUPPORTED_RANKS, SUPPORTED_RINGS

from .geometry import LAYOUTS, Geometry, view_layouts

if TYPE_CHECKING:
    from .pool import Pool

# the largest max|S| load_states and append accept: 2^24 times the widest domain SPEC §4 judges (2^40), and far below
# where fp32 sums of |E| over V overflow (about 2^120 at V = 128, which would store NaN codes)
STATE_MAX = 2.0**64
# every pool tensor starts 16-byte aligned: TileLang's TMA copies fault on anything less
ALIGN = 16


def check_geometry(geo: "Geometry", convention: str) -> None:
    for name in ("num_slots", "heads", "head_k", "head_v", "ring", "rank"):
        v = getattr(geo, name)
        if not isinstance(v, int) or isinstance(v, bool):
            raise TypeError(f"{name} must be an int, got {type(v).__name__}")
    if geo.num_slots < 1:
        raise ValueError(f"num_slots must be >= 1, got {geo.num_slots}")
    if geo.heads < 1:
        raise ValueError(f"heads must be >= 1, got {geo.heads}")
    if geo.head_k not in SUPPORTED_HEAD_DIMS or geo.head_v not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head_k and head_v must be in {SUPPORTED_HEAD_DIMS}, got {geo.head_k}, {geo.head_v}")
    if geo.ring not in SUPPORTED_RINGS:
        raise ValueError(f"ring must be in {SUPPORTED_RINGS}, got {geo.ring}")
    if geo.rank not in SUPPORTED_RANKS:
        raise ValueError(f"rank must be in {SUPPORTED_RANKS}, got {geo.rank}")
    if geo.gate not in ("kda", "gdn"):
        raise ValueError(f"gate must be 'kda' or 'gdn', got {geo.gate!r}")
    if convention not in ("vllm", "sglang"):
        raise ValueError(f"convention must be 'vllm' or 'sglang', got {convention!r}")
    if geo.layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {geo.layout!r}")
    if geo.checkpoint_bytes > 4 * geo.head_stride:
        raise ValueError(f"checkpoint ({geo.checkpoint_bytes} B) does not fit the region ({4 * geo.head_stride} B)")


def check_iters(iters) -> None:
    if not isinstance(iters, int) or isinstance(iters, bool) or not 1 <= iters <= 4:
        raise ValueError(f"iters must be an int in 1..4, got {iters!r}")


def _expect(t, name: str, dtype: torch.dtype, shape: tuple, device: torch.device) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise TypeError(f"{name} must be {dtype}, got {t.dtype}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {list(shape)}, got {list(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} must be on {device}, got {t.device}")


def _in_storage(t: torch.Tensor, name: str) -> tuple[int, int] | None:
    """Every element of ``t`` lies inside its storage: a tensor whose storage was shrunk under it (another view's
    ``untyped_storage().resize_``) would send a kernel past the allocation. Returns the address range
    ``[first, end)`` of its elements (None when empty): by address, two storages over the same memory (``from_numpy``,
    DLPack) compare too. Metadata only, and cheap: every call checks its tensors with it."""
    if t.is_contiguous():
        size = t.nbytes
        if not size:
            return None
    elif t.numel() == 0:
        return None
    else:
        size = (sum((n - 1) * s for n, s in zip(t.shape, t.stride())) + 1) * t.element_size()
    first = t.data_ptr()
    end = first + size
    st = t.untyped_storage()
    base, have = st.data_ptr(), st.nbytes()
    if end - base > have:
        raise ValueError(f"{name} reaches byte {end - base} of its storage, which holds only {have} bytes")
    return first, end


def check_in_storage(t: torch.Tensor, name: str) -> None:
    """Every element of ``t`` lies inside its storage (metadata only): a kernel given a tensor whose storage is
    shorter than its shape and strides say would read or write past the allocation."""
    _in_storage(t, name)


def check_no_self_overlap(t: torch.Tensor, name: str) -> None:
    """No two elements of ``t`` share memory (an expanded or stride-0 view written by a kernel would give each
    element the last writer's value): with the dimensions ordered by stride, each stride reaches past everything the
    smaller ones span."""
    if t.is_contiguous():  # dense: no two elements share memory
        return
    dims = sorted(((n, st) for n, st in zip(t.shape, t.stride()) if n > 1), key=lambda d: d[1])
    reach = 1
    for size, stride in dims:
        if stride < reach:
            raise ValueError(f"{name} must not have elements that share memory (shape {list(t.shape)}, strides "
                             f"{t.stride()}): it is written")
        reach += stride * (size - 1)


def _dense(t, name: str, dtype: torch.dtype, shape: tuple, device: torch.device) -> None:
    _expect(t, name, dtype, shape, device)
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (strides {t.stride()}): the kernels index it as dense rows")
    _in_storage(t, name)
    if t.numel() and t.data_ptr() % ALIGN:
        raise ValueError(f"{name} must start at a {ALIGN}-byte aligned address, got {t.data_ptr():#x}")


POOL_BASE = ("raw", "kbuf", "ubuf", "w", "pcum", "gbuf", "hcnt", "q0")


def check_pool_tensors(geo: "Geometry", tensors: dict, prefix: str = "") -> None:
    """The base tensors of a pool of geometry ``geo`` (``tensors``: name -> tensor, :data:`POOL_BASE`), metadata only:
    dtypes, shapes, one device (``raw``'s), contiguity, storage sizes, alignment, and no two overlapping (a flush
    writes ``raw``, ``w``, ``pcum``, ``gbuf``: an alias would corrupt what another tensor holds). Nothing is read
    from the data and nothing is resized. ``prefix`` goes before each name in messages (``"pool."``)."""
    NS, HV, K, V, L, R = geo.num_slots, geo.heads, geo.head_k, geo.head_v, geo.ring, geo.rank
    raw = tensors["raw"]
    if not isinstance(raw, torch.Tensor):
        raise TypeError(f"{prefix}raw must be a torch.Tensor, got {type(raw).__name__}")
    dev = raw.device
    if dev.type == "meta":
        raise ValueError(f"{prefix}raw is on the meta device, which holds no data: a pool needs memory its kernels "
                         f"can read and write")
    want = {
        "raw": (torch.float32, (geo.raw_words,)),
        "kbuf": (torch.bfloat16, (NS, HV, L, K)),
        "ubuf": (torch.bfloat16, (NS, HV, L, V)),
        "w": (torch.float32, (NS, HV, L)),
        "pcum": (torch.float32, (NS, HV, K if geo.gate == "kda" else 1)),
        "hcnt": (torch.int32, (NS, HV)),
        "q0": (torch.float32, (V, R)),
    }
    if geo.gate == "kda":
        want["gbuf"] = (torch.float16, (NS, HV, L, K))
    elif tensors.get("gbuf") is not None:
        raise ValueError(f"{prefix}gbuf must be None for gate 'gdn', got a tensor")
    if isinstance(raw, torch.Tensor) and raw.dim() == 1 and raw.dtype == torch.float32 \
            and raw.numel() != want["raw"][1][0]:
        # the views of raw would reach past it (and setting them up would resize the caller's storage)
        per_slot = ("(heads + 1) * head_v * head_k" if geo.layout == "engine"
                    else f"heads * {geo.head_stride} (the checkpoint rounded up to 128 bytes, in words)")
        raise ValueError(f"{prefix}raw must hold num_slots * {per_slot} + {BASE_WORDS} = {want['raw'][1][0]} fp32 "
                         f"words for num_slots={NS} in the {geo.layout} layout, got {raw.numel()}")
    for name, (dtype, shape) in want.items():
        _dense(tensors.get(name), prefix + name, dtype, shape, dev)
    # the same address ranges every call compares its outputs with (spans), sorted: neighbours must not overlap
    ranges = sorted((lo, hi, name) for name, lo, hi in spans(tensors, prefix))
    for (_, end_a, a), (start_b, _, b) in zip(ranges, ranges[1:]):
        if start_b < end_a:
            raise ValueError(f"{a} and {b} overlap in memory: each pool tensor needs its own bytes")


def check_pool(pool: "Pool") -> None:
    """The pool's tensors still have the dtypes, shapes, strides, devices, storage and aliasing its geometry says
    (metadata only: no synchronisation)."""
    g = pool.geometry
    check_geometry(g, pool.convention)
    check_iters(pool.iters)
    check_pool_tensors(g, {n: getattr(pool, n) for n in POOL_BASE}, prefix="pool.")
    raw = pool.raw
    for name, (dtype, shape, strides, offset) in view_layouts(g, raw.storage_offset()).items():
        t = getattr(pool, name)
        _expect(t, f"pool.{name}", dtype, shape, raw.device)
        if t.untyped_storage().data_ptr() != raw.untyped_storage().data_ptr():
            raise ValueError(f"pool.{name} must be a view of pool.raw")
        if t.stride() != strides or t.storage_offset() != offset:
            raise ValueError(f"pool.{name} must be raw's view with strides {strides} at element {offset} (SPEC §2), "
                             f"got strides {t.stride()} at {t.storage_offset()}")


def check_pool_values(pool: "Pool") -> None:
    """What ``check=True`` reads of the pool's data (a synchronisation): ``q0`` finite (a NaN start matrix would give
    every due program NaN factors and codes)."""
    if not bool(torch.isfinite(pool.q0).all()):
        raise ValueError("pool.q0 must be finite (it is the start matrix of every flush), got non-finite values")


def check_idx_layout(pool: "Pool", idx) -> None:
    """``idx`` is an int32 ``[N]`` contiguous tensor on the pool's device: its metadata only, no synchronisation.

    ``flush`` runs this even with ``check=False``: the kernels read ``idx`` as consecutive words, so a strided view
    names other slots than the caller's and flushes them without any error (the view [3, 7] of [3, 5, 7, 2] would
    flush slots 3 and 5); and the contract is int32 for every backend.
    """
    if not isinstance(idx, torch.Tensor):
        raise TypeError(f"idx must be a torch.Tensor of int32, got {type(idx).__name__}")
    if idx.dtype != torch.int32:
        raise TypeError(f"idx must be int32, got {idx.dtype}")
    if idx.dim() != 1:
        raise ValueError(f"idx must be 1-D [N], got shape {list(idx.shape)}")
    if idx.device != pool.device:
        raise ValueError(f"idx must be on the pool's device {pool.device}, got {idx.device}")
    if not idx.is_contiguous():
        raise ValueError(f"idx must be contiguous (stride {idx.stride()})")


def check_idx(pool: "Pool", idx) -> None:
    """``idx``: int32 ``[N]`` on the pool's device; real slots distinct; padding as the pool's convention says."""
    check_idx_layout(pool, idx)
    if idx.numel() == 0:
        return
    host = idx.cpu()
    pad = 0 if pool.convention == "vllm" else -1
    lo, hi = int(host.min()), int(host.max())
    if lo < pad or hi >= pool.num_slots:
        raise ValueError(
            f"idx values must lie in [{pad}, {pool.num_slots}) under the {pool.convention} convention "
            f"({pad} pads), got min {lo}, max {hi}"
        )
    real = host[host >= pool.first_slot]
    if real.numel() != torch.unique(real).numel():
        vals, counts = torch.unique(real, return_counts=True)
        raise ValueError(f"idx names slots more than once: {vals[counts > 1].tolist()}")


SLOT_DTYPES = (torch.int32, torch.int64)


def slot_list(slots, name: str) -> list[int]:
    """The slots of a sequence (or a single slot) as Python ints: each must be an int or a numpy integer (anything
    with ``__index__`` but a bool). A float or a bool would otherwise be cast (``[1.7, 2.2]`` naming slots 1 and 2,
    ``[True, False]`` slot 1 and the null slot)."""
    if isinstance(slots, (str, bytes)):
        raise TypeError(f"{name} must be a sequence of ints or an integer tensor, got {type(slots).__name__}")
    try:
        items = list(slots)
    except TypeError:
        items = [slots]  # a single slot
    out = []
    for x in items:
        if isinstance(x, (bool, torch.Tensor)) or type(x).__name__ == "bool_":
            raise TypeError(f"{name} must hold Python ints (or numpy integers), got {type(x).__name__} {x!r}")
        try:
            out.append(operator.index(x))
        except TypeError:
            raise TypeError(f"{name} must hold Python ints (or numpy integers), got {type(x).__name__} "
                            f"{x!r}") from None
    return out


def check_slots(pool: "Pool", slots, name: str = "slots", distinct: bool = False, check: bool = True) -> torch.Tensor:
    """``slots`` as a 1-D integer tensor on the pool's device. ``check``: a sequence of ints (bools and floats are
    refused, not cast) or an integer tensor, returned as int64, every value in ``[0, NS)`` and, with ``distinct``,
    none twice (a repeated slot's writes would overwrite each other); a tensor's values are read on the host (a
    synchronisation). Without ``check``: metadata only, an int32 or int64 1-D contiguous tensor on the pool's device,
    returned as it is. A tensor must lie inside its storage either way."""
    if not check:
        if not isinstance(slots, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor with check=False, got {type(slots).__name__}")
        if slots.dtype not in SLOT_DTYPES:
            raise TypeError(f"{name} must be int32 or int64, got {slots.dtype}")
        if slots.dim() != 1 or not slots.is_contiguous():
            raise ValueError(f"{name} must be 1-D and contiguous, got shape {list(slots.shape)}, "
                             f"strides {slots.stride()}")
        if slots.device != pool.device:
            raise ValueError(f"{name} must be on the pool's device {pool.device}, got {slots.device}")
        _in_storage(slots, name)
        return slots
    if isinstance(slots, torch.Tensor):
        if slots.is_floating_point() or slots.is_complex() or slots.dtype == torch.bool:
            raise TypeError(f"{name} must hold integers, got {slots.dtype}")
        _in_storage(slots, name)  # before its values are read
        s = slots.to(device=pool.device, dtype=torch.long).reshape(-1)
        host = s.cpu().tolist()
    else:
        host = slot_list(slots, name)
        s = None
    if host and (min(host) < 0 or max(host) >= pool.num_slots):
        raise ValueError(f"{name} must lie in [0, {pool.num_slots}), got {host}")
    if distinct and len(set(host)) != len(host):
        seen, twice = set(), set()
        for x in host:
            (twice if x in seen else seen).add(x)
        raise ValueError(f"{name} names slots more than once: {sorted(twice)}")
    return s if s is not None else torch.tensor(host, dtype=torch.long, device=pool.device)


def check_copy_slots(pool: "Pool", src, dst, check: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``Pool.copy_slots``' ``src`` and ``dst`` as 1-D integer tensors on the pool's device, of one length, sharing no
    byte with the pool tensors the copy writes. ``check`` (a synchronisation): sequences of ints or integer tensors
    (returned int64), every value a real slot of the pool's convention (the vLLM null slot 0 neither read nor
    written), ``dst`` distinct; ``src`` may repeat and may name slots of ``dst`` (every read happens before any
    write). Without ``check``: metadata only (int32 or int64, 1-D, contiguous, on the pool's device)."""
    s = check_slots(pool, src, "src", check=check)
    d = check_slots(pool, dst, "dst", distinct=check, check=check)
    if s.numel() != d.numel():
        raise ValueError(f"src and dst must name as many slots: got {s.numel()} and {d.numel()}")
    written = tuple(sp for sp in pool.tensor_spans() if sp[0] != "pool.q0")
    why = "copy_slots writes the pool while it reads them"
    check_apart(s, "src", written, why)
    check_apart(d, "dst", written, why)
    if check and pool.first_slot and s.numel():
        for name, t in (("src", s), ("dst", d)):
            if bool((t == 0).any()):
                raise ValueError(f"{name} names slot 0, the null slot of the vllm convention (its padding rows' slot): "
                                 f"a copy neither reads nor writes it")
    return s, d


def check_finite(t: torch.Tensor, name: str, bound: float | None = STATE_MAX) -> None:
    """``t`` finite with ``max|t| <= bound`` (``None``: finite only; a synchronisation)."""
    if not t.numel():
        return
    t = t.detach()
    if not bool(torch.isfinite(t).all()):
        raise ValueError(f"{name} must be finite, got NaN or infinite values")
    if bound is None:
        return
    m = float(t.abs().max())
    if m > bound:
        raise ValueError(f"{name} must have max|x| <= 2^{math.log2(bound):g}, got {m:.6g}")


def check_state_values(states: torch.Tensor, name: str = "states") -> None:
    """States to compress (``load_states``): finite, ``max|S| <= STATE_MAX``. Outside, the fp32 compression stores
    NaN (|S| near 3e38) or the state is beyond any domain a backend claims; tiny and zero states are fine (they
    compress to zero codes). Anything but a floating-point tensor is left to the type checks."""
    if isinstance(states, torch.Tensor) and states.is_floating_point():
        check_finite(states, name)


def state_shape(pool: "Pool", n: int, state_v_first: bool) -> tuple[int, int, int, int]:
    """``[n, HV, V, K]`` (V-first) or ``[n, HV, K, V]`` (FLA's default layout)."""
    HV, K, V = pool.heads, pool.head_k, pool.head_v
    return (n, HV, V, K) if state_v_first else (n, HV, K, V)


def check_state_tensor(pool: "Pool", t, n: int, state_v_first: bool, name: str, check: bool) -> torch.Tensor:
    """``t`` as fp32 on the pool's device with the layout's shape: converted with ``check`` (a copy where needed),
    required as it is without."""
    want = state_shape(pool, n, state_v_first)
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if tuple(t.shape) != want:
        layout = "[n, HV, V, K]" if state_v_first else "[n, HV, K, V] (state_v_first=False)"
        raise ValueError(f"{name} must be {layout} = {list(want)} for this pool, got {list(t.shape)}")
    if check:
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
        return t.to(device=pool.device, dtype=torch.float32)
    if t.dtype != torch.float32:
        raise TypeError(f"{name} must be float32 with check=False, got {t.dtype}")
    if t.device != pool.device:
        raise ValueError(f"{name} must be on the pool's device {pool.device} with check=False, got {t.device}")
    return t


def _dense_heads(t: torch.Tensor) -> bool:
    """Whether every head's state of ``t`` occupies ``V K`` consecutive words of its own, in the layout's order (a
    kernel keeps scratch words in its head's words, so heads must not share any)."""
    n, HV, A, B = t.shape
    if n * HV == 0:
        return True
    own = (HV == 1 or t.stride(1) >= A * B) and (n == 1 or t.stride(0) >= HV * A * B)
    return t.stride(3) == 1 and t.stride(2) == B and own


def check_states_out(pool: "Pool", out, n: int, state_v_first: bool) -> None:
    """``Pool.states``' ``out``: fp32 on the pool's device, the layout's shape, each head dense in words of its own."""
    if not isinstance(out, torch.Tensor) or out.dtype != torch.float32:
        raise TypeError(f"out must be a float32 tensor, got {getattr(out, 'dtype', type(out).__name__)}")
    if out.device != pool.device:
        raise ValueError(f"out must be on the pool's device {pool.device}, got {out.device}")
    want = state_shape(pool, n, state_v_first)
    if tuple(out.shape) != want:
        raise ValueError(f"out must have shape {list(want)}, got {list(out.shape)}")
    if not _dense_heads(out):
        raise ValueError(f"out must hold each head's state densely in words of its own (strides [>= "
                         f"{out.shape[1] * out.shape[2] * out.shape[3]}, >= {out.shape[2] * out.shape[3]}, "
                         f"{out.shape[3]}, 1]), got strides {out.stride()}")


def spans(tensors: dict, prefix: str = "") -> tuple:
    """``(name, first address, end address)`` of each non-empty tensor of ``tensors`` (name -> tensor or None), names
    after ``prefix``, each checked to lie inside its storage (:func:`_in_storage`): the ranges :func:`check_apart`
    compares (a pool's are computed once after its metadata was checked: :meth:`Pool.tensor_spans`). Metadata
    only."""
    return tuple((prefix + name, *r) for name, t in tensors.items()
                 if t is not None and (r := _in_storage(t, prefix + name)) is not None)


def check_apart(t: torch.Tensor, name: str, others, why: str) -> None:
    """``t`` lies inside its storage and shares no byte with any range of ``others`` (:func:`spans`), else a
    ValueError naming both and ``why``. Address ranges are compared, so two storages over the same memory
    (``from_numpy``, DLPack) are seen too, and interleaved views of one buffer are refused."""
    r = _in_storage(t, name)
    if r is None:
        return
    lo, hi = r
    for other, lo_o, hi_o in others:
        if lo < hi_o and lo_o < hi:
            raise ValueError(f"{name} and {other} share memory: {why}")


def check_states_out_apart(pool: "Pool", out: torch.Tensor, slots: torch.Tensor) -> None:
    """``Pool.states``' ``out`` (already :func:`check_states_out`) inside its storage, no two of its elements sharing
    memory, and no byte shared with a pool tensor or ``slots``: it is written while those are read, and ``states``
    writes nothing in the pool (SPEC §5.1). Metadata only."""
    check_no_self_overlap(out, "out")
    why = "states() writes out while it reads the pool and slots, and writes nothing in the pool"
    check_apart(out, "out", pool.tensor_spans() + spans({"slots": slots}), why)


def check_load_apart(pool: "Pool", states: torch.Tensor, slots: torch.Tensor) -> None:
    """``load_states``' ``states`` and ``slots`` share no byte with the pool tensors it writes (all but ``q0``:
    raw, kbuf, ubuf, w, pcum, gbuf, hcnt): a state or a slot read from bytes the call is writing would be corrupted.
    Metadata only."""
    written = tuple(sp for sp in pool.tensor_spans() if sp[0] != "pool.q0")
    why = "load_states writes the pool while it reads them"
    check_apart(states, "states", written, why)
    check_apart(slots, "slots", written, why)


def check_device(device) -> torch.device:
    """``Pool``'s ``device`` as a torch.device that holds data and exists here, before anything is allocated: a
    device type torch does not know, CUDA without a CUDA device, a GPU index past the count, and ``meta`` (which
    holds no data: every tensor would start at address 0) raise a ValueError naming it."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device must name a torch device, got {device!r} ({e})") from None
    if dev.type == "meta":
        raise ValueError(f"device={str(device)!r} holds no data: a pool needs memory its kernels can read and write "
                         f"(use 'cpu' or 'cuda')")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device={str(device)!r}: CUDA is not available here (torch {torch.__version__}, "
                             f"torch.cuda.is_available() is False)")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device={str(device)!r}: there are only {torch.cuda.device_count()} CUDA devices")
    return dev


# the largest log decay whose stored gate is finite: KDA stores fp16(exp g) (fp16's max is 65504, exp(11) ~ 59874),
# GDN multiplies pcum and w by exp g in fp32 (exp(88) ~ 1.65e38)
GATE_MAX = {"kda": 11.0, "gdn": 88.0}


def check_gate_range(gate: str, g: torch.Tensor, name: str) -> None:
    """The log decays ``g`` (finite) of a pool of ``gate`` within :data:`GATE_MAX` (a synchronisation): above, the
    stored gate overflows and the ring's state becomes infinite. ``append`` and ``step(check=True)`` refuse them."""
    g_max = GATE_MAX[gate]
    if g.numel():
        m = float(g.max())
        if m > g_max:
            raise ValueError(f"{name} must be <= {g_max} (the stored gate exp(g) overflows "
                             f"{'fp16' if gate == 'kda' else 'fp32'} above), got max {m:.6g}")


def check_append(pool: "Pool", slots, k, v, g, beta) -> tuple:
    """``Pool.append``'s arguments: distinct slots whose fill counts lie in ``[0, L]`` (``L``: flushed, next entry 0),
    and finite fp32 ``k [B, HV, K]``, ``v [B, HV, V]``, ``beta [B, HV]``, ``g`` (KDA ``[B, HV, K]``, GDN ``[B, HV]``)
    whose stored gate is finite (KDA ``fp16(exp g)``: ``g <= 11``; GDN ``exp g``: ``g <= 88``). Returns
    ``(slots int64, k, v, g, beta)`` on the pool's device in fp32."""
    s = check_slots(pool, slots, distinct=True)
    B, HV, K, V, L = s.numel(), pool.heads, pool.head_k, pool.head_v, pool.ring
    want = {"k": (k, (B, HV, K)), "v": (v, (B, HV, V)), "beta": (beta, (B, HV)),
            "g": (g, (B, HV, K) if pool.gate == "kda" else (B, HV))}
    out = {}
    for name, (t, shape) in want.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"append: {name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"append: {name} must be a floating-point tensor, got {t.dtype}")
        if tuple(t.shape) != shape:
            raise ValueError(f"append: {name} must be {list(shape)} for this pool ({pool.gate}), got {list(t.shape)}")
        out[name] = t.detach().to(pool.device, torch.float32)
        check_finite(out[name], f"append: {name}")
    check_gate_range(pool.gate, out["g"], "append: g")
    if B:
        h = pool.hcnt[s]
        lo, hi = int(h.min()), int(h.max())
        if lo < 0 or hi > L:
            raise ValueError(f"pool.hcnt of the appended slots must lie in [0, {L}] (the ring's fill count), got "
                             f"min {lo}, max {hi}")
    return s, out["k"], out["v"], out["g"], out["beta"]


def check_run_inputs(codes, s_k, s_v, u, q, kbuf, ubuf, gbuf, w, pcum, q0) -> tuple[int, int, int, int, int, int]:
    """``leapquant.run``'s tensors against the shapes of ``codes [B, HV, V, K]``, ``u [B, HV, R, K]`` and
    ``kbuf [B, HV, L, K]``: each named where it disagrees. Returns ``(B, HV, V, K, R, L)``."""
    for name, t in (("codes", codes), ("u", u), ("kbuf", kbuf)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a 4-D tensor [B, HV, ...], got "
                             f"{list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    B, HV, V, K = codes.shape
    R, L = u.shape[2], kbuf.shape[2]
    dev = codes.device
    want = [
        ("codes", codes, torch.int8, (B, HV, V, K)),
        ("s_k", s_k, torch.float32, (B, HV, K)),
        ("s_v", s_v, torch.float32, (B, HV, V)),
        ("u", u, torch.float16, (B, HV, R, K)),
        ("q", q, torch.float16, (B, HV, R, V)),
        ("kbuf", kbuf, torch.bfloat16, (B, HV, L, K)),
        ("ubuf", ubuf, torch.bfloat16, (B, HV, L, V)),
        ("w", w, torch.float32, (B, HV, L)),
        ("pcum", pcum, torch.float32, (B, HV, K if gbuf is not None else 1)),
        ("q0", q0, torch.float32, (V, R)),
    ]
    if gbuf is not None:
        want.append(("gbuf", gbuf, torch.float16, (B, HV, L, K)))
    for name, t, dtype, shape in want:
        _expect(t, name, dtype, shape, dev)
    return B, HV, V, K, R, L


STEP_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def token_rows(t, name: str, dims: int, rows: int, form: str = ""):
    """``t`` as its ``[B, ...]`` form with ``dims`` dimensions, from that form or the engines' ``[B, 1, ...]`` and
    ``[1, B, ...]`` forms: a view, never a copy. Metadata only (no synchronisation). ``form`` ends each message (what
    the tensor should be, e.g. the gate's shape for this pool)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() == dims + 1:
        if t.shape[1] == 1:
            t = t[:, 0]
        elif t.shape[0] == 1:
            t = t[0]
        else:
            raise ValueError(f"{name} has {t.dim()} dimensions, so one of its first two must be 1 (one token per "
                             f"row: [B, 1, ...] or [1, B, ...]), got {list(t.shape)}{form}")
    if t.dim() != dims:
        raise ValueError(f"{name} must have {dims} dimensions ([B, ...]) or {dims + 1} ([B, 1, ...] / [1, B, ...]), "
                         f"got {list(t.shape)}{form}")
    if t.shape[0] != rows:
        raise ValueError(f"{name} has {t.shape[0]} rows, idx has {rows}")
    return t


def gate_form(gate: str) -> str:
    """What ``g`` must be for a pool of ``gate``: said in every error about it."""
    return ("; g is the KDA gate here, [B, HV, K] (one log decay per key channel)" if gate == "kda"
            else "; g is the GDN gate here, [B, HV] (one log decay per head)")


def check_step_inputs(pool: "Pool", q, k, v, g, beta, out) -> None:
    """Shapes, dtypes, devices and unit last strides of ``step``'s token tensors (in their ``[B, ...]`` forms)."""
    HV, K, V = pool.heads, pool.head_k, pool.head_v
    H = q.shape[1] if q.dim() == 3 else -1
    if q.dim() != 3 or q.shape[2] != K or H < 1 or HV % H:
        raise ValueError(f"q must be [B, H, K] with K = {K} and H dividing HV = {HV}, got {list(q.shape)}")
    want = {"k": (k, (q.shape[0], H, K)), "v": (v, (q.shape[0], HV, V)), "beta": (beta, (q.shape[0], HV)),
            "g": (g, (q.shape[0], HV, K) if pool.gate == "kda" else (q.shape[0], HV))}
    if out is not None:
        want["out"] = (out, (q.shape[0], HV, V))
    for name, (t, shape) in [("q", (q, tuple(q.shape)))] + list(want.items()):
        if t.dtype not in STEP_DTYPES:
            raise TypeError(f"{name} must be float32, bfloat16 or float16, got {t.dtype}")
        if tuple(t.shape) != shape:
            form = gate_form(pool.gate) if name == "g" else ""
            raise ValueError(f"{name} must have shape {list(shape)} for this pool ({pool.gate}), got "
                             f"{list(t.shape)}{form}")
        if t.device != pool.device:
            raise ValueError(f"{name} must be on the pool's device {pool.device}, got {t.device}")
        if t.numel() and t.stride(-1) != 1:
            raise ValueError(f"{name} must have a unit stride in its last dimension, got strides {t.stride()}")
    if out is not None and out.dtype != q.dtype:
        raise TypeError(f"out must have q's dtype {q.dtype}, got {out.dtype}")


def check_scale(scale):
    """``step``'s ``scale``: a real number on the host (a Python or NumPy float or int), finite; no synchronisation.
    Returned as a float (a symbolic float under ``torch.compile`` is left to the op, which checks it when it runs)."""
    if isinstance(scale, torch.SymFloat):
        return scale
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a real number (a host float), got {type(scale).__name__}")
    s = float(scale)
    if not math.isfinite(s):
        raise ValueError(f"scale must be finite, got {s}")
    return s


def check_step_memory(pool: "Pool", idx, q, k, v, g, beta, out) -> None:
    """The memory of ``step``'s tensors, metadata only (no synchronisation), every call: each lies inside its storage,
    and ``out`` (written; None when the step allocates it) has no two elements sharing memory
    (:func:`check_no_self_overlap`) and shares no byte with a pool tensor or an input: each kernel program reads its
    inputs and the pool while others write ``out``, and a pool byte under ``out`` would be overwritten
    (:func:`check_apart`; the pool's ranges are cached: :meth:`Pool.tensor_spans`)."""
    inputs = spans({"idx": idx, "q": q, "k": k, "v": v, "g": g, "beta": beta})
    if out is None:
        return
    check_no_self_overlap(out, "out")
    check_apart(out, "out", pool.tensor_spans() + inputs, "what a call writes needs bytes of its own")


def check_hcnt(pool: "Pool", idx: torch.Tensor) -> None:
    """``check=True``: the fill counts of the slots ``idx`` names (its real rows) lie in ``[0, L]`` (one host read).
    Outside, a flush never takes the ring and a step drops its entries (a count above L) or the token (a negative
    count)."""
    if not idx.numel():
        return
    i = idx.long()
    real = (i >= pool.first_slot) & (i < pool.num_slots)
    h = torch.where(real[:, None], pool.hcnt[torch.where(real, i, 0)], 0)
    lo, hi = torch.stack(torch.aminmax(h)).tolist()
    if lo < 0 or hi > pool.ring:
        n, hv = ((h < 0) | (h > pool.ring)).nonzero()[0].tolist()
        raise ValueError(f"pool.hcnt of the slots idx names must lie in [0, {pool.ring}] (the ring's fill count), got "
                         f"{int(h[n, hv])} at slot {int(i[n])}, head {hv} (min {lo}, max {hi})")


def check_step_values(pool: "Pool", idx: torch.Tensor, q, k, v, g, beta) -> None:
    """``step(check=True)``: the token values of the real rows (padding rows are not read) as ``append`` takes them:
    finite, and the gate within :data:`GATE_MAX` (:func:`check_gate_range`). A synchronisation per tensor."""
    i = idx.long()
    real = (i >= pool.first_slot) & (i < pool.num_slots)
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        x = torch.where(real.view((-1,) + (1,) * (t.dim() - 1)), t.detach(), 0)
        check_finite(x, name, bound=None)
        if name == "g":
            check_gate_range(pool.gate, x, "g")
