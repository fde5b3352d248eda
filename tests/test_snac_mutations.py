"""Mutation tests: verification is not vacuous.

Valid schedules are broken in one place each (dataclasses.replace on the frozen Schedule) and
``verify`` must reject them with a message that names the rank, the step and, where there is
one, the flag. Broken schedules that the cpu executor can run (a dropped notify, a cycle, a wait
nobody satisfies) must raise PurlinTimeoutError within the time limit, naming the same things.
"""

import dataclasses
import re
import time

import numpy as np
import pytest

from purlin.errors import ExecutionError, PurlinTimeoutError, VerificationError
from purlin.atom.cpu import CpuRun
from purlin.snac import Consume, Flag, Notify, Region, Stage, Wait, plan, verify
from purlin.spec import collectives, reference, standard

TIMEOUT = 0.5


# -- helpers -----------------------------------------------------------------------------------


def edit(schedule, rank, change):
    """A copy of ``schedule`` whose rank ``rank`` steps (a list) went through ``change``."""
    steps = [list(r) for r in schedule.steps]
    change(steps[rank])
    return dataclasses.replace(schedule, steps=tuple(tuple(r) for r in steps))


def index_of(steps, predicate):
    return next(i for i, st in enumerate(steps) if predicate(st))


def rejected(schedule, **kw):
    report = verify(schedule, **kw)
    assert not report.ok, f"verify accepted a broken schedule:\n{schedule.render()}"
    return report


def messages(report):
    return report.errors + [r.message for r in report.races]


def has_race(report, region, first, second):
    """A race on ``region`` between (rank, step) ``first`` and ``second``, in either order."""
    for race in report.races:
        ends = {race.first[1:3], race.second[1:3]}
        if race.region == region and ends == {first, second}:
            return race
    raise AssertionError(f"no race on {region!r} between rank/step {first} and {second}: "
                         + "; ".join(messages(report)))


def direct_push_all_reduce_3(chunks=2):
    """Per rank: stage, stage, notify, notify, consume (per piece)."""
    return plan(collectives.all_reduce(3), "direct-push", count=6, dtype="float64",
                chunks=chunks)


def fresh_inputs(schedule, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.uniform(0.5, 4.0, schedule.sizing.input_count(r)) *
            rng.choice([-1.0, 1.0], schedule.sizing.input_count(r))
            for r in range(schedule.nranks)]


def run_cpu(schedule, seed=0, timeout=TIMEOUT):
    """Run one call on CpuRun with numpy buffers; return (outputs, inputs)."""
    run = CpuRun(schedule, timeout=timeout)
    inputs = fresh_inputs(schedule, seed)
    outputs = [np.full(schedule.sizing.output_count(r), np.nan) for r in range(schedule.nranks)]
    run(inputs, outputs)
    return outputs, inputs, run


TIMED_OUT = re.compile(r"rank (\d+) step (\d+) \(lane (\d+), call 0\) timed out waiting on "
                       r"flag\(r(\d+)<-r(\d+)\.l(\d+)\) \(notified by rank (\d+) lane (\d+)\): "
                       r"expected >= (\d+), saw (\d+)")


def expect_timeout(schedule):
    """Run ``schedule`` on the cpu executor: it must raise PurlinTimeoutError in time."""
    run = CpuRun(schedule, timeout=TIMEOUT)
    inputs = fresh_inputs(schedule)
    outputs = [np.zeros(schedule.sizing.output_count(r)) for r in range(schedule.nranks)]
    start = time.monotonic()
    with pytest.raises(PurlinTimeoutError) as info:
        run(inputs, outputs)
    took = time.monotonic() - start
    assert TIMEOUT * 0.9 <= took < TIMEOUT + 2.0, f"gave up after {took:.2f} s"
    match = TIMED_OUT.search(str(info.value))
    assert match, str(info.value)
    rank, step, lane, owner, src, flane, by_rank, by_lane, want, saw = map(int, match.groups())
    # the message is about a real wait of that step on a flag in the waiting rank's memory
    st = schedule.steps[rank][step]
    assert st.lane == lane and owner == rank and (by_rank, by_lane) == (src, flane)
    assert Flag(owner, src, flane) in {w.flag for w in st.waits}
    assert saw < want
    # a failed binding refuses to run again instead of running with flags out of step
    with pytest.raises(ExecutionError, match="failed earlier"):
        run(inputs, outputs)
    return (rank, step, Flag(owner, src, flane), want, saw)


