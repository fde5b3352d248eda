"""The sm datapath on real GPUs: every standard collective, strategy and dtype against the
reference, graph replays, timeouts. Skipped, with the reason, where no GPU is visible."""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest

from purlin.errors import PurlinTimeoutError
from purlin.snac import Notify, plan
from purlin.spec import STANDARD, reference, standard

pytestmark = pytest.mark.gpu

STRATEGIES = ("direct-push", "direct-pull", "two-phase", "ring")
TOL = {"bfloat16": 2e-2, "float16": 4e-3, "float32": 1e-5, "int32": 0}


@pytest.fixture(scope="module")
def torch():
    import torch

    return torch


def _cluster(kind: str, n: int):
    from purlin.runtime import Cluster

    if kind == "local":
        import torch

        if torch.cuda.device_count() < n:
            pytest.skip(f"needs {n} GPUs, {torch.cuda.device_count()} visible")
        return Cluster.local(n)
    return Cluster.virtual(n)


def _inputs(torch, sizing, gen):
    """Random inputs per rank (never zeros) as float64 numpy (the values the GPU sees)."""
    dt = sizing.dtype.name
    out = []
    for r in range(sizing.collective.nranks):
        k = sizing.input_count(r)
        if dt == "int32":
            x = gen.integers(-1000, 1000, size=k).astype(np.float64)
            x[x == 0] = 7
        else:
            x = gen.standard_normal(k) + 0.5
            x = torch.tensor(x).to(getattr(torch, dt)).double().numpy()
        out.append(x)
    return out


def _check(torch, bound, sizing, gen, calls=2):
    dt = getattr(torch, sizing.dtype.name)
    for _ in range(calls):
        xs = _inputs(torch, sizing, gen)
        before = [torch.tensor(x).to(dt) for x in xs]
        outs = bound([b.clone() for b in before])
        ref = reference(sizing, xs)
        for r, (o, e) in enumerate(zip(outs, ref)):
            got = o.double().cpu().numpy()
            tol = TOL[sizing.dtype.name] * max(1.0, np.abs(e).max(initial=0) if len(e) else 1)
            bad = np.abs(got - e) > tol + 1e-12
            assert not bad.any(), (f"rank {r}: {int(bad.sum())} of {len(e)} elements wrong, "
                                   f"first at {int(np.argmax(bad))}: {got[bad][:4]} vs "
                                   f"{e[bad][:4]}")
        ins = [bound.inputs[r][:sizing.input_count(r)].cpu() for r in range(len(xs))]
        for r, (a, b) in enumerate(zip(ins, before)):
            assert torch.equal(a, b), f"input of rank {r} was modified"


