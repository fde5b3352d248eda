"""Variable-length collectives on GPUs: the pack/unpack kernels compile for sm_90 (no GPU
needed); on a GPU (``-m gpu``), virtual ranks against the unpadded reference for every
collective x strategy x dtype, device counts in a CUDA graph, a bad count caught on the
device, and the MoE example."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
KINDS = ("all-gather-v", "reduce-scatter-v", "all-to-all-v")
GPU_DTYPES = ("bfloat16", "float16", "float32", "int32", "float8_e4m3fn")


@pytest.mark.skipif(os.environ.get("NUMBA_ENABLE_CUDASIM") == "1",
                    reason="PTX can only be checked without the simulator")
@pytest.mark.parametrize("kernel", ["pack", "unpack"])
@pytest.mark.parametrize("elem", ["uint8", "int16", "int32", "int64"])
def test_kernels_compile_for_sm90(kernel, elem):
    pytest.importorskip("numba.cuda")
    from purlin.kernels import varlen as kv
    from purlin.kernels.compat import compile_ptx

    sig = {"pack": f"void({elem}[::1], int64, {elem}[::1], int64[::1], int64[::1], "
                   "int64[:, ::1], int64, int64, int64, int64[::1], int64)",
           "unpack": f"void({elem}[::1], int64[::1], {elem}[::1], int64[::1], int64[:, ::1], "
                     "int64, int64, int64, int64[::1])"}[kernel]
    ptx = compile_ptx(getattr(kv, kernel).py_func, sig, cc=(9, 0))
    assert ".entry" in ptx
    if kernel == "pack":
        assert "atom.global.cas.b64" in ptx  # the error record's first-writer-wins


@pytest.mark.skipif(os.environ.get("NUMBA_ENABLE_CUDASIM") == "1",
                    reason="PTX can only be checked without the simulator")
@pytest.mark.parametrize("kernel", ["pack_group", "unpack_group"])
@pytest.mark.parametrize("elem", ["uint8", "int64"])
@pytest.mark.parametrize("ranks", [1, 8])
def test_group_kernels_compile_for_sm90(kernel, elem, ranks):
    """The one-launch-per-device kernels take their ranks' arrays as tuples."""
    pytest.importorskip("numba.cuda")
    from numba import types

    from purlin.kernels import varlen as kv
    from purlin.kernels.compat import compile_ptx

    a, a64 = types.Array(getattr(types, elem), 1, "C"), types.Array(types.int64, 1, "C")
    m, i = types.Array(types.int64, 2, "C"), types.int64

    def t(x):
        return types.UniTuple(x, ranks)

    sig = {"pack_group": types.void(t(a), t(i), t(a), t(a64), a64, t(m), t(i), i, i, i,
                                    t(a64), t(i)),
           "unpack_group": types.void(t(a), t(a64), t(a), a64, t(m), t(i), i, i, i,
                                      t(a64))}[kernel]
    ptx = compile_ptx(getattr(kv, kernel).py_func, sig, cc=(9, 0))
    assert ".entry" in ptx and "%ctaid.z" in ptx  # blockIdx.z picks the rank
    if kernel == "pack_group":
        assert "cas.b64" in ptx  # the error record's first-writer-wins


def _torch():
    import torch

    return torch


def _case(kind, dtype, style, rng, n=4, cap=6, row=3):
    from purlin.spec.varlen import VARIABLE

    v = VARIABLE[kind](n, cap, row=row)
    if style == "zero":
        counts = [0] * len(v.names)
    elif style == "full":
        counts = [cap] * len(v.names)
    else:
        counts = rng.integers(0, cap + 1, len(v.names)).tolist()
        counts[0], counts[-1] = 0, cap
    checked = v.counts(counts)
    values = [rng.integers(-3, 4, sum(v.input_counts(r, checked)) * row).astype(np.float64)
              for r in range(n)]
    return v, counts, values


