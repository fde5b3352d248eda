"""A strategy written by a user, the way ARCHITECTURE.md ("Add a strategy") says: registered from
this file with ``@purlin.snac.strategy``, planned, verified, run on the cpu datapath and lowered
to instruction tables that the host interpreter runs (the sm datapath's tables, on the CPU), each
against the reference; broken and malformed ones refused with the strategy, rank, slot or step
named; names registered once."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import purlin
from purlin import Cluster, PlanError, VerificationError, collectives, reference
from purlin.snac import (INTO_OUTPUT, STRATEGIES, Consume, Node, Piece, Stage, strategy,
                         unregister, verify)
from purlin.snac.strategies import check_route

NAME = "test-recursive-doubling"


def _power_of_two_all_reduce(collective) -> str | None:
    n = collective.nranks
    if collective.name != "all-reduce":
        return f"it is written for all-reduce, not {collective.name}"
    if n & (n - 1):
        return f"it pairs rank r with r xor 2^k, so the rank count must be a power of two, not {n}"
    return None


def recursive_doubling(piece: Piece, *, drop_last_partner=False) -> list[Node]:
    """Step k: every rank adds its partner's (r xor 2^k) partial to its own."""
    n = piece.nranks
    nodes = [Node(r, own=piece.input(r)) for r in range(n)]          # 0..n-1: inputs to send
    last = {}
    for r in range(n):                                                # step 0: input + partner's
        last[r] = len(nodes)
        nodes.append(Node(r, own=piece.input(r), preds=[r ^ 1],
                          outputs=piece.outputs(r) if n == 2 else []))
    d = 2
    while d < n:
        final = 2 * d == n
        step = {}
        for r in range(n):
            preds = [last[r]] if final and drop_last_partner else [last[r], last[r ^ d]]
            step[r] = len(nodes)
            nodes.append(Node(r, preds=preds, outputs=piece.outputs(r) if final else []))
        last, d = step, 2 * d
    return nodes


@pytest.fixture(autouse=True, scope="module")
def registered():
    """Registered for this file's tests only: other files (``auto``'s candidates) never see it."""
    strategy(NAME, check=_power_of_two_all_reduce)(recursive_doubling)
    yield
    unregister(NAME)


def _inputs(sizing, seed=0, dtype="float32"):
    """Integer-valued inputs: exact in float32 whatever the order of the sum."""
    gen = np.random.default_rng(seed)
    return [gen.integers(-40, 40, sizing.input_count(r)).astype(dtype)
            for r in range(sizing.collective.nranks)]


# -- planned, verified, run --------------------------------------------------------------------
@pytest.mark.parametrize("n", [2, 4, 8])
def test_plan_verifies_with_log2_steps_per_rank(n):
    s = purlin.plan(collectives.all_reduce(n), NAME, count=16 * n)
    report = verify(s)
    assert report.ok, str(report)
    assert s.strategy == NAME
    steps = n.bit_length() - 1
    for r in range(n):
        reductions = [st for st in s.steps[r] if st.moves_data and st.op == "sum"]
        assert len(reductions) == steps, r              # one reduction per doubling step
    # bytes only ever cross between partners r and r xor 2^k
    partners = {(r, r ^ (1 << k)) for r in range(n) for k in range(steps)}
    assert set(s.summary()["link_bytes"]) == partners


@pytest.mark.parametrize("chunks,lanes", [(1, 1), (2, 2), (3, 1)])
@pytest.mark.parametrize("n", [2, 4, 8])
def test_runs_on_the_cpu_datapath_like_the_reference(n, chunks, lanes):
    coll = collectives.all_reduce(n)
    bound = Cluster.cpu(n).bind(coll, NAME, count=12 * n, chunks=chunks, lanes=lanes)
    for call in range(2):  # back to back: scratch reuse across calls
        x = _inputs(bound.schedule.sizing, seed=call)
        out = bound(x)
        for r, want in enumerate(reference(bound.schedule.sizing, x)):
            np.testing.assert_array_equal(out[r], want, err_msg=f"call {call} rank {r}")


