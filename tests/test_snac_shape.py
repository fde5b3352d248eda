"""The shape of planned schedules, checked without executing them (STYLE.md habit 7).

Hops, bytes per link, ring neighbours, flag numbering, lanes, scratch copies, acknowledgements,
JSON round-trips, rendering, determinism and caching.
"""

import json
import os
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path

import pytest

from purlin.errors import PlanError
from purlin.snac import Capabilities, Consume, Notify, Schedule, Stage, plan, verify
from purlin.snac.planner import _plan
from purlin.spec import STANDARD, Collective, copy, reduce, standard

REPO = Path(__file__).resolve().parents[1]
NS = range(2, 9)
STRATEGIES = ["direct-push", "direct-pull", "two-phase", "ring"]
ROOTED = ("broadcast", "reduce", "gather", "scatter")


def every_schedule(ns=(2, 3, 5), chunkings=((1, 1), (3, 2))):
    for name in STANDARD:
        for strategy in STRATEGIES:
            if strategy == "two-phase" and not standard(name, 2).op.is_reduce:
                continue
            for n in ns:
                for chunks, lanes in chunkings:
                    yield pytest.param(name, strategy, n, chunks, lanes,
                                       id=f"{name}-{strategy}-n{n}-{chunks}x{lanes}")


def planned(name, strategy, n, chunks=1, lanes=1, **kw):
    coll = standard(name, n, root=n - 1 if name in ROOTED else 0)
    kw.setdefault("count", 4 * n if name != "broadcast" else 12)
    return plan(coll, strategy, chunks=chunks, lanes=lanes, **kw)


def data_steps(schedule, rank=None):
    ranks = range(schedule.nranks) if rank is None else [rank]
    return [s for r in ranks for s in schedule.steps[r] if s.moves_data]


def peer_writes(schedule, rank):
    """Steps of ``rank`` that write another rank's memory (push hops)."""
    return [s for s in data_steps(schedule, rank) if s.dst.rank != rank]


def sent_bytes(schedule, rank):
    return sum(b for (a, _), b in schedule.summary()["link_bytes"].items() if a == rank)


# -- hops and bytes ----------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", ["direct-push", "direct-pull"])
@pytest.mark.parametrize("n", NS)
def test_direct_all_gather_has_n_times_n_minus_1_remote_hops(strategy, n):
    s = planned("all-gather", strategy, n)
    assert s.summary()["remote_hops"] == n * (n - 1)
    # every ordered pair of ranks is one link, carrying one chunk (4 elements of float32)
    assert s.summary()["link_bytes"] == {(a, b): 16 for a in range(n) for b in range(n) if a != b}
    assert planned("all-gather", strategy, n, chunks=3).summary()["remote_hops"] == 3 * n * (n - 1)


@pytest.mark.parametrize("n", NS)
def test_direct_pull_only_reads_peers(n):
    s = planned("all-reduce", "direct-pull", n)
    assert all(st.dst.rank == st.rank for st in data_steps(s))
    assert sum(1 for st in data_steps(s) for src in st.srcs if src.rank != st.rank) == n * (n - 1)
    assert s.scratch == (0,) * n and s.scratch_copies == 1


@pytest.mark.parametrize("chunks", [1, 3])
@pytest.mark.parametrize("n", NS)
def test_ring_all_reduce_hops_go_to_the_next_rank(n, chunks):
    s = planned("all-reduce", "ring", n, chunks=chunks)
    for r in range(n):
        writes = peer_writes(s, r)
        # n parts x chunks pieces, each 2(n-1) hops around the ring, shared by n ranks
        assert len(writes) == 2 * (n - 1) * chunks, f"rank {r}"
        assert {w.dst.rank for w in writes} == {(r + 1) % n}, f"rank {r}"
        # the first n-1 hops of a part reduce into scratch, the last n-1 copy into outputs
        assert Counter(w.dst.buffer for w in writes) == {"scratch": (n - 1) * chunks,
                                                         "output": (n - 1) * chunks}
    # a hop that reduces local data into the next rank's scratch sends one result, not two
    assert s.summary()["remote_hops"] == 2 * n * (n - 1) * chunks
    message = s.sizing.message_bytes
    links = s.summary()["link_bytes"]
    assert set(links) == {(r, (r + 1) % n) for r in range(n)}
    assert all(b * n == 2 * (n - 1) * message for b in links.values()), links


