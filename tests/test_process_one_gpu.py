"""Process mode with every process on one GPU (``-m gpu``): a gloo group, the sm datapath, the
staging buffers mapped between the processes by CUDA IPC (NCCL and PyTorch symmetric memory
refuse two ranks on one GPU). Each call is checked against the result computed on the host
from the seeds every rank knows: all-reduce at an LL, a fused and an interpreter size (eager
and in graph replay), the add + RMSNorm epilogue, all-gather, reduce-scatter, and a
three-piece all-gather delivered interleaved (GQA's q, k, v) with aligned and odd pieces."""

from __future__ import annotations

import pytest

from purlin.torch.testing import raise_for, run_processes

pytestmark = pytest.mark.gpu


def _inputs(torch, n, count, call, device):
    return [torch.randn(count, generator=torch.Generator().manual_seed(1000 * call + r)).to(
        torch.bfloat16).to(device) for r in range(n)]


def _worker(rank, n):
    import warnings

    import torch

    from purlin.torch import CommOptions, Communicator
    from purlin.torch.comm import add_rms_norm

    warnings.simplefilter("ignore")
    dev = torch.device("cuda", torch.cuda.current_device())
    comm = Communicator(datapath="sm", timeout=10.0, options=CommOptions(staging_bytes=64 << 20))
    bad = []

    def far(got, ref, tol=3e-2):
        return int(((got.float() - ref.float()).abs() > tol * (1 + ref.float().abs())).sum())

    for count in (4096, 65536, 1 << 20):
        t = torch.empty(count, dtype=torch.bfloat16, device=dev)
        graph = None
        for call in range(4):
            xs = _inputs(torch, n, count, call, dev)
            t.copy_(xs[rank])
            if call < 2:
                comm.all_reduce(t)
            else:  # captured once, replayed on new inputs
                if graph is None:
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        comm.all_reduce(t)
                    t.copy_(xs[rank])
                graph.replay()
            torch.cuda.synchronize()
            wrong = far(t, sum(x.float() for x in xs))
            if wrong:
                bad.append(f"all_reduce {count} call {call}: {wrong} wrong")
    for rows, hidden in ((1, 4096), (8, 8192), (64, 4096)):
        for call in range(2):
            xs = _inputs(torch, n, rows * hidden, call, dev)
            w = (torch.rand(hidden, generator=torch.Generator().manual_seed(7)) + 0.5).to(
                torch.bfloat16).to(dev)
            r0 = torch.randn(rows * hidden, generator=torch.Generator().manual_seed(50 + call))
            r0 = r0.to(torch.bfloat16).to(dev).view(rows, hidden)
            t, r = xs[rank].clone().view(rows, hidden), r0.clone()
            comm.all_reduce_add_rms_norm(t, r, w, 1e-6)
            torch.cuda.synchronize()
            ref_t = sum(x.float() for x in xs).to(torch.bfloat16).view(rows, hidden)
            ref_r = r0.clone()
            add_rms_norm(ref_t, ref_r, w, 1e-6)
            if far(r, ref_r) or far(t, ref_t, 1.6e-2):
                bad.append(f"add_rms_norm {rows}x{hidden} call {call}: residual "
                           f"{far(r, ref_r)}, norm {far(t, ref_t, 1.6e-2)} wrong")
    xs = _inputs(torch, n, 8192, 9, dev)
    out = torch.empty(n * 8192, dtype=torch.bfloat16, device=dev)
    comm.all_gather_into_tensor(out, xs[rank])
    if not torch.equal(out, torch.cat(xs)):
        bad.append("all_gather_into_tensor")
    xs = _inputs(torch, n, n * 8192, 10, dev)
    part = torch.empty(8192, dtype=torch.bfloat16, device=dev)
    comm.reduce_scatter_tensor(part, xs[rank])
    wrong = far(part, sum(x.float() for x in xs)[rank * 8192: (rank + 1) * 8192])
    if wrong:
        bad.append(f"reduce_scatter_tensor: {wrong} wrong")
    bad += _gqa(torch, comm, n, rank, dev)
    comm.check()
    kernels = sorted((p["count"], p.get("epilogues", 0), str(p.get("protocol")),
                      p.get("strategy"))
                     for p in comm.plans() if p["function"] == "all-reduce-add-rms-norm")
    comm.close()
    return bad, kernels


def _gqa(torch, comm, n, rank, dev):
    """Each rank's q, k and v (4:1:1) gathered interleaved to every rank -- all q, then all
    k, then all v -- with whole 16-byte pieces and with each piece one element longer (every
    piece after a rank's first off a 16-byte boundary): several pieces a rank, the layouts
    whose fused programs hold segmented ops built from every rank's table. Returns what is
    wrong, and that it ran on the fused kernel."""
    from test_fused_rows import gqa

    qkv = gqa(n)
    bad = []
    for extra, call in ((0, 20), (1, 21)):
        sizes = {(r, t): (4 if t == "q" else 1) * 2048 + extra for r in range(n) for t in "qkv"}
        xs = _inputs(torch, n, sum(sizes[(0, t)] for t in "qkv"), call, dev)
        pieces = {(r, t): x for r, x in enumerate(xs)
                  for t, x in zip("qkv", torch.split(x, [sizes[(r, t)] for t in "qkv"]))}
        got = comm.run(qkv, xs[rank], chunk_sizes=sizes)
        torch.cuda.synchronize()
        want = torch.cat([pieces[(r, t)] for t in "qkv" for r in range(n)])
        if not torch.equal(got, want):
            bad.append(f"gqa +{extra}: {int((got != want).sum())} wrong")
    ran = [str(p.get("protocol")) for p in comm.plans() if p["function"] == qkv.name]
    if len(ran) != 2 or not all(p.startswith("fused") for p in ran):
        bad.append(f"gqa ran on {ran}, not the fused kernel twice")
    return bad


@pytest.mark.parametrize("n", [2, 4])
def test_process_mode_with_every_rank_on_one_gpu(n):
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    results = raise_for(run_processes(_worker, n, backend="gloo", timeout=300, pg_timeout=120))
    for rank, (bad, kernels) in enumerate(results):
        assert bad == [], (rank, bad)
        # the epilogue ran inside the all-reduce's kernel wherever that is the fused kernel
        # on a direct-push plan, whose last op is the sum into the output (the strategy and
        # protocol are the tuning table's or the fast path's for the rank count; a two-phase
        # plan ends with its all-gather: all_reduce and then PyTorch)
        assert len(kernels) == 3, kernels
        assert all(k[1] > 0 for k in kernels if k[2].startswith("fused") and
                   k[3] == "direct-push"), kernels
        if n == 2:
            assert all(k[1] > 0 for k in kernels), kernels
