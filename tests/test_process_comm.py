"""purlin.torch.Communicator in process mode: one process per rank, gloo + the shm cpu datapath.

Every function must equal torch.distributed's own result on the same data (4 processes; fp32,
fp64, int32; odd sizes; every reduce op), over back-to-back calls of mixed sizes, with a
staging area small enough to force evictions; fallbacks warn once and stay right; a custom
collective equals the spec reference; a group split into 2 "nodes" x 2 ranks runs hierarchically
and equals the flat result; a peer killed before its notify makes the survivors raise
PurlinTimeoutError naming it, within the time limit, leaving their tensors untouched.

Each test spawns its processes once and checks many cases in them (spawning costs seconds).
"""

from __future__ import annotations

import os
import time
import warnings

import pytest

from purlin.torch.testing import raise_for, run_processes

WORLD = 4
DTYPES = ("float32", "float64", "int32")
OPS = ("sum", "max", "min", "avg")


# -- workers (run in the spawned processes) --------------------------------------------------------


def _data(torch, rank, salt, count, dtype):
    """Integers (exact in every dtype, sums included), different per rank, call and size."""
    gen = torch.Generator().manual_seed(1000 * salt + 10 * rank + count)
    x = torch.randint(-40, 40, (count,), generator=gen)
    return (x.to(getattr(torch, dtype)) / (1 if dtype == "int32" else 4)).to(
        getattr(torch, dtype))


def _same(torch, got, want, what, bad):
    if not torch.equal(got, want):
        bad.append(f"{what}: got {got.tolist()[:8]}..., torch.distributed gives "
                   f"{want.tolist()[:8]}...")


def _check_all_gather(torch, dist, comm, rank, n, salt, dtype, counts, tag, bad):
    for count in counts:
        inp = _data(torch, rank, salt, count, dtype)
        out = torch.full((n * count,), -9, dtype=inp.dtype)
        ref = torch.empty_like(out)
        dist.all_gather_into_tensor(ref, inp)
        comm.all_gather_into_tensor(out, inp)
        _same(torch, out, ref, f"{tag}all_gather {dtype} n={count}", bad)


def _check_functions(torch, dist, comm, rank, n, salt, bad, tag):
    R = dist.ReduceOp
    for dtype in DTYPES:
        ops = [o for o in OPS if not (o == "avg" and dtype == "int32")]
        for op in ops:
            for count in (1, 3, 7, 64, 1001):
                x = _data(torch, rank, salt, count, dtype)
                ref = x.clone()
                if op == "avg":  # gloo has no AVG everywhere: sum, then divide exactly
                    dist.all_reduce(ref)
                    ref /= n
                else:
                    dist.all_reduce(ref, op=getattr(R, op.upper()))
                comm.all_reduce(x, op=getattr(R, op.upper()))
                _same(torch, x, ref, f"{tag} all_reduce {dtype} {op} n={count}", bad)
            for count in (1, 5, 33):
                inp = _data(torch, rank, salt, count * n, dtype)
                out, ref = torch.full((count,), -9, dtype=inp.dtype), torch.empty(count,
                                                                                  dtype=inp.dtype)
                if op == "avg":
                    dist.reduce_scatter_tensor(ref, inp)
                    ref /= n
                else:
                    dist.reduce_scatter_tensor(ref, inp, op=getattr(R, op.upper()))
                comm.reduce_scatter_tensor(out, inp, op=getattr(R, op.upper()))
                _same(torch, out, ref, f"{tag} reduce_scatter {dtype} {op} n={count}", bad)
            for count in (1, 7, 100):
                for root in (0, n - 1):
                    t = _data(torch, rank, salt, count, dtype)
                    before, ref = t.clone(), t.clone()
                    if op == "avg":
                        continue  # torch.distributed.reduce has no AVG on gloo
                    dist.reduce(ref, dst=root, op=getattr(R, op.upper()))
                    comm.reduce(t, dst=root, op=getattr(R, op.upper()))
                    _same(torch, t, ref if rank == root else before,
                          f"{tag} reduce {dtype} {op} n={count} root={root}", bad)
        _check_all_gather(torch, dist, comm, rank, n, salt, dtype, (1, 5, 33), f"{tag} ", bad)
        for count in (1, 3, 17):
            inp = _data(torch, rank, salt, count * n, dtype)
            out, ref = torch.full_like(inp, -9), torch.empty_like(inp)
            dist.all_to_all_single(ref, inp)
            comm.all_to_all_single(out, inp)
            _same(torch, out, ref, f"{tag} all_to_all {dtype} n={count}", bad)
        for count in (1, 7, 100):
            for root in (0, 2):
                t = _data(torch, rank, salt, count, dtype)
                ref = t.clone()
                dist.broadcast(ref, src=root)
                comm.broadcast(t, src=root)
                _same(torch, t, ref, f"{tag} broadcast {dtype} n={count} root={root}", bad)


