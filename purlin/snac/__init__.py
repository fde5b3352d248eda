"""SNAC: Stage, Notify, And Consume — the orchestration layer (ARCHITECTURE.md, "SNAC").

>>> from purlin.spec import collectives
>>> from purlin.snac import plan
>>> print(plan(collectives.broadcast(2), "direct-push", count=4).render())  # doctest: +ELLIPSIS
broadcast (copy) on 2 ranks, direct-push, 1 chunk(s) x 1 lane(s), float32
...
"""

from purlin.snac.ir import Consume, Flag, Notify, Region, Schedule, Stage, Wait
from purlin.snac.planner import Capabilities, plan
from purlin.snac.strategies import STRATEGIES
from purlin.snac.verify import Report, verify

__all__ = ["Capabilities", "Consume", "Flag", "Notify", "Region", "Report", "STRATEGIES",
           "Schedule", "Stage", "Wait", "plan", "verify"]
