"""LeapQuant's TileLang backend: :func:`flush_kernel` (the kernel factory, ``kernel.py``) and the registered
``"tilelang"`` backend (``backend.py``) that drives a :class:`leapquant.Pool` with it.

``tilelang`` is imported on first use of the factory, so that the backend can be listed (as unavailable, with the
reason) on a machine without it.
"""

__all__ = ["flush_kernel", "due_list_capacity", "DUE_LIST_MAX"]


def __getattr__(name):
    if name in __all__:
        from . import kernel

        return getattr(kernel, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