def _functions_worker(rank, n):
    import torch
    import torch.distributed as dist

    from purlin.torch import CommOptions, Communicator

    warnings.simplefilter("ignore", FutureWarning)  # torch 2.13 renames *_into_tensor/_tensor
    bad: list[str] = []
    comms = {
        "auto": Communicator(datapath="cpu", timeout=20),
        # ring with pipelining and two lanes (two threads per process)
        "ring": Communicator(datapath="cpu", timeout=20,
                             options=CommOptions(strategy="ring", chunks=2, lanes=2)),
        # a 48 KiB area: the larger sizes evict the smaller ones, again and again
        "small": Communicator(datapath="cpu", timeout=20, options=CommOptions(
            staging_bytes=48 << 10, strategy="direct-pull")),
    }
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", RuntimeWarning)
        for salt in range(2):  # back to back, every size again with new data
            for tag, comm in comms.items():
                _check_functions(torch, dist, comm, rank, n, salt, bad, tag)
    fallbacks = [str(w.message) for w in caught if "falls back" in str(w.message)]
    evicted = comms["small"].evictions
    plans = comms["ring"].plans()
    for comm in comms.values():
        comm.check()
        comm.close()
    return {"bad": bad, "fallbacks": fallbacks, "evicted": evicted, "plans": plans}