@pytest.mark.parametrize("ll", [False, True], ids=["simple", "ll"])
@pytest.mark.parametrize("n", [2, 4, 8])
def test_lowered_tables_run_on_the_host_interpreter(n, ll):
    from purlin.atom.host import HostBuffers, run_calls

    s = purlin.plan(collectives.all_reduce(n), NAME, count=8 * n, chunks=2, lanes=2)
    bufs = HostBuffers(s, ll=ll)
    xs = [_inputs(s.sizing, seed=c, dtype=np.float64) for c in range(3)]
    outs = run_calls(bufs.lower(), bufs, xs)
    for call in range(3):
        for r, want in enumerate(reference(s.sizing, xs[call])):
            np.testing.assert_array_equal(outs[call][r], want, err_msg=f"call {call} rank {r}")


def test_avg_divides_once_by_the_rank_count():
    coll = collectives.all_reduce(4, op="avg")
    bound = Cluster.cpu(4).bind(coll, NAME, count=16)
    x = _inputs(bound.schedule.sizing)
    for got, want in zip(bound(x), reference(bound.schedule.sizing, x)):
        np.testing.assert_allclose(got, want, rtol=1e-6)


@pytest.mark.parametrize("n", [3, 6])
def test_rank_counts_it_cannot_pair_are_refused_by_name(n):
    coll = collectives.all_reduce(n)
    with pytest.raises(PlanError, match=rf"strategy '{NAME}' cannot plan all-reduce on {n} "
                                        r"ranks: .*power of two, not " + str(n)):
        purlin.plan(coll, NAME, count=12 * n)
    with pytest.raises(PlanError, match="power of two"):
        Cluster.cpu(n).bind(coll, NAME, count=12 * n)


def test_other_collectives_are_refused_and_auto_skips_it():
    from purlin.runtime.auto import strategies_for

    with pytest.raises(PlanError, match="written for all-reduce, not all-gather"):
        purlin.plan(collectives.all_gather(4), NAME, count=8)
    assert NAME in strategies_for(collectives.all_reduce(4))
    assert NAME not in strategies_for(collectives.all_reduce(3))
    assert NAME not in strategies_for(collectives.all_gather(4))


def test_every_piece_is_handed_over_once_with_its_part_and_chunk():
    seen = []

    @strategy("test-recording", owners=True)
    def recording(piece: Piece) -> list[Node]:
        seen.append(piece)
        return recursive_doubling(piece)

    try:
        purlin.plan(collectives.all_reduce(4), "test-recording", count=48, chunks=3)
    finally:
        unregister("test-recording")
    assert [(p.part, p.chunk) for p in seen] == [(a, b) for a in range(4) for b in range(3)]
    assert {(p.parts, p.chunks, p.count) for p in seen} == {(4, 3, 4)}
    assert [p.start for p in seen] == list(range(0, 48, 4))      # contiguous, in order
    assert [p.owner for p in seen] == [a for a in range(4) for _ in range(3)]
    assert seen[0].names == (0,) and seen[-1].names == (3,) and seen[0].op == "sum"


# -- broken: the verifier names the step -------------------------------------------------------
def _edit(schedule, rank, change):
    steps = [list(r) for r in schedule.steps]
    change(steps[rank])
    return dataclasses.replace(schedule, steps=tuple(tuple(r) for r in steps))


def test_two_ranks_waiting_on_each_other_is_a_deadlock_named_by_step():
    good = purlin.plan(collectives.all_reduce(2), NAME, count=8)

    def wait_first(steps):  # consume the partner's value before sending ours
        at = next(i for i, st in enumerate(steps) if isinstance(st, Consume) and st.waits)
        steps.insert(0, steps.pop(at))

    broken = _edit(_edit(good, 0, wait_first), 1, wait_first)
    report = verify(broken)
    assert not report.ok
    (message,) = report.errors
    assert message.startswith("deadlock: ")
    assert "rank 0 step 0" in message and "rank 1 step 0" in message
    assert "from rank 1 lane 0" in message and "from rank 0 lane 0" in message
    with pytest.raises(VerificationError, match="deadlock: rank 0 step 0"):
        verify(broken, raise_on_error=True)


def test_a_consume_that_does_not_wait_is_a_race_named_by_step():
    good = purlin.plan(collectives.all_reduce(4), NAME, count=8)
    at = next(i for i, st in enumerate(good.steps[2]) if isinstance(st, Consume) and st.waits)

    def no_wait(steps):
        steps[at] = Stage(*(getattr(steps[at], f) for f in ("rank", "lane", "op", "srcs", "dst",
                                                          "names", "engine")))

    report = verify(_edit(good, 2, no_wait))
    assert not report.ok and report.races
    assert any(f"rank 2 step {at}" in r.message for r in report.races), \
        [r.message for r in report.races]