@pytest.mark.gpu
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("strategy", ["direct-push", "ring", "direct-pull"])
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("style", ["mixed", "zero", "full"])
def test_virtual_ranks_match_reference(kind, strategy, dtype, style):
    torch = _torch()
    from purlin import Cluster

    from purlin.errors import CapabilityError

    rng = np.random.default_rng(abs(hash((kind, strategy, dtype, style))) % 2**32)
    v, counts, values = _case(kind, dtype, style, rng)
    try:
        bound = Cluster.virtual(v.nranks).bind(v, strategy, dtype=dtype)
    except CapabilityError as exc:  # FP8 sums only where one step reduces every element
        assert dtype.startswith("float8") and v.collective.op.is_reduce, exc
        assert "one rounding" in str(exc), exc
        return
    dev = torch.device("cuda", 0)
    ins = [torch.from_numpy(x).to(dev, getattr(torch, dtype)) for x in values]
    outs = bound(ins, counts)
    want = v.reference(values, counts)
    for r in range(v.nranks):
        got = outs[r].double().cpu().numpy()
        assert np.array_equal(got, want[r]), (r, got, want[r])


@pytest.mark.gpu
@pytest.mark.parametrize("protocol", ["simple", "ll", "fused"])
def test_protocols(protocol):
    torch = _torch()
    from purlin import Cluster

    rng = np.random.default_rng(3)
    v, counts, values = _case("all-to-all-v", "bfloat16", "mixed", rng)
    bound = Cluster.virtual(v.nranks).bind(v, dtype="bfloat16", protocol=protocol)
    ins = [torch.from_numpy(x).to("cuda", torch.bfloat16) for x in values]
    outs = bound(ins, counts)
    want = v.reference(values, counts)
    assert all(np.array_equal(o.double().cpu().numpy(), w) for o, w in zip(outs, want))


@pytest.mark.gpu
@pytest.mark.parametrize("kind", KINDS)
def test_copy_engine_datapath(kind):
    """The padded collective on copy engines (reductions on sm): the same pack and unpack."""
    torch = _torch()
    from purlin import Cluster

    rng = np.random.default_rng(5)
    v, counts, values = _case(kind, "float32", "mixed", rng, n=2)
    bound = Cluster.virtual(2).bind(v, dtype="float32", datapath="ce")
    outs = bound([torch.from_numpy(x).float().cuda() for x in values], counts)
    want = v.reference(values, counts)
    assert all(np.array_equal(o.double().cpu().numpy(), w) for o, w in zip(outs, want))


@pytest.mark.gpu
def test_device_counts_replay_in_a_cuda_graph():
    """Counts and rows change in place between replays of one captured graph: the outputs
    follow them with no host sync inside."""
    torch = _torch()
    from purlin import Cluster
    from purlin.spec.varlen import all_to_all_v

    n, cap, row = 4, 8, 4
    v = all_to_all_v(n, cap, row=row)
    bound = Cluster.virtual(n).bind(v, dtype="float32")
    dev = torch.device("cuda", 0)
    ins = [torch.zeros(v.input_capacity(r), device=dev) for r in range(n)]
    counts = torch.zeros(n * n, dtype=torch.int64, device=dev)
    bound.launch(ins, counts)  # eager once: compiles the kernels
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.graph(graph, stream=stream):
        outs, got = bound.launch(ins, counts)
    rng = np.random.default_rng(0)
    for trial in range(3):
        host = rng.integers(0, cap + 1, n * n).tolist()
        values = [rng.standard_normal(sum(host[r * n:(r + 1) * n]) * row) for r in range(n)]
        counts.copy_(torch.tensor(host))
        for r in range(n):
            ins[r].zero_()
            ins[r][:values[r].size] = torch.from_numpy(values[r]).float()
        graph.replay()
        torch.cuda.synchronize()
        bound.check()
        want = v.reference([x.astype(np.float32).astype(np.float64) for x in values], host)
        for r in range(n):
            k = sum(host[j * n + r] for j in range(n))
            assert got[r].tolist() == [host[j * n + r] for j in range(n)], trial
            assert np.array_equal(outs[r][:k * row].double().cpu().numpy(), want[r]), trial


