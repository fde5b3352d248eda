"""The ce datapath's prepared driver calls, built without a GPU (cuda.bindings parameter
structures need no driver): one ``cuStreamBatchMemOp`` per run of counter operations, the
atomic-add / wait / write parameters, the caller's stream filled in, the add-kernel fallback."""

import pytest

pytest.importorskip("cuda.bindings")

from purlin.atom import ce_driver as drv  # noqa: E402
from purlin.atom.ce import CAPABILITIES  # noqa: E402
from purlin.atom.ce_lowering import (Add, Launch, Memcpy, Record, WaitEvent, WaitGeq,  # noqa: E402
                                     Write, lower_ce)
from purlin.snac import plan  # noqa: E402
from purlin.spec import collectives  # noqa: E402

d = drv.driver()
U64 = 1 << 64


def fake_resources(atomic_add=True, lanes=((0, 0),)):
    made = []

    def pair_array(pairs):
        made.append(pairs)
        return 0xABC000 + len(made)

    streams = {key: d.CUstream(0x100 + i) for i, key in enumerate(lanes)}
    events = {name: d.CUevent(0x200 + i) for i, name in enumerate(
        ["fork:d0", "end:d0", *[f"done:r{r}.l{lane}" for r, lane in lanes]])}
    res = drv.Resources(0, streams, events, launch=lambda stream: None,
                        add_kernel=None if atomic_add else "ADD_KERNEL",
                        pair_array=pair_array, atomic_add=atomic_add)
    return res, made


def test_parameters():
    p = drv.add_param(0x1000, -4)
    assert p.operation == d.CUstreamBatchMemOpType.CU_STREAM_MEM_OP_ATOMIC_REDUCTION
    ar = p.atomicReduction
    assert int(ar.address) == 0x1000 and int(ar.value) == U64 - 4
    assert ar.reductionOp == d.CUstreamAtomicReductionOpType.CU_STREAM_ATOMIC_REDUCTION_OP_ADD
    assert ar.dataType == \
        d.CUstreamAtomicReductionDataType.CU_STREAM_ATOMIC_REDUCTION_UNSIGNED_64
    w = drv.wait_param(0x2000, 7)
    assert w.operation == d.CUstreamBatchMemOpType.CU_STREAM_MEM_OP_WAIT_VALUE_64
    assert int(w.waitValue.address) == 0x2000 and int(w.waitValue.value64) == 7
    assert w.waitValue.flags == d.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ
    x = drv.write_param(0x3000, 1)
    assert x.operation == d.CUstreamBatchMemOpType.CU_STREAM_MEM_OP_WRITE_VALUE_64
    assert int(x.writeValue.value64) == 1


def names(calls):
    return [fn if isinstance(fn, str) else getattr(fn, "__name__", str(fn)) for fn, _ in calls]


def test_counter_operations_in_a_row_are_one_batch():
    res, _ = fake_resources()
    ops = (WaitEvent("fork:d0"), WaitGeq(0x10, 2), Memcpy(0x20, 0x30, 64, 0), Add(0x40, 1),
           Add(0x48, 1), WaitGeq(0x50, 1), Record("done:r0.l0"))
    calls = drv._stream_calls(ops, res.streams[(0, 0)], res)
    assert names(calls) == ["cuStreamWaitEvent", "cuStreamBatchMemOp", "cuMemcpyAsync",
                            "cuStreamBatchMemOp", "cuEventRecord"]
    fn, (stream, count, params, flags) = calls[3]
    assert count == 3 and flags == 0 and stream is res.streams[(0, 0)]
    assert [int(p.operation) for p in params] == [8, 8, 4]
    assert calls[2][1] == (0x20, 0x30, 64, res.streams[(0, 0)])


def test_long_runs_split_below_256_operations():
    res, _ = fake_resources()
    calls = drv._stream_calls([Add(0x40 + 8 * k, 1) for k in range(600)], "S", res)
    assert [args[1] for _, args in calls] == [255, 255, 90]


def test_without_atomic_reduction_adds_go_to_the_add_kernel():
    res, made = fake_resources(atomic_add=False)
    ops = (WaitGeq(0x10, 2), Add(0x40, 1), Add(0x48, -3), WaitGeq(0x50, 1), Write(0x60, 1))
    calls = drv._stream_calls(ops, "S", res)
    assert names(calls) == ["cuStreamBatchMemOp", "ADD_KERNEL", "cuStreamBatchMemOp"]
    assert made == [[(0x40, 1), (0x48, -3)]]
    assert calls[1][1] == (0xABC001, 2, "S")
    assert calls[2][1][1] == 2   # the wait and the write share a batch


