"""LeapQuant's Triton backend: :class:`TritonBackend` (registered as ``"triton"``). Per op (flush, step, states) a
kernel module of ``@triton.jit`` code (``<op>_kernel``) and a host module that builds and launches it (``<op>``);
:mod:`.targets` the targets and compile options, :mod:`.launcher` the launches and their per-pool cache,
:mod:`.portability` the ahead-of-time compile check.

Importing this package does not import Triton; the backend's ``available()`` says whether it can run here.
"""

from .backend import TritonBackend

__all__ = ["TritonBackend"]
