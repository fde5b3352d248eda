"""Runtime: clusters, binding and running schedules (DESIGN.md §4)."""

from purlin.runtime.api import RunResult, run
from purlin.runtime.cluster import Bound, Cluster

__all__ = ["Bound", "Cluster", "RunResult", "run"]
