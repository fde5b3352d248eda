"""Measured timelines: cpu records, GPU trace buffers (synthetic, built from the lowered
tables) and the clock-offset arithmetic of the flag ping-pong."""

from types import SimpleNamespace

import numpy as np
import pytest

from purlin.atom.lowering import lower
from purlin.errors import ExecutionError, SpecError
from purlin.kernels import isa
from purlin.runtime import Cluster
from purlin.snac import plan
from purlin.spec import collectives
from purlin.trace import (ClockOffset, Clocks, align_clocks, from_cpu, from_sm,
                          from_sm_records, measure_clocks, offset_from_samples, ping_pong,
                          predict)
from purlin.trace.profiles import Profile

TOY = Profile("toy", link_bandwidth=1e9, alpha_ns=1000.0, step_ns=10.0)


# -- cpu --------------------------------------------------------------------------------------


def test_from_cpu_of_a_bound_collective():
    b = Cluster.cpu(4).bind(collectives.all_reduce(4), "two-phase", count=64, chunks=2,
                            lanes=2, dtype="float64")
    with pytest.raises(ExecutionError, match="trace=True"):
        from_cpu(b)
    b([np.ones(64)] * 4, trace=True)
    t = from_cpu(b)
    assert len(t) == len(b.last_trace) and t.start_ns == 0 and t.check() == []
    assert {e.engine for e in t} == {"cpu"} and t.meta["zero_ns"] > 0
    assert {e.row for e in t} == {(r, lane) for r in range(4) for lane in range(2)}


# -- clocks -----------------------------------------------------------------------------------


def test_offset_from_samples_brackets_the_true_offset():
    rng = np.random.default_rng(0)
    true = 123_456.7
    t_send = np.cumsum(rng.uniform(1000, 2000, 64))
    there = rng.uniform(300, 900, 64)   # flag flight time to the device
    back = rng.uniform(300, 900, 64)    # and back
    t_remote = t_send + there + true
    t_back = t_send + there + back
    est = offset_from_samples(t_send, t_remote, t_back)
    assert abs(est.offset_ns - true) <= est.uncertainty_ns + 1e-6
    assert est.uncertainty_ns < 400 and est.samples == 64
    # every round's interval contains the truth, so the intersection is never empty
    assert np.all(t_remote - t_back <= true) and np.all(true <= t_remote - t_send)


def test_offset_from_samples_falls_back_to_the_fastest_round():
    # a bad remote stamp makes the intervals disjoint: the shortest round trip decides
    est = offset_from_samples([0, 1000], [5050, 9000], [100, 1400])
    assert est == ClockOffset(5000.0, 50.0, 2)
    with pytest.raises(SpecError, match="came back before it was sent"):
        offset_from_samples([10], [5], [0])
    with pytest.raises(SpecError, match="one send, remote and back stamp"):
        offset_from_samples([0, 1], [0], [0])


def test_ping_pong_with_two_clock_callables():
    now = [0.0]

    def ping():  # the reference GPU's clock; every read takes 700 ns of host time
        now[0] += 700
        return now[0]

    def pong():  # the other GPU's clock runs 2.5 ms ahead
        now[0] += 700
        return now[0] + 2_500_000

    est = ping_pong(ping, pong, rounds=8)
    assert abs(est.offset_ns - 2_500_000) <= est.uncertainty_ns
    assert est.uncertainty_ns == pytest.approx(700)


def test_align_clocks_re_references_and_adds_uncertainties():
    c = align_clocks({0: 0.0, 1: (1500.0, 40.0), 2: ClockOffset(-300.0, 25.0)})
    assert c.reference == 0 and c.offset_ns(1) == 1500.0 and c.uncertainty_ns(2) == 25.0
    c1 = align_clocks(c, reference=1)
    assert (c1.offset_ns(0), c1.uncertainty_ns(0)) == (-1500.0, 40.0)
    assert (c1.offset_ns(2), c1.uncertainty_ns(2)) == (-1800.0, 65.0)
    with pytest.raises(SpecError, match="no clock offset for GPU 7"):
        c.offset_ns(7)
    with pytest.raises(SpecError, match="clock offset of GPU 1"):
        align_clocks({1: "soon"})