def test_a_device_program_forks_launches_and_joins_on_the_callers_stream():
    s = plan(collectives.all_reduce(2), "two-phase", count=16, capabilities=CAPABILITIES)
    bases = {(r, b): (1 + 4 * r + i) << 20 for r in range(2)
             for i, b in enumerate(("input", "output", "scratch"))}
    low = lower_ce(s, bases, {r: (100 + r) << 20 for r in range(2)},
                   {r: (200 + r) << 20 for r in range(2)}, (0, 1))
    res, _ = fake_resources()
    lanes = {(0, 0): low.ranks[0].lanes[0][0]}
    calls = drv.compile_program(low.programs[0][0], lanes, res)
    assert names(calls)[:2] == ["cuEventRecord", "launch"]
    assert calls[0][1][1] is drv.MAIN and calls[1][1] == (drv.MAIN,)
    bound = drv.bind_main(calls, 0x777)
    assert int(bound[0][1][1]) == 0x777 and bound[1][1] == (0x777,)
    assert names(bound)[-3:] == ["cuStreamWaitEvent", "cuStreamBatchMemOp", "cuEventRecord"]
    # the join waits for the lane's end event on the caller's stream, then rebases
    _, (stream, event, _flags) = bound[-3]
    assert int(stream) == 0x777 and event is res.events["done:r0.l0"]
    rebase = bound[-2][1][2]
    assert all(int(p.operation) == 8 for p in rebase)
    assert sorted(int(p.atomicReduction.value) - U64 for p in rebase) == [-2, -2]


def test_max_connections(monkeypatch):
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    assert drv.max_connections() == 8
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32")
    assert drv.max_connections() == 32


def test_launch_is_only_on_devices_with_sm_steps():
    s = plan(collectives.all_gather(2), "direct-push", count=8, capabilities=CAPABILITIES)
    low = lower_ce(s, {(r, b): (1 + 4 * r + i) << 20 for r in range(2)
                       for i, b in enumerate(("input", "output", "scratch"))},
                   {r: (100 + r) << 20 for r in range(2)}, {r: (200 + r) << 20 for r in range(2)},
                   (0, 1))
    assert not any(isinstance(op, Launch) for p in low.programs.values() for op in p[0].head)


def _fresh(code: str, **env) -> str:
    """stdout of ``code`` in a fresh interpreter whose environment lacks the variable."""
    import os
    import subprocess
    import sys

    base = {k: v for k, v in os.environ.items() if k != "CUDA_DEVICE_MAX_CONNECTIONS"}
    return subprocess.run([sys.executable, "-c", code], env={**base, **env},
                          capture_output=True, text=True, check=True).stdout.strip()


def test_import_leaves_the_environment_alone():
    code = "import os, purlin; print(os.environ.get('CUDA_DEVICE_MAX_CONNECTIONS'))"
    assert _fresh(code) == "None"


def test_a_copy_engine_cluster_asks_for_32_hardware_queues_unless_told_otherwise():
    code = ("import os; from purlin.atom import ce; ok = ce.ask_for_queues(); "
            "print(ok, os.environ.get('CUDA_DEVICE_MAX_CONNECTIONS'))")
    assert _fresh(code) == "True 32"
    assert _fresh(code, CUDA_DEVICE_MAX_CONNECTIONS="8") == "False 8"  # the user's choice


def test_too_few_queues_warn_once_with_what_to_set(monkeypatch):
    import warnings

    from purlin.atom import ce

    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "8")
    monkeypatch.setattr(ce, "_warned_queues", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ce._warn_few_queues()
        ce._warn_few_queues()
    assert len(caught) == 1 and caught[0].category is RuntimeWarning
    assert "set CUDA_DEVICE_MAX_CONNECTIONS=32 before CUDA starts" in str(caught[0].message)
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32")
    monkeypatch.setattr(ce, "_warned_queues", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ce._warn_few_queues()
    assert not caught


def test_a_gpu_left_stuck_refuses_further_binds_instead_of_hanging(monkeypatch):
    """After a ce collective could not be drained, a bind on that GPU (whose synchronize would
    wait for ever) fails at once, naming the GPU and why."""
    from purlin.atom import ce
    from purlin.errors import ExecutionError
    from purlin.runtime import Cluster

    monkeypatch.setattr(ce, "STUCK", {1: "rank 0 lane 0 waits for flag(r0<-r1.l0) >= 4, saw 2"})
    cluster = Cluster("local", 2, (0, 1))  # no GPU is touched before the refusal
    with pytest.raises(ExecutionError, match="GPU 1 still runs a stuck copy-engine"):
        cluster.bind(collectives.all_gather(2), "direct-push", count=8)
    ce.refuse_stuck([0])  # other GPUs stay usable
