"""The ce lowering without a GPU: engines per step, the operations of every stream (copies,
counter adds and waits with their addresses and values, fork / join events), the executor rows
of the sm part, graph-replayable counters; then the whole lowering run on fake memory
(``purlin.atom.ce_sim``) over back-to-back calls in random interleavings."""

import numpy as np
import pytest

from purlin.atom.ce import CAPABILITIES
from purlin.atom.ce_lowering import (Add, Launch, Memcpy, Record, WaitEvent, WaitGeq, Write,
                                     assign_engines, ce_flag_slots, chain_lanes, lookback,
                                     lower_ce, side_copies_of)
from purlin.atom.ce_sim import CeSim
from purlin.errors import CapabilityError, ExecutionError
from purlin.kernels.isa import (COPY, COUNT, DST, EPOCH_OFFSET, FLAG, NOTIFY, NSRC, OP,
                                PER_CALL, REDUCE, SRC, STEP, VALUE, WAIT)
from purlin.snac import Region, Schedule, Stage, plan
from purlin.spec import STANDARD, collectives, reference, standard

BUFFERS = ("input", "output", "scratch")


def addresses(n, lanes=1):
    bases = {(r, b): (1 + 4 * r + i) << 20 for r in range(n) for i, b in enumerate(BUFFERS)}
    flags = {r: (100 + r) << 20 for r in range(n)}
    epochs = {r: (200 + r) << 20 for r in range(n)}
    return bases, flags, epochs


def lowered(schedule, blocks_per_lane=1, devices=None):
    n = schedule.nranks
    bases, flags, epochs = addresses(n)
    devices = devices if devices is not None else tuple(range(n))
    return lower_ce(schedule, bases, flags, epochs, devices, blocks_per_lane=blocks_per_lane)


def flag_addr(owner, src, lane, lanes=1, n=2):
    return ((100 + owner) << 20) + 8 * (src * lanes + lane)


def handoff_addr(rank, lane, lanes=1, n=2):
    return ((100 + rank) << 20) + 8 * (n * lanes + lanes + lane)


def ar(strategy, n=2, count=16, chunks=1, lanes=1, dtype="float32"):
    return plan(collectives.all_reduce(n), strategy, count=count, dtype=dtype, chunks=chunks,
                lanes=lanes, capabilities=CAPABILITIES)


# -- engines ----------------------------------------------------------------------------------
def test_notifies_and_waits_run_on_the_engine_of_their_lanes_data():
    s = ar("two-phase")
    # copy, notify, wait+sum, copy, notify, wait-only
    assert assign_engines(s) == (("ce", "ce", "sm", "ce", "ce", "ce"),) * 2


def test_a_lane_with_no_data_stays_on_copy_engines_and_pull_reductions_on_sm():
    s = ar("direct-pull")
    # notify, wait + sum reading the peer's input, notify, wait: all on sm, no ce work at all
    assert assign_engines(s) == (("sm",) * 4,) * 2
    low = lowered(s)
    assert all(ops == () for r in low.ranks for ops in r.lanes[0])
    assert [type(op) for op in low.programs[0][0].head] == [Record, Launch]


def test_reductions_planned_on_the_copy_engine_are_refused():
    s = plan(collectives.all_reduce(2), "direct-push", count=8)   # engines left blank
    assert set(assign_engines(s)[0]) == {"ce", "sm"}             # blank: copy ce, reduce sm
    step = s.steps[0][2]
    bad = Schedule(s.collective, s.dtype, s.chunk_counts, s.strategy, s.chunks, s.lanes,
                   (s.steps[0][:2] + (type(step)(step.rank, step.lane, step.waits, step.op,
                                                 step.srcs, step.dst, step.names, "ce"),),
                    s.steps[1]), s.scratch, s.scratch_copies)
    with pytest.raises(CapabilityError, match="can only copy"):
        assign_engines(bad)


