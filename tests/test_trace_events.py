"""Event streams of every standard collective and strategy, predicted and cpu-measured, are
consistent: every released wait/consume comes after its notify, lanes never overlap
themselves, and every step of the schedule shows up."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from purlin.runtime import run
from purlin.snac.ir import Consume, Notify, Stage
from purlin.spec import STANDARD, standard
from purlin.snac import plan
from purlin.trace import Timeline, from_cpu, predict
from purlin.trace.profiles import Profile

N = 4
CASES = [(name, strategy) for name in STANDARD
         for strategy in ("direct-push", "direct-pull", "two-phase", "ring")
         if strategy != "two-phase" or standard(name, N).op.is_reduce]
PROFILE = Profile("test", link_bandwidth=100e9, alpha_ns=700.0, hbm_bandwidth=1e12,
                  step_ns=20.0, launch_ns=300.0)


def schedule_of(name, strategy, chunks=2, lanes=2):
    return plan(standard(name, N), strategy, count=8 * N, dtype="float64", chunks=chunks,
                lanes=lanes)


def expected_events(schedule) -> dict:
    """(rank, step, kind) -> 1 for every event a step must produce."""
    out = {}
    for r, steps in enumerate(schedule.steps):
        for i, s in enumerate(steps):
            if isinstance(s, Notify):
                out[(r, i, "notify")] = 1
            elif isinstance(s, Stage):
                out[(r, i, "stage")] = 1
            else:
                if s.waits:
                    out[(r, i, "wait")] = 1
                if s.moves_data:
                    out[(r, i, "consume")] = 1
    return out


def released_waits(schedule) -> int:
    return sum(1 for steps in schedule.steps for s in steps if isinstance(s, Consume)
               for w in s.waits if w.call == 0)


@pytest.mark.parametrize("name,strategy", CASES)
def test_predicted_events_are_consistent(name, strategy):
    s = schedule_of(name, strategy)
    t = predict(s, PROFILE)
    assert t.check() == []
    assert {(e.rank, e.step, e.kind): 1 for e in t} == expected_events(s)
    assert len(t.flows()) == released_waits(s)
    for notify, released in t.flows():
        # the wait ends exactly when its last flag lands (or when the lane gets there)
        assert released.end_ns >= notify.end_ns + PROFILE.alpha_ns - 1e-6
        assert notify.kind == "notify" and released.kind in ("wait", "consume")
    for e in t.where(kind="wait"):
        step = s.steps[e.rank][e.step]
        lands = [n.end_ns + PROFILE.alpha_ns for n, r in t.flows() if r == e]
        assert e.end_ns == pytest.approx(max([e.start_ns + PROFILE.step_ns, *lands]))
        assert all(w.call != 0 for w in step.waits) or lands
    assert min(e.start_ns for e in t) == PROFILE.launch_ns
    assert t.meta["latency_ns"] == t.end_ns


@pytest.mark.parametrize("name,strategy", CASES)
def test_cpu_measured_events_are_consistent(name, strategy):
    coll = standard(name, N)
    s = schedule_of(name, strategy)
    sizing = s.sizing
    inputs = [np.arange(sizing.input_count(r), dtype=np.float64) + r for r in range(N)]
    res = run(coll, inputs, strategy=strategy, chunks=2, lanes=2, sizing=sizing, trace=True)
    assert res.schedule == s
    t = from_cpu(res.trace, res.schedule)
    assert t.start_ns == 0 and t.label == "measured (cpu)"
    assert t.check() == []
    assert {(e.rank, e.step, e.kind): 1 for e in t} == expected_events(s)
    assert len(t.flows()) == released_waits(s)
    assert {e.source for e in t} == {"measured-cpu"}


def test_flows_pair_the_v_th_notify_of_a_flag():
    s = plan(standard("all-gather", N), "ring", count=4 * N)
    t = predict(s, PROFILE)
    for notify, released in t.flows():
        step = s.steps[released.rank][released.step]
        note = s.steps[notify.rank][notify.step]
        assert any(w.flag == note.flag and w.value == note.value for w in step.waits)
    # rank 0 waits on rank 3's ring flag for values 1, 2, 3, in that order
    into0 = sorted((r.step, n.step) for n, r in t.flows() if r.rank == 0)
    notifies = [i for i, x in enumerate(s.steps[3]) if isinstance(x, Notify)]
    assert [n for _, n in into0] == notifies


def test_event_fields_come_from_the_schedule():
    s = plan(standard("all-reduce", 2), "direct-push", count=8, dtype="float32")
    t = predict(s, PROFILE)
    stage = t.where(rank=0, kind="stage").events[0]
    step = s.steps[0][stage.step]
    assert stage.bytes == step.dst.count * 4 and stage.names == step.names
    assert stage.peer == 1 and stage.op == "copy" and stage.source == "predicted"
    notify = t.where(rank=0, kind="notify").events[0]
    assert notify.bytes == 0 and notify.names == () and notify.peer == 1


def test_records_dataframe_and_json_round_trip():
    t = predict(schedule_of("all-to-all", "direct-push"), PROFILE)
    recs = t.to_records()
    assert len(recs) == len(t) and {"rank", "lane", "kind", "step", "peer", "bytes", "names",
                                    "start_ns", "end_ns", "source", "block"} <= set(recs[0])
    json.dumps(recs)
    pd = pytest.importorskip("pandas", reason="pandas is needed for to_dataframe")
    df = t.to_dataframe()
    assert isinstance(df, pd.DataFrame) and len(df) == len(t)
    assert df["duration_ns"].min() >= 0
    back = Timeline.from_json(json.loads(json.dumps(t.to_json())))
    assert back == t and back.meta["latency_ns"] == t.meta["latency_ns"]


def test_timeline_extent_and_selection():
    t = predict(schedule_of("all-reduce", "ring"), PROFILE)
    assert t.duration_ns == t.end_ns - t.start_ns > 0
    assert t.rows() == [(r, lane) for r in range(N) for lane in range(2)]
    assert set(t.where(rank=1).rows()) >= {(1, 0), (1, 1)}
    assert all(e.rank == 1 and e.kind == "wait" for e in t.where(rank=1, kind="wait"))
    moved = t.shifted(1000.0)
    assert moved.start_ns == t.start_ns + 1000.0 and moved.duration_ns == t.duration_ns


def test_check_reports_overlaps_and_early_releases():
    from dataclasses import replace

    t = predict(schedule_of("all-gather", "ring", chunks=1, lanes=1), PROFILE)
    e = t.where(rank=0, kind="stage").events[1]
    bad = replace(t, events=t.events + (replace(e, start_ns=e.start_ns + 1, end_ns=e.end_ns + 1),))
    assert any("starts before" in p for p in bad.check())
    notify, released = t.flows()[0]
    early = replace(released, start_ns=0.0, end_ns=notify.start_ns - 5)
    bad = replace(t, events=tuple(x for x in t.events if x != released) + (early,))
    assert any("ends before" in p for p in bad.check())


def test_import_purlin_needs_no_plotting_libraries():
    code = ("import sys, purlin, purlin.trace, purlin.viz; "
            "bad = [m for m in ('plotly', 'pandas', 'ipywidgets') if m in sys.modules]; "
            "print(bad); sys.exit(1 if bad else 0)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 0, proc.stdout + proc.stderr
