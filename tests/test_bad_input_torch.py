"""Every mistake a purlin.torch user can make gets a clear answer before anything runs, and
nothing is written: the error type (torch's own where torch has one), the phrase that says
what to do, and the tensors as they were.

Ranks that disagree about a call -- another function, size, dtype or root, or a call one rank
does not make -- raise CallMismatchError on every rank, naming the ranks and what each called,
well before the timeout (a rank that makes no call is named as still at its last one).
"""

from __future__ import annotations

import time
import warnings

import pytest

from purlin.torch.testing import raise_for, run_processes


@pytest.fixture
def world_of_one(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0,
                            world_size=1)
    yield dist
    dist.destroy_process_group()


@pytest.mark.parametrize("options, phrase", [
    (dict(protocol="lamport"), "protocol must be one of simple, ll, fused, fused-ll, auto"),
    (dict(epilogue_grid=48), "epilogue_grid must be None, 'rows' or threads per block"),
    (dict(epilogue_kernel="generic"), "epilogue_kernel must be 'auto' or 'fused'"),
    (dict(staging_bytes=-1), "staging_bytes must be a positive int"),
    (dict(staging_bytes="1M"), "staging_bytes must be a positive int"),
])
def test_bad_options_are_refused_when_made(options, phrase):
    from purlin.errors import PurlinError
    from purlin.torch import CommOptions

    with pytest.raises(PurlinError, match=phrase):
        CommOptions(**options)


@pytest.mark.parametrize("timeout", [-1, 0, float("nan"), float("inf"), "5", True])
def test_bad_timeouts_are_refused(world_of_one, timeout):
    from purlin.errors import SpecError
    from purlin.torch import Communicator

    with pytest.raises(SpecError, match="timeout must be a positive number of seconds"):
        Communicator(datapath="cpu", timeout=timeout)


def test_options_must_be_a_record(world_of_one):
    from purlin.errors import SpecError
    from purlin.torch import Communicator

    with pytest.raises(SpecError, match="options must be a purlin.torch.CommOptions"):
        Communicator(datapath="cpu", options={"protocol": "ll"})
    with pytest.raises(TypeError):  # the knobs are no longer keyword arguments
        Communicator(datapath="cpu", protocol="ll")


def test_module_functions_need_init_first():
    import torch

    import purlin.torch as pt

    saved, pt._default = pt._default, None  # as in a process that never called init
    try:
        t = torch.ones(3)
        with pytest.raises(RuntimeError, match=r"purlin.torch.init\(\) has not been called"):
            pt.all_reduce(t)
        assert torch.equal(t, torch.ones(3))
    finally:
        pt._default = saved


# -- in processes: every rank makes the mistake, or the ranks disagree -----------------------------


def _bad_calls_worker(rank, n):
    """Each bad call on every rank: (label, error type names, message, tensors unchanged)."""
    import torch
    import torch.distributed as dist

    import purlin.torch as pt
    from purlin.torch import CommOptions

    warnings.simplefilter("ignore", FutureWarning)
    comm = pt.init(datapath="cpu", timeout=20, options=CommOptions(staging_bytes=1 << 20))
    other = dist.new_group(list(range(n)))
    out = []

    def attempt(label, make, call):
        tensors = make()
        before = [t.clone() for t in tensors]
        try:
            call(*tensors)
            out.append((label, None, "", True))
            return
        except Exception as exc:  # noqa: BLE001 - the test reads the type
            names = [c.__name__ for c in type(exc).__mro__]
            same = all(torch.equal(a, b) for a, b in zip(tensors, before))
            out.append((label, names, str(exc), same))

    one = lambda: [torch.arange(6.0) + rank]  # noqa: E731
    for op in ("bogus", 5, None, "product"):
        attempt(f"all_reduce op={op!r}", one, lambda t: pt.all_reduce(t, op=op))
    attempt("reduce_scatter_tensor op='bogus'",
            lambda: [torch.zeros(3), torch.arange(3.0 * n)],
            lambda o, i: pt.reduce_scatter_tensor(o, i, "bogus"))
    attempt("reduce op=max()", one, lambda t: pt.reduce(t, 0, op=max))
    attempt("method op='bogus'", one, lambda t: comm.all_reduce(t, "bogus"))
    attempt("method group=other", one, lambda t: comm.all_reduce(t, group=other))
    attempt("broadcast src and group_src", one, lambda t: pt.broadcast(t, 0, group_src=0))
    attempt("broadcast no root", one, lambda t: pt.broadcast(t))
    attempt("broadcast src outside", one, lambda t: pt.broadcast(t, n + 3))
    attempt("reduce group_dst outside", one, lambda t: pt.reduce(t, group_dst=-1))
    attempt("broadcast src=1.0", one, lambda t: pt.broadcast(t, 1.0))
    # torch writes the sum, then raises: refused before, with its error type
    attempt("avg of int32", lambda: [torch.arange(4, dtype=torch.int32)],
            lambda t: pt.all_reduce(t, dist.ReduceOp.AVG))
    # what torch refuses itself, after the fallback: its own error, nothing written
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        attempt("all_gather output too small", lambda: [torch.full((3,), -1.0), torch.ones(2)],
                lambda o, i: pt.all_gather_into_tensor(o, i))
    # torch's own answers to the same mistakes, for the types
    theirs = {}
    for label, call in (("op='bogus'", lambda: dist.all_reduce(torch.ones(2), op="bogus")),
                        ("src and group_src",
                         lambda: dist.broadcast(torch.ones(2), 0, group_src=0)),
                        ("avg of int32", lambda: dist.all_reduce(
                            torch.ones(2, dtype=torch.int32), op=dist.ReduceOp.AVG))):
        try:
            call()
        except Exception as exc:  # noqa: BLE001
            theirs[label] = type(exc).__name__
    # the communicator is still good: none of the above ran anything
    t = torch.ones(4)
    pt.all_reduce(t)
    ok = torch.equal(t, torch.full((4,), float(n)))
    comm.close()
    return {"out": out, "theirs": theirs, "ok": ok}


