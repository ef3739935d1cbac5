"""LeapQuant: int8 + rank-R compressed recurrent state for KDA / Gated DeltaNet decode.

    import leapquant
    pool = leapquant.Pool(num_slots=257, heads=32, gate="kda", device="cuda")   # slot 0: the null slot
    pool.load_states(slots, state, state_v_first=False)   # a prefill's fp32 state [N, HV, K, V] into its slots
    o = leapquant.step(pool, idx, q, k, v, g, beta)       # one decode token (q [B, H, K]) or T draft tokens
                                                          # (q [B, T, H, K]): full rings flushed, the output returned
    leapquant.accept(pool, idx, num_accepted)             # keep the first num_accepted[b] drafts (int32 [B])
    o = leapquant.step_packed(pool, idx, mixed_qkv, a, b, A_log=A_log, dt_bias=dt_bias)  # vLLM's packed decode call
    pool.copy_slots(src, dst)                             # a prefix's slots into others' (prefix caching)
    leapquant.flush(pool, idx)                            # the flush alone (in place; idx int32 [N])
    state = pool.states(slots, state_v_first=False)       # the states back, for a prefill that continues them

``leapquant.reference`` is the fp32 definition of correct; ``leapquant.backends()`` lists the backends and why one
cannot run here. The tools (demo, decode simulation, prefill round trip) are in ``leapquant.tools``.
"""

from . import formulas, reference
from .backends import Backend, BackendError, Requirements
from .registry import BackendInfo, backends, register
from .registry import get as get_backend
from .constants import EPS, QMAX
from .ops import accept, flush, run, select, step
from .geometry import Geometry
from .pool import Pool, start_matrix
from .packed import PackedWorkspace, packed_workspace, step_packed

__version__ = "0.1.0"

__all__ = [
    "Backend",
    "BackendError",
    "BackendInfo",
    "EPS",
    "Geometry",
    "PackedWorkspace",
    "Pool",
    "QMAX",
    "Requirements",
    "accept",
    "backends",
    "flush",
    "formulas",
    "get_backend",
    "packed_workspace",
    "reference",
    "register",
    "run",
    "select",
    "start_matrix",
    "step",
    "step_packed",
]