@pytest.mark.parametrize("n", NS)
def test_ring_all_gather_each_rank_forwards_n_minus_1_pieces(n):
    s = planned("all-gather", "ring", n, chunks=2)
    for r in range(n):
        assert len(peer_writes(s, r)) == (n - 1) * 2
        assert {w.dst.rank for w in peer_writes(s, r)} == {(r + 1) % n}


@pytest.mark.parametrize("chunks", [1, 2])
@pytest.mark.parametrize("n", NS)
def test_two_phase_all_reduce_sends_2_n_minus_1_over_n_of_the_message(n, chunks):
    s = planned("all-reduce", "two-phase", n, chunks=chunks, count=12 * n)
    message = s.sizing.message_bytes
    assert message == 12 * n * 4
    for r in range(n):
        assert sent_bytes(s, r) * n == 2 * (n - 1) * message, f"rank {r}"
        assert len(peer_writes(s, r)) == 2 * (n - 1) * chunks
    links = s.summary()["link_bytes"]
    assert len(links) == n * (n - 1) and len(set(links.values())) == 1  # balanced
    assert s.summary()["total_link_bytes"] == 2 * (n - 1) * message


@pytest.mark.parametrize("n", NS)
def test_direct_push_all_reduce_each_rank_sends_n_minus_1_messages(n):
    s = planned("all-reduce", "direct-push", n, count=8 * n)
    message = s.sizing.message_bytes
    for r in range(n):
        assert sent_bytes(s, r) == (n - 1) * message, f"rank {r}"
        assert {w.dst.rank for w in peer_writes(s, r)} == set(range(n)) - {r}
        assert all(w.dst.buffer == "scratch" and w.op == "copy" for w in peer_writes(s, r))
    # direct moves more than two-phase for n > 2 and the same for n = 2
    two_phase = planned("all-reduce", "two-phase", n, count=8 * n)
    assert s.summary()["total_link_bytes"] >= two_phase.summary()["total_link_bytes"]
    assert (s.summary()["total_link_bytes"] == two_phase.summary()["total_link_bytes"]) == (n == 2)


# -- flags -------------------------------------------------------------------------------------


@pytest.mark.parametrize("name, strategy, n, chunks, lanes", list(every_schedule()))
def test_flags_only_grow_and_every_signal_has_its_wait(name, strategy, n, chunks, lanes):
    s = planned(name, strategy, n, chunks, lanes)
    values = defaultdict(list)   # flag -> notify values in program order of its (rank, lane)
    for r, steps in enumerate(s.steps):
        for st in steps:
            if isinstance(st, Notify):
                assert (st.flag.src, st.flag.lane) == (r, st.lane)
                assert st.flag.owner != r
                values[st.flag].append(st.value)
    assert values, "a collective that moves data between ranks has flags"
    for flag, vals in values.items():
        assert vals == list(range(1, len(vals) + 1)), flag
    assert s.flags() == {flag: len(vals) for flag, vals in values.items()}
    waited = defaultdict(set)
    for r, steps in enumerate(s.steps):
        for st in steps:
            for w in st.waits:
                assert w.flag.owner == r, "a rank waits only on flags in its own memory"
                waited[w.flag].add(w.value)
    # every notify is waited for, and no wait asks for more than its flag reaches in a call
    assert {f: sorted(v) for f, v in waited.items()} == dict(values)


# -- lanes, chunks, scratch --------------------------------------------------------------------


@pytest.mark.parametrize("name, strategy", [("all-gather", "direct-push"),
                                            ("all-reduce", "ring"),
                                            ("all-reduce", "two-phase"),
                                            ("all-to-all", "direct-pull")])