def test_the_unmutated_schedules_pass_and_run():
    for s in (direct_push_all_reduce_3(), plan(collectives.all_reduce(3), "ring", count=6),
              plan(collectives.all_gather(3), "direct-pull", count=3, dtype="float64")):
        assert verify(s).ok
        outputs, inputs, _ = run_cpu(dataclasses.replace(s, dtype="float64"))
        for got, want in zip(outputs, reference(s.sizing, inputs)):
            np.testing.assert_allclose(got, want, rtol=1e-12)


# -- (a) a dropped Notify ----------------------------------------------------------------------


def test_a_dropped_notify_breaks_the_numbering():
    s = direct_push_all_reduce_3()
    flag = Flag(1, 0, 0)
    i = index_of(s.steps[0], lambda st: isinstance(st, Notify) and st.flag == flag)
    assert (i, s.steps[0][i].value) == (2, 1)
    report = rejected(edit(s, 0, lambda steps: steps.pop(i)))
    # rank 1 now waits for a second notify that never comes, and the next notify of that flag
    # (step 7, now step 6) claims =2 but is the first one
    assert sorted(report.errors) == [
        f"rank 0 step 6 notifies {flag} =2, but it is notify number 1 of that flag in the call",
        f"rank 1 step 9 waits on {flag} >= 2, but the flag grows by 1 per call: it would wait "
        "for ever"]


def test_a_dropped_notify_renumbered_leaves_a_wait_that_never_ends():
    s = direct_push_all_reduce_3()
    flag = Flag(1, 0, 0)

    def drop_and_renumber(steps):
        steps.pop(index_of(steps, lambda st: isinstance(st, Notify) and st.flag == flag))
        k = index_of(steps, lambda st: isinstance(st, Notify) and st.flag == flag)
        steps[k] = dataclasses.replace(steps[k], value=1)

    report = rejected(edit(s, 0, drop_and_renumber))
    waiting = index_of(s.steps[1], lambda st: any(w.flag == flag and w.value == 2
                                                  for w in st.waits))
    assert report.errors == [f"rank 1 step {waiting} waits on {flag} >= 2, but the flag grows "
                             "by 1 per call: it would wait for ever"]


def test_a_dropped_notify_makes_the_executor_time_out():
    s = direct_push_all_reduce_3()
    flag = Flag(1, 0, 0)
    i = index_of(s.steps[0], lambda st: isinstance(st, Notify) and st.flag == flag)
    rank, step, got_flag, want, saw = expect_timeout(edit(s, 0, lambda steps: steps.pop(i)))
    # rank 1 consumes piece 2 after the wait for the second notify, which never comes
    assert (rank, step, got_flag, want, saw) == (1, 9, flag, 2, 1)


def test_the_only_notify_of_a_flag_dropped_times_out_too():
    s = plan(collectives.all_reduce(2), "direct-push", count=4, dtype="float64")
    flag = Flag(1, 0, 0)
    mutant = edit(s, 0, lambda steps: steps.pop(index_of(
        steps, lambda st: isinstance(st, Notify) and st.flag == flag)))
    assert rejected(mutant).errors == [f"rank 1 step 2 waits on {flag} >= 1, but no step ever "
                                       "notifies that flag: it would wait for ever"]
    assert expect_timeout(mutant) == (1, 2, flag, 1, 0)


SWEEP = [("all-reduce", "direct-push", 3, 2, 1), ("all-reduce", "ring", 3, 2, 1),
         ("all-reduce", "two-phase", 4, 1, 1), ("all-gather", "direct-pull", 3, 2, 2),
         ("all-to-all", "direct-push", 3, 1, 1), ("broadcast", "ring", 3, 2, 1),
         ("reduce-scatter", "ring", 4, 1, 2), ("gather", "direct-push", 3, 2, 1)]


