"""Launches of a ``@triton.jit`` kernel that skip Triton's per-call argument binding once the kernel is compiled:
on the host, binding and specialising the arguments cost about half of an eager flush (docs/DESIGN.md, "Triton:
host-side launches").

A :class:`Launcher` calls ``fn[grid]`` (inside ``compile_context``) the first time it sees a key, keeps the
``CompiledKernel`` and afterwards calls ``CompiledKernel[grid](*args)``, as ``JITFunction.run`` ends (Triton
3.5-3.9). Its key is at least as fine as Triton's (the current device, each tensor's dtype and 16-byte alignment, the
other arguments by value, the options, the launch-time knobs), so a kept kernel only meets arguments Triton would give
the same binary, and no compile can happen on the direct path. Tensors go as their addresses, checked to be on the
current device (Triton's launcher would ask the driver per pointer). :meth:`Launcher.prepare` takes the arguments that
stay the same from launch to launch once. Under ``TRITON_INTERPRET=1`` every call goes through ``fn[grid]``.

:func:`per_pool` keeps what the flush, step and states hosts prepare for a pool, for as long as the pool's memory
lives and stays where it is.
"""

from __future__ import annotations

import contextlib
from typing import Callable, TypeVar

import torch
import triton
from torch.utils.weak import WeakIdKeyDictionary

T = TypeVar("T")


def _knob_state() -> tuple:
    """The Triton settings read at launch time that change what ``JITFunction.run`` compiles."""
    knobs = getattr(triton, "knobs", None)
    if knobs is None:
        return ()
    return (getattr(knobs.runtime, "debug", None), getattr(knobs.compilation, "instrumentation_mode", None))


class Launcher:
    """``launcher(grid, args, options)`` launches ``fn`` like ``fn[grid](**args, **options)``.

    Args:
        fn: the ``@triton.jit`` function.
        compile_context: a context manager factory entered around every call that may compile.
        direct: launch cached kernels directly (False: always through ``fn[grid]``, for comparisons); default: when
            ``fn`` is a compiled ``JITFunction`` (not under the interpreter).
        current_device: the device index Triton launches on (``torch.cuda.current_device``; injectable for tests).
    """

    def __init__(self, fn, compile_context: Callable = contextlib.nullcontext, direct: bool | None = None,
                 current_device: Callable[[], int] = torch.cuda.current_device):
        self.fn = fn
        self.name = getattr(fn, "__name__", repr(fn))
        self.names = tuple(fn.arg_names)
        self.compile_context = compile_context
        self.direct = isinstance(fn, triton.runtime.jit.JITFunction) if direct is None else direct
        self.current_device = current_device
        self.kernels: dict = {}

    def key(self, args: dict, options: dict) -> tuple:
        """The launch's key (what Triton specialises on; see the module's docstring)."""
        return self._prepare(args, options)[0]

    def _prepare(self, args: dict, options: dict) -> tuple[tuple, list]:
        """(the key, the arguments in signature order with each tensor as its address)."""
        device = self.current_device()
        parts = [device]
        values = []
        for name in self.names:
            try:
                v = args[name]
            except KeyError:
                raise TypeError(f"{self.name} takes {self.names}, got {tuple(args)}") from None
            part, value = self._part(name, v, device)
            parts.append(part)
            values.append(value)
        parts.append(tuple(sorted(options.items())))
        parts.append(_knob_state())
        return tuple(parts), values

    def _part(self, name: str, v, device: int | None) -> tuple:
        """(the key part, the launch value) of argument ``name``; a tensor off ``device`` (unless None) is refused."""
        if isinstance(v, torch.Tensor):
            ptr = v.data_ptr()
            if device is not None and v.get_device() != device:
                raise ValueError(f"{self.name}: argument {name} is on {v.device}, but the current device is "
                                 f"{device}; make the tensors' device current (leapquant.flush does)")
            return (v.dtype, ptr % 16 == 0), ptr
        if isinstance(v, (bool, int, float, str, type(None))):
            return v, v
        raise TypeError(f"{self.name}: argument {name} of type {type(v).__name__} has no launch key")

    def prepare(self, static: dict, options: dict) -> "Prepared":
        """The launches of ``fn`` that share ``static`` (every argument but a few) and ``options``: the static
        arguments' launch values (the tensors' addresses) are taken once, here, and stay out of the key. The static
        tensors must stay where they are (same objects, same addresses) for as long as the result is used; the caller
        prepares again when they move."""
        return Prepared(self, static, options)

    def __call__(self, grid: tuple, args: dict, options: dict) -> None:
        if not self.direct:
            self._bound(grid, args, options)
            return
        key, values = self._prepare(args, options)
        self._launch(self.kernels, key, grid, values, args, {}, options)

    def _launch(self, kernels: dict, key: tuple, grid: tuple, values: list, static: dict, dynamic: dict,
                options: dict) -> None:
        """The kernel kept in ``kernels`` under ``key`` launched with ``values``; without one, a bound launch with the
        arguments ``static`` and ``dynamic`` (merged only then: not on the direct path), whose compiled kernel is then
        kept."""
        kernel = kernels.get(key)
        if kernel is None:
            kernel = self._bound(grid, {**static, **dynamic}, options)
            # a kernel compiled in the background would come back as a future: launched, not kept
            if hasattr(kernel, "function") and hasattr(kernel, "__getitem__"):
                kernels[key] = kernel
            return
        kernel[tuple(grid) + (1,) * (3 - len(grid))](*values)

    def _bound(self, grid: tuple, args: dict, options: dict):
        """``fn[grid](**args, **options)`` inside the compile context. The argument names are checked here, off the
        direct path: a key is only kept after its names passed, and :meth:`key` refuses a missing one."""
        if set(args) != set(self.names):
            raise TypeError(f"{self.name} takes {self.names}, got {tuple(args)}")
        with self.compile_context():
            return self.fn[grid](**args, **options)


