"""Timing Purlin's bound collectives: on GPUs (CUDA-graph replays and eager calls), on the cpu
datapath (wall time per call, host threads: not GPU numbers) and by the cost model.

Every point is checked first: random inputs, one call, outputs compared with a reference built
from the sizing (so any custom collective can be benchmarked); the cost model runs no data and
reports #wrong as N/A (-1).
"""

from __future__ import annotations

import time

from purlin.bench.metrics import Record, Timing, op_counts, plan_extra
from purlin.runtime.auto import launch_options
from purlin.spec.sizing import fit_nbytes

TOL = {"bfloat16": 2e-2, "float16": 4e-3, "float32": 1e-5, "int32": 0.0}
# A sum a route builds hop by hop (ring, recursive doubling, a user's tree) is rounded to the
# wire dtype at every hop: at most nranks roundings, each within the unit roundoff u of the
# partial sum, so the error stays within nranks * u * sum(|x|) -- a bound that grows with the
# inputs' magnitude, where TOL alone (relative to the result) flags correct sums that cancel.
UNIT_ROUNDOFF = {"bfloat16": 2.0 ** -8, "float16": 2.0 ** -11, "float32": 2.0 ** -24}


def allowed_error(xp, expect, abs_sum, dtype: str, nranks: int, reduces: bool):
    """Per-element error a correct result may have (``xp``: numpy or torch).

    >>> import numpy as np
    >>> allowed_error(np, np.array([0.0]), np.array([8.0]), "bfloat16", 8, True).item()
    0.25
    """
    tol = TOL.get(dtype, 1e-5) * (1 + xp.abs(expect))
    if not reduces or dtype not in UNIT_ROUNDOFF:
        return tol
    return xp.maximum(tol, nranks * UNIT_ROUNDOFF[dtype] * abs_sum)


def reference_on_gpu(torch, sizing, inputs):
    """Expected outputs (float32, on each output rank's device) from the bound inputs."""
    coll = sizing.collective
    op = coll.op.reduce_op
    outs = []
    for r, row in enumerate(coll.output):
        dev = inputs[r].device
        parts = []
        for name in row:
            srcs = []
            for s, p in coll.sources(name):
                at, k = sizing.input_offset(s, p), sizing.chunk_count(name)
                srcs.append(inputs[s][at: at + k].to(dev).float())
            if not coll.op.is_reduce:
                parts.append(srcs[0])
                continue
            stack = torch.stack(srcs)
            parts.append({"sum": stack.sum(0), "avg": stack.mean(0), "max": stack.amax(0),
                          "min": stack.amin(0)}[op])
        outs.append(torch.cat(parts) if parts else torch.zeros(0, device=dev))
    return outs


def count_wrong(torch, bound) -> int:
    """Fill the bound inputs with random data, run once, count wrong output elements."""
    s = bound.schedule
    sizing = s.sizing
    for r, x in enumerate(bound.inputs):
        with torch.cuda.device(x.device):
            if x.dtype == torch.int32:
                x.copy_(torch.randint(-1000, 1000, x.shape, device=x.device))
            else:
                x.copy_(torch.randn(x.shape, device=x.device) + 0.5)
    inputs = [bound.inputs[r][: sizing.input_count(r)] for r in range(s.nranks)]
    expect = reference_on_gpu(torch, sizing, inputs)
    reduces = sizing.collective.op.reduce_op in ("sum", "avg")
    scale = reference_on_gpu(torch, sizing, [x.abs() for x in inputs]) if reduces else expect
    bound.launch()
    bound.check()
    wrong = 0
    for r, (e, a) in enumerate(zip(expect, scale)):
        got = bound.outputs[r][: sizing.output_count(r)].float()
        limit = allowed_error(torch, e, a, s.dtype, s.nranks, reduces)
        wrong += int((torch.abs(got - e) > limit).sum().item())
    return wrong


