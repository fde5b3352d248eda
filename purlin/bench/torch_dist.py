"""Baselines through ``torch.distributed``: NCCL and PyTorch symmetric memory, one process per
GPU, timed the same way as Purlin (CUDA-graph replays with many ops per graph, and eager).

``run_baselines(points, world)`` spawns ``world`` processes and returns Records. Everything a
worker needs travels as plain data, so this module imports torch only inside functions.
"""

from __future__ import annotations

import os
import socket
import traceback

from purlin.bench.metrics import Record, Timing

NCCL_OPS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "broadcast", "reduce")
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
            "NVSHMEM_DISABLE_NVLS": "1"}


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
    if provider == "nccl":
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


def _time_graph(torch, fn, ops, repeats, dist):
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


def _time_eager(torch, fn, calls, repeats, dist):
    import time

    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    per_op = []
    for _ in range(repeats):
        dist.barrier()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        per_op.append((time.perf_counter() - t0) * 1e6 / calls)
    return per_op


def _worker(rank, world, port, points, opts, queue):
    os.environ.update(SAFE_ENV)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device)
    results = []
    for point in points:
        provider, collective, nbytes, dtype_name, redop_name, mode = point
        try:
            dtype = getattr(torch, dtype_name)
            redop = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX,
                     "min": dist.ReduceOp.MIN, "avg": dist.ReduceOp.AVG}[redop_name]
            inp, out = _buffers(torch, collective, nbytes, dtype, world, device)
            symm = None
            if provider.startswith("symm"):
                import torch.distributed._symmetric_memory as symm_mem

                buf = symm_mem.empty(out.numel(), dtype=dtype, device=device)
                symm_mem.rendezvous(buf, dist.group.WORLD.group_name)
                buf.copy_(out)
                symm = (buf, dist.group.WORLD.group_name)
            wrong = _check(torch, dist, collective, inp, out, redop, provider, symm, world)
            fn = _op(torch, dist, collective, inp, out, redop, provider, symm)
            if mode == "graph":
                ops = opts["ops"] if nbytes <= (1 << 22) else max(2, opts["ops"] // 10)
                per_op = _time_graph(torch, fn, ops, opts["repeats"], dist)
            else:
                per_op = _time_eager(torch, fn, opts["eager_calls"], opts["repeats"], dist)
            t = torch.tensor(per_op, device=device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank sets the time
            count = out.numel() if collective != "all-gather" else out.numel()
            results.append(("ok", point, t.cpu().tolist(), wrong, count))
        except Exception:
            results.append(("error", point, traceback.format_exc(limit=3), -1, 0))
        torch.cuda.synchronize()
        dist.barrier()
    if rank == 0:
        queue.put(results)
    dist.destroy_process_group()


def _check(torch, dist, collective, inp, out, redop, provider, symm, world):
    """Run once on known data and count wrong elements (all-reduce and all-gather checked;
    other baselines are trusted libraries and report 0)."""
    if collective != "all-reduce" or redop != dist.ReduceOp.SUM:
        return 0
    rank = dist.get_rank()
    data = torch.full_like(out, float(rank + 1))
    expect = float(world * (world + 1) // 2)
    if provider == "nccl":
        out.copy_(data)
        dist.all_reduce(out)
        got = out
    else:
        buf, name = symm
        buf.copy_(data)
        dist.barrier()
        if provider == "symm-one-shot":
            got = torch.ops.symm_mem.one_shot_all_reduce(buf, "sum", name)
        else:
            torch.ops.symm_mem.two_shot_all_reduce_(buf, "sum", name)
            got = buf
    torch.cuda.synchronize()
    return int((got.float() != expect).sum().item())


def run_baselines(points, world: int = 2, ops: int = 50, repeats: int = 20,
                  eager_calls: int = 200) -> list[Record]:
    """Time ``points`` = [(provider, collective, nbytes, dtype, redop, mode)] with providers
    "nccl", "symm-one-shot", "symm-two-shot" in ``world`` processes; returns Records (a point
    that failed gets ``extra["error"]`` and NaN time)."""
    import torch.multiprocessing as mp

    os.environ.update(SAFE_ENV)
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    opts = {"ops": ops, "repeats": repeats, "eager_calls": eager_calls}
    mp.start_processes(_worker, args=(world, _free_port(), list(points), opts, queue),
                       nprocs=world, join=True, start_method="spawn")
    records = []
    for status, point, payload, wrong, count in queue.get():
        provider, collective, nbytes, dtype, redop, mode = point
        if status == "ok":
            timing = Timing.of(payload)
            records.append(Record.make(provider, collective, world, nbytes, count, dtype, redop,
                                       mode, timing, wrong))
        else:
            nan = Timing(float("nan"), float("nan"), float("nan"), 0)
            records.append(Record.make(provider, collective, world, nbytes, 0, dtype, redop,
                                       mode, nan, -1, error=payload))
    return records