def test_measure_clocks_runs_the_pair_hook_per_device():
    true = {1: 4000.0, 2: -9000.0}
    calls = []

    def measure_pair(ref, dev):
        calls.append((ref, dev))
        t_send = np.arange(4) * 10_000.0
        return t_send, t_send + 400 + true[dev], t_send + 800

    clocks = measure_clocks(measure_pair, [0, 1, 2, 1])
    assert calls == [(0, 1), (0, 2)]
    assert clocks.offset_ns(1) == pytest.approx(4000) and clocks.uncertainty_ns(2) == 400
    assert clocks.offset_ns(0) == 0


# -- GPU trace buffers ------------------------------------------------------------------------


def _lowered(schedule, bpl):
    # the output buffers sit 4 bytes off 16-byte alignment, so steps that reread what their
    # lane wrote keep their lane barriers (aligned steps on the same region need none)
    bases = {(r, b): ((1 + 3 * r + i) << 24) + (4 if b == "output" else 0)
             for r in range(schedule.nranks)
             for i, b in enumerate(("input", "output", "scratch"))}
    return lower(schedule, bases, {r: (100 + r) << 24 for r in range(schedule.nranks)},
                 blocks_per_lane=bpl)


def _gpu_trace(schedule, timeline, lowered, bpl, clock_ns, jitter=7, spare_rows=3):
    """What the executor would write if it ran like ``timeline``: per block, one record per
    table row of its lane, stamped with the device's clock ``clock_ns[r]`` (ns added to the
    true time). Several WAIT rows of a step share its wait span; a lane barrier takes no time
    just before the step it guards (a data step, or a flag's second notify). Block ``sub``
    runs ``jitter * sub`` ns late."""
    spans = {(e.rank, e.step, e.kind): e for e in timeline}
    traces = []
    for r, low in enumerate(lowered):
        table, offsets = low.tables[0], low.lane_offsets
        rows = int(np.diff(offsets).max()) + spare_rows  # unused rows stay zero
        rec = np.zeros(((len(offsets) - 1) * bpl, rows, isa.TRACE_WIDTH), dtype=np.int64)
        for lane in range(len(offsets) - 1):
            for sub in range(bpl):
                for i, row in enumerate(range(offsets[lane], offsets[lane + 1])):
                    op, step, peer = table[row, isa.OP], table[row, isa.STEP], table[row, isa.PEER]
                    if op in (isa.NOTIFY, isa.WAIT) and peer < 0:  # lane barrier
                        nxt = spans.get((r, step, "wait")) or spans.get((r, step, "consume")) \
                            or spans.get((r, step, "notify")) or spans[(r, step, "stage")]
                        start = end = nxt.start_ns
                    else:
                        kind = {isa.NOTIFY: "notify", isa.WAIT: "wait"}.get(op)
                        e = spans.get((r, step, kind)) if kind else \
                            spans.get((r, step, "consume")) or spans[(r, step, "stage")]
                        start, end = e.start_ns, e.end_ns
                    shift = clock_ns[r] + jitter * sub
                    rec[lane * bpl + sub, i] = (row, sub, round(start) + shift,
                                                round(end) + shift)
        traces.append(rec)
    return traces


@pytest.mark.parametrize("name,strategy,bpl", [("all-reduce", "ring", 2),
                                               ("all-reduce", "two-phase", 1),
                                               ("all-to-all", "direct-pull", 2)])