def time_graph(torch, bound, ops: int, repeats: int) -> list[float]:
    """Per-op microseconds over ``repeats`` replays of graphs holding ``ops`` calls each."""
    per_op = graph_timer(torch, bound, ops)(repeats)
    bound.check()
    return per_op


def graph_timer(torch, bound, ops: int):
    """``timed(repeats)``: per-op microseconds over ``repeats`` replays of graphs of ``ops``
    calls, captured once here -- so that several binds can be timed in turns (round after
    round, each bind's times pooled), which spreads a drift of the clocks over all of them."""
    graphs = bound.capture(ops)
    graphs.replay()
    bound.check()
    devices = sorted({d for d, _ in graphs.graphs})

    def timed(repeats: int) -> list[float]:
        per_op = []
        for _ in range(repeats):
            events = []
            for d in devices:
                with torch.cuda.device(d):
                    start, end = (torch.cuda.Event(enable_timing=True),
                                  torch.cuda.Event(enable_timing=True))
                    start.record()
                    events.append((d, start, end))
            for d, graph in graphs.graphs:
                with torch.cuda.device(d):
                    graph.replay()
            for d, start, end in events:
                with torch.cuda.device(d):
                    end.record()
            for _, _, end in events:
                end.synchronize()
            per_op.append(max(s.elapsed_time(e) for _, s, e in events) * 1e3 / ops)
        return per_op
    return timed


def time_eager(torch, bound, calls: int, repeats: int) -> tuple[list[float], list[float]]:
    """Host-inclusive per-call time (launch loop + final sync) and host-only launch time."""
    for _ in range(5):
        bound.launch()
    bound.synchronize()
    inclusive, host = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            bound.launch()
        t1 = time.perf_counter()
        bound.synchronize()
        t2 = time.perf_counter()
        inclusive.append((t2 - t0) * 1e6 / calls)
        host.append((t1 - t0) * 1e6 / calls)
    bound.check()
    return inclusive, host


def time_purlin(cluster, collective, nbytes: int, dtype: str = "bfloat16",
                strategy: str = "direct-push", chunks: int = 1, lanes: int = 1,
                blocks_per_lane: int | None = None, threads: int | None = None,
                mode: str = "graph",
                ops: int = 50, repeats: int = 20, provider: str | None = None,
                protocol: str = "simple", pdl: bool = False, lanes_by: str = "piece",
                fallback: bool = False) -> Record:
    """Bind, check and time one point; returns a Record (graph: device time per op).
    ``protocol="ll"``: the sm datapath's LL transfers ("fused": run by the fused LL kernel);
    ``pdl``: programmatic dependent launch (all ``purlin.atom.sm.bind``); ``threads``: the
    datapath's choice when None; ``fallback``: a fused protocol that cannot run this size
    runs on the interpreter (a tuning table's choice for a nearby size)."""
    import torch

    coll = collective
    sizing = coll.sized(nbytes=fit_nbytes(coll, nbytes, dtype), dtype=dtype)
    how = launch_options(blocks_per_lane, protocol, pdl)
    if strategy != "auto":  # named: a bind that names no protocol takes the fast path
        how.update(protocol=protocol, pdl=pdl)
    bound = cluster.bind(coll, strategy, sizing=sizing, chunks=chunks, lanes=lanes,
                         lanes_by=lanes_by, threads=threads, **how,
                         **({"fallback": True} if fallback else {}))
    wrong = count_wrong(torch, bound)
    sched = bound.schedule
    extra = {**plan_extra(sched), "blocks_per_lane": bound.blocks_per_lane,
             "threads": getattr(bound, "threads", threads)}
    if getattr(bound, "protocol", "simple") != "simple":  # as bound: auto may choose them
        extra["protocol"] = bound.protocol
    if getattr(bound, "pdl", False):
        extra["pdl"] = True
    ops, repeats = op_counts(sizing.message_bytes, ops, repeats)
    if mode == "graph":
        timing = Timing.of(time_graph(torch, bound, ops, repeats))
    else:
        inclusive, host = time_eager(torch, bound, ops, repeats)
        timing = Timing.of(inclusive)
        extra["host_launch_us"] = Timing.of(host).median_us
    name = provider or f"purlin:{strategy}"
    redop = coll.op.reduce_op or "none"
    return Record.make(name, coll.name, coll.nranks, sizing.message_bytes,
                       sizing.message_count, dtype, redop, mode, timing, wrong, **extra)