# -- the streams' operations ------------------------------------------------------------------
def test_direct_push_all_reduce_operations():
    s = ar("direct-push", count=16)
    low = lowered(s)
    bases, _, epochs = addresses(2)
    r0 = low.ranks[0]
    assert low.unit == 1 and low.parities == s.scratch_copies == 2
    (lane,) = r0.lanes[0]
    assert lane == (
        WaitEvent("fork:d0"),
        Memcpy(dst=bases[(1, "scratch")], src=bases[(0, "input")], nbytes=64, step=0),
        Add(flag_addr(1, 0, 0), 1, step=1, what="notify"),
        Add(handoff_addr(0, 0), 1, step=2, what="handoff"),
        Record("done:r0.l0"))
    # the sm part: wait for the ce hand-off, wait for the peer's notify, reduce
    table = r0.sm.tables[0]
    assert [row[OP] for row in table] == [WAIT, WAIT, REDUCE]
    assert table[0][FLAG] == handoff_addr(0, 0) and table[0][VALUE] == 1
    assert table[1][FLAG] == flag_addr(0, 1, 0) and table[1][VALUE] == 1
    assert all(row[PER_CALL] == 0 and row[EPOCH_OFFSET] == 0 for row in table)
    red = table[2]
    assert red[DST] == bases[(0, "output")] and red[COUNT] == 16 and red[NSRC] == 2
    assert list(r0.sm.srcs[red[SRC]: red[SRC] + 2]) == [bases[(0, "scratch")],
                                                         bases[(0, "input")]]
    # the call ends with the flag and the hand-off counter rebased by what they grew
    assert set(r0.rebase) == {Add(handoff_addr(0, 0), -1, what="rebase"),
                              Add(flag_addr(0, 1, 0), -1, what="rebase")}
    prog = low.programs[0][0]
    assert prog.head == (Record("fork:d0"), Write(epochs[0], 0), Launch((0,)))
    assert prog.tail == (WaitEvent("done:r0.l0"), *r0.rebase, Record("end:d0"))


def test_two_phase_hands_the_lane_back_to_the_copy_engine_after_the_reduction():
    s = ar("two-phase", count=16)
    low = lowered(s, blocks_per_lane=4)
    bases, _, _ = addresses(2)
    r0 = low.ranks[0]
    ops = r0.lanes[0][0]
    assert low.unit == 4
    assert ops[1:-1] == (
        Memcpy(bases[(1, "scratch")], bases[(0, "input")] + 32, 32, 0),
        Add(flag_addr(1, 0, 0), 4, 1),                      # one notify = unit
        Add(handoff_addr(0, 0), 4, 2, "handoff"),           # ce -> sm
        WaitGeq(handoff_addr(0, 0), 8, 3, "handoff"),       # sm -> ce: second hand-off
        Memcpy(bases[(1, "output")], bases[(0, "output")], 32, 3),
        Add(flag_addr(1, 0, 0), 4, 4),
        WaitGeq(flag_addr(0, 1, 0), 8, 5))                  # the peer's second notify
    table = r0.sm.tables[0]
    assert [row[OP] for row in table] == [WAIT, WAIT, REDUCE, NOTIFY]
    assert [row[VALUE] for row in table if row[OP] == WAIT] == [4, 4]
    assert table[3][FLAG] == handoff_addr(0, 0) and table[3][VALUE] == 1   # per block
    assert list(table[:, STEP]) == [2, 2, 2, 3]       # a hand-off row names the next step
    assert set(r0.rebase) == {Add(handoff_addr(0, 0), -8, what="rebase"),
                              Add(flag_addr(0, 1, 0), -8, what="rebase")}
    assert r0.handoffs == (2,)


def test_copy_collectives_have_no_sm_part_and_count_notifies_in_ones():
    s = plan(collectives.all_gather(3), "ring", count=12, capabilities=CAPABILITIES)
    low = lowered(s, blocks_per_lane=8)
    assert low.unit == 1 and not low.uses_sm
    assert all(r.sm is None for r in low.ranks)
    assert all(not any(isinstance(op, (Launch, Write)) for op in p.head)
               for programs in low.programs.values() for p in programs)
    kinds = {type(op) for _, op in low.ops(0)}
    assert kinds == {Record, WaitEvent, Memcpy, Add, WaitGeq}
    assert all(op.value == 1 for _, op in low.ops(0) if isinstance(op, Add) and op.what ==
               "notify")


