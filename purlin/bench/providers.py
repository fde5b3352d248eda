"""Timing Purlin's bound collectives on GPUs: CUDA-graph replays and eager calls.

Every point is checked first: random inputs, one call, outputs compared on the GPU with a
float32 reference built from the sizing (so any custom collective can be benchmarked).
"""

from __future__ import annotations

import time

from purlin.bench.metrics import Record, Timing
from purlin.spec.sizing import fit_nbytes

TOL = {"bfloat16": 2e-2, "float16": 4e-3, "float32": 1e-5, "int32": 0.0}


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
    bound.launch()
    bound.check()
    wrong = 0
    tol = TOL[s.dtype]
    for r, e in enumerate(expect):
        got = bound.outputs[r][: sizing.output_count(r)].float()
        wrong += int((torch.abs(got - e) > tol * (1 + torch.abs(e))).sum().item())
    return wrong


def time_graph(torch, bound, ops: int, repeats: int) -> list[float]:
    """Per-op microseconds over ``repeats`` replays of graphs holding ``ops`` calls each."""
    graphs = bound.capture(ops)
    graphs.replay()
    bound.check()
    devices = sorted({d for d, _ in graphs.graphs})
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
    bound.check()
    return per_op


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
                blocks_per_lane: int | None = None, threads: int = 512, mode: str = "graph",
                ops: int = 50, repeats: int = 20, provider: str | None = None) -> Record:
    """Bind, check and time one point; returns a Record (graph: device time per op)."""
    import torch

    coll = collective
    sizing = coll.sized(nbytes=fit_nbytes(coll, nbytes, dtype), dtype=dtype)
    bound = cluster.bind(coll, strategy, sizing=sizing, chunks=chunks, lanes=lanes,
                         blocks_per_lane=blocks_per_lane, threads=threads)
    wrong = count_wrong(torch, bound)
    extra = {"strategy": strategy, "chunks": chunks, "lanes": lanes,
             "blocks_per_lane": bound.blocks_per_lane, "threads": threads}
    if mode == "graph":
        k = ops if sizing.message_bytes <= (1 << 22) else max(2, ops // 10)
        timing = Timing.of(time_graph(torch, bound, k, repeats))
    else:
        inclusive, host = time_eager(torch, bound, ops, repeats)
        timing = Timing.of(inclusive)
        extra["host_launch_us"] = Timing.of(host).median_us
    name = provider or f"purlin:{strategy}"
    redop = coll.op.reduce_op or "none"
    return Record.make(name, coll.name, coll.nranks, sizing.message_bytes,
                       sizing.message_count, dtype, redop, mode, timing, wrong, **extra)