@pytest.mark.parametrize("name, strategy, n, chunks, lanes", SWEEP)
def test_dropping_any_single_notify_is_rejected(name, strategy, n, chunks, lanes):
    s = plan(standard(name, n, root=1), strategy, count=6 * n, chunks=chunks, lanes=lanes)
    dropped = 0
    for rank, steps in enumerate(s.steps):
        for i, st in enumerate(steps):
            if isinstance(st, Notify):
                report = rejected(edit(s, rank, lambda l, i=i: l.pop(i)))
                assert any(repr(st.flag) in m for m in messages(report)), messages(report)
                dropped += 1
    assert dropped == sum(s.flags().values())


# -- (b) data read before it is staged ---------------------------------------------------------


def test_a_notify_hoisted_above_its_stage_races_with_the_reader():
    s = direct_push_all_reduce_3()
    stage = index_of(s.steps[0], lambda st: isinstance(st, Stage) and st.dst.rank == 1)
    note = index_of(s.steps[0], lambda st: isinstance(st, Notify) and st.flag.owner == 1)
    assert (stage, note) == (0, 2)

    def hoist(steps):
        steps.insert(0, steps.pop(note))   # notify, then the stage it announces

    report = rejected(edit(s, 0, hoist))
    reader = index_of(s.steps[1], lambda st: isinstance(st, Consume) and st.moves_data)
    race = has_race(report, s.steps[0][stage].dst, (0, 1), (1, reader))
    assert race.message.startswith(f"race on {s.steps[0][stage].dst!r}: written and read by ")
    assert "rank 0 step 1 (lane 0 stage, call 0)" in race.message
    assert f"rank 1 step {reader} (lane 0 consume, call 0)" in race.message


def test_a_consume_waiting_for_an_earlier_notify_reads_too_early():
    s = direct_push_all_reduce_3()
    # rank 1's second consume waits for notify 2 of rank 0; let it wait for notify 1
    i = 9
    assert [w.value for w in s.steps[1][i].waits] == [2, 2]

    def earlier(steps):
        c = steps[i]
        steps[i] = dataclasses.replace(c, waits=(dataclasses.replace(c.waits[0], value=1),
                                                 c.waits[1]))

    report = rejected(edit(s, 1, earlier))
    staged = index_of(s.steps[0], lambda st: isinstance(st, Stage) and st.dst.rank == 1
                      and st.dst.offset > 0)
    has_race(report, s.steps[0][staged].dst, (0, staged), (1, i))


def test_forwarding_before_reducing_is_rejected():
    # ring: rank 0 reduces its part into its output (step 4), then forwards it (step 5)
    s = plan(collectives.all_reduce(3), "ring", count=6)
    consume, forward = s.steps[0][4], s.steps[0][5]
    assert consume.dst == forward.srcs[0] and forward.dst.rank == 1

    def swap(steps):
        steps[4], steps[5] = steps[5], steps[4]

    report = rejected(edit(s, 0, swap))
    assert any("rank 0 step 4 (lane 0 stage" in m for m in messages(report)), messages(report)


def test_a_dropped_stage_leaves_a_read_of_nothing():
    s = direct_push_all_reduce_3(chunks=1)
    i = index_of(s.steps[1], lambda st: isinstance(st, Stage) and st.dst.rank == 0)
    lost = s.steps[1][i].dst
    report = rejected(edit(s, 1, lambda steps: steps.pop(i)))
    reader = index_of(s.steps[0], lambda st: isinstance(st, Consume) and lost in st.srcs)
    assert report.errors == [f"rank 0 step {reader} (lane 0 consume, call 0) reads {lost!r}, "
                             "which holds no data at that point (nothing staged it, or it was "
                             "not yet staged)"]


# -- (c) a wait value shrunk -------------------------------------------------------------------


@pytest.mark.parametrize("strategy", ["direct-push", "ring", "two-phase"])
def test_a_shrunk_wait_is_rejected(strategy):
    s = plan(collectives.all_reduce(3), strategy, count=12, chunks=2)
    # the last data-moving consume of rank 1 that waits for a second notify
    i = max(k for k, st in enumerate(s.steps[1])
            if st.moves_data and any(w.value >= 2 for w in st.waits))
    c = s.steps[1][i]
    k = index_of(c.waits, lambda w: w.value >= 2)
    waits = list(c.waits)
    waits[k] = dataclasses.replace(waits[k], value=waits[k].value - 1)
    report = rejected(edit(s, 1, lambda steps: steps.__setitem__(
        i, dataclasses.replace(c, waits=tuple(waits)))))
    assert report.races, messages(report)
    assert any(f"rank 1 step {i} " in m for m in messages(report)), messages(report)