def test_a_dropped_hop_is_refused_before_planning_naming_slot_and_ranks():
    name = "test-rd-without-last-partner"
    strategy(name, check=_power_of_two_all_reduce)(
        lambda piece: recursive_doubling(piece, drop_last_partner=True))
    try:
        with pytest.raises(PlanError) as err:
            purlin.plan(collectives.all_reduce(4), name, count=8)
        msg = str(err.value)
        assert msg.startswith(f"strategy '{name}', all-reduce piece of chunk(s)")
        assert "rank 0's output slot r0.output[0:8]" in msg
        assert "misses the input of rank(s) 2, 3" in msg
    finally:
        unregister(name)


# -- malformed routes --------------------------------------------------------------------------
def _piece(coll=None, count=8):
    from purlin.snac.segments import segments

    coll = coll or collectives.all_reduce(4)
    (seg,) = segments(coll.sized(count))
    return Piece(coll, seg, 0, count)


def _refused(nodes, match, piece=None):
    with pytest.raises(PlanError, match=match):
        check_route("mine", piece or _piece(), nodes)


def test_malformed_routes_are_refused_naming_what_is_wrong():
    p = _piece()
    good = recursive_doubling(p)
    assert check_route("mine", p, good) == good
    _refused(None, r"strategy 'mine', .*returns a non-empty list of Node, got None")
    _refused([], "returns a non-empty list of Node")
    _refused([(0, None)], r"node 0 is a tuple, not a Node")
    hop_out = good[:4] + [Node(4, own=p.input(0))] + good[4:]
    _refused(hop_out, r"node 4 is on rank 4, which is not a rank of this 4-rank collective")
    _refused([Node(0, preds=[1], outputs=p.outputs(0)), Node(1, own=p.input(1))],
             r"node 0 \(rank 0\) lists predecessor 1, which is not an earlier node")
    no_end = [dataclasses.replace(nd, outputs=[]) if nd.rank == 3 else nd for nd in good]
    _refused(no_end, r"rank 3's output slot r3.output\[0:8\] is never written: the route does "
                     r"not reach its destination")
    wrong_slot = [dataclasses.replace(nd, outputs=p.outputs(2)) if nd.outputs and nd.rank == 3
                  else nd for nd in good]
    _refused(wrong_slot, r"node \d+ \(rank 3\) writes r2.output\[0:8\], which is not an output "
                         r"slot of this piece on rank 3")
    twice = good + [Node(0, own=p.input(0), outputs=p.outputs(0))]
    _refused(twice, r"output slot r0.output\[0:8\] is written by node 8 and node 12; each slot "
                    "is written once")
    alone = [Node(h, own=p.input(h), outputs=p.outputs(h)) for h in range(4)]
    _refused(alone, r"rank 0's output slot r0.output\[0:8\], written by node 0 \(rank 0\), "
                    r"misses the input of rank\(s\) 1, 2, 3: a reduction needs every source once")
    _refused([Node(0, own=p.input(1))], r"node 0 \(rank 0\) reads r1.input\[0:8\]; rank 0's "
                                        r"input of this piece is r0.input\[0:8\]")
    _refused([Node(0, outputs=p.outputs(0))], "has neither predecessors nor its own input")
    _refused([Node(0, own=p.input(0), incoming="push")], "incoming='push'; use SCRATCH")
    dead = good + [Node(1, own=p.input(1))]
    _refused(dead, r"node \d+ \(rank 1\) leads nowhere")
    double = [Node(r, own=p.input(r)) for r in range(4)]
    double += [Node(h, own=p.input(h), preds=[0, 1, 2, 3], outputs=p.outputs(h)) for h in range(4)]
    _refused(double, r"rank 0's output slot r0.output\[0:8\], written by node 4 \(rank 0\), "
                     r"counts the input of rank\(s\) 0 more than once")
    into = [Node(0, own=p.input(0)), Node(1, own=p.input(1), preds=[0], incoming=INTO_OUTPUT)]
    _refused(into, "receives INTO_OUTPUT, which needs exactly one predecessor and an output")