def test_bad_calls_raise_before_anything_runs_and_write_nothing():
    results = raise_for(run_processes(_bad_calls_worker, 2, timeout=90))
    for rank, res in enumerate(results):
        assert res["ok"], "a refused call left the communicator out of step"
        got = {label: (names, msg, same) for label, names, msg, same in res["out"]}
        assert res["theirs"] == {"op='bogus'": "TypeError", "src and group_src": "ValueError",
                                 "avg of int32": "RuntimeError"}, res["theirs"]
        for label in ("all_reduce op='bogus'", "all_reduce op=5", "all_reduce op=None",
                      "reduce_scatter_tensor op='bogus'", "reduce op=max()",
                      "method op='bogus'"):
            names, msg, same = got[label]
            assert names and "OpError" in names and "TypeError" in names, (label, names)
            assert "op must be a torch.distributed.ReduceOp" in msg, (label, msg)
            assert same, f"{label} wrote a tensor"
        names, msg, same = got["all_reduce op='product'"]  # a string that is no Purlin op
        assert "TypeError" in names and "got 'product'" in msg and same
        expect = {
            "method group=other": "got another group than this communicator's",
            "broadcast src and group_src": "needs exactly one of src=",
            "broadcast no root": "needs exactly one of src=",
            "broadcast src outside": f"src={2 + 3} is not in the group",
            "reduce group_dst outside": "group_dst=-1 is not a rank of the group",
            "broadcast src=1.0": "src must be an int",
        }
        for label, phrase in expect.items():
            names, msg, same = got[label]
            assert names and "SpecError" in names and "ValueError" in names, (label, names)
            assert phrase in msg and f"rank {rank}" in msg, (label, msg)
            assert same, f"{label} wrote a tensor"
        names, msg, same = got["avg of int32"]
        assert names and "OpDtypeError" in names and "RuntimeError" in names, names
        assert "AVG of int32 tensors has no int32 result" in msg and same, msg
        for label, kind in (("all_gather output too small", "RuntimeError"),):
            names, msg, same = got[label]
            assert names and kind in names, (label, names, msg)
            assert same, f"{label} wrote a tensor"


def _mismatch_worker(rank, n, cases, datapath="cpu"):
    """Each disagreement on a fresh communicator: what each rank's call raised."""
    import torch
    import torch.distributed as dist

    from purlin.errors import ExecutionError
    from purlin.torch import CommOptions, Communicator

    warnings.simplefilter("ignore", FutureWarning)
    warnings.simplefilter("ignore", RuntimeWarning)
    out = {}
    dev = torch.device("cuda", torch.cuda.current_device()) if datapath == "sm" else "cpu"
    for case, timeout in cases:
        comm = Communicator(datapath=datapath, timeout=timeout,
                            options=CommOptions(staging_bytes=1 << 20))
        last = n - 1
        x64, x32 = torch.arange(64.0, device=dev) + rank, torch.arange(32.0, device=dev) + rank
        gathered = torch.full((64 * n,), -1.0, device=dev)
        if case in ("cached", "both cached"):
            comm.all_reduce(x64.clone())  # prepared on every rank
            comm.all_reduce(x32.clone())
        calls = {
            # rank `last` calls another function / size / dtype / root; the others agree
            "function": lambda: comm.all_gather_into_tensor(gathered, x64) if rank == last
            else comm.all_reduce(x64),
            "size": lambda: comm.all_reduce(x32 if rank == last else x64),
            "dtype": lambda: comm.all_reduce(x64.to(torch.bfloat16) if rank == last else x64),
            "root": lambda: comm.broadcast(x64, src=rank if rank in (0, last) else 0),
            # the others' size is prepared, the last rank's is new
            "cached": lambda: comm.all_reduce(torch.arange(128.0, device=dev) if rank == last
                                              else x64),
            # both sizes prepared: the ranks wait on different flags
            "both cached": lambda: comm.all_reduce(x32 if rank == last else x64),
            # the last rank makes no call: the others are told where it is
            "missing": lambda: None if rank == last else comm.all_reduce(x64),
        }
        before = [x64.clone(), x32.clone(), gathered.clone()]
        t0 = time.monotonic()
        try:
            calls[case]()
            comm.check()
            error, kind = None, None
        except ExecutionError as exc:
            error, kind = str(exc), type(exc).__name__
        elapsed = time.monotonic() - t0
        same = all(torch.equal(a, b) for a, b in zip((x64, x32, gathered), before))
        again = None
        if error:
            try:
                comm.all_reduce(torch.ones(2, device=dev))
            except ExecutionError as exc:
                again = str(exc)
        comm.close()
        dist.barrier()
        out[case] = {"error": error, "kind": kind, "elapsed": elapsed, "same": same,
                     "again": again}
    return out