@pytest.mark.parametrize("lanes", [1, 2, 4])
def test_chunks_and_lanes_spread_steps_over_lanes(name, strategy, lanes):
    n = 4
    one = planned(name, strategy, n, chunks=1, lanes=1, count=96)
    s = planned(name, strategy, n, chunks=lanes, lanes=lanes, count=96)
    assert s.lanes == lanes and s.chunks == lanes
    for r in range(n):
        per_lane = Counter(st.lane for st in data_steps(s, r))
        assert set(per_lane) == set(range(lanes)), f"rank {r} uses lanes {sorted(per_lane)}"
        assert len(set(per_lane.values())) == 1, f"rank {r} lanes unbalanced: {per_lane}"
        # chunking multiplies the data steps and divides their size
        assert len(data_steps(s, r)) == lanes * len(data_steps(one, r))
        assert sum(st.dst.count for st in data_steps(s, r)) == \
            sum(st.dst.count for st in data_steps(one, r))
        for lane in range(lanes):
            assert s.lane_steps(r, lane) == tuple(st for st in s.steps[r] if st.lane == lane)
    assert s.summary()["total_link_bytes"] == one.summary()["total_link_bytes"]


def test_pieces_go_round_robin_over_the_whole_collective():
    """One piece per segment still fills every lane: a two-root broadcast's halves (two
    segments) take a lane each on every rank, as do an all-gather's ranks' chunks."""
    n = 4
    two_roots = Collective([["a"], ["b"]] + [[] for _ in range(n - 2)], [["a", "b"]] * n,
                           "copy", name="two-root broadcast")
    s = plan(two_roots, "direct-pull", count=64, lanes=2)
    for r in range(n):
        names = defaultdict(set)
        for st in data_steps(s, r):
            names[st.lane].update(st.names)
        assert names == {0: {"a"}, 1: {"b"}}, f"rank {r}: {dict(names)}"
    s = planned("all-gather", "direct-push", n, chunks=1, lanes=2, count=96)
    assert {st.lane for st in data_steps(s, 0)} == {0, 1}


def test_lanes_one_uses_lane_zero_only():
    s = planned("all-reduce", "ring", 5, chunks=4, lanes=1)
    assert {st.lane for steps in s.steps for st in steps} == {0}


def test_scratch_copies():
    for n in (2, 4, 8):
        assert planned("all-reduce", "two-phase", n).scratch_copies == 1
        assert planned("all-reduce", "direct-push", n).scratch_copies == 2
        assert planned("all-reduce", "direct-pull", n).scratch_copies == 1


@pytest.mark.parametrize("name, strategy, n, chunks, lanes", list(every_schedule()))
def test_scratch_fits_every_region(name, strategy, n, chunks, lanes):
    s = planned(name, strategy, n, chunks, lanes)
    assert s.scratch_copies in (1, 2)
    used = [0] * n
    for st in data_steps(s):
        for region in (*st.srcs, st.dst):
            if region.buffer == "scratch":
                used[region.rank] = max(used[region.rank], region.end)
    assert list(s.scratch) == used


# -- acknowledgements --------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", ["direct-push", "ring"])
@pytest.mark.parametrize("n", [2, 3, 5])
def test_broadcast_acknowledges_reads_of_its_scratch(strategy, n):
    s = planned("broadcast", strategy, n, chunks=2)
    assert s.scratch_copies == 2
    acks = [(r, w) for r, steps in enumerate(s.steps) for st in steps for w in st.waits
            if w.call < 0]
    assert acks, "a broadcast has no reverse traffic: scratch reuse needs acknowledgements"
    assert all(w.call == -s.scratch_copies for _, w in acks)
    root = n - 1
    if strategy == "direct-push":  # the root waits for every rank it wrote to
        assert {(r, w.flag.src) for r, w in acks} == {(root, k) for k in range(n - 1)}
    else:                          # each forwarder waits for its successor in the ring
        assert {(r, w.flag.src) for r, w in acks} == {(r, (r + 1) % n) for r in range(n)
                                                      if (r + 1) % n != root}
    assert all(w.flag.owner == r for r, w in acks)
    assert sorted(w.value for _, w in acks) == sorted([1, 2] * (n - 1))  # one per piece
    for calls in (3, 5):
        report = verify(s, calls=calls)
        assert report.ok, str(report)
        assert report.calls == calls and report.events > 0