def test_copy_routes_forward_one_value_and_own_inputs_must_exist():
    gather = collectives.all_gather(2)
    from purlin.snac.segments import segments

    seg = segments(gather.sized(4))[0]          # chunk 0: source rank 0, held by both
    p = Piece(gather, seg, 0, 2)
    _refused([Node(1, own=p.input(0))], r"node 0 \(rank 1\) reads own input r0.input\[0:2\], but "
             "rank 1 holds no input of this piece; its sources are ranks 0", piece=p)
    with pytest.raises(PlanError, match="rank 1 holds no input of chunk"):
        p.input(1)
    two = [Node(0, own=p.input(0)), Node(1, own=p.input(0), preds=[0])]
    _refused(two, "rank 1 holds no input of this piece", piece=p)
    merged = [Node(0, own=p.input(0)), Node(0, own=p.input(0), preds=[0], outputs=p.outputs(0))]
    _refused(merged, "combines 2 values, but all-gather copies", piece=p)


def test_a_strategy_that_raises_a_plan_error_is_named_in_it():
    name = "test-refusing-inside"

    @strategy(name)
    def refusing(piece):
        return [Node(0, own=piece.input(5))]

    try:
        with pytest.raises(PlanError, match=rf"strategy '{name}': rank 5 holds no input"):
            purlin.plan(collectives.all_reduce(2), name, count=4)
    finally:
        unregister(name)


# -- registration rules ------------------------------------------------------------------------
def test_a_name_is_registered_once():
    assert STRATEGIES[NAME].fn is recursive_doubling and not STRATEGIES[NAME].builtin

    def other(piece):
        return recursive_doubling(piece)

    with pytest.raises(PlanError, match=rf"strategy '{NAME}' is already registered \(by "
                                        r"test_user_strategy.recursive_doubling\); pick another "
                                        r"name, or pass replace=True"):
        strategy(NAME)(other)
    strategy(NAME, check=_power_of_two_all_reduce)(recursive_doubling)  # a re-run cell: fine
    assert STRATEGIES[NAME].fn is recursive_doubling
    strategy("test-lambda")(lambda piece: recursive_doubling(piece))
    try:
        with pytest.raises(PlanError, match="'test-lambda' is already registered"):
            strategy("test-lambda")(lambda piece: recursive_doubling(piece))
    finally:
        unregister("test-lambda")


def test_built_ins_and_auto_cannot_be_taken():
    for name in ("direct-push", "ring", "two-phase"):
        with pytest.raises(PlanError, match=f"strategy '{name}' is built in and cannot be "
                                            "replaced"):
            strategy(name, replace=True)(recursive_doubling)
        with pytest.raises(PlanError, match="built in and cannot be removed"):
            unregister(name)
    with pytest.raises(PlanError, match="'auto' is reserved"):
        strategy("auto")
    with pytest.raises(PlanError, match="non-empty string"):
        strategy(" spaced ")
    with pytest.raises(PlanError, match="no strategy 'never-registered' is registered"):
        unregister("never-registered")
    with pytest.raises(PlanError, match="unknown strategy 'never-registered'; registered: "
                                        ".*" + NAME):
        purlin.plan(collectives.all_reduce(2), "never-registered")


def test_replacing_a_strategy_replans_with_the_new_one():
    name = "test-replaced"
    coll = collectives.all_reduce(4)
    strategy(name)(recursive_doubling)
    try:
        first = purlin.plan(coll, name, count=8)
        assert first.summary()["remote_hops"] != 6

        def star(piece):  # everything to rank 0, then out again: 6 hops
            leaves = [Node(s, own=piece.input(s)) for s in (1, 2, 3)]
            hub = Node(0, own=piece.input(0), preds=[0, 1, 2], outputs=piece.outputs(0))
            return leaves + [hub] + [Node(h, preds=[3], outputs=piece.outputs(h))
                                     for h in (1, 2, 3)]

        strategy(name, replace=True)(star)
        second = purlin.plan(coll, name, count=8)  # not the cached plan of the old function
        assert second.summary()["remote_hops"] == 6 and verify(second).ok
    finally:
        unregister(name)
    assert name not in STRATEGIES
    with pytest.raises(PlanError, match=f"unknown strategy '{name}'"):
        purlin.plan(coll, name, count=8)


def test_auto_forgets_its_cached_choices_when_the_registry_changes():
    from purlin.runtime import auto

    sizing = collectives.all_reduce(4).sized(1024)
    auto.model_choice(sizing)
    assert auto.model_choice.cache_info().currsize > 0
    strategy("test-new-candidate")(recursive_doubling)
    assert auto.model_choice.cache_info().currsize == 0  # the new candidate is ranked next time
    assert "test-new-candidate" in auto.strategies_for(sizing.collective)
    auto.model_choice(sizing)
    unregister("test-new-candidate")
    assert auto.model_choice.cache_info().currsize == 0
