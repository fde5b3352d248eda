"""Several lanes on the fused kernel (``purlin.atom.fused_lanes``): each (rank, lane) a
program of its own, launched as a rank slot beside the rank's other lanes. The programs keep
every row in its lane's order, run three calls to the end on host threads (a thread per
program and block, one block slow, ranks drifting apart) and give the reference; the sm
datapath's fast path takes multi-lane plans (in the simulator: tests/test_kernels_sim.py; on
GPUs: tests/test_gpu_sm.py)."""

from __future__ import annotations

import numpy as np
import pytest

from purlin.atom.fused import fuse_problem, fused_problems, fused_unit, rank_ops
from purlin.atom.fused_lanes import lane_slots, slot_lanes
from purlin.atom.fused_rows import cluster_ops
from purlin.atom.host import HostBuffers, fused_programs, run_fused_calls
from purlin.kernels import isa
from purlin.snac import plan
from purlin.spec import Collective, collectives, reference

PLANS = [  # (collective, strategy, chunks, lanes, lanes_by)
    ("all_reduce", "ring", 4, 2, "piece"),
    ("all_reduce", "two-phase", 4, 4, "piece"),
    ("all_reduce", "two-phase", 2, 2, "stage"),
    ("all_reduce", "direct-push", 2, 2, "piece"),
    ("all_gather", "ring", 2, 2, "piece"),
    ("all_gather", "direct-pull", 3, 3, "piece"),
    ("all_gather", "direct-push", 1, 2, "piece"),
    ("reduce_scatter", "ring", 2, 2, "piece"),
    ("all_to_all", "direct-push", 2, 2, "piece"),
    ("broadcast", "direct-pull", 4, 2, "piece"),
]


def _plan(name, strategy, chunks, lanes, lanes_by, n, dtype="float32", per_rank=48):
    coll = getattr(collectives, name)(n)
    return plan(coll, strategy, count=per_rank * n * chunks, dtype=dtype, chunks=chunks,
                lanes=lanes, lanes_by=lanes_by)


def _two_roots(n: int) -> Collective:
    return Collective([["a"], ["b"]] + [[] for _ in range(n - 2)], [["a", "b"]] * n, "copy",
                      name="two-root broadcast")


def test_each_lane_becomes_a_program_of_its_rows_in_order():
    s = _plan("all_reduce", "two-phase", 4, 4, "piece", 4)
    low = HostBuffers(s).lower()
    slots = lane_slots(low)
    assert len(slots) == 4 * 4 and all(len(x.lane_offsets) == 2 for x in slots)
    for r, before in enumerate(low):
        mine = [x for x in slots if x.rank == r]
        assert slot_lanes(before) == [0, 1, 2, 3]
        for table in range(len(before.tables)):  # both parities, every row, lane by lane
            np.testing.assert_array_equal(np.concatenate([x.tables[table] for x in mine]),
                                          before.tables[table])


def test_a_lane_without_rows_gets_no_program():
    """A broadcast of one piece leaves lane 1 empty on every rank: one program a rank."""
    s = _plan("broadcast", "direct-pull", 1, 2, "piece", 4)
    low = HostBuffers(s).lower()
    assert all(slot_lanes(x) == [0] for x in low)
    assert [x.rank for x in lane_slots(low)] == [0, 1, 2, 3]


def test_one_lane_ranks_are_kept_as_they_are():
    s = plan(collectives.all_reduce(4), "direct-push", count=256, dtype="float32")
    low = HostBuffers(s).lower()
    assert all(a is b for a, b in zip(lane_slots(low), low))
    assert fused_unit(low, "fused")[1] is None


