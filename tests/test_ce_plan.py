"""Planning for a datapath that cannot reduce: verified mixed schedules (copies on ``ce``,
reductions on ``sm``), run on the cpu datapath against the float64 reference, and the
``datapath=`` switch of ``Cluster.bind``. No GPU needed."""

import subprocess
import sys

import numpy as np
import pytest

from purlin.atom import capabilities
from purlin.atom.ce import CAPABILITIES, auto_datapath
from purlin.errors import CapabilityError, PlanError
from purlin.runtime import Cluster
from purlin.snac import Capabilities, Consume, Notify, Stage, plan, verify
from purlin.spec import collectives, reference, standard

REDUCING = ["all-reduce", "reduce-scatter", "reduce"]
COPYING = ["all-gather", "all-to-all", "broadcast", "gather", "scatter"]
STRATEGIES = ["direct-push", "direct-pull", "two-phase", "ring"]


def mixed(name, strategy, n, chunks=1, lanes=1, dtype="float64"):
    coll = standard(name, n)
    return plan(coll, strategy, chunk_sizes={c: 6 for c in coll.input.names()}, dtype=dtype,
                chunks=chunks, lanes=lanes, capabilities=CAPABILITIES)


def data_steps(schedule):
    return [s for steps in schedule.steps for s in steps if s.moves_data]


def test_ce_reports_that_it_cannot_reduce():
    assert CAPABILITIES == Capabilities(name="ce", can_reduce=False, reduce_engine="sm")
    assert capabilities("ce") == CAPABILITIES


