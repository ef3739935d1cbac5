"""LeapQuant: the flush of int8 + rank-R compressed recurrent state for KDA / Gated DeltaNet layers.

    import leapquant
    pool = leapquant.Pool(num_slots=257, device="cuda")
    leapquant.flush(pool, idx, backend="auto")      # in place; idx int32 [N]

``leapquant.reference`` is the fp32 definition of correct; ``leapquant.backends()`` lists the backends and why one
cannot run here.
"""

from . import formulas, reference
from .backends import Backend, BackendError, Requirements
from .registry import BackendInfo, backends, register
from .registry import get as get_backend
from .constants import EPS, QMAX
from .ops import flush, run, select, step
from .geometry import Geometry
from .pool import Pool, start_matrix

__version__ = "0.1.0"

__all__ = [
    "Backend",
    "BackendError",
    "BackendInfo",
    "EPS",
    "Geometry",
    "Pool",
    "QMAX",
    "Requirements",
    "backends",
    "flush",
    "formulas",
    "get_backend",
    "reference",
    "register",
    "run",
    "select",
    "start_matrix",
    "step",
]