@pytest.mark.parametrize("ll,unit", [(False, 16), (True, 16), (True, 8)])
@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("name,strategy,chunks,lanes,lanes_by", PLANS)
def test_lane_programs_run_on_host_threads(name, strategy, chunks, lanes, lanes_by, n, ll,
                                           unit):
    s = _plan(name, strategy, chunks, lanes, lanes_by, n)
    bufs = HostBuffers(s, ll=ll)
    low = bufs.lower()
    problem = fuse_problem(low, unit)
    if problem is not None:  # (a relay of received LL data, as for one-lane plans)
        assert ll and "LL transfer's destination" in problem, problem
        return
    programs = fused_programs(low, bufs, unit)
    assert len(programs) == sum(len(slot_lanes(x)) for x in low) > n
    rng = np.random.default_rng(n + lanes)
    xs = [[rng.integers(-50, 50, s.sizing.input_count(r)).astype(np.float64)
           for r in range(n)] for _ in range(3)]
    outs = run_fused_calls(programs, bufs, xs, blocks=3, threads=2, slow_block_delay=0.001)
    for call, x in enumerate(xs):
        want = reference(s.sizing, x)
        for r in range(n):
            got = np.asarray(outs[call][r][:len(want[r])], np.float64)
            assert np.allclose(got, want[r]), (name, strategy, call, r)


def test_the_fast_path_takes_multi_lane_plans():
    for name, strategy, chunks, lanes, lanes_by in PLANS:
        s = _plan(name, strategy, chunks, lanes, lanes_by, 4, dtype="bfloat16", per_rank=4096)
        assert fused_problems(s)["fused"] is None, (name, strategy)


@pytest.mark.parametrize("n", [4, 8])
def test_two_roots_in_two_lanes_wait_for_one_root_a_program(n):
    """The two-root broadcast with lanes=2: every rank's half "a" in one program and "b" in
    the other, so a receiver's blocks of each wait for one root only, as its twin's do."""
    s = plan(_two_roots(n), "direct-pull", chunk_sizes={"a": 4096, "b": 4096},
             dtype="bfloat16", lanes=2)
    bufs = HostBuffers(s)
    low = bufs.lower()
    assert fuse_problem(low, 16) is None
    ops = cluster_ops(low, 16)
    assert [x.rank for x in ops.lowered] == [r for r in range(n) for _ in range(2)]
    for x, prog in zip(ops.lowered, ops.ops):
        waited = {op.peer for op in prog if op.kind == "wait"}
        if x.rank >= 2:  # a receiver: one root a lane
            assert len(waited) == 1, (x.rank, waited)
    xs = [[np.arange(s.sizing.input_count(r), dtype=np.float64) % 97 + 7 * r for r in range(n)]
          for _ in range(2)]
    outs = run_fused_calls(fused_programs(low, bufs, 16), bufs, xs, blocks=2, threads=2)
    for call, x in enumerate(xs):
        for r, want in enumerate(reference(s.sizing, x)):
            np.testing.assert_array_equal(outs[call][r][:len(want)], want)


def test_a_rank_hears_from_a_peer_in_any_of_its_lanes():
    """An LL sender may hear from its peer in another lane: the rank's lanes end together
    before its next call, so it cannot run two calls ahead of the peer."""
    s = _plan("all_gather", "direct-push", 1, 2, "piece", 4, dtype="bfloat16", per_rank=64)
    low = HostBuffers(s, ll=True).lower()
    assert fuse_problem(low, 8) is None
    slots = lane_slots(low)
    ops = [rank_ops(x, 8) for x in slots]
    heard = [{op.peer for op in o if op.kind == "wait"} |
             {src.peer for op in o if op.kind == "move" for src in op.sources if src.is_ll}
             for o in ops]
    put = [{op.peer for op in o if op.kind == "put"} for o in ops]
    assert any(p - h for p, h in zip(put, heard))  # (some lane puts to a peer it never hears)
    for r in range(4):
        mine = [k for k, x in enumerate(slots) if x.rank == r]
        assert set().union(*(put[k] for k in mine)) <= set().union(*(heard[k] for k in mine))