def test_lookback_biases_counters_so_acknowledgements_of_two_calls_back_are_constants():
    s = plan(collectives.broadcast(2), "direct-push", count=6, capabilities=CAPABILITIES)
    assert s.scratch_copies == 2
    ack = s.steps[0][0].waits[0]
    assert ack.call == -2 and lookback(s) == {ack.flag: 2, s.steps[1][0].waits[0].flag: 0}
    low = lowered(s)
    r0 = low.ranks[0]
    assert r0.init == {flag_addr(0, 1, 0): 2}            # K * per_call * unit
    first = [op for op in r0.lanes[0][0] if isinstance(op, WaitGeq)]
    assert first == [WaitGeq(flag_addr(0, 1, 0), 1, 0)]  # (K + call) * per_call + value
    assert Add(flag_addr(0, 1, 0), -1, what="rebase") in r0.rebase


def test_two_scratch_copies_give_two_programs_that_differ_only_in_scratch_addresses():
    s = ar("direct-push", count=16, chunks=2, lanes=2)
    assert s.scratch_copies == 2
    low = lowered(s)
    bases, _, epochs = addresses(2)
    even, odd = low.ranks[0].lanes
    shift = s.scratch[1] * 4
    for a, b in zip(even[0], odd[0]):
        if isinstance(a, Memcpy):
            assert b.dst == a.dst + shift and b.src == a.src
        else:
            assert a == b
    # the executor picks its parity from its call counter, which the call writes first
    assert low.programs[0][0].head == (Record("fork:d0"), Write(epochs[0], 0), Launch((0,)))
    assert low.programs[0][1].head == (Record("fork:d0"), Write(epochs[0], 1), Launch((0,)))
    sm = low.ranks[0].sm
    rows = len(sm.tables[0])
    assert len(sm.srcs) == 2 * 2 * 2                     # 2 reductions x 2 sources x 2 parities
    red_even = [r for r in sm.tables[0] if r[OP] == REDUCE]
    red_odd = [r for r in sm.tables[1] if r[OP] == REDUCE]
    assert len(sm.tables[1]) == rows
    for e, o in zip(red_even, red_odd):
        assert sm.srcs[o[SRC]] == sm.srcs[e[SRC]] + shift   # scratch source moves
        assert sm.srcs[o[SRC] + 1] == sm.srcs[e[SRC] + 1]   # input source does not


def test_several_ranks_on_one_device_share_its_main_stream_and_launch():
    s = ar("direct-push", n=3, count=12)
    low = lowered(s, devices=(0, 0, 0))
    _, _, epochs = addresses(3)
    assert list(low.programs) == [0]
    prog = low.programs[0][0]
    assert prog.head == (Record("fork:d0"), *[Write(epochs[r], 0) for r in range(3)],
                         Launch((0, 1, 2)))
    assert [op for op in prog.tail if isinstance(op, WaitEvent)] == \
        [WaitEvent(f"done:r{r}.l0") for r in range(3)]
    # host order: the fork is recorded before any lane waits on it, the lanes record their
    # end before the main stream waits on it
    order = [(stream, op) for stream, op in low.ops(0) if isinstance(op, (Record, WaitEvent))]
    assert order[0] == ("main:d0", Record("fork:d0"))
    assert order[-1] == ("main:d0", Record("end:d0"))


def test_consecutive_sm_steps_that_share_memory_get_a_lane_barrier_with_several_blocks():
    s = ar("direct-push", count=8)
    st = s.steps[0][2]
    # custom: reduce into the output, then (sm) copy that output on to the scratch
    again = Stage(0, 0, "copy", (st.dst,), Region(0, "scratch", 0, 8), st.names, "sm")
    steps = (s.steps[0] + (again,), s.steps[1])
    custom = Schedule(s.collective, s.dtype, s.chunk_counts, s.strategy, 1, 1, steps, s.scratch)
    one = lowered(custom, blocks_per_lane=1).ranks[0].sm.tables[0]
    two = lowered(custom, blocks_per_lane=2).ranks[0]
    assert [r[OP] for r in one] == [WAIT, WAIT, REDUCE, COPY]
    assert [r[OP] for r in two.sm.tables[0]] == [WAIT, WAIT, REDUCE, NOTIFY, WAIT, COPY]
    barrier = two.sm.tables[0][3][FLAG]
    assert two.sm.tables[0][4][FLAG] == barrier and two.sm.tables[0][4][VALUE] == 2
    assert Add(barrier, -2, what="rebase") in two.rebase


def test_flag_slots():
    assert ce_flag_slots(4, 2) == 4 * 2 + 2 + 2