@pytest.mark.gpu
def test_over_capacity_is_caught_on_the_device():
    torch = _torch()
    from purlin import Cluster
    from purlin.errors import CountError
    from purlin.spec.varlen import all_to_all_v

    v = all_to_all_v(2, capacity=3)
    bound = Cluster.virtual(2).bind(v, dtype="float32")
    ins = [torch.arange(6.0, device="cuda"), torch.arange(6.0, device="cuda")]
    outs, got = bound.launch(ins, torch.tensor([1, 1, 7, 1], device="cuda"))
    with pytest.raises(CountError, match=r"rank 1 chunk \(1,0\) \(input position 0\): count 7 "
                                         r"is over the capacity of 3 rows \(caught on the GPU"):
        bound.check()
    assert got[0].tolist() == [1, 3]  # clamped inside its slot, nothing past it
    bound.check()  # reported once: the record is cleared
    outs, got = bound.launch(ins, torch.tensor([-1, 0, 0, 0], device="cuda"))
    with pytest.raises(CountError, match=r"rank 0 chunk \(0,0\).*count -1 is negative"):
        bound.check()


@pytest.mark.gpu
def test_one_pack_and_one_unpack_launch_for_all_virtual_ranks():
    """8 virtual ranks on one GPU: one pack and one unpack launch for them all, grids that
    span many blocks per slot, rows right against the reference, and a bad count on rank 5
    alone reported with its rank and chunk."""
    torch = _torch()
    from purlin import Cluster
    from purlin.errors import CountError
    from purlin.spec.varlen import all_to_all_v

    n, cap, row = 8, 2048, 64
    v = all_to_all_v(n, cap, row=row)
    bound = Cluster.virtual(n).bind(v, dtype="float32")
    assert [g.ranks for g in bound._pack_groups] == [tuple(range(n))]
    assert [g.ranks for g in bound._unpack_groups] == [tuple(range(n))]
    assert bound._pack_groups[0].grid[0] > 1 and bound._pack_groups[0].grid[1:] == (n, n)
    rng = np.random.default_rng(2)
    host = rng.integers(0, cap + 1, n * n).tolist()
    host[3] = cap
    values = [rng.integers(-8, 8, sum(host[r * n:(r + 1) * n]) * row).astype(np.float64)
              for r in range(n)]
    ins = [torch.zeros(v.input_capacity(r), device="cuda") for r in range(n)]
    for r in range(n):
        ins[r][:values[r].size] = torch.from_numpy(values[r]).float()
    outs, got = bound.launch(ins, torch.tensor(host, device="cuda"))
    bound.check()
    want = v.reference(values, host)
    for r in range(n):
        k = sum(host[j * n + r] for j in range(n))
        assert got[r].tolist() == [host[j * n + r] for j in range(n)], r
        assert np.array_equal(outs[r][:k * row].double().cpu().numpy(), want[r]), r
    bad = list(host)
    bad[5 * n + 2] = cap + 1
    bound.launch(ins, torch.tensor(bad, device="cuda"))
    with pytest.raises(CountError, match=r"^rank 5 chunk \(5,2\) \(input position 2\): count "
                                         rf"{cap + 1} is over the capacity of {cap} rows"):
        bound.check()


@pytest.mark.gpu
def test_moe_example_on_virtual_ranks():
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_moe", ROOT / "bench" / "moe.py")
    moe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(moe)
    row = moe.run(ranks=4, tokens=64, datapath="sm", repeats=2, log=None)
    assert row["status"] == "ok", row


