"""The backend registry, the one choice of a backend for every operation, and the launch on the pool's device.

Backends are found through the entry-point group ``leapquant.backends`` (the built-ins included: they are entries
of this package's own metadata), or added at run time with :func:`register`. :func:`resolve` answers, for a backend
name (or ``"auto"``), a pool and an operation, which backend runs it, or why none can; :func:`launch` runs it with
the pool's GPU current.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from importlib import metadata
from typing import TYPE_CHECKING

import torch

from .backends import ENTRY_POINT_GROUP, OPS, Backend, BackendError

if TYPE_CHECKING:
    from .pool import Pool

# what a source tree without installed metadata still knows: the built-ins, by the same "module:Class" an entry
# point gives
BUILT_INS = (("reference", "leapquant.reference:ReferenceBackend"),
             ("triton", "leapquant_triton.backend:TritonBackend"),
             ("tilelang", "leapquant_tilelang.backend:TileLangBackend"))


def _load(path: str) -> Backend:
    module, cls = path.split(":")
    obj = getattr(importlib.import_module(module), cls)()
    if not isinstance(obj, Backend):
        raise TypeError(f"{path} did not produce a leapquant.Backend")
    return obj


@functools.lru_cache(maxsize=None)
def _registry() -> dict[str, Backend | Exception]:
    paths = {ep.name: ep.value for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)}
    if "reference" not in paths:
        paths = {**dict(BUILT_INS), **paths}
    found: dict[str, Backend | Exception] = {}
    for name, path in paths.items():
        try:
            found[name] = _load(path)
        except Exception as e:  # an optional backend whose import fails is listed as unavailable, with the reason
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


_VERB = {"flush": "flush", "force_flush": "force-flush (partially filled rings included)", "step": "decode with",
         "step_tokens": "decode several tokens per row with", "states": "load or rebuild states of"}


def _fits(b: Backend, pool: "Pool", op: str) -> tuple[bool, str]:
    ok, why = b.supports(pool)
    if ok and not b.implements(op):
        ok, why = False, {"flush": "it has no flush", "step": "it has no decode step",
                          "states": "it has no load_states / states",
                          "force_flush": "it flushes full rings only (no flush(..., force=True)); the reference and "
                                         "Triton backends flush partially filled rings",
                          "step_tokens": "its decode step takes one token per row; the reference backend takes "
                                         "T > 1 (SPEC §6.1)"}[op]
    return ok, why


def _resolve(name: str, pool: "Pool", op: str) -> Backend:
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    if name != "auto":
        b = get(name)
        ok, why = _fits(b, pool, op)
        if not ok:
            raise BackendError(f"backend {name!r} cannot {_VERB[op]} {pool!r}: {why}")
        return b
    reasons = []
    for info in backends():
        if not info.available:
            reasons.append(f"{info.name}: {info.reason}")
            continue
        b = get(info.name)
        ok, why = _fits(b, pool, op)
        if ok and pool.device.type in b.not_for_auto:
            ok, why = False, f"not chosen by auto: {b.not_for_auto[pool.device.type]}"
        if ok:
            return b
        reasons.append(f"{info.name}: {why}")
    raise BackendError(f"no backend can {_VERB[op]} this pool: " + "; ".join(reasons))


# (backend name, operation, pool specialisation) -> backend, so that an eager call does not rank the backends again;
# what a machine can run does not change within a process, but the registry can: register() clears it
_CHOSEN: dict[tuple, Backend] = {}


def resolve(name: str, pool: "Pool", op: str = "flush") -> Backend:
    """The backend that runs ``op`` (``"flush"``, ``"force_flush"``, ``"step"`` or ``"states"``:
    :data:`leapquant.backends.OPS`) on
    ``pool``: ``name`` itself, or for ``"auto"`` the highest-priority backend that supports the pool and implements
    ``op``. Raises :class:`BackendError` saying why none can. Remembered per name, operation and pool specialisation
    until the next :func:`register`."""
    if not isinstance(name, str):
        raise TypeError(f"backend must be a string, got {type(name).__name__}")
    key = (name, op, pool.geometry, pool.convention, pool.iters, str(pool.device))
    b = _CHOSEN.get(key)
    if b is None:
        b = _CHOSEN[key] = _resolve(name, pool, op)
    return b


def launch(pool: "Pool", fn, *args) -> None:
    """``fn(pool, *args)`` (a backend's operation) with the pool's GPU current, restored afterwards: Triton launches
    on the current device (with a pool on another GPU it refuses the pointers), and some torch ops of the reference
    fault there; the current stream is then that device's. Autograd is off throughout, on every backend: inputs that
    require grad (a token, ``q0``, a state) would leave a history on the pool's tensors, growing call after call (the
    flag is set by the function form: ``with torch.no_grad()`` costs several microseconds of host time per call)."""
    grad = torch.is_grad_enabled()
    torch.set_grad_enabled(False)
    try:
        if pool.device.type != "cuda":
            fn(pool, *args)
            return
        with torch.cuda.device(pool.device):
            fn(pool, *args)
    finally:
        torch.set_grad_enabled(grad)
