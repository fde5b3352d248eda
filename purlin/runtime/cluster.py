"""Clusters: which ranks run where, and binding a collective to them.

>>> import numpy as np
>>> from purlin.spec import collectives
>>> ar = Cluster.cpu(2).bind(collectives.all_reduce(2), count=4, dtype="float64")
>>> [o.tolist() for o in ar([np.arange(4.0), np.ones(4)])]
[[1.0, 2.0, 3.0, 4.0], [1.0, 2.0, 3.0, 4.0]]
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from purlin import atom
from purlin.atom.sm import is_fused
from purlin.errors import CapabilityError, PlanError, SpecError
from purlin.snac.planner import plan
from purlin.spec.collective import Collective


def _rank_count(n, what: str) -> int:
    """``n`` if it is a rank count (an int >= 1, not a bool), else a SpecError naming it."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise SpecError(f"{what} takes a number of ranks, an int >= 1; got {n!r}")
    return n


def check_timeout(timeout) -> float:
    """``timeout`` in seconds if it is a finite number > 0, else a SpecError naming it.

    >>> check_timeout(2)
    2.0
    >>> check_timeout(float("nan"))
    Traceback (most recent call last):
    ...
    purlin.errors.SpecError: timeout must be a finite number of seconds > 0, got nan
    """
    ok = (isinstance(timeout, (int, float)) and not isinstance(timeout, bool)
          and math.isfinite(timeout) and timeout > 0)
    if not ok:
        raise SpecError(f"timeout must be a finite number of seconds > 0, got {timeout!r}")
    return float(timeout)


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
        return cls("cpu", _rank_count(n, "Cluster.cpu"))

    @classmethod
    def local(cls, n: int | None = None) -> "Cluster":
        """One rank per visible GPU (or the first ``n``), peer access enabled both ways."""
        if n is not None:
            _rank_count(n, "Cluster.local")
        atom.load("ce").ask_for_queues()  # before CUDA starts: ce binds on it need them
        devices = atom.load("sm").local_devices(n)
        return cls("local", len(devices), devices)

    @classmethod
    def virtual(cls, n: int, device: int = 0) -> "Cluster":
        """n ranks on one GPU, all resident in one launch."""
        _rank_count(n, "Cluster.virtual")
        atom.load("ce").ask_for_queues()  # before CUDA starts: ce binds on it need them
        atom.load("sm").check_device(device)
        return cls("virtual", n, (device,) * n)

    @classmethod
    def best(cls, n: int = 2) -> "Cluster":
        """GPUs if there are enough for ``n`` ranks, else n virtual ranks on one GPU, else cpu."""
        try:
            count = atom.load("sm").device_count()
        except Exception:
            count = 0
        if count >= n:
            return cls.local(n)
        if count >= 1:
            return cls.virtual(n)
        return cls.cpu(n)

    @property
    def datapath(self) -> str:
        """The datapath a bind runs on unless told otherwise."""
        return "cpu" if self.kind == "cpu" else "sm"

    def bind(self, collective: Collective, strategy: str = "direct-push", *, count=None,
             nbytes=None, dtype="float32", chunk_sizes=None, sizing=None, chunks: int = 1,
             lanes: int = 1, lanes_by: str = "piece", timeout: float = 5.0,
             datapath: str | None = None, deterministic: bool = False, **options):
        """Plan, verify and prepare ``collective`` for this cluster; call the result to run it.

        Everything is allocated here (buffers, flags, instruction tables); a call only runs.
        ``datapath`` says how bytes move: "sm" (the GPU default), "ce" (copy engines, reductions
        on sm; on a cpu cluster the mixed schedule runs on the cpu datapath) or "auto".
        ``chunks``, ``lanes`` and ``lanes_by`` shape the plan (``purlin.snac.plan``);
        ``timeout`` (seconds, > 0) bounds every wait; ``options`` go to the datapath's bind.
        ``deterministic=True``: bitwise the same result for the same inputs whatever the
        strategy, chunks, lanes or arrival order (``plan(..., deterministic=True)``; ``auto``
        then picks among the strategies that qualify), on every datapath and protocol: each
        of them sums a step's sources in the order listed, in a fixed accumulation type, and
        rounds once (ARCHITECTURE.md, "Deterministic mode").
        A :class:`purlin.spec.varlen.VarLen` binds at its capacity and is called with counts
        (``purlin.runtime.varlen``).
        """
        from purlin.spec.varlen import VarLen

        if isinstance(collective, VarLen):  # planned at capacity; counts come per call
            from purlin.runtime.varlen import bind_varlen

            if any(x is not None for x in (count, nbytes, chunk_sizes, sizing)):
                raise SpecError(f"{collective.name} is sized by its capacity "
                                f"({collective.capacity} rows of {collective.row}); bind it "
                                "without count, nbytes, chunk_sizes or sizing")

            return bind_varlen(self, collective, strategy, dtype=dtype, chunks=chunks,
                               lanes=lanes, lanes_by=lanes_by, timeout=timeout,
                               datapath=datapath, deterministic=deterministic, **options)
        timeout = check_timeout(timeout)
        if collective.nranks != self.nranks:
            raise PlanError(f"{collective.name} is declared for {collective.nranks} ranks but "
                            f"the cluster has {self.nranks}")
        atom.refuse_stuck(self.devices)
        choice = None
        if strategy == "auto":
            from purlin.runtime.auto import select

            size = ({"chunk_sizes": dict(sizing.chunks), "dtype": sizing.dtype.name}
                    if sizing is not None else {"count": count, "nbytes": nbytes,
                                                "dtype": dtype, "chunk_sizes": chunk_sizes})
            choice = select(collective, self, **size,
                            deterministic=deterministic or _fp8_sum_on_gpu(self, collective,
                                                                           sizing, dtype))
            strategy, chunks, lanes = choice.strategy, choice.chunks, choice.lanes
            lanes_by = choice.lanes_by
        datapath = self._datapath(collective, datapath, count=count, nbytes=nbytes,
                                  dtype=dtype, chunk_sizes=chunk_sizes, sizing=sizing)
        if choice is not None and self.kind != "cpu":
            options = _auto_options(choice, options, sm=datapath == "sm")
        schedule = plan(collective, strategy, count=count, nbytes=nbytes, dtype=dtype,
                        chunk_sizes=chunk_sizes, sizing=sizing, chunks=chunks, lanes=lanes,
                        lanes_by=lanes_by, capabilities=atom.capabilities(datapath),
                        deterministic=deterministic)
        runner = "cpu" if self.kind == "cpu" else datapath  # a cpu cluster runs any plan
        return atom.load(runner).bind(self, schedule, timeout=timeout, **options)

    def _datapath(self, collective, datapath, **size) -> str:
        """The datapath a bind plans for: its capabilities shape the plan."""
        if datapath is None:
            return self.datapath
        if datapath == "auto":
            return "cpu" if self.kind == "cpu" else atom.auto_datapath(collective, **size)
        allowed = atom.runs_on(self.kind)
        if datapath not in allowed:
            raise CapabilityError(f"datapath {datapath!r} cannot run on {self!r}; choose one of "
                                  f"{', '.join((*allowed, 'auto'))}")
        return datapath

    def __repr__(self) -> str:
        where = f" on GPUs {list(self.devices)}" if self.devices else ""
        return f"Cluster.{self.kind}({self.nranks} ranks{where})"