# -- running the lowering on fake memory ------------------------------------------------------
def sim_cases():
    for name in STANDARD:
        for strategy in ["direct-push", "direct-pull", "two-phase", "ring"]:
            for n, chunks, lanes in ((2, 1, 1), (3, 3, 2)):
                if planned(name, strategy, n, chunks, lanes) is not None:
                    yield name, strategy, n, chunks, lanes


def planned(name, strategy, n, chunks, lanes):
    coll = standard(name, n)
    try:
        return plan(coll, strategy, chunk_sizes={c: 6 for c in coll.input.names()},
                    dtype="float64", chunks=chunks, lanes=lanes, capabilities=CAPABILITIES)
    except Exception:
        return None


def check_calls(s, bpl, seeds, calls=4, hook=None):
    """Back-to-back calls with fresh inputs: every output right (or already a later call's, as
    SNAC allows a fast peer to run ahead), the last one exactly, counters back where they
    started (what makes a captured graph replayable)."""
    n = s.nranks
    rng = np.random.default_rng(0)
    ins = [[rng.integers(1, 50, s.sizing.input_count(r)).astype(float) for r in range(n)]
           for _ in range(calls)]
    refs = [reference(s.sizing, x) for x in ins]
    for seed in seeds:
        sim = CeSim(s, blocks_per_lane=bpl, lowered_hook=hook)
        start = sim.counters()
        snaps = sim.run(ins, seed=seed)
        for r in range(n):
            np.testing.assert_array_equal(snaps[-1][r], refs[-1][r])
            for c in range(calls):
                ok = np.zeros(len(refs[c][r]), bool)
                for k in range(c, calls):
                    ok |= snaps[c][r] == refs[k][r]
                assert ok.all(), f"rank {r} call {c}: stale or wrong output"
        assert sim.counters() == start


@pytest.mark.parametrize("name,strategy,n,chunks,lanes", list(sim_cases()))
@pytest.mark.parametrize("bpl", [1, 3])
def test_lowered_programs_compute_their_collective_in_any_interleaving(name, strategy, n,
                                                                       chunks, lanes, bpl):
    s = planned(name, strategy, n, chunks, lanes)
    check_calls(s, bpl, seeds=range(4))


def test_virtual_ranks_on_one_device():
    s = planned("all-reduce", "two-phase", 3, 2, 2)
    n = s.nranks
    rng = np.random.default_rng(1)
    ins = [[rng.integers(1, 9, s.sizing.input_count(r)).astype(float) for r in range(n)]] * 3
    snaps = CeSim(s, blocks_per_lane=2, devices=(0, 0, 0)).run(ins, seed=3)
    for got, want in zip(snaps[-1], reference(s.sizing, ins[-1])):
        np.testing.assert_array_equal(got, want)


def _drop(kind):
    def hook(low):
        for r in low.ranks:
            if kind == "rebase":
                r.rebase = ()
            if kind == "bias":
                r.init = {}
            if kind == "handoff":
                r.lanes = [[tuple(op for op in ops if not (isinstance(op, WaitGeq) and
                                                           op.what == "handoff"))
                            for ops in parity] for parity in r.lanes]
        if kind == "rebase":
            for programs in low.programs.values():
                for p in programs:
                    p.tail = tuple(op for op in p.tail if getattr(op, "what", "") != "rebase")
        return low
    return hook


@pytest.mark.parametrize("kind,case", [("rebase", ("all-reduce", "two-phase", 3, 2, 1)),
                                       ("rebase", ("all-gather", "ring", 3, 2, 1)),
                                       ("bias", ("broadcast", "direct-push", 3, 1, 1)),
                                       ("handoff", ("all-reduce", "two-phase", 3, 2, 1))])
def test_the_simulation_catches_a_broken_lowering(kind, case):
    s = planned(*case)
    with pytest.raises((AssertionError, ExecutionError)):
        check_calls(s, 1, seeds=range(8), hook=_drop(kind))


def _chained(primary):
    def hook(low):
        for r in low.ranks:
            r.lanes = [chain_lanes(lanes, r.rank, primary) for lanes in r.lanes]
        return low
    return hook


def test_chained_lanes_wait_for_the_previous_lane():
    s = ar("two-phase", count=16, chunks=2, lanes=3)
    lanes = chain_lanes(lowered(s).ranks[0].lanes[0], 0)
    assert [ops[0] for ops in lanes] == [WaitEvent("fork:d0"), WaitEvent("done:r0.l0"),
                                         WaitEvent("done:r0.l1")]