def _process_worker(rank, n):
    import warnings

    import torch
    import torch.distributed as dist

    from purlin.errors import CountError
    from purlin.torch import Communicator

    warnings.simplefilter("ignore")
    dev = torch.device("cuda", torch.cuda.current_device())
    comm = Communicator(datapath="sm", timeout=10.0)
    bad = []
    for dtype in (torch.bfloat16, torch.float32, torch.int32):
        for send in ([1, 3], [0, 0], [4, 4]):
            send = send if rank == 0 else send[::-1]
            inp = (torch.arange(sum(send) * 8, device=dev) + 100 * rank).to(dtype)
            inp = inp.reshape(sum(send), 8)
            recv_t = torch.empty(n, dtype=torch.int64, device=dev)
            dist.all_to_all_single(recv_t, torch.tensor(send, device=dev))
            recv = recv_t.tolist()
            a = torch.zeros(sum(recv), 8, dtype=dtype, device=dev)
            b = a.clone()
            dist.all_to_all_single(a, inp, recv, send)
            comm.all_to_all_single(b, inp, recv, send)
            if not torch.equal(a, b):
                bad.append(f"all_to_all_single {dtype} {send}")
            out = torch.zeros(n * 4, 8, dtype=dtype, device=dev)
            got = comm.all_to_all_v(out, inp, torch.tensor(send, device=dev), capacity=4)
            if got.tolist() != recv or not torch.equal(out[:sum(recv)], a):
                bad.append(f"all_to_all_v {dtype} {send}: {got.tolist()}")
    # captured with device splits, replayed with new ones written in place
    splits = torch.tensor([2, 1], device=dev)
    inp = torch.randn(8, 8, device=dev)
    out = torch.zeros(2 * 4, 8, device=dev)
    comm.all_to_all_v(out, inp, splits, capacity=4)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = comm.all_to_all_v(out, inp, splits, capacity=4)
    for trial in ([3, 0], [1, 4]):
        splits.copy_(torch.tensor(trial if rank == 0 else trial[::-1], device=dev))
        graph.replay()
        torch.cuda.synchronize()
        comm.check()
        recv_t = torch.empty(n, dtype=torch.int64, device=dev)
        dist.all_to_all_single(recv_t, splits.to(torch.int64))
        ref = torch.zeros(int(recv_t.sum()), 8, device=dev)
        dist.all_to_all_single(ref, inp[:int(splits.sum())], recv_t.tolist(),
                               splits.tolist())
        if got.tolist() != recv_t.tolist() or not torch.equal(out[:ref.shape[0]], ref):
            bad.append(f"graph replay {trial}: {got.tolist()}")
    error = ""
    try:
        comm.all_to_all_v(out, inp, torch.tensor([5, 0], device=dev), capacity=4)
    except CountError as exc:
        error = str(exc)
    comm.close()
    return bad, error


@pytest.mark.gpu
def test_process_mode_on_two_gpus():
    torch = _torch()
    from purlin.torch.testing import raise_for, run_processes

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    results = raise_for(run_processes(_process_worker, 2, backend="nccl", timeout=240,
                                      pg_timeout=120))
    for rank, (bad, error) in enumerate(results):
        assert bad == [], (rank, bad)
        assert f"rank {rank} chunk ({rank},0) (its split for rank 0): split 5 is over the " \
               "capacity of 4 rows (caught on the GPU" in error, error


@pytest.mark.gpu
def test_process_mode_on_one_gpu():
    """The same, with both processes on GPU 0 (a gloo group; the staging buffers mapped by
    CUDA IPC): what a researcher with one GPU can run."""
    torch = _torch()
    from purlin.torch.testing import raise_for, run_processes

    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    results = raise_for(run_processes(_process_worker, 2, backend="gloo", timeout=240,
                                      pg_timeout=120))
    for rank, (bad, error) in enumerate(results):
        assert bad == [], (rank, bad)
        assert f"rank {rank} chunk ({rank},0) (its split for rank 0): split 5 is over the " \
               "capacity of 4 rows (caught on the GPU" in error, error