def _fp8_sum_on_gpu(cluster, collective, sizing, dtype) -> bool:
    """Is this an FP8 reduction on GPUs? Their kernels round FP8 once only where every
    element is summed in one step, so ``auto`` picks among the deterministic strategies."""
    from purlin.spec.dtypes import dtype as as_dtype

    dt = sizing.dtype if sizing is not None else as_dtype(dtype)
    return cluster.kind != "cpu" and collective.op.is_reduce and dt.is_fp8


def _auto_options(choice, options: dict, sm: bool) -> dict:
    """The bind options of an ``auto`` choice under those the caller gave: blocks per lane,
    and on the sm datapath its protocol and PDL (a fused protocol with ``fallback``). The
    table measured its blocks per lane with its protocol, so the caller's blocks per lane or
    protocol replace the table's pair."""
    mine = choice.sm_options() if sm else {"blocks_per_lane": choice.blocks_per_lane}
    if options.get("blocks_per_lane") is not None or "protocol" in options:
        mine = {k: v for k, v in mine.items() if k not in ("blocks_per_lane", "protocol")}
    if is_fused(mine.get("protocol", "")):
        mine["fallback"] = True  # measured at a nearby size: the interpreter where it must
    if sm and mine.get("blocks_per_lane") is not None:
        mine["fit"] = True  # measured on some cluster: cut to what fits on this one
    given = {k: v for k, v in options.items() if not (k == "blocks_per_lane" and v is None)}
    return {**mine, **given}
