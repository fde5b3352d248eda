"""Clusters: which ranks run where, and binding a collective to them.

>>> import numpy as np
>>> from purlin.spec import collectives
>>> ar = Cluster.cpu(2).bind(collectives.all_reduce(2), count=4, dtype="float64")
>>> [o.tolist() for o in ar([np.arange(4.0), np.ones(4)])]
[[1.0, 2.0, 3.0, 4.0], [1.0, 2.0, 3.0, 4.0]]
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import numpy as np

from purlin.errors import CapabilityError, ExecutionError, PlanError, SpecError
from purlin.snac.ir import Schedule
from purlin.snac.planner import plan
from purlin.spec.collective import Collective


@dataclass(frozen=True)
class Cluster:
    """``kind`` is "cpu" (numpy, threads), "local" (one GPU per rank in this process) or
    "virtual" (n ranks sharing one GPU, launched together)."""

    kind: str
    nranks: int
    devices: tuple[int, ...] = ()

    @classmethod
    def cpu(cls, n: int) -> "Cluster":
        """n ranks on the cpu datapath (works everywhere)."""
        if not isinstance(n, int) or n < 1:
            raise SpecError(f"a cluster needs at least 1 rank, got {n!r}")
        return cls("cpu", n)

    @classmethod
    def local(cls, n: int | None = None) -> "Cluster":
        """One rank per visible GPU (or the first ``n``), peer access enabled both ways."""
        from purlin.atom import sm

        return sm.local_cluster(cls, n)

    @classmethod
    def virtual(cls, n: int, device: int = 0) -> "Cluster":
        """n ranks on one GPU, all resident in one launch."""
        from purlin.atom import sm

        return sm.virtual_cluster(cls, n, device)

    @classmethod
    def best(cls, n: int = 2) -> "Cluster":
        """GPUs if there are enough for ``n`` ranks, else n virtual ranks on one GPU, else cpu."""
        try:
            from purlin.atom import sm

            count = sm.device_count()
        except Exception:
            count = 0
        if count >= n:
            return cls.local(n)
        if count >= 1:
            return cls.virtual(n)
        return cls.cpu(n)

    @property
    def datapath(self) -> str:
        return "cpu" if self.kind == "cpu" else "sm"

    def bind(self, collective: Collective, strategy: str = "direct-push", *, count=None,
             nbytes=None, dtype="float32", chunk_sizes=None, sizing=None, chunks: int = 1,
             lanes: int = 1, lanes_by: str = "piece", timeout: float = 5.0,
             datapath: str | None = None, **options) -> "Bound":
        """Plan, verify and prepare ``collective`` for this cluster; call the result to run it.

        Everything is allocated here (buffers, flags, instruction tables); a call only runs.
        ``datapath`` says how bytes move: "sm" (the GPU default), "ce" (copy engines, reductions
        on sm; on a cpu cluster the mixed schedule runs on the cpu datapath) or "auto".
        ``chunks``, ``lanes`` and ``lanes_by`` shape the plan (``purlin.snac.plan``).
        """
        if collective.nranks != self.nranks:
            raise PlanError(f"{collective.name} is declared for {collective.nranks} ranks but "
                            f"the cluster has {self.nranks}")
        ce = sys.modules.get("purlin.atom.ce")  # loaded once a ce collective was bound
        if ce is not None and self.devices:
            ce.refuse_stuck(self.devices)
        choice = None
        if strategy == "auto":
            from purlin.runtime.auto import select

            size = ({"chunk_sizes": dict(sizing.chunks), "dtype": sizing.dtype.name}
                    if sizing is not None else {"count": count, "nbytes": nbytes,
                                                "dtype": dtype, "chunk_sizes": chunk_sizes})
            choice = select(collective, self, **size)
            strategy, chunks, lanes = choice.strategy, choice.chunks, choice.lanes
            lanes_by = choice.lanes_by
        datapath, caps = self._datapath(collective, datapath, count=count, nbytes=nbytes,
                                        dtype=dtype, chunk_sizes=chunk_sizes, sizing=sizing)
        if choice is not None and self.kind != "cpu":
            options = _auto_options(choice, options, sm=datapath == "sm")
        schedule = plan(collective, strategy, count=count, nbytes=nbytes, dtype=dtype,
                        chunk_sizes=chunk_sizes, sizing=sizing, chunks=chunks, lanes=lanes,
                        lanes_by=lanes_by, capabilities=caps)
        if self.kind == "cpu":
            return CpuBound(self, schedule, timeout)
        if datapath == "ce":
            from purlin.atom import ce

            return ce.bind(self, schedule, timeout=timeout, **options)
        from purlin.atom import sm

        return sm.bind(self, schedule, timeout=timeout, **options)

    def _datapath(self, collective, datapath, **size):
        """The datapath a bind runs on and the capabilities the planner must respect."""
        if datapath is None:
            return self.datapath, None
        if datapath == "auto":
            if self.kind == "cpu":
                return "cpu", None
            from purlin.atom.ce import auto_datapath

            datapath = auto_datapath(collective, **size)
        allowed = ("cpu", "ce", "auto") if self.kind == "cpu" else ("sm", "ce", "auto")
        if datapath not in allowed:
            raise CapabilityError(f"datapath {datapath!r} cannot run on {self!r}; choose one of "
                                  f"{', '.join(allowed)}")
        if datapath == "ce":
            from purlin.atom import capabilities

            return "ce", capabilities("ce")
        return datapath, None

    def __repr__(self) -> str:
        where = f" on GPUs {list(self.devices)}" if self.devices else ""
        return f"Cluster.{self.kind}({self.nranks} ranks{where})"


def _auto_options(choice, options: dict, sm: bool) -> dict:
    """The bind options of an ``auto`` choice under those the caller gave: blocks per lane,
    and on the sm datapath its protocol and PDL (a fused protocol with ``fallback``). The
    table measured its blocks per lane with its protocol, so the caller's blocks per lane or
    protocol replace the table's pair."""
    mine = choice.sm_options() if sm else {"blocks_per_lane": choice.blocks_per_lane}
    if options.get("blocks_per_lane") is not None or "protocol" in options:
        mine = {k: v for k, v in mine.items() if k not in ("blocks_per_lane", "protocol")}
    if mine.get("protocol", "").startswith("fused"):
        mine["fallback"] = True  # measured at a nearby size: the interpreter where it must
    if sm and mine.get("blocks_per_lane") is not None:
        mine["fit"] = True  # measured on some cluster: cut to what fits on this one
    given = {k: v for k, v in options.items() if not (k == "blocks_per_lane" and v is None)}
    return {**mine, **given}