def test_a_program_of_several_lanes_is_refused_with_what_to_do():
    s = _plan("all_reduce", "ring", 2, 2, "piece", 2)
    low = HostBuffers(s).lower()
    with pytest.raises(Exception, match="rank 0 runs 2 lanes in one program .*lanes=1"):
        rank_ops(low[0])


def test_lane_records_put_each_lane_s_ops_on_its_rows_and_blocks():
    """A traced call's records, one set a program: read back as the interpreter's, lane l's
    blocks at ``l * blocks`` and every op on its row of the rank's table, so the measured
    timeline shows each lane (``purlin.trace.from_sm_records``)."""
    from purlin.atom.fused_rows import cluster_programs
    from purlin.atom.fused_trace import lane_records
    from purlin.trace import from_sm_records

    s = _plan("all_reduce", "ring", 2, 2, "piece", 4, dtype="bfloat16")
    low = HostBuffers(s).lower()
    programs = cluster_programs(low, lambda r: 0, 0, int, 16)
    blocks, out = 2, []
    for r in range(4):
        mine = [p for p in programs if int(p.words[isa.F_RANK]) == r]
        ops = max(p.ops for p in mine)
        rec = np.zeros((len(mine), blocks, ops, isa.TRACE_WIDTH), np.int64)
        for k, p in enumerate(mine):
            for b in range(blocks):
                for i in range(p.ops):  # (every op 50 ns, lane 1 a little later)
                    rec[k, b, i] = (i, b, 1000 + 100 * i + 7 * k, 1050 + 100 * i + 7 * k)
        got = lane_records(low[r], mine, rec)
        assert got.shape == (2 * blocks, len(low[r].tables[0]), isa.TRACE_WIDTH)
        offsets = low[r].lane_offsets
        for b in range(2 * blocks):
            rows = [int(x) for x in np.flatnonzero(got[b, :, 2])]
            assert rows and all(offsets[b // blocks] <= x < offsets[b // blocks + 1]
                                for x in rows), (r, b, rows)
            assert (got[b, rows, 0] == rows).all() and (got[b, rows, 1] == b % blocks).all()
        out.append(got)
    t = from_sm_records(s, low, out, blocks, devices=[0] * 4, block_matched=True)
    assert {e.lane for e in t} == {0, 1}
    assert {(e.rank, e.lane, e.step) for e in t} == \
        {(r, st.lane, k) for r in range(4) for k, st in enumerate(s.steps[r])}


def test_an_error_names_the_lane_of_its_step():
    """The fused kernel records lane 0 for every program; the launch names the step's."""
    import torch

    from purlin.atom.sm_kernel import RankKernel

    s = _plan("all_reduce", "ring", 2, 2, "piece", 2)
    step = next(k for k, st in enumerate(s.steps[1]) if st.lane == 1)
    control = torch.zeros(2 + isa.ERR_WIDTH, dtype=torch.int64)
    control[2 + isa.E_CODE], control[2 + isa.E_STEP] = isa.ERR_TIMEOUT, step
    kernel = RankKernel(0, [1], None, 0, 0, [control])
    assert kernel.records()[0][1][isa.E_LANE] == 0
    kernel.step_lanes = {1: [st.lane for st in s.steps[1]]}
    assert kernel.records()[0][1][isa.E_LANE] == 1


def test_a_launch_of_lanes_fits_every_lane_s_blocks_or_says_what_would():
    from purlin.atom.sm import Gpu, fused_launch
    from purlin.errors import CapabilityError

    gpu = Gpu(0, 132)
    one = fused_launch(gpu, 1 << 16, 8)
    blocks, threads = fused_launch(gpu, 1 << 16, 8, lanes=4)
    assert blocks < one[0] and blocks * 8 * 4 <= gpu.resident(threads)
    with pytest.raises(CapabilityError, match=r"8 rank\(s\) x 4 lane\(s\) x 32 blocks per lane"
                                              r".*at most 4 blocks per lane fit"):
        fused_launch(gpu, 1 << 16, 8, lanes=4, blocks=32, threads=512)
