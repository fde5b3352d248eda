"""Several lanes on the fused kernel (``purlin.atom.fused_lanes``): each rank's lanes merged
into one keep every lane's order, run three calls to the end on host threads (a thread per
rank and block, one block slow, ranks drifting apart) and give the reference; the sm
datapath's fast path takes multi-lane plans (on GPUs: tests/test_gpu_sm.py)."""

from __future__ import annotations

import numpy as np
import pytest

from purlin.atom.fused import fuse_problem, fused_problems, fused_unit
from purlin.atom.fused_lanes import one_lane
from purlin.atom.host import HostBuffers, fused_programs, run_fused_calls
from purlin.errors import CapabilityError
from purlin.kernels import isa
from purlin.snac import plan
from purlin.spec import collectives, reference

PLANS = [  # (collective, strategy, chunks, lanes, lanes_by)
    ("all_reduce", "ring", 4, 2, "piece"),
    ("all_reduce", "two-phase", 4, 4, "piece"),
    ("all_reduce", "two-phase", 2, 2, "stage"),
    ("all_reduce", "direct-push", 2, 2, "piece"),
    ("all_gather", "ring", 2, 2, "piece"),
    ("all_gather", "direct-pull", 3, 3, "piece"),
    ("reduce_scatter", "ring", 2, 2, "piece"),
    ("all_to_all", "direct-push", 2, 2, "piece"),
    ("broadcast", "direct-pull", 4, 2, "piece"),
]


def _plan(name, strategy, chunks, lanes, lanes_by, n, dtype="float32", per_rank=48):
    coll = getattr(collectives, name)(n)
    return plan(coll, strategy, count=per_rank * n * chunks, dtype=dtype, chunks=chunks,
                lanes=lanes, lanes_by=lanes_by)


def test_each_lane_keeps_its_order_and_every_row_stays():
    s = _plan("all_reduce", "two-phase", 4, 4, "piece", 4)
    low = HostBuffers(s).lower()
    merged = one_lane(low)
    for before, after in zip(low, merged):
        assert len(after.lane_offsets) == 2 and len(before.lane_offsets) == 5
        table = before.tables[0]
        rows = [tuple(r) for r in table]
        assert sorted(map(tuple, after.tables[0])) == sorted(rows)  # the same rows
        for lane in range(4):  # each lane's rows in their order
            mine = [tuple(r) for r in table[before.lane_offsets[lane]:
                                            before.lane_offsets[lane + 1]]]
            assert [r for r in map(tuple, after.tables[0]) if r in mine] == mine
        # the parities' tables are reordered alike
        assert (after.tables[-1][:, isa.STEP] == after.tables[0][:, isa.STEP]).all()


@pytest.mark.parametrize("ll,unit", [(False, 16), (True, 16), (True, 8)])
@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("name,strategy,chunks,lanes,lanes_by", PLANS)
def test_merged_lanes_run_on_host_threads(name, strategy, chunks, lanes, lanes_by, n, ll,
                                          unit):
    s = _plan(name, strategy, chunks, lanes, lanes_by, n)
    bufs = HostBuffers(s, ll=ll)
    low = one_lane(bufs.lower())
    problem = fuse_problem(low, unit)
    if problem is not None:  # (a relay of received LL data, as for one-lane plans)
        assert ll and "LL transfer's destination" in problem, problem
        return
    programs = fused_programs(low, bufs, unit)
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


def test_a_lane_waiting_for_what_no_lane_sends_is_refused():
    """A hand-broken table (a wait for more than the peer sends) cannot be merged: the
    refusal names the rank, lane and step, and says what runs it instead."""
    s = _plan("all_reduce", "ring", 2, 2, "piece", 2)
    low = HostBuffers(s).lower()
    table = low[1].tables[0]
    wait = next(k for k in range(int(low[1].lane_offsets[1]), len(table))
                if table[k, isa.OP] == isa.WAIT)
    for t in low[1].tables:
        t[wait, isa.VALUE] += 5
    with pytest.raises(CapabilityError, match=r"rank 1 lane 1 step \d+ .*interpreter"):
        one_lane(low)


def test_one_lane_ranks_are_kept_as_they_are():
    s = plan(collectives.all_reduce(4), "direct-push", count=256, dtype="float32")
    low = HostBuffers(s).lower()
    assert all(a is b for a, b in zip(one_lane(low), low))
    assert fused_unit(low, "fused")[1] is None