# -- (d) two stages write one region -----------------------------------------------------------


def test_two_stages_into_one_region_race():
    s = direct_push_all_reduce_3(chunks=1)
    a = index_of(s.steps[0], lambda st: isinstance(st, Stage) and st.dst.rank == 2)
    b = index_of(s.steps[1], lambda st: isinstance(st, Stage) and st.dst.rank == 2)
    target = s.steps[0][a].dst
    assert s.steps[1][b].dst != target
    mutant = edit(s, 1, lambda steps: steps.__setitem__(
        b, dataclasses.replace(steps[b], dst=target)))
    report = rejected(mutant)
    race = has_race(report, target, (0, a), (1, b))
    assert race.message.startswith(f"race on {target!r}: written by rank ")
    assert f"rank 0 step {a} (lane 0 stage" in race.message
    assert f"rank 1 step {b} (lane 0 stage" in race.message


# -- (e) a consume reads the wrong region ------------------------------------------------------


def test_a_consume_reading_the_wrong_region_gives_the_wrong_output():
    s = direct_push_all_reduce_3(chunks=1)
    i = index_of(s.steps[0], lambda st: isinstance(st, Consume) and st.moves_data)
    c = s.steps[0][i]
    assert [r.buffer for r in c.srcs] == ["scratch", "scratch", "input"]
    wrong = dataclasses.replace(c, srcs=(c.srcs[1], c.srcs[1], c.srcs[2]))
    report = rejected(edit(s, 0, lambda steps: steps.__setitem__(i, wrong)))
    assert not report.races
    assert report.errors[0] == (
        "rank 0 output position 0 (chunk '0', elements 0..2) ends call 0 holding "
        "sum('0' of rank 0 + 2 x '0' of rank 2), expected "
        "sum('0' of rank 0 + '0' of rank 1 + '0' of rank 2)")


def test_a_copy_into_the_wrong_output_slot_is_named():
    s = plan(collectives.all_gather(3), "direct-pull", count=3)
    i = index_of(s.steps[2], lambda st: isinstance(st, Consume) and st.moves_data)
    c = s.steps[2][i]
    assert c.srcs[0] == Region(0, "input", 0, 1) and c.dst == Region(2, "output", 0, 1)
    # rank 2 pulls rank 0's chunk into the slot of chunk 1 instead
    report = rejected(edit(s, 2, lambda steps: steps.__setitem__(
        i, dataclasses.replace(c, dst=Region(2, "output", 1, 1)))))
    # slot 1 is overwritten with the right chunk later by the same lane; slot 0 stays empty
    assert report.errors[0] == ("rank 2 output position 0 (chunk '0', elements 0..1) ends call "
                                "0 holding nothing, expected '0' of rank 0")


def test_a_changed_reduce_op_is_rejected():
    s = direct_push_all_reduce_3(chunks=1)
    i = index_of(s.steps[2], lambda st: isinstance(st, Consume) and st.moves_data)
    report = rejected(edit(s, 2, lambda steps: steps.__setitem__(
        i, dataclasses.replace(steps[i], op="max"))))
    assert report.errors[0].startswith("rank 2 output position 0 (chunk '0', elements 0..2) "
                                       "ends call 0 holding max(")


def test_an_average_without_the_division_is_rejected():
    s = plan(collectives.all_reduce(3, op="avg"), "two-phase", count=6)
    avgs = [(r, i) for r, steps in enumerate(s.steps) for i, st in enumerate(steps)
            if st.moves_data and st.op == "avg"]
    assert len(avgs) == 3  # one owner per part divides
    r, i = avgs[0]
    report = rejected(edit(s, r, lambda steps: steps.__setitem__(
        i, dataclasses.replace(steps[i], op="sum"))))
    assert any("/ n" in m and "expected sum(" in m for m in report.errors), report.errors


# -- (f) a wait on a flag nobody notifies ------------------------------------------------------


