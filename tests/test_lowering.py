"""Lowering a schedule to the executor's instruction tables (no GPU needed)."""

import numpy as np
import pytest

from purlin.atom.lowering import flag_slots, lower
from purlin.kernels import isa
from purlin.snac import Consume, Notify, plan
from purlin.spec import collectives


def _bases(n, shift=0):
    return {(r, b): ((1 + 3 * r + i) << 24) + (shift if b == "output" else 0)
            for r in range(n) for i, b in enumerate(("input", "output", "scratch"))}


def _flags(n):
    return {r: (100 + r) << 24 for r in range(n)}


def _barriers(lowered):
    return sum(int(np.sum((low.tables[0][:, isa.OP] == isa.NOTIFY)
                          & (low.tables[0][:, isa.PEER] < 0))) for low in lowered)


@pytest.mark.parametrize("strategy", ["ring", "two-phase", "direct-push"])
def test_rows_match_the_schedule_step_for_step(strategy):
    s = plan(collectives.all_reduce(3), strategy, count=96, chunks=2, lanes=2)
    for low, steps in zip(lower(s, _bases(3), _flags(3)), s.steps):
        table = low.tables[0]
        expect = sum(len(st.waits) + (1 if st.moves_data else 0) if isinstance(st, Consume)
                     else 1 for st in steps)
        assert len(table) == expect
        assert len(low.tables) == s.scratch_copies
        # lanes run their rows contiguously and in program order
        for lane in range(s.lanes):
            rows = table[low.lane_offsets[lane]:low.lane_offsets[lane + 1]]
            assert set(rows[:, isa.LANE]) <= {lane}
            assert list(rows[:, isa.STEP]) == sorted(rows[:, isa.STEP])


def test_waits_scale_with_blocks_per_lane_and_notifies_add_one_per_block():
    s = plan(collectives.all_reduce(2), "direct-push", count=64)
    per_call = s.flags()
    for bpl in (1, 4):
        for low, steps in zip(lower(s, _bases(2), _flags(2), blocks_per_lane=bpl), s.steps):
            waits = [w for st in steps for w in st.waits]
            rows = low.tables[0][low.tables[0][:, isa.OP] == isa.WAIT]
            assert list(rows[:, isa.VALUE]) == [w.value * bpl for w in waits]
            assert list(rows[:, isa.PER_CALL]) == [per_call[w.flag] * bpl for w in waits]
            notify = low.tables[0][low.tables[0][:, isa.OP] == isa.NOTIFY]
            assert set(notify[:, isa.VALUE]) == {1}
            assert len(notify) == sum(isinstance(st, Notify) for st in steps)


def test_flag_addresses_index_by_source_rank_and_lane():
    s = plan(collectives.all_to_all(3), "direct-push", count=9, lanes=1)
    low = lower(s, _bases(3), _flags(3))
    for r, (rank_low, steps) in enumerate(zip(low, s.steps)):
        rows = rank_low.tables[0][rank_low.tables[0][:, isa.OP] == isa.NOTIFY]
        for row, st in zip(rows, [st for st in steps if isinstance(st, Notify)]):
            assert row[isa.FLAG] == _flags(3)[st.flag.owner] + 8 * (st.flag.src * s.lanes
                                                                    + st.flag.lane)
    assert flag_slots(3, 2) == 3 * 2 + 2


def test_lane_barriers_only_where_blocks_may_meet_each_others_words():
    s = plan(collectives.all_reduce(2), "direct-push", count=64)
    assert _barriers(lower(s, _bases(2), _flags(2), blocks_per_lane=1)) == 0
    # aligned: every thread rereads only the words it wrote, the row barrier is enough
    assert _barriers(lower(s, _bases(2), _flags(2), blocks_per_lane=4)) == 0
    # misaligned output: other blocks may own the words a ring step rereads, a lane barrier
    # is needed (on top of those before a flag's second notify)
    ring = plan(collectives.all_reduce(2), "ring", count=64)

    def before_data(lowered):  # lane barriers followed by a data row, not by a notify
        return sum(int(row[isa.OP] == isa.WAIT and row[isa.PEER] < 0
                       and nxt[isa.OP] in (isa.COPY, isa.REDUCE, isa.WAIT))
                   for low in lowered for row, nxt in zip(low.tables[0], low.tables[0][1:]))

    assert before_data(lower(ring, _bases(2), _flags(2), blocks_per_lane=4)) == 0
    assert before_data(lower(ring, _bases(2, shift=4), _flags(2), blocks_per_lane=4)) > 0