def test_from_sm_records_aligns_clocks_and_recovers_the_timeline(name, strategy, bpl):
    s = plan(collectives.standard(name, 4), strategy, count=64, dtype="float32", chunks=2,
             lanes=2)
    truth = predict(s, TOY)
    lowered = _lowered(s, bpl)
    devices = [0, 1, 2, 3]
    clock = {0: 10**12, 1: 10**12 + 5_000_000, 2: 10**12 - 3_000_000, 3: 10**12 + 777}
    traces = _gpu_trace(s, truth, lowered, bpl, [clock[d] for d in devices])
    clocks = align_clocks({d: (clock[d] - clock[0], 30.0 if d else 0.0) for d in devices})
    t = from_sm_records(s, lowered, traces, bpl, devices=devices, clocks=clocks)
    assert t.meta["max_clock_uncertainty_ns"] == 30.0 and t.meta["truncated"] is False
    assert t.meta["clock_uncertainty_ns"] == {0: 0.0, 1: 30.0, 2: 30.0, 3: 30.0}
    assert {e.source for e in t} == {"measured-gpu"} and {e.block for e in t} == set(range(bpl))
    first = {(e.rank, e.step, e.kind): e for e in t if e.block == 0 and e.kind != "barrier"}
    want = {(e.rank, e.step, e.kind): e for e in truth}
    assert first.keys() == want.keys()
    for key, e in first.items():
        assert (e.start_ns, e.end_ns) == (round(want[key].start_ns), round(want[key].end_ns))
        assert (e.bytes, e.names, e.peer) == (want[key].bytes, want[key].names, want[key].peer)
    assert t.check(tolerance_ns=1.0) == []
    barriers = [e for e in t if e.kind == "barrier"]
    pairs = sum(int(np.sum((low.tables[0][:, isa.OP] == isa.NOTIFY)
                           & (low.tables[0][:, isa.PEER] < 0))) for low in lowered)
    assert len(barriers) == pairs * bpl
    if (name, strategy, bpl) == ("all-reduce", "ring", 2):
        assert pairs > 0  # the ring reduces into scratch and forwards it: barriers needed
    assert all(e.peer is None and e.bytes == 0 for e in barriers)
    assert len(from_sm_records(s, lowered, traces, bpl, devices=devices, clocks=clocks,
                               barriers=False)) == len(t) - len(barriers)
    # flows pair each block's wait with the notify that released it
    assert len(t.flows()) == bpl * len(truth.flows())


def test_from_sm_without_offsets_warns_that_gpus_disagree():
    s = plan(collectives.all_gather(2), "direct-push", count=8)
    truth = predict(s, TOY)
    lowered = _lowered(s, 1)
    traces = _gpu_trace(s, truth, lowered, 1, [1000, 1000])
    two = from_sm_records(s, lowered, traces, 1, devices=[0, 1])
    assert two.meta["max_clock_uncertainty_ns"] == float("inf") and "warning" in two.meta
    one = from_sm_records(s, lowered, traces, 1, devices=[0, 0])  # a virtual cluster
    assert one.meta["max_clock_uncertainty_ns"] == 0.0 and one.check() == []


def test_from_sm_reads_a_bound_collective_and_marks_truncated_traces():
    s = plan(collectives.all_reduce(2), "ring", count=16, chunks=2)
    truth = predict(s, TOY)
    lowered = _lowered(s, 1)
    traces = _gpu_trace(s, truth, lowered, 1, [0, 0], spare_rows=0)
    short = [t[:, :3] for t in traces]  # the kernel records only trace_rows rows per block
    bound = SimpleNamespace(schedule=s, lowered=lowered, blocks_per_lane=1, devices=(0, 0),
                            trace_rows=3, read_trace=lambda: short)
    t = from_sm(bound)
    assert t.meta["truncated"] is True and len(t) > 0 and t.check() == []
    bound.trace_rows = 0
    with pytest.raises(ExecutionError, match="trace_rows"):
        from_sm(bound)
    empty = SimpleNamespace(**{**bound.__dict__, "trace_rows": 4,
                               "read_trace": lambda: [np.zeros_like(x) for x in short]})
    with pytest.raises(ExecutionError, match="no records"):
        from_sm(empty)


def test_clocks_json_is_plain():
    c = Clocks({0: ClockOffset(0.0), 1: ClockOffset(12.5, 3.0, 16)}, reference=0)
    assert c.to_json() == {"reference": 0, "offsets": {
        "0": {"offset_ns": 0.0, "uncertainty_ns": 0.0, "samples": 0},
        "1": {"offset_ns": 12.5, "uncertainty_ns": 3.0, "samples": 16}}}
