"""LeapQuant's Triton backend: :class:`TritonBackend` (registered as ``"triton"``) and the kernel in :mod:`.kernel`.

Importing this package does not import Triton; the backend's ``available()`` says whether it can run here.
"""

from .backend import TritonBackend

__all__ = ["TritonBackend"]