class Prepared:
    """``prepared(grid, dynamic)`` launches ``fn`` like ``launcher(grid, {**static, **dynamic}, options)``
    (:meth:`Launcher.prepare`). Its key is the launcher's less the parts that cannot change here (the static
    arguments and the options): the current device, the knobs and the dynamic arguments. Its kernels are kept apart
    from the launcher's, so the first launch of each key binds."""

    def __init__(self, launcher: Launcher, static: dict, options: dict):
        self.launcher = launcher
        self.static = dict(static)
        self.options = dict(options)
        unknown = set(static) - set(launcher.names)
        if unknown:
            raise TypeError(f"{launcher.name} takes {launcher.names}, got {tuple(static)}")
        self.dynamic = tuple(n for n in launcher.names if n not in static)
        self.positions = tuple(launcher.names.index(n) for n in self.dynamic)
        # the launch values in signature order, the dynamic ones filled in per launch; the static arguments' key parts
        # are not needed: they are the same for every launch of this object, whose kernels are its own
        self.template = [launcher._part(n, static[n], None)[1] if n in static else None for n in launcher.names]
        # the devices of the static tensors (-1 on the CPU), checked against the current device per launch
        self.devices = frozenset(v.get_device() for v in static.values() if isinstance(v, torch.Tensor))
        self.kernels: dict = {}

    def __call__(self, grid: tuple, dynamic: dict) -> None:
        la = self.launcher
        if not la.direct:
            la._bound(grid, {**self.static, **dynamic}, self.options)
            return
        device = la.current_device()
        if self.devices and self.devices != {device}:
            raise ValueError(f"{la.name}: the prepared tensors are on device(s) {sorted(self.devices)}, but the "
                             f"current device is {device}; make their device current (leapquant.flush does)")
        values = list(self.template)
        parts = [device, _knob_state()]
        for name, pos in zip(self.dynamic, self.positions):
            try:
                v = dynamic[name]
            except KeyError:
                raise TypeError(f"{la.name}: missing argument {name} (dynamic: {self.dynamic})") from None
            part, values[pos] = la._part(name, v, device)
            parts.append(part)
        if len(dynamic) != len(self.dynamic):
            raise TypeError(f"{la.name}: dynamic arguments {self.dynamic}, got {tuple(dynamic)}")
        la._launch(self.kernels, tuple(parts), grid, values, self.static, dynamic, self.options)


# per pool memory, keyed weakly by the pool's raw tensor (what is kept goes with it):
# {key: (the tensors' (address, dtype)s, what make() returned)}
_PER_POOL = WeakIdKeyDictionary()


def per_pool(raw: torch.Tensor, key: tuple, tensors, make: Callable[[], T]) -> T:
    """What ``make()`` returns for ``key`` (its first element the op, e.g. ``"flush"``) and the pool over ``raw``,
    made once and kept while ``tensors`` (the pool's tensors that ``make`` binds, None allowed) keep their addresses
    and dtypes: made again when one moved. Keyed by the memory, not the pool object, so a pool made afresh over the
    same tensors, such as the custom op's, finds it; what is kept holds the tensors, so their memory cannot go to
    another pool meanwhile."""
    memory = [None if t is None else (t.data_ptr(), t.dtype) for t in tensors]
    kept = _PER_POOL.get(raw)
    if kept is None:
        kept = _PER_POOL[raw] = {}
    entry = kept.get(key)
    if entry is None or entry[0] != memory:
        entry = kept[key] = (memory, make())
    return entry[1]
