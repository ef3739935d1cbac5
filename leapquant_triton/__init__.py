"""LeapQuant's Triton backend: :class:`TritonBackend` (registered as ``"triton"``), the kernels in :mod:`.kernel`
and their launch in :mod:`.host`.

Importing this package does not import Triton; the backend's ``available()`` says whether it can run here.
"""

from .backend import TritonBackend

__all__ = ["TritonBackend"]
