"""Backends: what each one needs, the registry, and the ``"auto"`` choice.

A backend is a :class:`Backend` subclass registered under the entry-point group ``leapquant.backends``
(``name = "package.module:Class"``); the class is instantiated with no arguments. It declares its
:class:`Requirements` and answers two questions with a reason: :meth:`Backend.available` (can it be imported and
run on this machine at all) and :meth:`Backend.supports` (can it flush this pool). ``"auto"`` ranks only the
backends that pass both, by ``priority`` (measured speed: higher is faster).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from importlib import metadata
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .pool import Pool

ENTRY_POINT_GROUP = "leapquant.backends"


@dataclass(frozen=True)
class Requirements:
    """What a backend can flush. ``None`` means any value."""

    devices: tuple[str, ...] = ("cuda",)  # torch device types
    capabilities: tuple[int, ...] | None = None  # CUDA compute capability as 10 * major + minor, e.g. 90
    gates: tuple[str, ...] = ("kda", "gdn")
    heads: tuple[int, ...] | None = None
    head_dims: tuple[tuple[int, int], ...] | None = ((128, 128),)  # (head_k, head_v) pairs
    rings: tuple[int, ...] | None = (16,)
    ranks: tuple[int, ...] | None = (1, 2, 3, 4)
    conventions: tuple[str, ...] = ("vllm", "sglang")
    layouts: tuple[str, ...] = ("engine", "compact")  # how raw holds the checkpoints (SPEC §2)
    # the max|S| the backend is accurate for (SPEC §4: the seed's domain is <= 2^14; reference and Triton 2^+-40)
    magnitude: tuple[float, float] = (2.0**-40, 2.0**40)
    notes: tuple[str, ...] = field(default_factory=tuple)

    def check(self, pool: "Pool") -> tuple[bool, str]:
        """The pool against every requirement: its layout, then its device and geometry."""
        ok, why = self.check_layout(pool)
        return self.check_device_and_geometry(pool) if ok else (ok, why)

    def check_device_and_geometry(self, pool: "Pool") -> tuple[bool, str]:
        g = pool.geometry
        dev = pool.device
        if dev.type not in self.devices:
            return False, f"runs on {'/'.join(self.devices)}, pool is on {dev.type}"
        if dev.type == "cuda" and self.capabilities is not None:
            cc = capability(dev)
            if cc not in self.capabilities:
                have = ", ".join(f"sm_{c}" for c in self.capabilities)
                return False, f"needs one of {have}; {torch.cuda.get_device_name(dev)} is sm_{cc}"
        if g.gate not in self.gates:
            return False, f"gate {g.gate!r} not supported (supports {self.gates})"
        if self.heads is not None and g.heads not in self.heads:
            return False, f"heads={g.heads} not supported (supports {self.heads})"
        if self.head_dims is not None and (g.head_k, g.head_v) not in self.head_dims:
            return False, f"(head_k, head_v)=({g.head_k}, {g.head_v}) not supported (supports {self.head_dims})"
        if self.rings is not None and g.ring not in self.rings:
            return False, f"ring={g.ring} not supported (supports {self.rings})"
        if self.ranks is not None and g.rank not in self.ranks:
            return False, f"rank={g.rank} not supported (supports {self.ranks})"
        if pool.convention not in self.conventions:
            return False, f"convention {pool.convention!r} not supported"
        return True, "ok"

    def check_layout(self, pool: "Pool") -> tuple[bool, str]:
        """The pool's layout against :attr:`layouts` (also asked before availability: it holds on every machine)."""
        if pool.geometry.layout not in self.layouts:
            return False, f"layout {pool.geometry.layout!r} not supported (supports {self.layouts})"
        return True, "ok"


def capability(device: torch.device) -> int:
    major, minor = torch.cuda.get_device_capability(device)
    return 10 * major + minor