@pytest.mark.parametrize("case", [("all-gather", "direct-pull", 3, 4, 4),
                                  ("all-reduce", "two-phase", 3, 4, 3),
                                  ("broadcast", "direct-push", 2, 2, 2),
                                  ("all-to-all", "ring", 3, 2, 2)])
def test_lanes_chained_one_after_another_still_compute_the_collective(case):
    """What a captured graph runs: a rank's lanes in lane order, the executor beside them."""
    s = planned(*case)
    check_calls(s, 2, seeds=range(4), hook=_chained(s.lanes))


@pytest.mark.parametrize("name,strategy", [("all-reduce", "two-phase"), ("all-reduce", "ring"),
                                           ("reduce-scatter", "ring")])
def test_an_sm_flag_notified_twice_waits_for_every_block_first(name, strategy):
    """As on the sm datapath (tests/test_lowering.py): with several blocks per lane, two sm
    notifies of one flag in a call have a lane barrier (or a hand-off) between them."""
    s = plan(standard(name, 2), strategy, count=2 * 64 * 8, chunks=8, lanes=1,
             capabilities=CAPABILITIES)
    repeated = False
    for low in lowered(s, blocks_per_lane=4).ranks:
        rows = low.sm.tables[0]
        since: dict = {}
        own = (100 + low.rank) << 20
        for row in rows:
            if row[OP] == WAIT and row[FLAG] - own >= 8 * 2:  # lane barrier or hand-off
                since = {f: True for f in since}
            if row[OP] == NOTIFY and row[FLAG] in since:
                repeated = True
                assert since[row[FLAG]], (name, strategy)
            if row[OP] == NOTIFY:
                since[row[FLAG]] = False
    assert repeated


def test_a_ranks_own_copy_runs_on_a_side_stream():
    """All-gather, direct-pull: each rank's copy of its own piece leaves lane 0 for side lane 1,
    forked where it stood and joined by the main stream; the pulls across NVLink stay."""
    s = plan(collectives.all_gather(2), "direct-pull", count=8, capabilities=CAPABILITIES)
    assert side_copies_of(s) == {(0, 1), (1, 1)}
    low = lowered(s)
    r0 = low.ranks[0]
    main, side = r0.lanes[0]
    fork = Record("side:r0.l0.s1")
    assert fork in main
    assert side[:2] == (WaitEvent("fork:d0"), WaitEvent("side:r0.l0.s1"))
    assert isinstance(side[2], Memcpy) and side[3] == Record("done:r0.l1")
    bases, _, _ = addresses(2)
    own = bases[(0, "input")], bases[(0, "output")]
    assert (side[2].src, side[2].dst) == own  # its own input into its own output
    copies = [op for op in main if isinstance(op, Memcpy)]
    assert len(copies) == 1 and copies[0].src == bases[(1, "input")]  # the pull stays
    assert WaitEvent("done:r0.l1") in low.programs[0][0].tail
    # chained for a graph, the side lane keeps its fork; without side copies nothing moves
    assert chain_lanes(r0.lanes[0], 0, s.lanes)[1] == side
    plain = lower_ce(s, bases, *addresses(2)[1:], devices=(0, 1), side_copies=False)
    assert len(plain.ranks[0].lanes[0]) == 1


@pytest.mark.parametrize("name,strategy,n,chunks,lanes", list(sim_cases()))
def test_only_a_ranks_copies_of_its_own_input_into_unread_memory_go_aside(name, strategy, n,
                                                                          chunks, lanes):
    s = planned(name, strategy, n, chunks, lanes)
    reads = [(r, i, x) for r, steps in enumerate(s.steps) for i, st in enumerate(steps)
             if st.moves_data for x in st.srcs]
    for r, i in side_copies_of(s):
        st = s.steps[r][i]
        (src,) = st.srcs
        assert st.op == "copy" and not st.waits
        assert src.rank == st.dst.rank == r and src.buffer == "input"
        assert not any(st.dst.overlaps(x) for _, _, x in reads)
    if name in ("all-gather", "all-to-all") and s.nranks == 2:
        assert len(side_copies_of(s)) == 2  # each rank's own piece
