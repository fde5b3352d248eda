"""The ce datapath as a benchmark provider: timed exactly like ``providers.time_purlin``.

    record = time_ce(Cluster.local(2), collectives.all_gather(2), 256 << 20)

The record's provider is ``purlin-ce:<strategy>`` and ``extra["datapath"] = "ce"``; where the
collective reduces, the reductions ran on the sm executor (``extra["sm_blocks_per_lane"]``).
"""

from __future__ import annotations

from purlin.bench.metrics import Record, Timing, plan_extra
from purlin.spec.sizing import fit_nbytes


def time_ce(cluster, collective, nbytes: int, dtype: str = "bfloat16",
            strategy: str = "direct-push", chunks: int = 1, lanes: int = 1,
            blocks_per_lane: int | None = None, threads: int = 512, mode: str = "graph",
            ops: int = 50, repeats: int = 20, provider: str | None = None,
            lanes_by: str = "piece") -> Record:
    """Bind ``collective`` on the ce datapath, check it on random data, time it: ``graph``
    (device time per op over CUDA-graph replays) or ``eager`` (host-inclusive per call)."""
    import torch

    from purlin.bench.providers import count_wrong, time_eager, time_graph

    coll = collective
    sizing = coll.sized(nbytes=fit_nbytes(coll, nbytes, dtype), dtype=dtype)
    bound = cluster.bind(coll, strategy, sizing=sizing, chunks=chunks, lanes=lanes,
                         lanes_by=lanes_by, blocks_per_lane=blocks_per_lane, threads=threads,
                         datapath="ce")
    wrong = count_wrong(torch, bound)
    sched = bound.schedule
    extra = {**plan_extra(sched), "datapath": "ce", "atomic_add": bound.atomic_add}
    if bound.lowered.uses_sm:
        extra["sm_blocks_per_lane"] = bound.blocks_per_lane
    big = sizing.message_bytes > (1 << 22)
    if mode == "graph":
        k = max(2, ops // 10) if big else ops
        k += k % 2  # two scratch areas alternate: an even count keeps one graph replayable
        timing = Timing.of(time_graph(torch, bound, k, repeats))
    else:
        inclusive, host = time_eager(torch, bound, ops, repeats)
        timing = Timing.of(inclusive)
        extra["host_launch_us"] = Timing.of(host).median_us
    return Record.make(provider or f"purlin-ce:{sched.strategy}", coll.name, coll.nranks,
                       sizing.message_bytes, sizing.message_count, dtype,
                       coll.op.reduce_op or "none", mode, timing, wrong, **extra)