class Backend:
    """Base class of a flush backend.

    Subclasses set ``name``, ``priority`` and ``requirements`` and implement :meth:`flush`; they override
    :meth:`available` when they need a package or a device, and :meth:`supports` when the requirements table cannot
    say everything.
    """

    name: str = ""
    priority: int = 0
    description: str = ""
    requirements: Requirements = Requirements()
    # "auto" considers this backend only where this is None; otherwise it says why not (e.g. not yet passing the
    # parity suite on that device kind); asking for the backend by name still works
    not_for_auto: dict[str, str] = {}

    def available(self) -> tuple[bool, str]:
        """Whether this backend can run on this machine at all, and why not."""
        return True, "ok"

    def supports(self, pool: "Pool") -> tuple[bool, str]:
        """Whether this backend can flush ``pool`` (geometry, device), and why not. The layout comes first: a reason
        that holds on every machine, and the one a caller can act on."""
        ok, why = self.requirements.check_layout(pool)
        if not ok:
            return ok, why
        ok, why = self.available()
        if not ok:
            return ok, why
        return self.requirements.check_device_and_geometry(pool)

    def flush(self, pool: "Pool", idx: torch.Tensor) -> None:
        """Flush the due programs of ``idx`` (int32 ``[N]`` on the pool's device) in place.

        Called with validated arguments. Must not synchronise with the host and must launch the same work for the
        same pool and ``N``, so that it can be captured in a CUDA graph. Writes nothing outside the due programs.
        """
        raise NotImplementedError

    def step(self, pool: "Pool", idx: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             g: torch.Tensor, beta: torch.Tensor, scale: float, use_qk_l2norm: bool, out: torch.Tensor) -> None:
        """One decode token per row of ``idx`` in place (SPEC §6): full rings flushed first, then the token into the
        ring and ``out[n] = scale S_t q`` (zero for rows that name no real slot). Called with validated arguments:
        ``q``, ``k`` ``[N, H, K]``, ``v`` ``[N, HV, V]``, ``g`` ``[N, HV, K]`` (KDA) or ``[N, HV]``, ``beta``
        ``[N, HV]``, ``out`` ``[N, HV, V]``, each with a unit last stride. Same rules as :meth:`flush` (no host sync,
        graph-capturable). Backends without a decode step leave it out (:attr:`has_step`)."""
        raise NotImplementedError

    @property
    def has_step(self) -> bool:
        """Whether the backend implements :meth:`step`."""
        return type(self).step is not Backend.step

    def load_states(self, pool: "Pool", slots: torch.Tensor, states: torch.Tensor, state_v_first: bool) -> None:
        """Compress fp32 ``states`` (``[n, HV, V, K]``, or ``[n, HV, K, V]`` where not ``state_v_first``; any strides)
        into the checkpoints of ``slots`` (int32 or int64 ``[n]`` on the pool's device) by SPEC §3 steps 5-10, reset
        their rings as a flush does and set their ``hcnt`` to 0 (SPEC §5). Called with validated arguments; same rules
        as :meth:`flush` (no host sync, graph-capturable). Backends without it leave it out (:attr:`has_states`)."""
        raise NotImplementedError

    def states(self, pool: "Pool", slots: torch.Tensor, out: torch.Tensor, state_v_first: bool) -> None:
        """Write the rebuilt states of ``slots`` (SPEC §3 steps 1-4) into ``out`` (fp32 ``[n, HV, V, K]``, or
        ``[n, HV, K, V]`` where not ``state_v_first``; each head dense). Writes nothing else; no host sync."""
        raise NotImplementedError

    @property
    def has_states(self) -> bool:
        """Whether the backend implements :meth:`load_states` and :meth:`states`."""
        return type(self).load_states is not Backend.load_states and type(self).states is not Backend.states

    def __repr__(self) -> str:
        return f"<leapquant backend {self.name!r}>"


class BackendError(RuntimeError):
    """A backend was asked for that cannot run here."""


@functools.lru_cache(maxsize=None)
def _registry() -> dict[str, Backend | Exception]:
    found: dict[str, Backend | Exception] = {}
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        try:
            obj = ep.load()()
            if not isinstance(obj, Backend):
                raise TypeError(f"entry point {ep.value} did not produce a leapquant.Backend")
            found[ep.name] = obj
        except Exception as e:  # an optional backend whose import fails is listed as unavailable, with the reason
            found[ep.name] = e
    if "reference" not in found:
        # running from a source tree without installed metadata: the built-ins are still known
        from .reference import ReferenceBackend

        found["reference"] = ReferenceBackend()
        for name, path in (("triton", "leapquant_triton.backend:TritonBackend"),
                           ("tilelang", "leapquant_tilelang.backend:TileLangBackend")):
            if name not in found:
                try:
                    mod, cls = path.split(":")
                    found[name] = getattr(__import__(mod, fromlist=[cls]), cls)()
                except Exception as e:
                    found[name] = e
    return found


