"""Purlin: GPU collective communication inside a node, as layouts, schedules and atoms.

>>> import purlin
>>> purlin.collectives.all_reduce(4).nranks
4
"""

from purlin.errors import (CapabilityError, ExecutionError, PlanError, PurlinError,
                           PurlinTimeoutError, SpecError, VerificationError)
from purlin.spec import (Collective, Layout, Op, collectives, copy, dtype, reduce, reference,
                         standard)

from purlin.runtime import Cluster, run
from purlin.snac import Schedule, plan, verify
import purlin.trace  # noqa: E402,F401  (registers the cost model with strategy="auto")

__version__ = "0.1.0"

__all__ = [
    "CapabilityError", "Collective", "ExecutionError", "Layout", "Op", "PlanError",
    "PurlinError", "PurlinTimeoutError", "SpecError", "VerificationError", "collectives", "copy",
    "dtype", "reduce", "reference", "standard", "Cluster", "Schedule", "plan", "run", "verify",
]