def test_importing_the_ce_datapath_needs_neither_torch_nor_numba():
    code = ("import sys, purlin.atom.ce, purlin.atom.ce_lowering, purlin.atom.ce_sim; "
            "print('torch' in sys.modules, 'numba' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.split() == ["False", "False"]


@pytest.mark.parametrize("strategy", ["direct-push", "two-phase"])
@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_all_reduce_mixed_schedule_is_verified(strategy, n):
    s = mixed("all-reduce", strategy, n)
    assert verify(s).ok
    moves = data_steps(s)
    assert {m.engine for m in moves if m.op == "copy"} == {"ce"}
    assert {m.engine for m in moves if m.op != "copy"} == {"sm"}
    # one reduction per owner piece: n for two-phase, and for direct-push each rank reduces
    # its whole output once
    assert sum(1 for m in moves if m.op == "sum") == n


def test_two_phase_shape_on_two_ranks():
    """Each rank: copy its peer's half over (ce), notify, reduce its own half (sm), copy the
    result back (ce), notify, wait for the peer's result."""
    s = mixed("all-reduce", "two-phase", 2)
    for rank, steps in enumerate(s.steps):
        kinds = [(type(st).__name__, getattr(st, "engine", "")) for st in steps]
        assert kinds == [("Stage", "ce"), ("Notify", ""), ("Consume", "sm"), ("Stage", "ce"),
                         ("Notify", ""), ("Consume", "")]
        assert steps[2].srcs[-1].rank == rank and steps[2].dst.rank == rank
        assert steps[3].dst.rank == 1 - rank


def test_direct_push_shape():
    s = mixed("all-reduce", "direct-push", 3)
    for rank, steps in enumerate(s.steps):
        stages = [st for st in steps if isinstance(st, Stage)]
        assert len(stages) == 2 and all(st.engine == "ce" and st.op == "copy" for st in stages)
        assert {st.dst.rank for st in stages} == {0, 1, 2} - {rank}
        (red,) = [st for st in steps if isinstance(st, Consume) and st.moves_data]
        assert red.engine == "sm" and red.op == "sum" and len(red.srcs) == 3
        assert len(red.waits) == 2
        assert sum(isinstance(st, Notify) for st in steps) == 2


@pytest.mark.parametrize("name", REDUCING)
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("n,chunks,lanes", [(2, 1, 1), (3, 3, 2), (5, 2, 2)])
def test_mixed_schedules_compute_their_collective_on_cpu(name, strategy, n, chunks, lanes):
    coll = standard(name, n)
    bound = Cluster.cpu(n).bind(coll, strategy, chunk_sizes={c: 6 for c in coll.input.names()},
                                dtype="float64", chunks=chunks, lanes=lanes, datapath="ce")
    assert verify(bound.schedule).ok
    assert {m.engine for m in data_steps(bound.schedule)} <= {"ce", "sm"}
    rng = np.random.default_rng(n)
    sizing = bound.schedule.sizing
    for _ in range(3):
        inputs = [rng.uniform(0.5, 2, sizing.input_count(r)) for r in range(n)]
        outs = bound(inputs)
        for got, want in zip(outs, reference(sizing, inputs)):
            np.testing.assert_allclose(got, want, rtol=1e-12)


@pytest.mark.parametrize("name", COPYING)
@pytest.mark.parametrize("strategy", ["direct-push", "direct-pull", "ring"])
def test_copy_collectives_run_entirely_on_copy_engines(name, strategy):
    s = mixed(name, strategy, 4, chunks=2, lanes=2)
    assert verify(s).ok
    assert {m.engine for m in data_steps(s)} == {"ce"}


def test_a_datapath_that_cannot_reduce_and_names_no_partner_is_refused():
    lonely = Capabilities(name="ce", can_reduce=False)
    with pytest.raises(PlanError, match="cannot reduce"):
        plan(collectives.all_reduce(2), "direct-push", count=8, capabilities=lonely)
    # a pure copy needs no reduction engine
    plan(collectives.all_gather(2), "direct-push", count=8, capabilities=lonely)


def test_bind_datapath_switch_on_a_cpu_cluster():
    coll = collectives.all_reduce(2)
    cpu = Cluster.cpu(2)
    assert {m.engine for m in data_steps(cpu.bind(coll, count=8).schedule)} == {""}
    assert {m.engine for m in data_steps(cpu.bind(coll, count=8, datapath="ce").schedule)} \
        == {"ce", "sm"}
    assert cpu.bind(coll, count=8, datapath="auto").schedule == cpu.bind(coll, count=8).schedule
    with pytest.raises(CapabilityError, match="cannot run on"):
        cpu.bind(coll, count=8, datapath="sm")
    with pytest.raises(CapabilityError, match="cannot run on"):
        cpu.bind(coll, count=8, datapath="tma")


def test_auto_prefers_copy_engines_for_large_copies_only():
    ag, ar = collectives.all_gather(2), collectives.all_reduce(2)
    assert auto_datapath(ag, nbytes=128 << 20, dtype="bfloat16") == "ce"
    assert auto_datapath(ag, nbytes=64 << 20, dtype="bfloat16") == "sm"
    assert auto_datapath(ag) == "sm"
    assert auto_datapath(ar, nbytes=1 << 30, dtype="bfloat16") == "sm"
    sizing = ag.sized(nbytes=256 << 20, dtype="bfloat16")
    assert auto_datapath(ag, sizing=sizing) == "ce"


@pytest.mark.parametrize("name", REDUCING + COPYING)
@pytest.mark.parametrize("n", [2, 3, 4])
def test_push_pull_splits_each_segment_between_the_engines(name, n):
    """push-pull: the first half of a segment is pushed (a copy, on the copy engines), the
    second pulled (read by the step that consumes it, on the SMs for reductions)."""
    coll = standard(name, n)
    bound = Cluster.cpu(n).bind(coll, "push-pull", chunk_sizes={c: 8 for c in
                                                                coll.input.names()},
                                dtype="float64", chunks=2, lanes=2, datapath="ce")
    s = bound.schedule
    assert verify(s).ok
    remote = [st for st in data_steps(s) if st.dst.rank != st.rank
              or any(src.rank != st.rank for src in st.srcs)]
    pushes = [st for st in remote if st.dst.rank != st.rank]
    pulls = [st for st in remote if any(src.rank != st.rank for src in st.srcs)]
    assert pushes and pulls and not set(map(id, pushes)) & set(map(id, pulls))
    assert {st.engine for st in pushes} == {"ce"}
    assert {st.lane for st in pushes} == {0} and {st.lane for st in pulls} == {1}
    if coll.op.is_reduce:
        assert {st.engine for st in pulls} == {"sm"}
    rng = np.random.default_rng(n)
    sizing = s.sizing
    for _ in range(3):
        inputs = [rng.uniform(0.5, 2, sizing.input_count(r)) for r in range(n)]
        for got, want in zip(bound(inputs), reference(sizing, inputs)):
            np.testing.assert_allclose(got, want, rtol=1e-12)


def test_auto_leaves_push_pull_to_an_explicit_choice():
    from purlin.runtime.auto import strategies_for

    assert "push-pull" not in strategies_for(collectives.all_reduce(2))
