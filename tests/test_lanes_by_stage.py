"""Lanes by stage (``plan(..., lanes_by="stage")``): a piece's hop at depth d runs in lane
d % lanes. Checked without a GPU: the lane of every step, verification, the cpu datapath and the
copy-engine lowering run on fake memory (``purlin.atom.ce_sim``) against the reference, the
property meant to let transfers overlap reductions on copy engines, which layouts the ce
datapath refuses (a copy-engine wait on the same call), JSON and the bench provider."""

from __future__ import annotations

import numpy as np
import pytest

from purlin.atom.ce import CAPABILITIES as CE
from purlin.atom.ce_lowering import Memcpy, WaitGeq, lower_ce
from purlin.atom.ce_sim import CeSim
from purlin.bench.sweep import Provider
from purlin.errors import CapabilityError, PlanError, SpecError
from purlin.runtime import Cluster
from purlin.snac import Consume, Schedule, plan, verify
from purlin.spec import STANDARD, reference, standard

STRATEGIES = ["direct-push", "direct-pull", "two-phase", "ring"]
ROOTED = ("broadcast", "reduce", "gather", "scatter")


def cases():
    for name in STANDARD:
        for strategy in STRATEGIES:
            if strategy == "two-phase" and not standard(name, 2).op.is_reduce:
                continue
            for n, chunks, lanes in ((2, 4, 3), (3, 2, 2), (4, 3, 4)):
                yield pytest.param(name, strategy, n, chunks, lanes,
                                   id=f"{name}-{strategy}-n{n}-c{chunks}l{lanes}")


def _coll(name, n):
    return standard(name, n, root=n - 1 if name in ROOTED else 0)


def _inputs(sizing, rng):
    return [rng.uniform(0.5, 2, sizing.input_count(r)) for r in range(sizing.collective.nranks)]


@pytest.mark.parametrize("name,strategy,n,chunks,lanes", list(cases()))
def test_stage_lanes_verify_and_compute_the_collective(name, strategy, n, chunks, lanes):
    coll = _coll(name, n)
    bound = Cluster.cpu(n).bind(coll, strategy, chunk_sizes={c: 6 for c in coll.input.names()},
                                dtype="float64", chunks=chunks, lanes=lanes, lanes_by="stage")
    s = bound.schedule
    assert s.lanes_by == "stage" and verify(s).ok
    assert {st.lane for r in s.steps for st in r} <= set(range(lanes))
    rng = np.random.default_rng(n)
    for _ in range(3):  # back to back: scratch reuse across calls is part of what verify proved
        inputs = _inputs(s.sizing, rng)
        for got, want in zip(bound(inputs), reference(s.sizing, inputs)):
            np.testing.assert_allclose(got, want, rtol=1e-12)


@pytest.mark.parametrize("name,strategy,n,chunks,lanes",
                         [c for c in cases() if standard(c.values[0], 2).op.is_reduce])
def test_stage_lanes_on_copy_engines_run_on_fake_memory(name, strategy, n, chunks, lanes):
    coll = _coll(name, n)
    s = plan(coll, strategy, chunk_sizes={c: 6 for c in coll.input.names()}, dtype="float64",
             chunks=chunks, lanes=lanes, lanes_by="stage", capabilities=CE)
    rng = np.random.default_rng(chunks)
    calls = [_inputs(s.sizing, rng) for _ in range(3)]
    outs = CeSim(s, blocks_per_lane=2).run(calls, seed=n)
    for got_call, inputs in zip(outs, calls):
        for got, want in zip(got_call, reference(s.sizing, inputs)):
            np.testing.assert_allclose(got, want, rtol=1e-12)


def test_two_phase_by_stage_puts_each_hop_in_its_own_lane():
    s = plan(standard("all-reduce", 2), "two-phase", count=64, chunks=4, lanes=3,
             lanes_by="stage")
    for r in range(2):
        by_lane = {lane: s.lane_steps(r, lane) for lane in range(3)}
        # lane 0: the reduce-scatter pushes, never waiting; lane 1: the owner's reductions and
        # its all-gather pushes; lane 2: only the waits for the peer's all-gather pushes
        assert all(not isinstance(st, Consume) for st in by_lane[0])
        assert [st.op for st in by_lane[1] if st.moves_data] == ["sum", "copy"] * 4
        assert all(isinstance(st, Consume) and not st.moves_data for st in by_lane[2])
        assert len(by_lane[2]) == 4


