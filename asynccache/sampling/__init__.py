"""Deterministic epoch order and its partition over ranks and workers. Pure: no I/O, no torch.

See :mod:`.order` (what order the samples of an epoch come in) and :mod:`.partition`
(who reads which part, and what is left after a stop).
"""

from .order import EpochOrder
from .partition import Plan, Segment, consumed_to_remaining, plan

__all__ = ["EpochOrder", "Plan", "Segment", "consumed_to_remaining", "plan"]