def _sizing(coll, nbytes, dtype, odd):
    from purlin.spec import dtype as as_dtype

    item = as_dtype(dtype).itemsize
    names = coll.input.names()
    widest = max(max(len(r) for r in coll.input), max(len(r) for r in coll.output))
    each = max(1, nbytes // item // widest)
    if odd:  # uneven, odd chunk sizes: exercises scalar tails and misaligned vectors
        return coll.sized(chunk_sizes={n: each + (2 * i + 1) % 5 for i, n in
                                       enumerate(names)}, dtype=dtype)
    return coll.sized(count=each * widest, dtype=dtype)


CASES = [(c, s) for c in STANDARD for s in STRATEGIES
         if not (s == "two-phase" and c not in ("all-reduce", "reduce-scatter", "reduce"))]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("name,strategy", CASES)
def test_two_gpus_every_collective(torch, name, strategy, dtype):
    cluster = _cluster("local", 2)
    gen = np.random.default_rng(1)
    coll = standard(name, 2, root=1)
    for nbytes, odd in ((16, False), (1000, True), (64 << 10, False), ((1 << 20) + 12, True)):
        sizing = _sizing(coll, nbytes, dtype, odd)
        for chunks, lanes in ((1, 1), (4, 2)):
            bound = cluster.bind(coll, strategy, sizing=sizing, chunks=chunks, lanes=lanes)
            _check(torch, bound, sizing, gen)


def _ops(dtype: str) -> tuple:
    """The reductions checked for ``dtype`` (no avg for int32 here)."""
    return ("sum", "max", "min") + (("avg",) if dtype != "int32" else ())


@pytest.mark.parametrize("dtype", ["float16", "int32"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_two_gpus_all_reduce_dtypes_and_ops(torch, strategy, dtype):
    cluster = _cluster("local", 2)
    gen = np.random.default_rng(2)
    for op in _ops(dtype):
        coll = standard("all-reduce", 2, op=op)
        sizing = _sizing(coll, 4096 + 6, dtype, True)
        _check(torch, cluster.bind(coll, strategy, sizing=sizing), sizing, gen)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_two_gpus_256mib(torch, strategy):
    cluster = _cluster("local", 2)
    gen = np.random.default_rng(3)
    for name in ("all-reduce", "all-gather"):
        if strategy == "two-phase" and name == "all-gather":
            continue
        coll = standard(name, 2)
        sizing = coll.sized(nbytes=256 << 20, dtype="bfloat16")
        bound = cluster.bind(coll, strategy, sizing=sizing, chunks=8, lanes=8)
        _check(torch, bound, sizing, gen, calls=1)
        del bound
        torch.cuda.empty_cache()


@pytest.mark.parametrize("name,strategy", [("all-reduce", "ring"), ("all-reduce", "two-phase"),
                                           ("all-gather", "ring"), ("all-to-all", "ring"),
                                           ("broadcast", "ring")])
def test_two_gpus_chunks_pipelined_through_one_many_block_lane(torch, name, strategy):
    """256 MiB as 8 chunks through one lane of 66 blocks: the tuning run that found wrong
    elements here (a fast block's second notify made up a waiter's target before a slow block
    finished its part of the first chunk); the lowering now puts a lane barrier between."""
    cluster = _cluster("local", 2)
    gen = np.random.default_rng(5)
    coll = standard(name, 2)
    sizing = coll.sized(nbytes=256 << 20, dtype="bfloat16")
    bound = cluster.bind(coll, strategy, sizing=sizing, chunks=8, lanes=1, blocks_per_lane=66)
    _check(torch, bound, sizing, gen, calls=2)
    del bound
    torch.cuda.empty_cache()


@pytest.mark.parametrize("kind,n", [("local", 2), ("virtual", 3)])
@pytest.mark.parametrize("name,strategy", [("all-reduce", "two-phase"), ("all-reduce", "ring"),
                                           ("all-gather", "direct-push"), ("reduce", "ring")])
def test_stage_lanes_match_the_reference(torch, kind, n, name, strategy):
    """Lanes by stage on the sm datapath: a hop at depth d runs in lane d % lanes."""
    cluster = _cluster(kind, n)
    gen = np.random.default_rng(6)
    coll = standard(name, n)
    for nbytes, odd in ((1000, True), ((4 << 20) + 12, True)):
        sizing = _sizing(coll, nbytes, "bfloat16", odd)
        bound = cluster.bind(coll, strategy, sizing=sizing, chunks=4, lanes=3, lanes_by="stage",
                             blocks_per_lane=8)  # 3 virtual ranks x 3 lanes must fit the SMs
        _check(torch, bound, sizing, gen)


@pytest.mark.parametrize("n", range(2, 9))
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_virtual_ranks(torch, n, strategy):
    cluster = _cluster("virtual", n)
    gen = np.random.default_rng(n)
    for name in STANDARD:
        if strategy == "two-phase" and name not in ("all-reduce", "reduce-scatter", "reduce"):
            continue
        coll = standard(name, n, root=n - 1)
        for nbytes, odd in ((64, False), (40000, True)):
            sizing = _sizing(coll, nbytes, "float32", odd)
            _check(torch, cluster.bind(coll, strategy, sizing=sizing, chunks=2, lanes=2),
                   sizing, gen, calls=2)


def _wrong_over_replays(torch, bound, replays: int) -> int:
    """Wrong elements over ``replays`` one-call graph replays of a 2-GPU float32 all-reduce of
    4096 elements, with fresh inputs before each."""
    graphs = bound.capture(ops=1)
    wrong = torch.zeros((), dtype=torch.int64, device="cuda:0")
    for _ in range(replays):
        for r in (0, 1):
            with torch.cuda.device(r):
                bound.inputs[r].copy_(torch.randn(4096, device=f"cuda:{r}") + 1.0)
        expect = bound.inputs[0] + bound.inputs[1].to("cuda:0")
        graphs.replay()
        for r in (0, 1):
            got = bound.outputs[r].to("cuda:0")
            wrong += (torch.abs(got - expect) > 1e-4 * (1 + torch.abs(expect))).sum()
    bound.check()
    return int(wrong.item())


def test_graph_replays_10000(torch):
    """10,000 CUDA-graph replays of an all-reduce with fresh inputs each time: zero wrong."""
    cluster = _cluster("local", 2)
    bound = cluster.bind(standard("all-reduce", 2), "direct-push", count=4096, dtype="float32")
    assert _wrong_over_replays(torch, bound, 10_000) == 0


@pytest.mark.parametrize("kind", ["local", "virtual"])
def test_broken_schedule_times_out(torch, kind):
    """A schedule with a Notify removed raises PurlinTimeoutError within the limit, naming
    the flag rank 0 waited on and its sender (virtual ranks: one launch for both)."""
    from purlin.atom import sm

    cluster = _cluster(kind, 2)
    good = plan(standard("all-reduce", 2), "direct-push", count=1024, dtype="float32")
    steps = list(good.steps)
    drop = next(i for i, s in enumerate(steps[1]) if isinstance(s, Notify))
    steps[1] = steps[1][:drop] + steps[1][drop + 1:]
    broken = dataclasses.replace(good, steps=tuple(steps))
    bound = sm.bind(cluster, broken, timeout=0.5)
    t0 = time.perf_counter()
    with pytest.raises(PurlinTimeoutError, match=r"rank 0 step \d+ .*timed out .*waiting on "
                                                 r"flag\(r0<-r1\.l0\) from rank 1: expected"):
        bound([None, None])
    assert time.perf_counter() - t0 < 5.0


# -- LL protocol: flags inside the data ------------------------------------------------------
# two-phase reduce-scatter has LL pairs; two-phase all-reduce has none (one flag carries both
# phases), so protocol="ll" must leave it exactly as the simple protocol runs it
LL_CASES = [("all-reduce", "direct-push"), ("all-gather", "direct-push"),
            ("reduce-scatter", "direct-push"), ("all-to-all", "direct-push"),
            ("reduce-scatter", "two-phase"), ("all-reduce", "two-phase")]


@pytest.mark.parametrize("kind,n", [("local", 2), ("virtual", 2), ("virtual", 4)])
@pytest.mark.parametrize("name,strategy", LL_CASES)
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_ll_protocol_matches_the_reference(torch, kind, n, name, strategy, dtype):
    """protocol="ll" (LL_PUT / LL_GET rows, no flags for the pairs) against the reference at
    tiny, odd and 64 KiB sizes, eager calls with fresh inputs each time."""
    from purlin.atom.lowering import ll_transfers
    from purlin.kernels import isa

    cluster = _cluster(kind, n)
    gen = np.random.default_rng(5)
    coll = standard(name, n)
    for nbytes, odd in ((16, False), (1000, True), (64 << 10, False)):
        sizing = _sizing(coll, nbytes, dtype, odd)
        bound = cluster.bind(coll, strategy, sizing=sizing, protocol="ll")
        ops = {int(op) for low in bound.lowered for op in low.tables[0][:, isa.OP]}
        if len(ll_transfers(bound.schedule)):
            assert bound.blocks_per_lane == 1 and {isa.LL_PUT, isa.LL_GET} <= ops
        else:
            assert not {isa.LL_PUT, isa.LL_GET} & ops
        _check(torch, bound, sizing, gen, calls=3)


@pytest.mark.parametrize("kind,n", [("local", 2), ("virtual", 3)])
@pytest.mark.parametrize("name", ["all-reduce", "all-gather", "reduce-scatter", "all-to-all"])
def test_ll_with_several_blocks_per_lane(torch, kind, n, name):
    """LL with 2-8 blocks per lane (a lane barrier after the LL_GET rows: they give threads
    8-byte units, data rows 16-byte ones) at odd and 64-256 KiB sizes."""
    cluster = _cluster(kind, n)
    gen = np.random.default_rng(9)
    coll = standard(name, n)
    for nbytes, odd, bpl, lanes in ((1000, True, 2, 1), (64 << 10, False, 4, 1),
                                    (64 << 10, False, 2, 2), (256 << 10, False, 8, 1)):
        sizing = _sizing(coll, nbytes, "bfloat16", odd)
        bound = cluster.bind(coll, "direct-push", sizing=sizing, chunks=lanes, lanes=lanes,
                             protocol="ll", blocks_per_lane=bpl)
        assert bound.blocks_per_lane == bpl
        _check(torch, bound, sizing, gen, calls=3)


def test_ll_several_blocks_graph_replays_with_fresh_inputs(torch):
    cluster = _cluster("local", 2)
    bound = cluster.bind(standard("all-reduce", 2), "direct-push", count=4096,
                         dtype="float32", protocol="ll", blocks_per_lane=4)
    assert _wrong_over_replays(torch, bound, 1_000) == 0


def test_ll_graph_replays_with_fresh_inputs(torch):
    """2,000 graph replays of an LL all-reduce, inputs changed before each: zero wrong (the
    tags of consecutive calls differ, so no stale unit is ever taken for new data)."""
    cluster = _cluster("local", 2)
    bound = cluster.bind(standard("all-reduce", 2), "direct-push", count=4096,
                         dtype="float32", protocol="ll")
    assert _wrong_over_replays(torch, bound, 2_000) == 0


def test_ll_missing_put_times_out_naming_the_ll_area(torch):
    """Rank 1 never sends (its LL_PUT rows turned into no-ops): rank 0's LL_GET times out and
    the error names the LL data, the tag expected and the tag seen."""
    from purlin.kernels import isa

    cluster = _cluster("local", 2)
    bound = cluster.bind(standard("all-reduce", 2), "direct-push", count=1024,
                         dtype="float32", protocol="ll", timeout=0.5)
    blob = bound._keep[1]  # rank 1's block: descriptor, control, lanes, tables, pool
    words = blob.cpu().numpy()
    rows = int(bound.lowered[1].lane_offsets[-1])
    for column in (isa.D_TABLE, isa.D_TABLE_ODD):  # both scratch parities
        table_at = (int(words[column]) - blob.data_ptr()) // 8
        for k in range(rows):
            if words[table_at + k * isa.ROW_WIDTH + isa.OP] == isa.LL_PUT:
                words[table_at + k * isa.ROW_WIDTH + isa.OP] = isa.NOP
    blob.copy_(torch.from_numpy(words))
    t0 = time.perf_counter()
    with pytest.raises(PurlinTimeoutError, match=r"rank 0 .*LL data rank 1 .*expected tag 1, "
                                                 r"saw 0"):
        bound([None, None])
    assert time.perf_counter() - t0 < 5.0


# -- programmatic dependent launch -------------------------------------------------------------
@pytest.mark.parametrize("protocol", ["simple", "ll"])
def test_pdl_launches_match_the_reference(torch, protocol):
    """pdl=True (executor_pdl, launched with programmatic stream serialization): eager calls
    and 2,000 graph replays with fresh inputs give the reference, with either protocol."""
    cluster = _cluster("local", 2)
    gen = np.random.default_rng(9)
    coll = standard("all-reduce", 2)
    for nbytes, odd in ((16, False), (1000, True), (64 << 10, False)):
        sizing = _sizing(coll, nbytes, "bfloat16", odd)
        bound = cluster.bind(coll, "direct-push", sizing=sizing, protocol=protocol, pdl=True)
        assert bound.pdl
        _check(torch, bound, sizing, gen, calls=3)
    bound = cluster.bind(coll, "direct-push", count=4096, dtype="float32", protocol=protocol,
                         pdl=True)
    assert _wrong_over_replays(torch, bound, 2_000) == 0


# -- the fused kernel --------------------------------------------------------------------------
FUSED_CASES = [(c, s) for c in STANDARD for s in ("direct-push", "two-phase", "ring")
               if not (s == "two-phase" and c not in ("all-reduce", "reduce-scatter", "reduce"))]


@pytest.mark.parametrize("kind,n", [("local", 2), ("virtual", 3)])
@pytest.mark.parametrize("name,strategy", FUSED_CASES)
@pytest.mark.parametrize("protocol", ["fused", "fused-ll"])
def test_fused_matches_the_reference(torch, kind, n, name, strategy, protocol):
    """protocol="fused" / "fused-ll" (the one-lane table run block-matched by the fused
    kernel, flags with a slot per block, LL units read in place) against the reference from
    16 bytes to 16 MiB (bf16; float32 at 64 KiB, 2 chunks), eager calls with fresh inputs
    (both parities); plans the fused kernel refuses are named by their reason."""
    from purlin.errors import CapabilityError

    cluster = _cluster(kind, n)
    gen = np.random.default_rng(11)
    coll = standard(name, n, root=n - 1)
    for nbytes, dtype, chunks in ((16 * n, "bfloat16", 1), (8 << 10, "bfloat16", 1),
                                  (64 << 10, "float32", 2), (1 << 20, "bfloat16", 1),
                                  (16 << 20, "bfloat16", 2)):
        sizing = _items_sizing(coll, nbytes, dtype, chunks)
        try:
            bound = cluster.bind(coll, strategy, sizing=sizing, chunks=chunks,
                                 protocol=protocol)
        except CapabilityError as exc:
            assert "LL transfer's destination" in str(exc) and protocol == "fused-ll", exc
            continue
        # (LL copies: the rows joined across flags, fused_rows.joined, on fused-seg; plain
        # copies only: the kernel built for them)
        assert bound.launches[0].launcher.kernel in (
            ("fused", "fused-seg") if protocol == "fused-ll" else ("fused", "fused-copy"))
        _check(torch, bound, sizing, gen, calls=3)


def _items_sizing(coll, nbytes, dtype, chunks=1):
    """About ``nbytes`` in the largest buffer, every piece of every chunk (and every part of
    it a two-phase plan makes) a whole number of 16-byte items: what the fused kernel runs."""
    from purlin.spec import dtype as as_dtype

    n = coll.nranks
    widest = max(max(len(r) for r in coll.input), max(len(r) for r in coll.output))
    quantum = 16 // as_dtype(dtype).itemsize * chunks * n
    each = max(quantum, nbytes // as_dtype(dtype).itemsize // widest // quantum * quantum)
    return coll.sized(count=each * widest, dtype=dtype)


@pytest.mark.parametrize("n", range(2, 9))
def test_fused_virtual_ranks(torch, n):
    cluster = _cluster("virtual", n)
    gen = np.random.default_rng(13)
    for name in ("all-reduce", "all-gather", "reduce-scatter", "all-to-all"):
        coll = standard(name, n)
        for protocol in ("fused", "fused-ll"):
            sizing = _items_sizing(coll, 64 << 10, "bfloat16")
            _check(torch, cluster.bind(coll, "direct-push", sizing=sizing, protocol=protocol),
                   sizing, gen, calls=3)


@pytest.mark.parametrize("kind,n", [("virtual", 4), ("virtual", 8), ("local", 2)])
def test_several_lanes_run_on_the_fused_kernel(torch, kind, n):
    """Multi-lane plans (pieces round-robin over lanes, or a lane per hop depth) run a
    program a lane, side by side (``purlin.atom.fused_lanes``), on the fused kernel, the
    default bind's fast path included, right over three calls and graph replays; the
    two-root broadcast with each root's half in a lane of its own too."""
    cluster = _cluster(kind, n)
    gen = np.random.default_rng(31)
    for name, strategy, chunks, lanes, lanes_by, nbytes in (
            ("all-reduce", "ring", 4, 2, "piece", 1 << 20),
            ("all-reduce", "two-phase", 4, 4, "piece", 4 << 20),
            ("all-reduce", "two-phase", 2, 2, "stage", 1 << 20),
            ("all-gather", "direct-pull", 2, 2, "piece", 64 << 10),
            ("reduce-scatter", "ring", 2, 2, "piece", 8 << 10)):
        coll = standard(name, n)
        sizing = _items_sizing(coll, nbytes, "bfloat16", chunks)
        bound = cluster.bind(coll, strategy, sizing=sizing, chunks=chunks, lanes=lanes,
                             lanes_by=lanes_by)
        assert bound.protocol.startswith("fused") and bound.schedule.lanes == lanes, \
            (name, strategy, bound.protocol)
        _check(torch, bound, sizing, gen, calls=3)
    from purlin.spec import Collective

    two_roots = Collective([["a"], ["b"]] + [[] for _ in range(n - 2)], [["a", "b"]] * n,
                           "copy", name="two-root broadcast")
    roots = two_roots.sized(chunk_sizes={"a": 32 << 10, "b": 32 << 10}, dtype="bfloat16")
    for protocol in ("fused", "fused-ll"):
        pulled = cluster.bind(two_roots, "direct-pull", sizing=roots, lanes=2,
                              protocol=protocol)
        assert pulled.launches[0].launcher.nranks_in_launch == \
            2 * len(pulled.launches[0].ranks), protocol  # (a program a lane)
        _check(torch, pulled, roots, gen, calls=3)
    graphs = bound.capture(ops=3)
    for _ in range(3):
        graphs.replay()
    _check(torch, bound, sizing, gen, calls=1)
    # traced (notebook 03's ring): the traced twin runs each lane's program; the timeline
    # names each step's own lane
    from purlin.trace import from_sm

    coll = standard("all-reduce", n)
    sizing = _items_sizing(coll, 64 << 10, "bfloat16", 2)
    traced = cluster.bind(coll, "ring", sizing=sizing, chunks=2, lanes=2, trace_rows=1024)
    assert traced.launches[0].launcher.kernel.endswith("-trace")
    _check(torch, traced, sizing, gen, calls=2)
    t = from_sm(traced)
    assert t.check(tolerance_ns=1000) == [] and {e.lane for e in t} == {0, 1}


@pytest.mark.parametrize("dtype", ["float16", "int32"])
@pytest.mark.parametrize("protocol", ["fused", "fused-ll"])
def test_fused_all_reduce_dtypes_and_ops(torch, dtype, protocol):
    cluster = _cluster("local", 2)
    gen = np.random.default_rng(12)
    for op in _ops(dtype):
        coll = standard("all-reduce", 2, op=op)
        sizing = _items_sizing(coll, 64 << 10, dtype)
        _check(torch, cluster.bind(coll, "direct-push", sizing=sizing, protocol=protocol),
               sizing, gen)


@pytest.mark.parametrize("kind,n", [("local", 2), ("virtual", 4)])
def test_fused_and_interpreted_ll_agree_bit_for_bit(torch, kind, n):
    """The same bf16 all-reduce through the interpreter's LL rows and the fused kernel: the
    same sources in the same order, so the same bits."""
    cluster = _cluster(kind, n)
    coll = standard("all-reduce", n)
    count = 24 << 10
    xs = [torch.randn(count).to(torch.bfloat16) for _ in range(n)]
    outs = {}
    for protocol in ("ll", "fused-ll", "fused"):
        bound = cluster.bind(coll, "direct-push", count=count, dtype="bfloat16",
                             protocol=protocol)
        outs[protocol] = [o.cpu() for o in bound([x.clone() for x in xs])]
    for r in range(n):
        assert torch.equal(outs["ll"][r], outs["fused-ll"][r]), f"rank {r}"
        assert torch.equal(outs["ll"][r], outs["fused"][r]), f"rank {r}"


@pytest.mark.parametrize("protocol,pdl", [("fused", False), ("fused", True),
                                          ("fused-ll", True)])
def test_fused_graph_replays_10000(torch, protocol, pdl):
    """10,000 graph replays of a fused all-reduce with fresh inputs each time: zero wrong."""
    cluster = _cluster("local", 2)
    bound = cluster.bind(standard("all-reduce", 2), "direct-push", count=4096,
                         dtype="float32", protocol=protocol, pdl=pdl)
    assert _wrong_over_replays(torch, bound, 10_000) == 0


@pytest.mark.parametrize("kind,n", [("local", 2), ("virtual", 3)])
def test_fused_ll_moves_eight_byte_messages_in_halves_of_ll_units(torch, kind, n):
    """8-byte messages of every standard collective (chunks of 4 bytes or fewer): fused-ll
    runs those of 4-byte multiples with a thread per 4-byte half of an LL unit, against the
    reference over three calls (bf16 and float32); 2-byte chunks are refused, naming why."""
    from purlin.errors import CapabilityError

    cluster = _cluster(kind, n)
    gen = np.random.default_rng(15)
    ran = set()
    for name in STANDARD:
        for dtype in ("bfloat16", "float32"):
            coll = standard(name, n, root=n - 1)
            sizing = _sizing(coll, 8 * n // 2, dtype, False)
            try:
                bound = cluster.bind(coll, "direct-push", sizing=sizing, protocol="fused-ll")
            except CapabilityError as exc:
                assert "not at 4-byte aligned" in str(exc) or "LL transfer's" in str(exc), exc
                continue
            assert bound.launches[0].launcher.kernel in ("fused", "fused-seg")  # (joined)
            _check(torch, bound, sizing, gen, calls=3)
            ran.add(name)
    assert {"all-gather", "reduce-scatter", "all-to-all"} <= ran, ran


def test_auto_falls_back_to_the_interpreter_where_it_must(torch):
    """The tuning table's fused choices hold for nearby sizes; at odd sizes (no whole
    4-byte items) auto runs the interpreter with the same signalling, and gets it right."""
    cluster = _cluster("local", 2)
    gen = np.random.default_rng(14)
    for nbytes in (8, 1000, 4096):
        for name in ("all-reduce", "all-gather"):
            coll = standard(name, 2)
            sizing = _sizing(coll, nbytes, "bfloat16", nbytes == 1000)
            bound = cluster.bind(coll, "auto", sizing=sizing)
            if nbytes == 4096:
                assert bound.protocol.startswith("fused"), bound.protocol
            _check(torch, bound, sizing, gen, calls=2)


def test_fused_refuses_what_it_cannot_fuse(torch):
    from purlin.errors import CapabilityError

    cluster = _cluster("local", 2)
    with pytest.raises(CapabilityError, match="not at 16-byte aligned addresses"):
        # chunk 1 starts at byte 2004 (an all-reduce of 1002 is one row: it fuses, with a tail)
        cluster.bind(standard("reduce-scatter", 2), "direct-push", count=1002,
                     dtype="float32", protocol="fused")


@pytest.mark.parametrize("protocol", ["fused", "fused-ll"])
def test_fused_missing_peer_times_out_naming_it(torch, protocol):
    """Rank 1's program loses its ops: rank 0 times out within the limit and the error
    names rank 1 (its flag, or the LL data it sends), the target and what was seen."""
    from purlin.kernels import isa

    cluster = _cluster("local", 2)
    bound = cluster.bind(standard("all-reduce", 2), "direct-push", count=1024,
                         dtype="float32", protocol=protocol, timeout=0.5)
    program = next(t for t in bound._keep if t.data_ptr() == bound.launches[1].desc)
    program[isa.F_NOPS] = 0
    t0 = time.perf_counter()
    want = (r"rank 0 .*LL data rank 1 .*expected tag 1, saw 0" if protocol == "fused-ll"
            else r"rank 0 step \d+ .*timed out .*flag\(r0<-r1\.l0\) from rank 1: expected "
                 r">= 1 \(1 notifies x 1 blocks\), saw 0")
    with pytest.raises(PurlinTimeoutError, match=want):
        bound([None, None])
    assert time.perf_counter() - t0 < 5.0


@pytest.mark.parametrize("n", [4, 8])
@pytest.mark.parametrize("strategy", ["direct-push", "auto"])
def test_default_binds_fit_on_virtual_ranks(torch, n, strategy):
    """The launch is sized to the GPU: 1 MiB with 4 or 8 virtual ranks (one launch for all
    of them) binds by default and with auto, also planned with four lanes, and is right."""
    cluster = _cluster("virtual", n)
    gen = np.random.default_rng(25)
    for name in ("all-gather", "reduce-scatter", "all-reduce"):
        coll = standard(name, n)
        sizing = _sizing(coll, 1 << 20, "bfloat16", False)
        for lanes in ((1, 4) if strategy == "direct-push" else (1,)):
            bound = cluster.bind(coll, strategy, sizing=sizing,
                                 **({"chunks": lanes, "lanes": lanes} if lanes > 1 else {}))
            grid = sum(k.launcher.grid for k in bound.launches)
            assert grid <= bound.gpu.resident(bound.threads), (name, lanes, grid)
            _check(torch, bound, sizing, gen, calls=2)


def test_an_explicit_launch_that_cannot_fit_says_what_would(torch):
    from purlin.errors import CapabilityError

    cluster = _cluster("virtual", 4)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    most = sms // 4
    with pytest.raises(CapabilityError, match=rf"at most {most} blocks per lane fit: pass "
                                              rf"blocks_per_lane<={most}"):
        cluster.bind(standard("all-reduce", 4), "direct-push", count=1 << 19,
                     dtype="bfloat16", blocks_per_lane=most + 1)
    bound = cluster.bind(standard("all-reduce", 4), "direct-push", count=1 << 19,
                         dtype="bfloat16", blocks_per_lane=most)
    _check(torch, bound, bound.schedule.sizing, np.random.default_rng(3), calls=1)



def test_binds_of_one_kernel_at_other_grids_run_in_any_order(torch):
    """Binds of the copy-only kernel whose launches ask for different spreading shared memory
    (a grid within the SMs, one past them) all launch, the first made after the last: the
    kernel's shared-memory limit is raised once for all of them."""
    from purlin.atom import sm

    cluster = _cluster("virtual", 4)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    coll = standard("all-gather", 4)
    sizing = _sizing(coll, 1 << 20, "bfloat16", False)
    schedule = plan(coll, "direct-pull", sizing=sizing)
    binds = [sm.bind(cluster, schedule, protocol="fused", blocks_per_lane=b, threads=128)
             for b in (8, sms // 4 + 8)]
    assert [b.launches[0].launcher.kernel for b in binds] == ["fused-copy"] * 2
    shared = [b.launches[0].launcher.shared_bytes for b in binds]
    gen = np.random.default_rng(27)
    for bound in binds:
        _check(torch, bound, sizing, gen, calls=1)
    assert shared[0] > shared[1] > 0, shared  # the first asks more than the last allowed

def _tail_sizing(coll, nbytes, tail, dtype="bfloat16"):
    """Every chunk whole 16-byte items but the last, which is ``tail`` elements longer."""
    from purlin.spec import dtype as as_dtype

    item = as_dtype(dtype).itemsize
    names = coll.input.names()
    each = max(16, nbytes // len(names)) // 16 * 16 // item
    sizes = {k: each for k in names}
    sizes[names[-1]] += tail
    return coll.sized(chunk_sizes=sizes, dtype=dtype)


@pytest.mark.parametrize("kind,n", [("virtual", 2), ("virtual", 4), ("local", 2)])
@pytest.mark.parametrize("protocol", ["fused", "fused-ll", "auto"])
def test_odd_sizes_run_on_the_fused_kernel(torch, kind, n, protocol):
    """An all-reduce one element (or a few) past a 16-byte multiple runs on the fused kernel
    (scalar tails), with the reference's result, at 8 KiB, 64 KiB and 1 MiB; graph replays
    with fresh inputs too."""
    cluster = _cluster(kind, n)
    gen = np.random.default_rng(26)
    for op in ("sum", "max", "avg"):
        coll = standard("all-reduce", n, op=op)
        for nbytes in (8 << 10, 64 << 10, 1 << 20):
            if protocol == "fused-ll" and nbytes > 256 << 10:
                continue
            for tail in (1, 3, 9):
                sizing = _tail_sizing(coll, nbytes, tail)
                if protocol == "auto":
                    bound = cluster.bind(coll, "auto", sizing=sizing)
                else:
                    bound = cluster.bind(coll, "direct-push", sizing=sizing, protocol=protocol)
                assert bound.launches[0].launcher.kernel == "fused", (op, nbytes, tail,
                                                                      bound.protocol)
                _check(torch, bound, sizing, gen, calls=2)
    graphs = bound.capture(ops=3)
    for _ in range(3):
        graphs.replay()
    _check(torch, bound, sizing, gen, calls=1)


def test_odd_dtypes_run_on_the_fused_kernel(torch):
    cluster = _cluster("virtual", 3)
    gen = np.random.default_rng(27)
    for dtype in ("bfloat16", "float16", "float32", "int32"):
        for op in ("sum", "min"):
            coll = standard("all-reduce", 3, op=op)
            for tail in (1, 2, 5):
                sizing = _tail_sizing(coll, 4096, tail, dtype)
                for protocol in ("fused", "fused-ll"):
                    bound = cluster.bind(coll, "direct-push", sizing=sizing, protocol=protocol)
                    assert bound.launches[0].launcher.kernel == "fused"
                    _check(torch, bound, sizing, gen, calls=2)
