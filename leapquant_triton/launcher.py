"""Launches of a ``@triton.jit`` kernel that skip Triton's per-call argument binding once the kernel is compiled.

``fn[grid](**args)`` (``JITFunction.run``) binds every argument, computes its specialisation (dtype and 16-byte
alignment of each pointer; type, divisibility by 16 and ``== 1`` of each integer), hashes that with the options into
its cache key and only then launches. On the H200 machine's host that was about half of the Triton backend's 71-80 us
per eager call (bench/NOTES.md, session 9); the other quarter was the ``mma.sync`` switch set around every launch.

A :class:`Launcher` calls ``fn[grid]`` (inside ``compile_context``) the first time it sees a key, keeps the
``CompiledKernel`` that call returns, and afterwards launches that kernel through ``CompiledKernel[grid](*args)``, the
same launcher call that ``JITFunction.run`` ends with (unchanged in Triton 3.4-3.9). Its key is at least as fine as
Triton's, so a cached kernel is only ever launched with arguments Triton would have given the same binary: the
current CUDA device (Triton's caches are per device, and a kernel's handles belong to the device it was loaded on),
each tensor's dtype and whether its address is a multiple of 16, every other argument by value, the options, and
the Triton settings that enter compilation at launch time (``knobs.runtime.debug``, the instrumentation mode). No
compile can happen on the direct path, so the switch that ``compile_context`` sets is not needed there.

A direct launch passes each tensor as its address (an int), which Triton's launcher takes as it is. Given a tensor,
that launcher calls its ``data_ptr`` from C and asks the driver whether the address can be reached from the current
device (``cuPointerGetAttribute``), per pointer and per launch. The launcher here checks the same thing without the
driver: every tensor must be on the current device (``Tensor.get_device``), else a ValueError names it; a launch on
another GPU's memory would fault in the kernel instead of being refused.

Under ``TRITON_INTERPRET=1`` every call goes through ``fn[grid]``.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
import triton


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
            if isinstance(v, torch.Tensor):
                ptr = v.data_ptr()
                parts.append((v.dtype, ptr % 16 == 0))
                values.append(ptr)
                if v.get_device() != device:
                    raise ValueError(f"{self.name}: argument {name} is on {v.device}, but the current device is "
                                     f"{device}; make the tensors' device current (leapquant.flush does)")
            elif isinstance(v, (bool, int, float, str, type(None))):
                parts.append(v)
                values.append(v)
            else:
                raise TypeError(f"{self.name}: argument {name} of type {type(v).__name__} has no launch key")
        parts.append(tuple(sorted(options.items())))
        parts.append(_knob_state())
        return tuple(parts), values

    def __call__(self, grid: tuple, args: dict, options: dict) -> None:
        if not self.direct:
            self._bound(grid, args, options)
            return
        key, values = self._prepare(args, options)
        kernel = self.kernels.get(key)
        if kernel is None:
            kernel = self._bound(grid, args, options)
            # a kernel compiled in the background would come back as a future: launched, not kept
            if hasattr(kernel, "function") and hasattr(kernel, "__getitem__"):
                self.kernels[key] = kernel
            return
        kernel[tuple(grid) + (1,) * (3 - len(grid))](*values)

    def _bound(self, grid: tuple, args: dict, options: dict):
        """``fn[grid](**args, **options)`` inside the compile context. The argument names are checked here, off the
        direct path: a key is only kept after its names passed, and :meth:`key` refuses a missing one."""
        if set(args) != set(self.names):
            raise TypeError(f"{self.name} takes {self.names}, got {tuple(args)}")
        with self.compile_context():
            return self.fn[grid](**args, **options)