# lane 1 does not exist in a one-lane schedule; laid out as src * lanes + lane, flag(r0<-r1.l1)
# would be the counter of flag(r0<-r2.l0), which rank 2 does notify
@pytest.mark.parametrize("ghost", [Flag(0, 2, 1), Flag(0, 1, 1), Flag(0, 0, 0)], ids=repr)
def test_a_wait_on_a_flag_nobody_notifies(ghost):
    s = direct_push_all_reduce_3(chunks=1)
    i = index_of(s.steps[0], lambda st: isinstance(st, Consume) and st.waits)
    c = s.steps[0][i]
    mutant = edit(s, 0, lambda steps: steps.__setitem__(
        i, dataclasses.replace(c, waits=c.waits + (Wait(ghost, 1),))))
    report = rejected(mutant)
    assert report.errors == [f"rank 0 step {i} waits on {ghost} >= 1, but no step ever notifies "
                             "that flag: it would wait for ever"]
    # the executor waits on it for real and gives up in time, naming rank, step and flag
    assert expect_timeout(mutant)[:3] == (0, i, ghost)


def test_a_wait_for_more_than_the_flag_reaches():
    s = direct_push_all_reduce_3(chunks=1)
    i = index_of(s.steps[1], lambda st: isinstance(st, Consume) and st.waits)
    c = s.steps[1][i]
    waits = (dataclasses.replace(c.waits[0], value=3),) + c.waits[1:]
    report = rejected(edit(s, 1, lambda steps: steps.__setitem__(
        i, dataclasses.replace(c, waits=waits))))
    assert report.errors == [f"rank 1 step {i} waits on {c.waits[0].flag} >= 3, but the flag "
                             "grows by 1 per call: it would wait for ever"]


def test_a_wait_on_another_ranks_flag():
    s = direct_push_all_reduce_3(chunks=1)
    i = index_of(s.steps[1], lambda st: isinstance(st, Consume) and st.waits)
    c = s.steps[1][i]
    foreign = Wait(Flag(2, 0, 0), 1)   # lives in rank 2's memory
    report = rejected(edit(s, 1, lambda steps: steps.__setitem__(
        i, dataclasses.replace(c, waits=(foreign,) + c.waits[1:]))))
    assert (f"rank 1 step {i} waits on {foreign.flag}, which lives in rank 2's memory; a rank "
            "waits only on its own flags") in report.errors


# -- (g) a cycle -------------------------------------------------------------------------------


def consume_before_notify(steps):
    """Move the rank's first waiting consume in front of its first notify."""
    c = index_of(steps, lambda st: isinstance(st, Consume) and st.waits)
    n = index_of(steps, lambda st: isinstance(st, Notify))
    assert n < c
    steps.insert(n, steps.pop(c))


def test_two_ranks_waiting_for_each_other_deadlock():
    s = plan(collectives.all_reduce(2), "direct-push", count=4, dtype="float64")
    mutant = edit(edit(s, 0, consume_before_notify), 1, consume_before_notify)
    report = rejected(mutant)
    assert report.errors == [
        "deadlock: rank 0 step 1 (lane 0 consume, call 0) waits on flag(r0<-r1.l0) >= 1 from "
        "rank 1 lane 0; rank 1 step 1 (lane 0 consume, call 0) waits on flag(r1<-r0.l0) >= 1 "
        "from rank 0 lane 0 - no lane can make progress"]
    rank, step, flag, want, saw = expect_timeout(mutant)
    assert step == 1 and flag == Flag(rank, 1 - rank, 0) and (want, saw) == (1, 0)


def test_a_three_rank_cycle_around_the_ring_deadlocks():
    s = plan(collectives.all_reduce(3), "ring", count=6, dtype="float64")
    mutant = s
    for r in range(3):
        mutant = edit(mutant, r, consume_before_notify)
    report = rejected(mutant)
    (msg,) = report.errors
    assert msg.startswith("deadlock: ") and msg.endswith(" - no lane can make progress")
    for r in range(3):  # each rank waits for its ring predecessor
        assert (f"rank {r} step 1 (lane 0 consume, call 0) waits on "
                f"flag(r{r}<-r{(r - 1) % 3}.l0) >= 1 from rank {(r - 1) % 3} lane 0") in msg
    expect_timeout(mutant)


