"""Runtime: clusters, binding and running schedules (ARCHITECTURE.md, "Runtime")."""

from purlin.atom.epilogue import Epilogue
from purlin.runtime.api import RunResult, run
from purlin.runtime.cluster import Cluster
from purlin.runtime.varlen import VarLenBound, bind_varlen

__all__ = ["Cluster", "Epilogue", "RunResult", "VarLenBound", "bind_varlen", "run"]