def register(backend: Backend) -> None:
    """Add a backend at run time (tests, experiments); the entry-point group is the way for packages."""
    if not isinstance(backend, Backend) or not backend.name:
        raise TypeError("register() takes a named leapquant.Backend instance")
    _registry()[backend.name] = backend
    _CHOSEN.clear()  # "auto" ranks the new backend too


def get(name: str) -> Backend:
    """The backend called ``name``; :class:`BackendError` naming the known ones if there is none or it is broken."""
    reg = _registry()
    if name not in reg:
        raise BackendError(f"unknown backend {name!r}; known: {sorted(reg)}")
    b = reg[name]
    if isinstance(b, Exception):
        raise BackendError(f"backend {name!r} failed to load: {type(b).__name__}: {b}")
    return b


@dataclass(frozen=True)
class BackendInfo:
    name: str
    available: bool
    reason: str
    priority: int
    description: str


def backends() -> list[BackendInfo]:
    """Every registered backend with whether it can run on this machine and why not, fastest first."""
    rows = []
    for name, b in _registry().items():
        if isinstance(b, Exception):
            rows.append(BackendInfo(name, False, f"failed to load: {type(b).__name__}: {b}", -1, ""))
        else:
            ok, why = b.available()
            rows.append(BackendInfo(name, ok, why, b.priority, b.description))
    return sorted(rows, key=lambda r: -r.priority)


def choose(pool: "Pool", need_step: bool = False, need_states: bool = False) -> Backend:
    """``"auto"``: the highest-priority backend that supports ``pool`` (and has a decode step, if ``need_step``;
    ``load_states`` and ``states``, if ``need_states``)."""
    reasons = []
    for info in backends():
        if not info.available:
            reasons.append(f"{info.name}: {info.reason}")
            continue
        b = get(info.name)
        ok, why = b.supports(pool)
        if ok and need_step and not b.has_step:
            ok, why = False, "no decode step"
        if ok and need_states and not b.has_states:
            ok, why = False, "no load_states / states"
        if ok and pool.device.type in b.not_for_auto:
            ok, why = False, f"not chosen by auto: {b.not_for_auto[pool.device.type]}"
        if ok:
            return b
        reasons.append(f"{info.name}: {why}")
    raise BackendError("no backend supports this pool: " + "; ".join(reasons))


def resolve(name: str, pool: "Pool", need_step: bool = False, need_states: bool = False) -> Backend:
    """The backend to flush (``need_step``: to decode; ``need_states``: to load and rebuild states) ``pool`` with:
    ``"auto"`` or a name; :class:`BackendError` saying why it cannot."""
    if name == "auto":
        return choose(pool, need_step, need_states)
    b = get(name)
    ok, why = b.supports(pool)
    if ok and need_step and not b.has_step:
        ok, why = False, "it has no decode step"
    if ok and need_states and not b.has_states:
        ok, why = False, "it has no load_states / states"
    if not ok:
        what = "decode with" if need_step else "load or rebuild states of" if need_states else "flush"
        raise BackendError(f"backend {name!r} cannot {what} {pool!r}: {why}")
    return b


# (backend name, pool specialisation) -> backend, so that an eager call does not rank the backends again; what a
# machine can run does not change within a process, but the registry can: register() clears it
_CHOSEN: dict[tuple, Backend] = {}


def resolve_cached(name: str, pool: "Pool", need_step: bool = False, need_states: bool = False) -> Backend:
    """:func:`resolve`, remembered per backend name and pool specialisation until the next :func:`register`."""
    key = (name, need_step, need_states, pool.geometry, pool.convention, pool.iters, str(pool.device))
    b = _CHOSEN.get(key)
    if b is None:
        b = _CHOSEN[key] = resolve(name, pool, need_step, need_states)
    return b
