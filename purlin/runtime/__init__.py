"""Runtime: clusters, binding and running schedules (ARCHITECTURE.md, "Runtime")."""

from purlin.runtime.api import RunResult, run
from purlin.runtime.cluster import Bound, Cluster

__all__ = ["Bound", "Cluster", "RunResult", "run"]