class Bound:
    """A collective ready to run on a cluster: ``bound(inputs) -> outputs``."""

    schedule: Schedule
    cluster: Cluster

    def check_inputs(self, inputs) -> list:
        s = self.schedule
        if len(inputs) != s.nranks:
            raise ExecutionError(f"{s.collective.name} on {s.nranks} ranks needs {s.nranks} "
                                 f"inputs, got {len(inputs)}")
        sizing = s.sizing
        out = []
        for r, x in enumerate(inputs):
            want = sizing.input_count(r)
            if x is None:
                if want:
                    raise ExecutionError(f"rank {r} needs an input of {want} elements, got None")
                out.append(x)
                continue
            n = int(np.prod(x.shape)) if hasattr(x, "shape") else len(x)
            if n != want:
                raise ExecutionError(f"input of rank {r} has {n} elements; this binding of "
                                     f"{s.collective.name} expects {want}")
            out.append(x)
        return out


class CpuBound(Bound):
    """A schedule bound to the cpu datapath (numpy arrays in and out)."""

    def __init__(self, cluster: Cluster, schedule: Schedule, timeout: float):
        from purlin.runtime.threads import CpuRun

        self.cluster, self.schedule = cluster, schedule
        self.run = CpuRun(schedule, timeout)
        self.last_trace: list = []

    def __call__(self, inputs, out=None, trace: bool = False) -> list[np.ndarray]:
        """Run once. ``inputs[r]`` is rank r's array (any shape, flattened); ``out`` may give
        the output arrays; in-place (an output sharing memory with an input) is refused."""
        s = self.schedule
        inputs = self.check_inputs(inputs)
        dt = self.run.np_dtype
        flat_in, given_in = [], []
        for r, x in enumerate(inputs):
            if x is None:
                flat_in.append(np.zeros(0, dtype=dt))
                continue
            x = np.asarray(x)
            if x.dtype != dt:
                raise ExecutionError(f"input of rank {r} is {x.dtype}; this binding moves {dt}")
            given_in.append(x)  # reshape may copy (non-contiguous): check overlap on the original
            flat_in.append(x.reshape(-1))
        sizing = s.sizing
        if out is None:
            out = [np.empty(sizing.output_count(r), dtype=dt) for r in range(s.nranks)]
        if len(out) != s.nranks:
            raise ExecutionError(f"{s.collective.name} on {s.nranks} ranks needs {s.nranks} "
                                 f"outputs, got {len(out)}")
        flat_out, copy_back = [], []
        for r, o in enumerate(out):
            o = np.asarray(o)
            if o.size != sizing.output_count(r) or o.dtype != dt:
                raise ExecutionError(f"output of rank {r} must hold {sizing.output_count(r)} "
                                     f"{dt} elements, got {o.size} {o.dtype}")
            if any(np.shares_memory(o, x) for x in given_in if x.size):
                raise ExecutionError(f"output of rank {r} shares memory with an input: in-place "
                                     "collectives are not supported; pass a separate output")
            flat = o.reshape(-1)
            if o.size and not np.shares_memory(flat, o):  # reshape copied: write back after
                copy_back.append((o, flat))
            flat_out.append(flat)
        records = [] if trace else None
        self.run(flat_in, flat_out, records)
        for o, flat in copy_back:
            np.copyto(o, flat.reshape(o.shape))
        self.last_trace = records or []
        return list(out)

    def __repr__(self) -> str:
        return f"<bound {self.schedule.title()} on {self.cluster}>"
