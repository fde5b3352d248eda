"""Timing user epilogues (:class:`purlin.Epilogue`) against the same all-reduce followed by
separate PyTorch ops (``bench/epilogues.py`` prints the table; notebook 07 draws it).

On a GPU the ranks are virtual (``Cluster.virtual``: every rank in one launch on one GPU) and
each time is a CUDA graph of ``ops`` calls, per call, median of ``replays``; on a cpu cluster
(no GPU) the calls are timed on the wall clock and say only that both paths run.
"""

from __future__ import annotations

import time

import numpy as np

from purlin.bench.metrics import Timing

__all__ = ["fp8_norm", "fp8_wire", "fused_vs_unfused", "wire_functions"]


def fp8_norm(hidden: int, eps: float):
    """The device functions of add + RMSNorm + float8_e4m3fn with a per-token scale, as a user
    writes them (``Epilogue(quantise, extras=(weight,), residual=..., stat=stat,
    finish=finish, out=codes, row_out=scales, hidden=hidden)``): (stat, finish, quantise).
    Ranks that share a launch share one call's functions."""
    import math

    from numba import cuda

    h, e = np.float32(hidden), np.float32(eps)

    @cuda.jit(device=True)
    def stat(v, w):
        return v * v, abs(v * w)

    @cuda.jit(device=True)
    def finish(total, peak):
        inv = np.float32(1) / np.float32(math.sqrt(total / h + e))
        return inv, max(peak * inv / np.float32(448), np.float32(1e-12))

    @cuda.jit(device=True)
    def quantise(v, inv, scale, w):
        return v * inv * w / scale

    return stat, finish, quantise


def _cluster(nranks: int, cluster=None):
    from purlin.runtime import Cluster

    if cluster is not None:
        return cluster
    from purlin.bench.clusters import gpu_count

    return Cluster.virtual(nranks) if gpu_count() else Cluster.cpu(nranks)


def _bind(cluster, count, dtype, epilogue=None, strategy=None):
    """The all-reduce (with ``epilogue``): on the one-shot kernel (direct-push, fused-ll), or
    with ``strategy`` as a user binds it -- the one-shot kernel where it runs, else the
    all-reduce's own path and then the epilogue kernel."""
    from purlin.spec import collectives

    ar = collectives.all_reduce(cluster.nranks)
    if cluster.kind == "cpu":
        return cluster.bind(ar, count=count, dtype=dtype, epilogue=epilogue)
    extra = {} if epilogue is None else {"epilogue": epilogue}
    if strategy is not None:
        return cluster.bind(ar, strategy, count=count, dtype=dtype, **extra)
    return cluster.bind(ar, "direct-push", count=count, dtype=dtype, protocol="fused-ll",
                        **extra)


class _NoDist:
    @staticmethod
    def barrier():
        pass