def test_on_copy_engines_the_transfer_lane_never_waits_for_a_reduction():
    """What makes piece k+1's transfer overlap piece k's reduction: by piece, the lane's copy
    engine waits for the sm part between pieces; by stage, the push lane runs straight."""
    def push_lane_waits(lanes_by, lanes):
        s = plan(standard("all-reduce", 2), "two-phase", count=64, chunks=4, lanes=lanes,
                 lanes_by=lanes_by, capabilities=CE)
        bases = {(r, b): (1 + 3 * r + i) << 20 for r in range(2)
                 for i, b in enumerate(("input", "output", "scratch"))}
        low = lower_ce(s, bases, {r: (8 + r) << 20 for r in range(2)},
                       {r: (10 + r) << 20 for r in range(2)}, devices=(0, 1))
        ops = low.ranks[0].lanes[0][0]
        return (sum(isinstance(op, Memcpy) for op in ops),
                sum(isinstance(op, WaitGeq) for op in ops))

    assert push_lane_waits("stage", 3) == (4, 0)
    copies, waits = push_lane_waits("piece", 1)
    assert copies == 8 and waits >= 4


def test_lanes_by_survives_json_and_older_files_read_as_piece():
    s = plan(standard("all-reduce", 2), "two-phase", count=16, chunks=2, lanes=3,
             lanes_by="stage")
    again = Schedule.from_json(s.dumps())
    assert again == s and again.lanes_by == "stage"
    old = s.to_json()
    del old["lanes_by"]
    assert Schedule.from_json(old).lanes_by == "piece"
    assert "by stage" in s.title()


def test_an_unknown_lanes_by_is_refused():
    with pytest.raises(PlanError, match="lanes_by must be one of piece, stage, got 'hop'"):
        plan(standard("all-reduce", 2), "two-phase", count=16, lanes_by="hop")


def test_the_ce_datapath_refuses_lanes_by_stage_that_wait_on_a_copy_engine():
    """Correct on fake memory (above) but refused on GPUs where a copy-engine stream waits for a
    same-call notify: it can hold up another lane's transfers in a shared hardware queue (a
    two-phase graph replay with 2 lanes by stage hung)."""
    from types import SimpleNamespace

    from purlin.atom import ce

    s = plan(standard("all-reduce", 2), "two-phase", count=64, chunks=4, lanes=2,
             lanes_by="stage", capabilities=CE)
    with pytest.raises(CapabilityError, match=r"rank 0 step \d+ \(lane 0\) waits on a copy "
                                              r"engine for flag\(r0<-r1.l1\) of the same call"):
        ce.bind(SimpleNamespace(devices=(0, 1)), s)


@pytest.mark.parametrize("name", ["all-reduce", "reduce-scatter", "reduce"])
def test_direct_push_by_stage_keeps_same_call_waits_on_the_sms(name):
    """Pushes on the copy engines in one lane, reductions on the SMs in the next: the ce lanes
    only copy and notify, so the ce datapath runs it (GPU test in tests/test_gpu_ce.py)."""
    from purlin.atom.ce import stage_lanes_problem
    from purlin.atom.ce_lowering import assign_engines

    s = plan(_coll(name, 2), "direct-push", count=64, chunks=4, lanes=2, lanes_by="stage",
             capabilities=CE)
    assert stage_lanes_problem(s) is None
    engines = assign_engines(s)
    for r in range(2):
        assert {engines[r][i] for i, st in enumerate(s.steps[r]) if st.lane == 0} <= {"ce"}
        assert {engines[r][i] for i, st in enumerate(s.steps[r]) if st.lane == 1} <= {"sm"}


def test_the_bench_provider_takes_stage():
    p = Provider.parse("ce:two-phase/c8/l3/stage")
    assert (p.chunks, p.lanes, p.lanes_by, p.name) == (8, 3, "stage", "ce:two-phase/c8/l3/stage")
    with pytest.raises(SpecError, match="/stage"):
        Provider.parse("ce:two-phase/stages")