@pytest.mark.parametrize("name,strategy", [("all-reduce", "ring"), ("all-reduce", "two-phase"),
                                           ("all-gather", "direct-push"),
                                           ("all-gather", "ring"), ("all-to-all", "direct-pull"),
                                           ("broadcast", "ring"), ("reduce-scatter", "ring")])
def test_a_flag_notified_twice_in_a_call_waits_for_every_block_first(name, strategy):
    """Seen on 2 x H200 at 256 MiB with 8 chunks through one lane of 66 blocks: a fast block's
    second add made up the waiter's target while a slow block's first part was missing. Now
    a lane barrier separates two notifies of one flag whenever the lane has several blocks."""
    s = plan(collectives.standard(name, 3), strategy, count=3 * 64 * 8, chunks=8, lanes=1)
    for bpl, barrier_expected in ((1, False), (4, True)):
        for low in lower(s, _bases(3), _flags(3), blocks_per_lane=bpl):
            rows = low.tables[0]
            since: dict[int, bool] = {}  # flag -> a lane barrier since its last notify
            repeated = False
            for row in rows:
                if row[isa.OP] == isa.WAIT and row[isa.PEER] < 0:
                    since = {f: True for f in since}
                if row[isa.OP] == isa.NOTIFY and row[isa.PEER] >= 0:
                    f = int(row[isa.FLAG])
                    if f in since:
                        repeated = True
                        assert since[f] or not barrier_expected, (name, strategy, bpl)
                    since[f] = False
            assert repeated  # eight chunks through one lane notify some flag again
        if not barrier_expected:
            assert _barriers(lower(s, _bases(3), _flags(3), blocks_per_lane=1)) == 0


def test_unsupported_dtype_is_refused():
    from purlin.errors import CapabilityError

    s = plan(collectives.all_reduce(2), "ring", count=8, dtype="int64")
    with pytest.raises(CapabilityError, match="int64"):
        lower(s, _bases(2), _flags(2))


def test_a_rank_block_holds_descriptor_control_lanes_tables_and_pool_contiguously():
    from purlin.atom.lowering import CONTROL_AT, CONTROL_WORDS, HEAD_WORDS, blob_size, build_blob

    s = plan(collectives.all_reduce(2), "direct-push", count=64, chunks=2, lanes=2)
    assert s.scratch_copies == 2
    low = lower(s, _bases(2), _flags(2), blocks_per_lane=2)[1]
    base = 1 << 32
    words = build_blob(base, low, s.lanes, abort=77, trace=88, trace_rows=9)
    assert len(words) == blob_size(low, s.lanes) >= HEAD_WORDS

    def at(address):
        assert (address - base) % 8 == 0 and 0 <= address - base < 8 * len(words)
        return (address - base) // 8

    assert words[isa.D_RANK] == 1 and words[isa.D_NLANES] == 2
    assert (words[isa.D_ABORT], words[isa.D_TRACE], words[isa.D_TRACE_ROWS]) == (77, 88, 9)
    assert at(words[isa.D_EPOCH]) == CONTROL_AT and at(words[isa.D_DONE]) == CONTROL_AT + 1
    assert at(words[isa.D_ERROR]) == CONTROL_AT + 2
    assert not words[CONTROL_AT: CONTROL_AT + CONTROL_WORDS].any(), "counters start at 0"
    lanes = at(words[isa.D_LANES])
    assert list(words[lanes: lanes + 3]) == list(low.lane_offsets)
    for key, table in ((isa.D_TABLE, low.tables[0]), (isa.D_TABLE_ODD, low.tables[1])):
        t = at(words[key])
        assert np.array_equal(words[t: t + table.size].reshape(table.shape), table)
    assert words[isa.D_TABLE] != words[isa.D_TABLE_ODD], "two scratch copies: two tables"
    pool = at(words[isa.D_SRCS])
    assert list(words[pool: pool + len(low.srcs)]) == list(low.srcs)


# -- LL transfers (flags inside the data) --------------------------------------------------------
def _ll(n):
    return {r: (200 + r) << 24 for r in range(n)}


