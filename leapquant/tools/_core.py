"""The core names the tools need beyond the public ``leapquant`` API, in one place.

The decode tools report which backend ran ``leapquant.step`` and ``load_states`` / ``states``; ``leapquant.select``
answers that for the flush only. Should the core export these two, this module becomes two re-exports of it.
"""

from leapquant.ops import select_step
from leapquant.states import select_states

__all__ = ["select_states", "select_step"]
