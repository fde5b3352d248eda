"""SNAC: Stage, Notify, And Consume — the orchestration layer (ARCHITECTURE.md, "SNAC").

>>> from purlin.spec import collectives
>>> from purlin.snac import plan
>>> print(plan(collectives.broadcast(2), "direct-push", count=4).render())  # doctest: +ELLIPSIS
broadcast (copy) on 2 ranks, direct-push, 1 chunk(s) x 1 lane(s), float32
...

Write a strategy of your own with ``@strategy(name)``: a function from a :class:`Piece` to the
:class:`Node` list of one route (ARCHITECTURE.md, "Add a strategy").
"""

from purlin.snac.determinism import DETERMINISTIC_STRATEGIES, check_deterministic
from purlin.snac.ir import Consume, Flag, Notify, Region, Schedule, Stage, Wait
from purlin.snac.planner import Capabilities, plan
from purlin.snac.routes import INTO_OUTPUT, PULL, SCRATCH, Node
from purlin.snac.strategies import (STRATEGIES, Piece, Strategy, check_route, strategy,
                                    unregister)
from purlin.snac.verify import Report, verify

__all__ = ["Capabilities", "Consume", "DETERMINISTIC_STRATEGIES", "Flag", "INTO_OUTPUT", "Node", "Notify", "PULL", "Piece",
           "Region", "Report", "SCRATCH", "STRATEGIES", "Schedule", "Stage", "Strategy", "Wait",
           "check_deterministic", "check_route", "plan", "strategy", "unregister", "verify"]