@pytest.mark.parametrize("n", [2, 3, 4])
def test_ll_replaces_each_direct_push_stage_notify_pair(n):
    """Direct-push all-reduce: every rank's stage to a peer and its notify become one LL_PUT,
    the peer's wait becomes an LL_GET; no NOTIFY or WAIT row is left."""
    from purlin.atom.lowering import ll_area_bytes, ll_transfers

    s = plan(collectives.all_reduce(n), "direct-push", count=16 * n)
    assert len(ll_transfers(s)) == n * (n - 1)
    scratch_bytes = {r: -(-s.scratch[r] * 4 // 16) * 16 for r in range(n)}
    lowered = lower(s, _bases(n), _flags(n), scratch_bytes=scratch_bytes, ll_bases=_ll(n))
    for low in lowered:
        for parity, table in enumerate(low.tables):
            ops = list(table[:, isa.OP])
            assert ops.count(isa.LL_PUT) == n - 1 and ops.count(isa.LL_GET) == n - 1
            assert isa.NOTIFY not in ops and isa.WAIT not in ops
            for row in table[table[:, isa.OP] == isa.LL_PUT]:
                peer = int(row[isa.PEER])
                area = _ll(n)[peer] + parity * ll_area_bytes(scratch_bytes[peer])
                assert area <= row[isa.DST] < area + ll_area_bytes(scratch_bytes[peer])
                assert (row[isa.DST] - area) % isa.LL_UNIT == 0
            for row in table[table[:, isa.OP] == isa.LL_GET]:
                assert row[isa.FLAG] == low.srcs[row[isa.SRC]]  # errors name the units
                assert row[isa.PEER] != low.rank


def test_ll_leaves_pairs_it_cannot_prove_alone():
    """Ring notifies a flag twice per call (its waits stay flags); a pull moves nothing a
    Notify could carry; direct-push all-gather stages into the peer's scratch and qualifies;
    the plain lowering stays the default."""
    from purlin.atom.lowering import ll_transfers

    assert len(ll_transfers(plan(collectives.all_reduce(4), "ring", count=64))) == 0
    assert len(ll_transfers(plan(collectives.all_gather(2), "direct-pull", count=16))) == 0
    assert len(ll_transfers(plan(collectives.all_gather(2), "direct-push", count=16))) == 2
    s = plan(collectives.all_reduce(2), "direct-push", count=32)
    ops = list(lower(s, _bases(2), _flags(2))[0].tables[0][:, isa.OP])
    assert isa.LL_PUT not in ops and isa.NOTIFY in ops


LL_PLANS = [(name, strategy)
            for name in ("all-reduce", "reduce-scatter", "all-gather", "all-to-all",
                         "broadcast", "reduce")
            for strategy in ("direct-push", "direct-pull", "two-phase", "ring")
            if strategy != "two-phase" or name in ("all-reduce", "reduce-scatter", "reduce")]


@pytest.mark.parametrize("name,strategy", LL_PLANS)
def test_every_ll_flag_had_one_notify_and_one_wait(name, strategy):
    """Whatever the collective, a flag is dropped only where it grew once per call and had a
    single wait of this call, in the step that reads the staged region."""
    from purlin.atom.lowering import ll_transfers
    from purlin.spec import standard

    s = plan(standard(name, 3), strategy, count=48, chunks=2)
    ll = ll_transfers(s)
    per_call = s.flags()
    for (rank, index, flag), (region, sender) in ll.gets.items():
        assert per_call[flag] == 1 and flag.owner == rank and flag.src == sender
        waits = [w for steps in s.steps for st in steps for w in st.waits if w.flag == flag]
        assert len(waits) == 1 and (waits[0].value, waits[0].call) == (1, 0)
        assert region in s.steps[rank][index].srcs
    for (rank, index) in ll.skip:
        assert isinstance(s.steps[rank][index], Notify)
    lower(s, _bases(3), _flags(3), ll_bases=_ll(3))  # lowers without complaint


def test_ll_with_several_blocks_puts_a_lane_barrier_between_get_and_data():
    """LL rows give each thread 8-byte units, data rows 16-byte ones: with several blocks per
    lane the step's data row must wait for every block's LL_GET."""
    s = plan(collectives.all_reduce(2), "direct-push", count=32)
    for bpl, expect in ((1, 0), (2, 1)):
        for low in lower(s, _bases(2), _flags(2), blocks_per_lane=bpl, ll_bases=_ll(2)):
            ops = list(low.tables[0][:, isa.OP])
            g = ops.index(isa.LL_GET)
            between = ops[g + 1: ops.index(isa.REDUCE)]
            assert between == [isa.NOTIFY, isa.WAIT] * expect, (bpl, ops)
