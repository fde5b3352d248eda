"""One call that plans, verifies and runs: ``purlin.run(collective, inputs)``.

>>> import numpy as np
>>> from purlin.spec import collectives
>>> res = run(collectives.all_gather(2), [np.array([1.0, 2.0]), np.array([3.0, 4.0])])
>>> res.outputs[1].tolist(), res.schedule.strategy
([1.0, 2.0, 3.0, 4.0], 'direct-push')
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from purlin.errors import ExecutionError
from purlin.runtime.cluster import Cluster
from purlin.snac.ir import Schedule
from purlin.spec.collective import Collective
from purlin.spec.reference import infer_sizing
from purlin.spec.sizing import Sizing


@dataclass
class RunResult:
    """Outputs per rank, the schedule that produced them and (if asked) raw trace records."""

    outputs: list
    schedule: Schedule
    trace: list = field(default_factory=list)


def run(collective: Collective, inputs, *, cluster: Cluster | None = None,
        strategy: str = "direct-push", chunks: int = 1, lanes: int = 1,
        sizing: Sizing | None = None, timeout: float = 5.0, trace: bool = False) -> RunResult:
    """Plan ``collective`` with ``strategy``, verify it, run it once on ``cluster`` (default:
    the cpu datapath) and return the outputs. Chunk sizes come from ``sizing`` or, for even
    chunks, from the input lengths. Torch tensors in give torch tensors out on the cpu
    datapath."""
    arrays = list(inputs)
    if len(arrays) != collective.nranks:
        raise ExecutionError(f"{collective.name} on {collective.nranks} ranks needs "
                             f"{collective.nranks} inputs (one per rank, None for a rank "
                             f"without one), got {len(arrays)}")
    cluster = cluster or Cluster.cpu(collective.nranks)
    if sizing is None:
        host = [np.zeros(0) if x is None else np.zeros(_numel(x)) for x in arrays]
        sizing = infer_sizing(collective, host)
    dtype = next((_dtype_name(x) for x in arrays if x is not None and _numel(x)), "float32")
    sizing = collective.sized(chunk_sizes=dict(sizing.chunks), dtype=dtype)
    bound = cluster.bind(collective, strategy, sizing=sizing, chunks=chunks, lanes=lanes,
                         timeout=timeout)
    outputs = bound(arrays, trace=trace)
    return RunResult(outputs, bound.schedule, list(getattr(bound, "last_trace", [])))


def _numel(x) -> int:
    shape = getattr(x, "shape", None)
    return int(np.prod(shape)) if shape is not None else len(x)


def _dtype_name(x) -> str:
    dt = getattr(x, "dtype", None)
    if dt is None:
        raise ExecutionError(f"inputs must be arrays or tensors, got {type(x).__name__}")
    return str(dt).removeprefix("torch.")
