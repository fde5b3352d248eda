"""Baselines through ``torch.distributed``: NCCL (``nccl``; ``nccl-window``: on buffers
registered as a symmetric window, :class:`purlin.bench.peers.NcclWindow`) and PyTorch
symmetric memory, one process per GPU, timed the same way as Purlin (CUDA-graph replays with
many ops per graph, and eager).

``run_baselines(points, world)`` spawns ``world`` processes and returns Records. Everything a
worker needs travels as plain data, so this module imports torch only inside functions.
"""

from __future__ import annotations

import os
import socket
import traceback

from purlin.bench.metrics import Record, Timing, op_counts

# the peers get the 32 hardware queues per device a Purlin GPU cluster asks for
# (purlin.atom.ce.ask_for_queues), so both sides are measured under the same conditions
NCCL_KINDS = ("nccl", "nccl-window")
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
            "NVSHMEM_DISABLE_NVLS": "1", "CUDA_DEVICE_MAX_CONNECTIONS": "32"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _buffers(torch, collective, nbytes, dtype, world, device):
    """(input, output) tensors sized like nccl-tests: nbytes is the largest per-rank buffer."""
    item = torch.empty((), dtype=dtype).element_size()
    count = max(world, nbytes // item // world * world)
    gen = torch.Generator(device=device).manual_seed(1234)
    full = torch.randn(count, generator=gen, device=device).to(dtype) + 1
    if collective in ("all-gather",):
        return full[: count // world].clone(), torch.empty(count, dtype=dtype, device=device)
    if collective == "reduce-scatter":
        return full, torch.empty(count // world, dtype=dtype, device=device)
    if collective == "all-to-all":
        return full, torch.empty_like(full)
    return full, full.clone()


def _op(torch, dist, collective, inp, out, redop, provider, symm):
    if provider in NCCL_KINDS:
        if collective == "all-reduce":
            return lambda: dist.all_reduce(out, op=redop)
        if collective == "all-gather":
            return lambda: dist.all_gather_into_tensor(out, inp)
        if collective == "reduce-scatter":
            return lambda: dist.reduce_scatter_tensor(out, inp, op=redop)
        if collective == "all-to-all":
            return lambda: dist.all_to_all_single(out, inp)
        if collective == "broadcast":
            return lambda: dist.broadcast(out, src=0)
        if collective == "reduce":
            return lambda: dist.reduce(out, dst=0, op=redop)
        raise ValueError(collective)
    buf, group_name = symm
    if provider == "symm-one-shot":
        return lambda: torch.ops.symm_mem.one_shot_all_reduce(buf, "sum", group_name)
    if provider == "symm-two-shot":
        return lambda: torch.ops.symm_mem.two_shot_all_reduce_(buf, "sum", group_name)
    raise ValueError(provider)


def graph_per_op_us(torch, fn, ops, repeats, dist) -> list[float]:
    """Microseconds per call of ``fn``, once per replay of a CUDA graph holding ``ops`` calls
    (after a barrier, so every rank starts together); used for baselines and Purlin alike."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(ops):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    per_op = []
    for _ in range(repeats):
        dist.barrier()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        per_op.append(start.elapsed_time(end) * 1e3 / ops)
    return per_op


def graph_median_us(torch, fn, ops, repeats, dist) -> float:
    """The median of :func:`graph_per_op_us` on the slowest rank (every rank gets it)."""
    times = sorted(graph_per_op_us(torch, fn, ops, repeats, dist))
    t = torch.tensor([times[len(times) // 2]], device=torch.cuda.current_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _sync(torch, device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_eager(torch, fn, calls, repeats, dist, device):
    import time

    for _ in range(5):
        fn()
    _sync(torch, device)
    per_op = []
    for _ in range(repeats):
        dist.barrier()
        _sync(torch, device)
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        _sync(torch, device)
        per_op.append((time.perf_counter() - t0) * 1e6 / calls)
    return per_op


def _worker(rank, world, port, points, opts, queue):
    os.environ.update(SAFE_ENV)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist

    if opts.get("device") == "cpu":  # gloo on the host: tests the harness without GPUs
        device = torch.device("cpu")
        dist.init_process_group("gloo", rank=rank, world_size=world)
    else:
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device)
    results, window, no_window = [], None, None
    if any(p[0] == "nccl-window" for p in points):
        try:  # collective: every rank builds it, before any point
            from purlin.bench.peers import NcclWindow

            window = NcclWindow(torch, dist, device, *NcclWindow.needs(points, world))
        except Exception as exc:  # noqa: BLE001 - each window point then says why
            no_window = f"no NCCL window: {type(exc).__name__}: {str(exc)[:300]}"
    for point in points:
        provider, collective, nbytes, dtype_name, redop_name, mode = point
        try:
            dtype = getattr(torch, dtype_name)
            redop = _REDOPS(dist).get(redop_name, dist.ReduceOp.SUM)  # "none": copies
            inp, out = _buffers(torch, collective, nbytes, dtype, world, device)
            if provider == "nccl-window":
                if window is None:
                    raise RuntimeError(no_window)
                inp, out = window.buffers(inp, out)
            symm = None
            if provider.startswith("symm"):
                import torch.distributed._symmetric_memory as symm_mem

                buf = symm_mem.empty(out.numel(), dtype=dtype, device=device)
                symm_mem.rendezvous(buf, dist.group.WORLD.group_name)
                buf.copy_(out)
                symm = (buf, dist.group.WORLD.group_name)
            wrong = _check(torch, dist, collective, inp, out, redop_name, provider, symm,
                           world)
            fn = _op(torch, dist, collective, inp, out, redop, provider, symm)
            ops, repeats = op_counts(nbytes, opts["ops"], opts["repeats"])
            if mode == "graph" and device.type == "cpu":
                raise ValueError("graph mode needs GPUs; the cpu (gloo) baselines run eager")
            if mode == "graph":
                per_op = graph_per_op_us(torch, fn, ops, repeats, dist)
            else:
                calls = op_counts(nbytes, opts["eager_calls"], repeats)[0]
                per_op = _time_eager(torch, fn, calls, repeats, dist, device)
            t = torch.tensor(per_op, device=device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank sets the time
            count = max(inp.numel(), out.numel())  # elements of the largest buffer
            results.append(("ok", point, t.cpu().tolist(), wrong, count))
        except Exception:
            results.append(("error", point, traceback.format_exc(limit=3), -1, 0))
        _sync(torch, device)
        dist.barrier()
        if rank == 0:
            queue.put(("progress", 1))
    if rank == 0:
        queue.put(("done", results))
    dist.destroy_process_group()


def _pattern(torch, rank, count, device):
    """Small integers that every dtype holds exactly, and whose sums over up to 8 ranks too."""
    i = torch.arange(count, device=device)
    return ((i % 13 + 2 * rank) % 17 - 8).float()


def _check(torch, dist, collective, inp, out, redop, provider, symm, world):
    """Run once on known data and count the wrong output elements of this rank, summed over
    the ranks (every baseline is checked, like every Purlin run)."""
    rank, device = dist.get_rank(), inp.device
    n_in = inp.numel()
    mine = _pattern(torch, rank, n_in, device)
    every = torch.stack([_pattern(torch, r, n_in, device) for r in range(world)])
    reduce = {"sum": lambda x: x.sum(0), "avg": lambda x: x.mean(0), "max": lambda x: x.amax(0),
              "min": lambda x: x.amin(0)}.get(redop)
    k = n_in // world  # a rank's chunk of a reduce-scatter or all-to-all input
    if provider not in NCCL_KINDS:
        buf, name = symm
        buf.copy_(mine.to(buf.dtype))
        dist.barrier()
        if provider == "symm-one-shot":
            got = torch.ops.symm_mem.one_shot_all_reduce(buf, "sum", name)
        else:
            torch.ops.symm_mem.two_shot_all_reduce_(buf, "sum", name)
            got = buf
        expect = every.sum(0)
    else:
        inp.copy_(mine.to(inp.dtype))
        if collective in ("all-reduce", "broadcast", "reduce"):
            out.copy_(inp)  # these run in place on ``out``
        fn = _op(torch, dist, collective, inp, out, _REDOPS(dist).get(redop), provider, symm)
        fn()
        got = out
        if collective == "all-reduce":
            expect = reduce(every)
        elif collective == "all-gather":
            expect = every.reshape(-1)
        elif collective == "reduce-scatter":
            expect = reduce(every)[rank * k: (rank + 1) * k]
        elif collective == "all-to-all":
            expect = every[:, rank * k: (rank + 1) * k].reshape(-1)
        elif collective == "broadcast":
            expect = every[0]
        else:  # reduce: only the root's output is defined
            expect = reduce(every) if rank == 0 else got.float()
    _sync(torch, device)
    tol = 0.0 if redop != "avg" else 1e-2
    bad = (got.float() - expect).abs() > tol * (1 + expect.abs())
    wrong = torch.tensor([int(bad.sum().item())], device=device)
    dist.all_reduce(wrong)
    return int(wrong.item())


def _REDOPS(dist):
    return {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
            "avg": dist.ReduceOp.AVG}


def run_baselines(points, world: int = 2, ops: int = 50, repeats: int = 20,
                  eager_calls: int = 200, progress=None, device: str = "cuda") -> list[Record]:
    """Time ``points`` = [(provider, collective, nbytes, dtype, redop, mode)] with providers
    "nccl", "nccl-window", "symm-one-shot", "symm-two-shot" in ``world`` processes; returns
    Records (a point that failed gets ``extra["error"]`` and NaN time). ``progress(k)`` is
    called as points finish. Ops and repeats shrink with the size (:func:`op_counts`).
    ``device="cpu"`` runs "nccl" points eagerly on gloo in host processes (a harness check,
    not a baseline)."""
    import time

    import torch.multiprocessing as mp

    points = list(points)
    if not points:
        return []
    os.environ.update(SAFE_ENV)
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    opts = {"ops": ops, "repeats": repeats, "eager_calls": eager_calls, "device": device}
    procs = mp.start_processes(_worker, args=(world, _free_port(), points, opts, queue),
                               nprocs=world, join=False, start_method="spawn")
    payload = None
    while True:
        while not queue.empty():
            kind, value = queue.get()
            if kind == "progress":
                if progress is not None:
                    progress(value)
            else:
                payload = value
        if procs.join(timeout=0.2):
            break
        time.sleep(0.05)
    while payload is None and not queue.empty():
        kind, value = queue.get()
        payload = value if kind == "done" else payload
    if payload is None:
        raise RuntimeError("the baseline processes ended without results")
    records = []
    for status, point, data, wrong, count in payload:
        provider, collective, nbytes, dtype, redop, mode = point
        if status == "ok":
            records.append(Record.make(provider, collective, world, nbytes, count, dtype, redop,
                                       mode, Timing.of(data), wrong))
        else:
            nan = Timing(float("nan"), float("nan"), float("nan"), 0)
            records.append(Record.make(provider, collective, world, nbytes, 0, dtype, redop,
                                       mode, nan, -1, error=data))
    return records
