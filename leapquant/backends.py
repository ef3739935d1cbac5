"""What a backend is: the :class:`Backend` base class and the :class:`Requirements` it declares.

A backend is a :class:`Backend` subclass registered under the entry-point group ``leapquant.backends``
(``name = "package.module:Class"``); the class is instantiated with no arguments. It declares its
:class:`Requirements` and answers two questions with a reason: :meth:`Backend.available` (can it be imported and
run on this machine at all) and :meth:`Backend.supports` (can it flush this pool). The registry and the ``"auto"``
choice are :mod:`leapquant.registry`'s. This module imports nothing else of the package: a third-party backend
imports it alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .pool import Pool

ENTRY_POINT_GROUP = "leapquant.backends"
# the operations a backend may implement: flush is required, the others optional ("force_flush": flush with
# force=True, partially filled rings included; "step_tokens": a step of T > 1 tokens per row)
OPS = ("flush", "force_flush", "step", "step_tokens", "states")


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
    # whether flush(..., force=True) is implemented: partially filled rings flushed too (SPEC §2, "Forced flush")
    partial_rings: bool = False
    # whether step takes T > 1 tokens per row (token tensors [B, T, ...], SPEC §6.1)
    multi_token: bool = False

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

    def flush(self, pool: "Pool", idx: torch.Tensor, force: bool = False) -> None:
        """Flush the due programs of ``idx`` (int32 ``[N]`` on the pool's device) in place.

        Called with validated arguments. Must not synchronise with the host and must launch the same work for the
        same pool and ``N``, so that it can be captured in a CUDA graph. Writes nothing outside the due programs.
        ``force`` (passed, positionally, only to a backend that sets :attr:`partial_rings`): every ring holding an
        entry is due, ``1 <= hcnt <= L``, read up to its ``hcnt`` entries, and a flushed program's ``hcnt`` set to
        ``L`` (SPEC §2, "Forced flush").
        """
        raise NotImplementedError

    def step(self, pool: "Pool", idx: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             g: torch.Tensor, beta: torch.Tensor, scale: float, use_qk_l2norm: bool, out: torch.Tensor) -> None:
        """One decode token per row of ``idx`` in place (SPEC §6): full rings flushed first, then the token into the
        ring and ``out[n] = scale S_t q`` (zero for rows that name no real slot). Called with validated arguments:
        ``q``, ``k`` ``[N, H, K]``, ``v`` ``[N, HV, V]``, ``g`` ``[N, HV, K]`` (KDA) or ``[N, HV]``, ``beta``
        ``[N, HV]``, ``out`` ``[N, HV, V]``, each with a unit last stride. Same rules as :meth:`flush` (no host sync,
        graph-capturable). Backends without a decode step leave it out (:meth:`implements`).

        A backend that sets :attr:`multi_token` also takes T > 1 tokens per row (SPEC §6.1): ``q``, ``k``
        ``[N, T, H, K]``, ``v`` ``[N, T, HV, V]``, ``g`` ``[N, T, HV, K]`` or ``[N, T, HV]``, ``beta`` ``[N, T, HV]``,
        ``out`` ``[N, T, HV, V]``: the rings that cannot hold T more entries flushed first, then T one-token steps,
        and the pool's history for :func:`leapquant.accept` written where the pool keeps one."""
        raise NotImplementedError

    def load_states(self, pool: "Pool", slots: torch.Tensor, states: torch.Tensor, state_v_first: bool) -> None:
        """Compress fp32 ``states`` (``[n, HV, V, K]``, or ``[n, HV, K, V]`` where not ``state_v_first``; any strides)
        into the checkpoints of ``slots`` (int32 or int64 ``[n]`` on the pool's device) by SPEC §3 steps 5-10, reset
        their rings as a flush does and set their ``hcnt`` to 0 (SPEC §5). Called with validated arguments; same rules
        as :meth:`flush` (no host sync, graph-capturable). Backends without it leave it out (:meth:`implements`)."""
        raise NotImplementedError

    def states(self, pool: "Pool", slots: torch.Tensor, out: torch.Tensor, state_v_first: bool) -> None:
        """Write the rebuilt states of ``slots`` (SPEC §3 steps 1-4) into ``out`` (fp32 ``[n, HV, V, K]``, or
        ``[n, HV, K, V]`` where not ``state_v_first``; each head dense). Writes nothing else; no host sync."""
        raise NotImplementedError

    def implements(self, op: str) -> bool:
        """Whether the backend implements ``op`` (one of :data:`OPS`; ``"states"`` means both :meth:`load_states`
        and :meth:`states`; ``"force_flush"`` a :meth:`flush` that takes ``force``, :attr:`partial_rings`)."""
        if op not in OPS:
            raise ValueError(f"op must be one of {OPS}, got {op!r}")
        if op == "force_flush":
            return self.partial_rings and self.implements("flush")
        if op == "step_tokens":
            return self.multi_token and self.implements("step")
        names = ("load_states", "states") if op == "states" else (op,)
        return all(getattr(type(self), n) is not getattr(Backend, n) for n in names)

    def __repr__(self) -> str:
        return f"<leapquant backend {self.name!r}>"


class BackendError(RuntimeError):
    """A backend was asked for that cannot run here."""
