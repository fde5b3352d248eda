"""Process mode on 2 GPUs (NCCL + the sm datapath): the RMSNorm epilogue.

``Communicator.all_reduce_add_rms_norm`` with the add and the norm inside the fused kernel
must give NCCL's all-reduce followed by the same add and norm in PyTorch: the residual equal,
the norm within a rounding, the same bits on both ranks, over eager calls and graph replays,
on ordinary tensors and on the epilogue's own input region, on the all-reduce's grid and on
blocks owning whole rows (``epilogue_grid="rows"``), on the one-shot kernel built for the
epilogue ``rms_norm`` (LL sizes, by default) and on the fused kernel with the NORM op
(``epilogue_kernel="fused"``);
rows the kernel's blocks do not divide run unfused and are right too. The full sweep over
dtypes and sizes, and the timings, are ``bench/process_mode.py``'s norm section.
"""

from __future__ import annotations

import warnings

import pytest

from purlin.torch.testing import raise_for, run_processes

pytestmark = pytest.mark.gpu


def _epilogue_worker(rank, n):
    import torch
    import torch.distributed as dist

    from purlin.torch import CommOptions, Communicator
    from purlin.torch.comm import add_rms_norm

    warnings.simplefilter("ignore")
    device = torch.device("cuda", torch.cuda.current_device())
    comm = Communicator(timeout=10.0, options=CommOptions(staging_bytes=64 << 20, zero_copy=True))
    # blocks that own whole rows: no row sums traded between blocks
    comm_rows = Communicator(timeout=10.0, options=CommOptions(
        staging_bytes=16 << 20, zero_copy=True, epilogue_grid="rows"))
    # the fused kernel with the NORM op where the one-shot kernel would run
    comm_fused = Communicator(timeout=10.0, options=CommOptions(
        staging_bytes=16 << 20, zero_copy=True, epilogue_kernel="fused"))
    comms = {"auto": comm, "rows": comm_rows, "fused": comm_fused}
    found = []
    # staged: the tensor is the epilogue's own input region (as a decoder writes its
    # row-parallel products), else an ordinary tensor (copied in)
    for rows, hidden, which in ((1, 4096, "auto"), (64, 4096, "auto"), (3, 1000, "auto"),
                                (8, 4096, "rows"), (1, 4096, "fused"), (8, 4096, "auto")):
        on, staged = comms[which], which == "rows"
        gen = torch.Generator(device=device).manual_seed(rows + hidden)
        weight = (torch.rand(hidden, generator=gen, device=device) + 0.5).to(torch.bfloat16)
        t = on.input_buffer("all_reduce_add_rms_norm", rows * hidden, torch.bfloat16,
                            hidden=hidden).view(rows, hidden) if staged else torch.empty(
            rows, hidden, dtype=torch.bfloat16, device=device)
        r = torch.empty_like(t)
        graph = None
        for call in range(6):
            g = torch.Generator(device=device).manual_seed(call * 10 + rank)
            x = torch.randn(rows, hidden, generator=g, device=device).to(torch.bfloat16)
            r0 = torch.randn(rows, hidden, generator=torch.Generator(device=device).manual_seed(
                call), device=device).to(torch.bfloat16)
            ref, ref_r = x.clone(), r0.clone()
            dist.all_reduce(ref)
            add_rms_norm(ref, ref_r, weight, 1e-5)
            t.copy_(x)
            r.copy_(r0)
            if call < 2:  # eager; then captured once and replayed
                on.all_reduce_add_rms_norm(t, r, weight, 1e-5)
            else:
                if graph is None:
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        on.all_reduce_add_rms_norm(t, r, weight, 1e-5)
                    t.copy_(x)
                    r.copy_(r0)
                graph.replay()
            theirs = t.clone()
            dist.broadcast(theirs, src=0)
            far = (t.float() - ref.float()).abs() > 1.6e-2 * (1 + ref.float().abs())
            found.append({"shape": (rows, hidden), "comm": which, "call": call,
                          "residual_wrong": int((r != ref_r).sum()), "norm_wrong": int(far.sum()),
                          "ranks_equal": bool(torch.equal(theirs, t))})
        torch.cuda.synchronize()
        on.check()
    fused = {(name, p["count"]): (p.get("epilogues", 0), p.get("blocks_per_lane"),
                                  p.get("norm_kernel"))
             for name, c in comms.items() for p in c.plans()
             if p["function"] == "all-reduce-add-rms-norm"}
    for c in comms.values():
        c.close()
    return found, fused


@pytest.mark.parametrize("backend", ["nccl", "gloo"])
def test_epilogue_equals_nccl_then_pytorch(backend):
    """nccl: two GPUs; gloo: both processes on one GPU (staging mapped by CUDA IPC), the
    reference all-reduce on gloo."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    if backend == "nccl" and torch.cuda.device_count() < 2:
        pytest.skip("process mode on nccl needs 2 GPUs")
    results = raise_for(run_processes(_epilogue_worker, 2, backend=backend, timeout=240,
                                      pg_timeout=120))
    for rank, (found, fused) in enumerate(results):
        bad = [f for f in found if f["residual_wrong"] or f["norm_wrong"]
               or not f["ranks_equal"]]
        assert not bad, (rank, bad[:4])
        # the epilogue ran fused: on the all-reduce's grid (LL sizes on the one-shot
        # kernel), on a block per row of 4096, and on the fused kernel when asked
        auto, kernel = fused[("auto", 4096)], "generic"
        assert auto[0] > 0 and auto[2] == kernel, fused
        assert fused[("auto", 8 * 4096)][2] == kernel, fused
        assert fused[("auto", 64 * 4096)][0] > 0, fused
        assert fused[("rows", 8 * 4096)][0] > 0 and fused[("rows", 8 * 4096)][1] == 8, fused
        assert fused[("fused", 4096)][0] > 0, fused
        assert fused[("fused", 4096)][2] == "fused-norm", fused
        assert fused[("auto", 3000)][0] == 0, fused  # 1000-element rows: unfused