def test_a_cycle_only_across_calls_is_found():
    # waiting for a notify of the *next* call is a deadlock at the last call
    s = plan(collectives.all_reduce(2), "direct-push", count=4)
    i = index_of(s.steps[0], lambda st: isinstance(st, Consume) and st.waits)
    c = s.steps[0][i]
    report = rejected(edit(s, 0, lambda steps: steps.__setitem__(
        i, dataclasses.replace(c, waits=(dataclasses.replace(c.waits[0], call=1),)))))
    assert report.errors[0].startswith(f"deadlock: rank 0 step {i} (lane 0 consume, call ")
    assert "waits on flag(r0<-r1.l0) >= 1 from rank 1 lane 0" in report.errors[0]


# -- across calls: scratch reuse ---------------------------------------------------------------


def test_broadcast_without_acknowledgements_races_two_calls_later():
    s = plan(collectives.broadcast(3), "direct-push", count=4)
    assert s.scratch_copies == 2

    def drop_acks(steps):
        for i, st in enumerate(steps):
            if any(w.call < 0 for w in st.waits):
                steps[i] = Stage(st.rank, st.lane, st.op, st.srcs, st.dst, st.names, st.engine)

    mutant = edit(s, 0, drop_acks)
    assert mutant != s
    # with two scratch copies the overwrite comes at call 2: two calls cannot see it
    assert verify(mutant, calls=2).ok
    report = rejected(mutant)          # the default runs copies + 1 = 3 calls
    assert report.calls == 3
    for rank in (1, 2):
        assert any(f"race on r{rank}.scratch[0:4]" in m and f"rank {rank} step 0 (lane 0 "
                   "consume, call 0)" in m and "call 2)" in m for m in messages(report))
    assert verify(s, calls=5).ok


def test_one_scratch_copy_where_two_are_needed_races_on_the_next_call():
    s = direct_push_all_reduce_3(chunks=1)
    assert s.scratch_copies == 2
    report = rejected(dataclasses.replace(s, scratch_copies=1))
    assert len(report.races) == 6  # every rank's two receive areas
    assert all(r.region.buffer == "scratch" for r in report.races)
    assert all({r.first[3], r.second[3]} == {0, 1} for r in report.races)


# -- static checks -----------------------------------------------------------------------------


def test_structural_errors_are_named():
    s = direct_push_all_reduce_3(chunks=1)
    stage = s.steps[0][0]
    cases = {
        "rank 0 step 0 writes r0.input[0:6]: inputs are never modified":
            dataclasses.replace(stage, dst=Region(0, "input", 0, 6)),
        "rank 0 step 0 touches r1.scratch[20:26], outside that buffer":
            dataclasses.replace(stage, dst=Region(1, "scratch", 20, 6)),
        "rank 0 step 0 moves regions of different sizes":
            dataclasses.replace(stage, dst=Region(1, "scratch", 0, 5)),
        "step 0 listed under rank 0 says it runs on rank 2": dataclasses.replace(stage, rank=2),
        "rank 0 step 0 runs on lane 1, outside the schedule's lanes 0..0":
            dataclasses.replace(stage, lane=1),
        "rank 0 step 2 (lane 0) notifies flag(r1<-r2.l0), which only lane 0 of rank 2 may add to":
            None,
    }
    for expected, replacement in cases.items():
        if replacement is None:
            mutant = edit(s, 0, lambda steps: steps.__setitem__(
                2, dataclasses.replace(steps[2], flag=Flag(1, 2, 0))))
        else:
            mutant = edit(s, 0, lambda steps, x=replacement: steps.__setitem__(0, x))
        report = rejected(mutant)
        assert any(m.startswith(expected) for m in report.errors), (expected, report.errors)


def test_a_schedule_checked_against_another_collective():
    s = direct_push_all_reduce_3(chunks=1)
    report = verify(s, collectives.reduce_scatter(3))
    assert report.errors == ["schedule is for all-reduce but was checked against reduce-scatter"]


def test_raise_on_error_gives_one_sentence_and_a_count():
    s = direct_push_all_reduce_3(chunks=1)
    with pytest.raises(VerificationError) as info:
        verify(dataclasses.replace(s, scratch_copies=1), raise_on_error=True)
    text = str(info.value)
    assert text.startswith("race on ") and text.endswith(
        " (and 5 more problem(s); see verify(...).errors/races)")
    assert "\n" not in text
    assert verify(s, raise_on_error=True).ok
