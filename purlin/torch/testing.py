"""Run a function in n fresh processes of one ``torch.distributed`` group, and never hang.

``run_processes(fn, n, *args)`` spawns n processes, initialises a process group in each (gloo by
default, through a file store: no ports to pick), calls ``fn(rank, n, *args)`` and returns
every rank's outcome in rank order: ``("ok", value)``, ``("error", traceback text)`` or
``("lost", exit code)`` for a process that died or missed the deadline (it is killed). ``fn``
must be importable by name (a module-level function).
"""

from __future__ import annotations

import os
import queue as queue_mod
import shutil
import tempfile
import time
import traceback
from datetime import timedelta

SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
            "NVSHMEM_DISABLE_NVLS": "1"}


def _entry(fn, rank, nprocs, backend, init_method, results, args, env, pg_timeout):
    os.environ.update(SAFE_ENV)
    os.environ.update(env or {})
    try:
        import torch
        import torch.distributed as dist

        kwargs = {}
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
            kwargs["device_id"] = torch.device("cuda", torch.cuda.current_device())
        dist.init_process_group(backend, init_method=init_method, rank=rank,
                                world_size=nprocs, timeout=timedelta(seconds=pg_timeout),
                                **kwargs)
        if backend == "gloo":  # every rank's mesh up before any rank may finish and leave
            dist.barrier()  # (a rank leaving early closed a peer's half-made connection)
        value = fn(rank, nprocs, *args)
        results.put((rank, "ok", value))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        results.put((rank, "error", traceback.format_exc()))
    # leave without tearing the group down: a dead peer must not make us wait
    results.close()
    results.join_thread()
    os._exit(0)


def run_processes(fn, nprocs: int, *args, backend: str = "gloo", timeout: float = 60.0,
                  env: dict | None = None, pg_timeout: float = 30.0) -> list[tuple]:
    """Every rank's outcome of ``fn(rank, nprocs, *args)``, in rank order (see the module)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    tmp = tempfile.mkdtemp(prefix="purlin-pg-")
    init_method = f"file://{os.path.join(tmp, 'store')}"
    procs = [ctx.Process(target=_entry, daemon=True, name=f"purlin-rank{rank}",
                         args=(fn, rank, nprocs, backend, init_method, results, args, env,
                               pg_timeout))
             for rank in range(nprocs)]
    outcome: dict = {}
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.start()
        while len(outcome) < nprocs and time.monotonic() < deadline:
            try:
                rank, status, value = results.get(timeout=0.2)
                outcome[rank] = (status, value)
            except queue_mod.Empty:
                if all(not p.is_alive() for p in procs) and results.empty():
                    break
        for p in procs:
            p.join(max(0.0, min(5.0, deadline - time.monotonic())))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5.0)
        results.close()
        shutil.rmtree(tmp, ignore_errors=True)
    return [outcome.get(rank, ("lost", procs[rank].exitcode)) for rank in range(nprocs)]


def raise_for(outcomes) -> list:
    """The values of ``outcomes``, or an AssertionError quoting the first failure."""
    for rank, (status, value) in enumerate(outcomes):
        if status != "ok":
            detail = value if status == "error" else f"exit code {value}"
            raise AssertionError(f"rank {rank} {status}: {detail}")
    return [value for _, value in outcomes]