def _fallback_worker(rank, n):
    import torch
    import torch.distributed as dist

    from purlin.torch import CommOptions, Communicator

    warnings.simplefilter("ignore", FutureWarning)
    comm = Communicator(datapath="cpu", timeout=20, options=CommOptions(staging_bytes=64 << 10))
    R = dist.ReduceOp
    bad, ok = [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", RuntimeWarning)
        cases = [
            ("bfloat16", lambda: torch.arange(6, dtype=torch.bfloat16) + rank, R.SUM),
            ("product", lambda: torch.full((5,), 1.0 + rank), R.PRODUCT),
            ("too large", lambda: torch.arange(40000, dtype=torch.float32) + rank, R.SUM),
        ]
        for label, make, op in cases:
            for _ in range(2):  # the warning comes once
                x, ref = make(), make()
                comm.all_reduce(x, op=op)
                dist.all_reduce(ref, op=op)
                (ok if torch.equal(x, ref) else bad).append(label)
        # strided tensors run on Purlin (copied in and out with their strides), exactly
        base = torch.arange(24, dtype=torch.float32).reshape(6, 4) * (rank + 1)
        view = base[:, 1]
        want = torch.arange(24, dtype=torch.float32).reshape(6, 4)[:, 1] * sum(range(1, n + 1))
        comm.all_reduce(view)
        untouched = torch.equal(base[:, 0], torch.arange(0, 24, 4.0) * (rank + 1))
        (ok if torch.equal(view, want) and untouched else bad).append("strided")
        # uneven all-to-all splits: on Purlin now (no warning)
        splits = [1, 2, 0, 1][:n]
        inp = torch.arange(sum(splits), dtype=torch.float32) + 10 * rank
        outs = [splits[rank]] * n
        out, ref = torch.empty(sum(outs)), torch.empty(sum(outs))
        comm.all_to_all_single(out, inp, outs, splits)
        dist.all_to_all_single(ref, inp, outs, splits)
        (ok if torch.equal(out, ref) else bad).append("uneven splits")
    messages = [str(w.message) for w in caught if "falls back" in str(w.message)]
    comm.close()
    return {"bad": bad, "ok": ok, "warnings": messages}


def _custom_worker(rank, n):
    import numpy as np
    import torch

    from purlin.spec import Collective, reduce, reference
    from purlin.torch import CommOptions, Communicator

    comm = Communicator(datapath="cpu", timeout=20)
    # every rank gathers all chunks in reverse rank order; then a reduce to two roots
    rev = Collective([[r] for r in range(n)], [list(range(n))[::-1]] * n, "copy",
                     name="reversed all-gather")
    two = Collective([["a", "b"]] * n, [["a"], [], [], ["b"]][:n], reduce.max,
                     name="reduce to two roots")
    results = {}
    for coll, count in ((rev, 5), (two, 6)):
        xs = [np.arange(count, dtype=np.float64) * (r + 1) - r for r in range(n)]
        want = reference(coll, xs)[rank]
        got = comm.run(coll, torch.from_numpy(xs[rank].copy()))
        results[coll.name] = bool(np.array_equal(got.numpy(), want))
    comm.close()
    return results


def _hierarchical_worker(rank, n, node_of_rank):
    import torch
    import torch.distributed as dist

    from purlin.torch import CommOptions, Communicator

    warnings.simplefilter("ignore", FutureWarning)
    comm = Communicator(datapath="cpu", timeout=20, node_of_rank=node_of_rank)
    R = dist.ReduceOp
    bad = []
    for salt in range(2):
        for dtype in DTYPES:
            for op in ("sum", "max", "avg"):
                if op == "avg" and dtype == "int32":
                    continue
                rop = getattr(R, op.upper()) if op != "avg" else R.AVG
                for count in (1, 6, 13, 257):
                    x = _data(torch, rank, salt, count, dtype)
                    ref = x.clone()
                    dist.all_reduce(ref, op=R.SUM if op == "avg" else rop)
                    if op == "avg":
                        ref /= n
                    comm.all_reduce(x, op=rop)
                    _same(torch, x, ref, f"all_reduce {dtype} {op} n={count}", bad)
                    inp = _data(torch, rank, salt, count * n, dtype)
                    out, ref = torch.full((count,), -9, dtype=inp.dtype), torch.empty(
                        count, dtype=inp.dtype)
                    dist.reduce_scatter_tensor(ref, inp, op=R.SUM if op == "avg" else rop)
                    if op == "avg":
                        ref /= n
                    comm.reduce_scatter_tensor(out, inp, op=rop)
                    _same(torch, out, ref, f"reduce_scatter {dtype} {op} n={count}", bad)
            _check_all_gather(torch, dist, comm, rank, n, salt, dtype, (1, 6, 13), "", bad)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", RuntimeWarning)
        t, ref = torch.arange(4.0) * rank, torch.arange(4.0) * rank
        comm.broadcast(t, src=1)
        dist.broadcast(ref, src=1)
        _same(torch, t, ref, "broadcast across nodes", bad)
    spans = [str(w.message) for w in caught if "spans nodes" in str(w.message)]
    prepared = len(comm.hierarchy.intra._cache)
    comm.check()
    return {"bad": bad, "spans": spans, "intra_prepared": prepared,
            "nodes": comm.hierarchy.plan_nodes}


def _norm_worker(rank, n):
    """all_reduce_add_rms_norm against float64 arithmetic: residual + sum, rounded to the
    dtype, then the row norm; bad arguments raise naming the rank."""
    import torch
    import torch.distributed as dist

    from purlin.errors import SpecError
    from purlin.torch import CommOptions, Communicator

    comm = Communicator(timeout=10.0)
    bad, caught = [], []
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for dtype, tol in (("float32", 1e-5), ("bfloat16", 1e-2)):
            dt = getattr(torch, dtype)
            for rows, hidden in ((1, 8), (3, 16), (5, 7)):
                gen = torch.Generator().manual_seed(rows * 100 + hidden)
                parts = [torch.randn(rows, hidden, generator=gen).to(dt) for _ in range(n)]
                residual = torch.randn(rows, hidden, generator=gen).to(dt)
                weight = (torch.rand(hidden, generator=gen) + 0.5).to(dt)
                total = sum(p.double() for p in parts)
                want_r = (residual.double() + total).to(dt)  # one rounding of the sum
                x = want_r.double()
                want = x / torch.sqrt((x ** 2).mean(-1, keepdim=True) + 1e-5) * weight.double()
                t, r = parts[rank].clone(), residual.clone()
                out = comm.all_reduce_add_rms_norm(t, r, weight, 1e-5)
                what = f"{dtype} {rows}x{hidden}"
                if out is not t:
                    bad.append(f"{what}: returned another tensor")
                if not torch.allclose(r.double(), want_r.double(), rtol=tol, atol=tol):
                    bad.append(f"{what}: residual {r.tolist()} != {want_r.tolist()}")
                if not torch.allclose(t.double(), want, rtol=2 * tol, atol=2 * tol):
                    bad.append(f"{what}: normed {t.tolist()} != {want.tolist()}")
        for args in ((torch.ones(6), torch.ones(6), torch.ones(4)),      # rows not whole
                     (torch.ones(8), torch.ones(4), torch.ones(4)),      # residual too short
                     (torch.ones(8, dtype=torch.int32),) * 2 + (torch.ones(4, dtype=torch.int32),)):
            try:
                comm.all_reduce_add_rms_norm(*args)
            except SpecError as exc:
                caught.append(str(exc))
        try:  # its input region needs the row length
            comm.input_buffer("all_reduce_add_rms_norm", 48, torch.float32)
        except SpecError as exc:
            caught.append(str(exc))
        try:  # which no other region takes
            comm.input_buffer("all_reduce", 48, torch.float32, hidden=16)
        except SpecError as exc:
            caught.append(str(exc))
        # and is a region of its own, apart from all_reduce's of the same size
        region = comm.input_buffer("all_reduce_add_rms_norm", 48, torch.float32, hidden=16)
        if region.numel() != 48 or region.data_ptr() == comm.input_buffer(
                "all_reduce", 48, torch.float32).data_ptr():
            bad.append("all_reduce_add_rms_norm's input region")
        region.copy_(torch.full((48,), float(rank + 1)))
        r = torch.zeros(48)
        comm.all_reduce_add_rms_norm(region, r, torch.ones(16), 1e-5)
        if not (torch.all(r == 3.0) and torch.allclose(region, torch.ones(48), atol=1e-5)):
            bad.append(f"in its input region: residual {r[:4]}, normed {region[:4]}")
    warned = [str(w.message) for w in seen if "all_reduce_add_rms_norm" in str(w.message)]
    comm.close()
    dist.barrier()
    return bad, caught, warned


def _killed_worker(rank, n, strategy, timeout):
    import torch

    from purlin.errors import ExecutionError, PurlinTimeoutError
    from purlin.runtime import shm
    from purlin.torch import CommOptions, Communicator

    comm = Communicator(datapath="cpu", timeout=timeout, options=CommOptions(strategy=strategy))
    x = torch.arange(12, dtype=torch.float32) + rank
    comm.all_reduce(x)  # a whole call first: flags are in step, then rank 3 dies mid-call
    if rank == n - 1:
        def die(self, flag):
            os._exit(1)
        shm.ShmRun._notify = die  # only in this process: its first notify of the next call
    x = torch.arange(12, dtype=torch.float32) * (rank + 1)
    before = x.clone()
    t0 = time.monotonic()
    try:
        comm.all_reduce(x)
    except PurlinTimeoutError as exc:
        elapsed = time.monotonic() - t0
        try:
            comm.all_reduce(x)
            again = "ran"
        except ExecutionError as exc2:
            again = str(exc2)
        return {"error": str(exc), "type": type(exc).__name__, "elapsed": elapsed,
                "untouched": bool(torch.equal(x, before)), "again": again,
                "missing": getattr(exc, "missing", None)}
    return {"error": None, "elapsed": time.monotonic() - t0}


# -- tests ----------------------------------------------------------------------------------------


def test_every_function_equals_torch_distributed():
    t0 = time.monotonic()
    results = raise_for(run_processes(_functions_worker, WORLD, timeout=120))
    for rank, res in enumerate(results):
        assert res["bad"] == [], f"rank {rank}: {res['bad'][:5]}"
        assert res["fallbacks"] == [], f"rank {rank} fell back: {res['fallbacks']}"
        assert res["evicted"] > 0
        kinds = {p["function"] for p in res["plans"]}
        assert kinds == {"all-reduce", "reduce-scatter", "reduce", "all-gather", "all-to-all",
                         "broadcast"}, kinds
        ring = [p for p in res["plans"] if p["function"] == "all-reduce" and p["count"] == 1001]
        assert {(p["strategy"], p["chunks"], p["lanes"], p["dtype"]) for p in ring} == {
            ("ring", 2, 2, d) for d in DTYPES}, ring
    assert time.monotonic() - t0 < 60


def test_fallbacks_warn_once_and_stay_right():
    results = raise_for(run_processes(_fallback_worker, WORLD, timeout=60))
    for rank, res in enumerate(results):
        assert res["bad"] == [], f"rank {rank}: wrong after fallback: {res['bad']}"
        assert sorted(res["ok"]) == sorted(["bfloat16"] * 2 + ["product"] * 2 +
                                           ["too large"] * 2 + ["strided", "uneven splits"])
        warned = res["warnings"]
        assert len(warned) == 3, warned  # bf16, product, too large: once each
        assert any("dtype bfloat16" in w for w in warned)
        assert any("reduce op" in w for w in warned)
        assert any("bytes of staging" in w for w in warned)
        assert not any("split" in w for w in warned)  # uneven splits run on Purlin
        assert all("torch.distributed (gloo)" in w for w in warned)


def test_custom_collective_equals_reference():
    results = raise_for(run_processes(_custom_worker, WORLD, timeout=60))
    for rank, res in enumerate(results):
        assert all(res.values()), f"rank {rank}: {res}"


@pytest.mark.parametrize("node_of_rank", [(0, 0, 1, 1), ("b", "a", "b", "a")],
                         ids=["blocked", "interleaved"])
def test_hierarchical_two_nodes_of_two_equals_flat(node_of_rank):
    results = raise_for(run_processes(_hierarchical_worker, WORLD, node_of_rank, timeout=90))
    for rank, res in enumerate(results):
        assert res["bad"] == [], f"rank {rank}: {res['bad'][:5]}"
        assert res["spans"], "broadcast across nodes must warn that it falls back"
        assert res["intra_prepared"] > 0  # the intra-node phases ran on Purlin
    assert results[0]["nodes"] in (((0, 1), (2, 3)), ((0, 2), (1, 3)))


def test_all_reduce_add_rms_norm_equals_float64_arithmetic():
    """On the cpu datapath the all-reduce runs on Purlin (bfloat16: on gloo) and the add and
    norm in PyTorch, warned once per reason: every rank gets residual + sum and its norm, also
    in its own input region (``input_buffer``, which needs the row length); bad shapes and
    integer tensors raise SpecError naming the rank."""
    results = raise_for(run_processes(_norm_worker, 2, timeout=60))
    for rank, (bad, caught, warned) in enumerate(results):
        assert not bad, bad[:3]
        assert len(caught) == 5 and all(f"rank {rank}" in c for c in caught), caught
        assert "needs hidden, the norm's row length" in caught[3], caught
        assert "input_buffer('all_reduce') takes no hidden" in caught[4], caught
        assert len(warned) == 2 and "the cpu datapath has no fused kernel" in warned[0] and \
            "dtype bfloat16" in warned[1], warned


@pytest.mark.parametrize("strategy", ["direct-push", "ring"])
def test_killed_peer_makes_survivors_time_out_naming_it(strategy):
    timeout = 2.0
    t0 = time.monotonic()
    outcomes = run_processes(_killed_worker, WORLD, strategy, timeout, timeout=60)
    assert time.monotonic() - t0 < 45
    assert outcomes[WORLD - 1] == ("lost", 1), outcomes[WORLD - 1]
    for rank, (status, res) in enumerate(outcomes[:-1]):
        assert status == "ok", res
        assert res["type"] == "PurlinTimeoutError", res
        msg = res["error"]
        assert msg.startswith(f"rank {rank} step "), msg
        assert f"is rank {WORLD - 1} alive?" in msg, msg
        assert res["missing"] == WORLD - 1
        assert res["elapsed"] < timeout + 2.0, res["elapsed"]
        assert res["untouched"], "a failed all_reduce must leave the tensor as it was"
        assert "failed earlier" in res["again"]
    # at least one survivor timed out itself, waiting on a flag, and says so
    own = [o[1]["error"] for o in outcomes[:-1] if "timed out after" in o[1]["error"]]
    assert own and "flag(r" in own[0] and "saw " in own[0]


def test_each_size_gets_the_protocol_it_can_run_on_gpus_only():
    """protocol="ll": small direct-push messages on the sm datapath get LL areas; large ones,
    ring plans and the cpu datapath keep flags. The fused protocols run where the fused kernel
    can run the plan (LL up to LL_MAX_BYTES), else the interpreter's protocol; "auto" takes
    the choice's protocol and PDL for its own plan, else the fast path."""
    from types import SimpleNamespace

    from purlin.runtime.shm import layout
    from purlin.snac import plan
    from purlin.spec import collectives
    from purlin.torch.comm import LL_MAX_BYTES, Communicator

    ar = collectives.all_reduce(2)
    small = plan(ar, "direct-push", nbytes=16 << 10, dtype="bfloat16")
    big = plan(ar, "direct-push", nbytes=2 * LL_MAX_BYTES, dtype="bfloat16")
    ring = plan(ar, "ring", nbytes=16 << 10, dtype="bfloat16", chunks=2, lanes=2)
    # 6 bytes in one row: a scalar tail, fused; a reduce-scatter's chunk 1 starts at byte 2
    tail = plan(ar, "direct-push", dtype="bfloat16",
                sizing=ar.sized(chunk_sizes={0: 1, 1: 2}, dtype="bfloat16"))
    rs = collectives.reduce_scatter(2)
    odd = plan(rs, "direct-push", dtype="bfloat16",
               sizing=rs.sized(chunk_sizes={0: 1, 1: 2}, dtype="bfloat16"))
    fp8 = plan(ar, "direct-push", nbytes=16 << 10, dtype="float8_e4m3fn")  # (an FP8 sum)

    def runs(schedule, protocol, datapath="sm", pdl=None, choice=None):
        comm = SimpleNamespace(protocol=protocol, datapath=datapath, pdl=pdl)
        return Communicator._protocol(comm, schedule, choice)

    assert runs(small, "ll") == ("ll", False)
    assert runs(big, "ll") == runs(ring, "ll") == runs(small, "simple") == ("simple", False)
    assert runs(small, "ll", datapath="cpu") == runs(small, "fused", "cpu") == ("simple", False)
    assert runs(small, "fused-ll") == ("fused-ll", True)
    assert runs(big, "fused-ll") == runs(big, "fused") == ("fused", True)
    assert runs(small, "fused", pdl=False) == ("fused", False)
    # two lanes, a program each (purlin.atom.fused_lanes); a ring relays what it received:
    # flags, not LL
    assert runs(ring, "fused-ll") == ("fused", True)
    assert runs(tail, "fused-ll") == ("fused-ll", True)
    assert runs(odd, "fused-ll") == ("fused-ll", True)  # (at byte 2: the narrow build)
    assert runs(fp8, "fused-ll") == ("fused-ll", True)  # (an FP8 sum: the narrow build)
    table = SimpleNamespace(strategy="direct-push", protocol="fused-ll", pdl=True)
    rules = SimpleNamespace(strategy="direct-push", protocol="simple", pdl=False)
    assert runs(small, "auto", choice=table) == ("fused-ll", True)
    assert runs(big, "auto", choice=table) == ("fused", True)
    assert runs(small, "auto", choice=rules) == ("simple", False)
    # a choice for another plan (the communicator's own strategy), or none: the fast path
    other = SimpleNamespace(strategy="ring", protocol="simple", pdl=False)
    assert runs(small, "auto", choice=other) == runs(small, "auto") == ("fused-ll", True)
    assert runs(big, "auto") == ("fused", True) and runs(ring, "auto") == ("fused", True)
    with_ll, without = layout(small, ll=True), layout(small)
    assert with_ll.has_ll and not without.has_ll and with_ll.size > without.size
    slots = layout(small, ll=True, block_flags=True)
    assert with_ll.block_flags == 0 and slots.block_flags > slots.abort
    assert slots.offset(0, "input") >= slots.control_end > with_ll.control_end
    assert slots.size > with_ll.size


def test_unknown_protocols_are_refused(tmp_path):
    """A protocol the datapath does not have is refused with the ones it has; an epilogue
    grid that is not None, 'rows' or a warp multiple up to 512 threads is refused naming it."""
    import torch.distributed as dist

    from purlin.errors import CapabilityError, SpecError
    from purlin.torch import CommOptions, Communicator

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0,
                            world_size=1)
    try:
        with pytest.raises(CapabilityError, match="one of simple, ll, fused, fused-ll, auto, "
                                                  "got 'lamport'"):
            CommOptions(protocol="lamport")
        fused = CommOptions(protocol="fused-ll")
        assert Communicator(datapath="cpu", options=fused).protocol == "fused-ll"
        for bad in ("columns", 48, 1024, 0):
            with pytest.raises(SpecError, match=f"epilogue_grid must be None, 'rows' or "
                                                f"threads per block .* got {bad!r}"):
                CommOptions(epilogue_grid=bad)
        rows = CommOptions(epilogue_grid="rows")
        assert Communicator(datapath="cpu", options=rows).epilogue_grid == "rows"
        assert Communicator(datapath="cpu", options=CommOptions(epilogue_grid=64)) \
            .epilogue_grid == 64
    finally:
        dist.destroy_process_group()