CASES = {
    # case: (the others' call, the last rank's call) as the messages name them
    "function": ("all_reduce of 64 float32 (sum)", "all_gather_into_tensor of 64 float32"),
    "size": ("all_reduce of 64 float32 (sum)", "all_reduce of 32 float32 (sum)"),
    "dtype": ("all_reduce of 64 float32 (sum)",
              "all_reduce of 64 bfloat16 (sum) on torch.distributed"),
    "root": ("broadcast of 64 float32 from rank 0", "broadcast of 64 float32 from rank 2"),
    "cached": ("all_reduce of 64 float32 (sum)", "all_reduce of 128 float32 (sum)"),
    "both cached": ("all_reduce of 64 float32 (sum)", "all_reduce of 32 float32 (sum)"),
}
TIMEOUT, SHORT = 20.0, 2.0


def test_ranks_that_disagree_about_a_call_all_say_so():
    """Three ranks, the last one calling something else (another function, size, dtype, root;
    a size the others have prepared and it has not; two sizes all have prepared), then the last
    one making no call: every rank's error names what each rank called, well before the
    timeout, and writes nothing; the communicator then refuses further calls."""
    n = 3
    cases = [(case, TIMEOUT) for case in CASES] + [("missing", SHORT)]
    t0 = time.monotonic()
    results = raise_for(run_processes(_mismatch_worker, n, cases, timeout=120))
    assert time.monotonic() - t0 < 90
    for case, (others, last) in CASES.items():
        call = 3 if case in ("cached", "both cached") else 1
        for rank, by_case in enumerate(results):
            res = by_case[case]
            assert res["kind"] == "CallMismatchError", (case, rank, res)
            msg = res["error"]
            assert msg.startswith(f"rank {rank}"), msg
            assert f"ranks disagree about call {call}: ranks 0 and 1 call {others}; rank 2 " \
                f"calls {last}" in msg, (case, msg)
            assert "same calls in the same order" in msg and "alive?" not in msg, msg
            assert res["elapsed"] < TIMEOUT / 4, (case, res["elapsed"])  # before the timeout
            assert res["same"], f"{case}: a call the ranks disagreed about wrote a tensor"
            assert "failed earlier" in res["again"], res["again"]
    assert results[2]["missing"]["error"] is None
    for rank, by_case in enumerate(results[:2]):
        res = by_case["missing"]
        assert res["kind"] == "PurlinTimeoutError", (rank, res)
        assert "to reach call 1 (all_reduce of 64 float32 (sum))" in res["error"] or \
            "gave up waiting for the others to reach call 1" in res["error"], res["error"]
        assert "rank 2 has made no call yet" in res["error"], res["error"]
        assert res["elapsed"] < SHORT + 2.0 and res["same"], res


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["nccl", "gloo"])
def test_gpu_ranks_that_disagree_on_first_use_all_say_so(backend):
    """The sm datapath compares the ranks' calls on the first use of a size (gathered with the
    barrier there): another function, size or root on rank 1, every rank raises
    CallMismatchError naming both calls. nccl: two GPUs; gloo: both processes on one GPU
    (their staging buffers mapped by CUDA IPC)."""
    import torch

    if backend == "nccl" and torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    cases = [("function", TIMEOUT), ("size", TIMEOUT), ("root", TIMEOUT)]
    results = raise_for(run_processes(_mismatch_worker, 2, cases, "sm", backend=backend,
                                      timeout=180))
    for case, _ in cases:
        others, last = CASES[case]
        last = last.replace("rank 2", "rank 1")
        for rank, by_case in enumerate(results):
            res = by_case[case]
            assert res["kind"] == "CallMismatchError", (case, rank, res)
            assert f"ranks disagree about call 1: rank 0 calls {others}; rank 1 calls {last}" \
                in res["error"], (case, res["error"])
            assert res["same"] and "failed earlier" in res["again"], res