def _time(torch, fn, ops: int, replays: int, gpu: bool) -> Timing:
    """Per call of ``fn``: a CUDA graph of ``ops`` calls on a GPU, else the wall clock."""
    if gpu:
        from purlin.bench.torch_dist import graph_per_op_us

        return Timing.of(graph_per_op_us(torch, fn, ops, replays, _NoDist))
    for _ in range(2):
        fn()
    samples = []
    for _ in range(max(3, replays // 10)):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e6)
    return Timing.of(samples)


def fused_vs_unfused(name: str, setup, *, hidden: int, batch: int, dtype: str = "bfloat16",
                     nranks: int = 2, cluster=None, ops: int = 20, replays: int = 30,
                     strategy: str | None = None) -> dict:
    """One record: ``setup(rank, count, device)`` returns (the rank's epilogue, a function
    applying the same to the all-reduce's output with separate PyTorch ops); the epilogue
    fused into the all-reduce against the all-reduce and then those ops. ``strategy``
    (e.g. ``"auto"``, for sizes past the one-shot kernel): both all-reduces bound with it,
    the epilogue's as the bind chooses (``kernel`` in the record says what ran)."""
    import torch

    cluster = _cluster(nranks, cluster)
    gpu = cluster.kind != "cpu"
    count = batch * hidden
    device = torch.device("cuda", cluster.devices[0]) if gpu else torch.device("cpu")
    tdt = getattr(torch, dtype)
    gen = torch.Generator(device=device).manual_seed(1)
    xs = [torch.randn(count, generator=gen, device=device).to(tdt) for _ in range(cluster.nranks)]
    pairs = [setup(r, count, device) for r in range(cluster.nranks)]
    fused = _bind(cluster, count, dtype, [p[0] for p in pairs], strategy=strategy)
    plain = _bind(cluster, count, dtype, strategy=strategy)
    if gpu:
        for r, x in enumerate(xs):
            fused.inputs[r][:count].copy_(x)
            plain.inputs[r][:count].copy_(x)
        outs = [plain.outputs[r][:count] for r in range(cluster.nranks)]

        def run_fused():
            fused.launch()

        def run_unfused():
            plain.launch()
            for (_, unfused), out in zip(pairs, outs):
                unfused(out)
    else:
        def run_fused():
            fused(xs)

        def run_unfused():
            for (_, unfused), out in zip(pairs, plain(xs)):
                unfused(out)

    f = _time(torch, run_fused, ops, replays, gpu)
    u = _time(torch, run_unfused, ops, replays, gpu)
    if gpu:
        fused.check()
        plain.check()
    return {"epilogue": name, "hidden": hidden, "batch": batch, "ranks": cluster.nranks,
            "where": "gpu" if gpu else "cpu", "fused_us": f.median_us,
            "unfused_us": u.median_us, "speedup": u.median_us / f.median_us,
            "strategy": strategy or "direct-push",
            "kernel": getattr(fused, "kernel", "host reference")}


FP8_MAX = {"float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}
_WIRE_FUNCTIONS: list = []


def wire_functions():
    """(quantise, dequantise): the prologue ``x / scale`` and the epilogue ``v * scale`` of
    an all-reduce with FP8 on the wire, ``scale`` a per-column extra (one pair per process:
    ranks that share a launch share the functions)."""
    if not _WIRE_FUNCTIONS:
        from numba import cuda

        @cuda.jit(device=True)
        def quantise(x, scale):
            return x / scale

        @cuda.jit(device=True)
        def dequantise(v, scale):
            return v * scale

        _WIRE_FUNCTIONS.extend((quantise, dequantise))
    return tuple(_WIRE_FUNCTIONS)


def fp8_wire(*, hidden: int, batch: int, wire: str = "float8_e4m3fn", dtype: str = "bfloat16",
             nranks: int = 2, cluster=None, ops: int = 20, replays: int = 30) -> dict:
    """One record: the all-reduce of ``batch`` rows of ``hidden`` with the prologue
    ``x / scale`` sent as FP8 ``wire`` and the epilogue ``v * scale`` (``wire_us``), against
    the same with ``dtype`` on the wire and a scale of 1 (``plain_us``); ``scale`` is each
    column's largest ``|x|`` over the ranks over the FP8 maximum. ``wire_err`` and
    ``plain_err``: the largest ``|output - exact sum|`` (float64), ``rel_err`` the wire's
    over the largest exact value."""
    import torch

    from purlin.atom.epilogue import Epilogue

    cluster = _cluster(nranks, cluster)
    gpu = cluster.kind != "cpu"
    count = batch * hidden
    device = torch.device("cuda", cluster.devices[0]) if gpu else torch.device("cpu")
    tdt = getattr(torch, dtype)
    gen = torch.Generator(device=device).manual_seed(3)
    xs = [torch.randn(count, generator=gen, device=device).to(tdt) for _ in range(cluster.nranks)]
    exact = sum(x.double() for x in xs)
    peak = torch.stack([x.view(batch, hidden).float().abs().amax(dim=0) for x in xs]).amax(0)
    scale = (peak / FP8_MAX[wire]).clamp(min=1e-12).to(tdt)
    quantise, dequantise = wire_functions()
    record = {"wire": wire, "hidden": hidden, "batch": batch, "ranks": cluster.nranks,
              "dtype": dtype, "where": "gpu" if gpu else "cpu"}
    for key, on_wire, s in (("wire", wire, scale), ("plain", None, torch.ones_like(scale))):
        epis = [Epilogue(dequantise, extras=(s,), prologue=quantise, wire=on_wire,
                         hidden=hidden, name="scaled") for _ in range(cluster.nranks)]
        bound = _bind(cluster, count, dtype, epis)
        out = bound([x.clone() for x in xs])
        record[f"{key}_err"] = max(float((o.double() - exact).abs().max()) for o in out)
        if gpu:
            for r, x in enumerate(xs):
                bound.inputs[r][:count].copy_(x)
            record[f"{key}_us"] = _time(torch, bound.launch, ops, replays, True).median_us
            bound.check()
        else:
            record[f"{key}_us"] = _time(torch, lambda: bound(xs), ops, replays, False).median_us
    record["speedup"] = record["plain_us"] / record["wire_us"]
    record["rel_err"] = record["wire_err"] / max(float(exact.abs().max()), 1e-30)
    return record


def table(records: list[dict], columns: list[str]) -> str:
    """``records`` as an aligned text table of ``columns``."""
    def cell(v):
        return f"{v:.2f}" if isinstance(v, (float, np.floating)) else str(v)

    rows = [[cell(r.get(c, "")) for c in columns] for r in records]
    widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(columns, widths))]
    lines += ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in rows]
    return "\n".join(lines)