def test_reverse_traffic_needs_no_acknowledgements():
    # all-reduce has traffic both ways, so the schedule's own waits order scratch reuse
    for strategy in ("direct-push", "two-phase", "ring"):
        s = planned("all-reduce", strategy, 4, chunks=2)
        assert not [w for steps in s.steps for st in steps for w in st.waits if w.call]
        assert verify(s, calls=4).ok


# -- data: JSON, render, determinism, cache ----------------------------------------------------


def custom_collectives():
    swap = Collective([["a", "b"], ["c"], []], [["c"], ["a"], ["b", "a"]], copy, name="mix")
    pair = Collective([[("p", 1)], [("p", 1)], [("p", 1)]], [[("p", 1)], [], [("p", 1)]],
                      reduce("avg"), name="reduce-to-two")
    return [swap, pair]


@pytest.mark.parametrize("name, strategy, n, chunks, lanes", list(every_schedule(ns=(2, 4))))
def test_json_round_trip(name, strategy, n, chunks, lanes):
    s = planned(name, strategy, n, chunks, lanes)
    assert Schedule.from_json(s.to_json()) == s
    text = json.dumps(s.to_json())
    assert Schedule.from_json(json.loads(text)) == s
    assert Schedule.from_json(text) == s
    assert Schedule.from_json(s.dumps(indent=1)) == s
    again = Schedule.from_json(text)
    assert again.render() == s.render() and again.summary() == s.summary()
    assert verify(again).ok


@pytest.mark.parametrize("coll", custom_collectives(), ids=lambda c: c.name)
@pytest.mark.parametrize("strategy", ["direct-push", "direct-pull", "ring"])
def test_json_round_trip_keeps_custom_names_and_engines(coll, strategy):
    caps = Capabilities("ce", can_reduce=False, reduce_engine="sm")
    s = plan(coll, strategy, count=6, dtype="float64", chunks=2, capabilities=caps)
    back = Schedule.from_json(json.loads(json.dumps(s.to_json())))
    assert back == s
    names = {n for steps in back.steps for st in steps if st.moves_data for n in st.names}
    assert names == set(coll.output.names())   # tuples stay tuples, strings stay strings
    assert {st.engine for steps in back.steps for st in steps if st.moves_data} <= {"ce", "sm"}


def test_schedules_differ_when_anything_differs():
    base = planned("all-reduce", "ring", 4)
    assert base == planned("all-reduce", "ring", 4)
    assert base != planned("all-reduce", "ring", 4, chunks=2)
    assert base != planned("all-reduce", "two-phase", 4)
    assert base != planned("all-reduce", "ring", 4, dtype="float64")
    assert base != planned("all-reduce", "ring", 4, count=32)


@pytest.mark.parametrize("name", sorted(STANDARD))
def test_render_mentions_every_rank_and_step(name):
    n = 5
    s = planned(name, "direct-push", n, chunks=2)
    text = s.render()
    assert text.splitlines()[0] == s.title()
    for r in range(n):
        assert f"rank {r}  (scratch {s.scratch[r]} elements" in text
    assert len(text.splitlines()) == 1 + n + sum(len(steps) for steps in s.steps)
    assert text.count(" notify ") == s.summary()["steps"].get("notify", 0)
    only3 = s.render(ranks=[3])
    assert only3.splitlines()[1].startswith("rank 3  (scratch")
    assert len(only3.splitlines()) == 2 + len(s.steps[3])
    assert all(f"rank {r}  (" not in only3 for r in (0, 1, 2, 4))
    assert repr(s).startswith(f"<Schedule {s.title()}: ")
    assert s._repr_html_().startswith("<pre>")