def time_purlin_cpu(collective, nbytes: int, dtype: str = "float32",
                    strategy: str = "direct-push", chunks: int = 1, lanes: int = 1,
                    calls: int = 10, repeats: int = 5, provider: str | None = None,
                    seed: int = 0, lanes_by: str = "piece") -> Record:
    """Bind on the cpu datapath, check against the float64 reference, time wall clock per
    call (mode "cpu": numpy and host threads, not GPU numbers)."""
    import numpy as np

    from purlin.runtime.cluster import Cluster
    from purlin.spec.reference import reference

    coll = collective
    sizing = coll.sized(nbytes=fit_nbytes(coll, nbytes, dtype), dtype=dtype)
    bound = Cluster.cpu(coll.nranks).bind(coll, strategy, sizing=sizing, chunks=chunks,
                                          lanes=lanes, lanes_by=lanes_by, timeout=30.0)
    rng = np.random.default_rng(seed)
    host = bound.run.np_dtype
    inputs = []
    for r in range(coll.nranks):
        n = sizing.input_count(r)
        x = (rng.integers(-100, 100, n) if host.kind in "iu" else rng.standard_normal(n) + 0.5)
        inputs.append(x.astype(host))
    outputs = bound(inputs)
    expect = reference(sizing, [x.astype(np.float64) for x in inputs])
    reduces = coll.op.reduce_op in ("sum", "avg") and host.kind == "f"
    scale = reference(sizing, [np.abs(x).astype(np.float64) for x in inputs]) if reduces \
        else expect
    wrong = 0
    for o, e, a in zip(outputs, expect, scale):
        limit = (allowed_error(np, e, a, dtype, coll.nranks, reduces) if host.kind == "f"
                 else 0.0)
        wrong += int(np.sum(np.abs(np.asarray(o, dtype=np.float64) - e) > limit))
    per_call = []
    calls, repeats = op_counts(sizing.message_bytes, calls, repeats)
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            bound(inputs)
        per_call.append((time.perf_counter() - t0) * 1e6 / calls)
    sched = bound.schedule
    return Record.make(provider or f"purlin:{strategy}", coll.name, coll.nranks,
                       sizing.message_bytes, sizing.message_count, dtype,
                       coll.op.reduce_op or "none", "cpu", Timing.of(per_call), wrong,
                       **plan_extra(sched), datapath="cpu")


def predict_purlin(collective, nbytes: int, dtype: str = "bfloat16",
                   strategy: str = "direct-push", chunks: int = 1, lanes: int = 1,
                   blocks_per_lane: int | None = None, profile="H200-measured",
                   provider: str | None = None, lanes_by: str = "piece") -> Record:
    """The cost model's latency for one point (mode "model", #wrong N/A: nothing runs)."""
    from purlin.snac import plan
    from purlin.trace.model import predict_latency
    from purlin.trace.profiles import get_profile

    coll = collective
    sizing = coll.sized(nbytes=fit_nbytes(coll, nbytes, dtype), dtype=dtype)
    schedule = plan(coll, strategy, sizing=sizing, chunks=chunks, lanes=lanes,
                    lanes_by=lanes_by)
    ns = predict_latency(schedule, profile)
    timing = Timing(ns / 1e3, ns / 1e3, ns / 1e3, 1)
    extra = {**plan_extra(schedule), "profile": get_profile(profile).name}
    if blocks_per_lane:
        extra["blocks_per_lane"] = blocks_per_lane
    return Record.make(provider or f"purlin:{strategy}", coll.name, coll.nranks,
                       sizing.message_bytes, sizing.message_count, dtype,
                       coll.op.reduce_op or "none", "model", timing, -1, **extra)