def test_render_lines_show_regions_flags_and_names():
    s = planned("all-gather", "direct-push", 2, count=8)
    text = s.render()
    assert "stage copy r0.input[0:4] -> r1.scratch[0:4]" in text
    assert "notify flag(r1<-r0.l0) =1" in text
    assert "consume wait flag(r1<-r0.l0)>=1; copy r1.scratch[0:4] -> r1.output[0:4]  {0}" in text


def test_plan_is_cached_and_deterministic():
    coll = standard("all-reduce", 6)
    a = plan(coll, "ring", count=60, chunks=2, lanes=2)
    assert plan(coll, "ring", count=60, chunks=2, lanes=2) is a
    assert plan(standard("all-reduce", 6), "ring", count=60, chunks=2, lanes=2) is a
    hits = _plan.cache_info().hits
    plan(coll, "ring", count=60, chunks=2, lanes=2)
    assert _plan.cache_info().hits == hits + 1
    _plan.cache_clear()
    b = plan(coll, "ring", count=60, chunks=2, lanes=2)
    assert b is not a and b == a and b.dumps() == a.dumps()
    assert plan(coll, "ring", count=60, chunks=2, lanes=2, check=False) == a


def test_plan_is_the_same_in_another_process():
    """No set or hash order leaks into a plan: other hash seeds give the same JSON."""
    code = ("from purlin.spec import standard, Collective, copy; from purlin.snac import plan; "
            "print(plan(standard('broadcast', 4, root=2), 'ring', count=12, chunks=2).dumps()); "
            "print(plan(Collective([['a','b'],['c'],[]], [['c'],['a'],['b','a']], copy, "
            "name='mix'), 'direct-push', count=6).dumps())")
    outs = []
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed, PYTHONPATH=str(REPO))
        outs.append(subprocess.run([sys.executable, "-c", code], env=env, check=True,
                                   capture_output=True, text=True).stdout)
    assert outs[0] == outs[1]
    here = (plan(standard("broadcast", 4, root=2), "ring", count=12, chunks=2).dumps() + "\n"
            + plan(custom_collectives()[0], "direct-push", count=6).dumps() + "\n")
    assert outs[0] == here


# -- capabilities ------------------------------------------------------------------------------


def test_a_datapath_without_reduce_gets_reductions_on_another_engine():
    caps = Capabilities("ce", can_reduce=False, reduce_engine="sm")
    s = plan(standard("all-reduce", 4), "two-phase", count=16, capabilities=caps)
    engines = {(st.op == "copy", st.engine) for st in data_steps(s)}
    assert engines == {(True, "ce"), (False, "sm")}
    assert verify(s).ok
    with pytest.raises(PlanError, match="cannot reduce and names no engine"):
        plan(standard("all-reduce", 4), "two-phase", count=16,
             capabilities=Capabilities("ce", can_reduce=False))
    # a copy collective needs no reduce engine
    copy_only = plan(standard("all-gather", 4), "ring", count=16,
                     capabilities=Capabilities("ce", can_reduce=False))
    assert all(st.engine == "" for st in data_steps(copy_only))


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_chunks_and_lanes_must_be_whole_numbers(bad):
    with pytest.raises(PlanError, match="chunks must be a whole number >= 1"):
        plan(standard("all-reduce", 2), count=4, chunks=bad)
    with pytest.raises(PlanError, match="lanes must be a whole number >= 1"):
        plan(standard("all-reduce", 2), count=4, lanes=bad)


def test_unknown_strategy_is_refused_with_the_registered_names():
    with pytest.raises(PlanError, match="unknown strategy 'tree'; registered: direct-push, "
                                        "direct-pull, two-phase, push-pull, ring"):
        plan(standard("all-reduce", 2), "tree", count=4)


def test_every_stage_is_a_push_or_local_and_every_consume_waits():
    s = planned("all-to-all", "direct-push", 4, chunks=2)
    kinds = s.summary()["steps"]
    assert kinds["stage"] + kinds["consume"] + kinds["notify"] == sum(map(len, s.steps))
    for steps in s.steps:
        for st in steps:
            if isinstance(st, Stage):
                assert not st.waits
            if isinstance(st, Consume):
                assert st.waits or not st.moves_data
