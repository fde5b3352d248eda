"""Chrome / Perfetto trace JSON: required fields, names, and flows that pair up."""

import json

import numpy as np
import pytest

from purlin.runtime import run
from purlin.snac import plan
from purlin.spec import collectives
from purlin.trace import from_cpu, predict, to_perfetto
from purlin.trace.events import Event, Timeline


@pytest.fixture(scope="module")
def timeline():
    s = plan(collectives.all_reduce(4), "two-phase", count=64, chunks=2, lanes=2)
    return predict(s, "H100")


def test_slices_have_the_required_fields(timeline):
    trace = to_perfetto(timeline)
    slices = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(slices) == len(timeline)
    for sl, ev in zip(slices, timeline.events):
        assert {"name", "cat", "ph", "pid", "tid", "ts", "dur", "args"} <= set(sl)
        assert (sl["pid"], sl["tid"], sl["cat"]) == (ev.rank, ev.lane, ev.kind)
        assert sl["ts"] == pytest.approx(ev.start_ns / 1e3)
        assert sl["dur"] == pytest.approx(ev.duration_ns / 1e3) and sl["dur"] >= 0
        assert sl["args"]["step"] == ev.step and sl["args"]["bytes"] == ev.bytes


def test_processes_are_ranks_and_threads_are_lanes(timeline):
    meta = [e for e in to_perfetto(timeline)["traceEvents"] if e["ph"] == "M"]
    procs = {e["pid"]: e["args"]["name"] for e in meta if e["name"] == "process_name"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in meta
               if e["name"] == "thread_name"}
    assert procs == {r: f"rank {r}" for r in range(4)}
    assert threads == {(r, lane): f"lane {lane}" for r in range(4) for lane in range(2)}


def test_flows_pair_up_inside_their_slices(timeline):
    events = to_perfetto(timeline)["traceEvents"]
    starts = {e["id"]: e for e in events if e["ph"] == "s"}
    ends = {e["id"]: e for e in events if e["ph"] == "f"}
    assert starts.keys() == ends.keys() and len(starts) == len(timeline.flows()) > 0
    slices = [e for e in events if e["ph"] == "X"]

    def inside(point):
        return any(s["pid"] == point["pid"] and s["tid"] == point["tid"]
                   and s["ts"] <= point["ts"] <= s["ts"] + s["dur"] for s in slices)

    for fid, s in starts.items():
        f = ends[fid]
        assert f["bp"] == "e" and s["cat"] == f["cat"] and s["name"] == f["name"]
        assert s["ts"] <= f["ts"] and inside(s) and inside(f)


def test_written_file_is_json_and_gpu_blocks_get_threads_of_their_own(tmp_path):
    res = run(collectives.all_gather(2), [np.ones(4), np.zeros(4)], trace=True)
    t = from_cpu(res.trace, res.schedule)
    path = tmp_path / "trace.json"
    to_perfetto(t, path)
    loaded = json.loads(path.read_text())
    assert loaded["otherData"]["label"] == "measured (cpu)"
    blocks = Timeline(tuple(Event(0, 1, "stage", 0, 0.0, 10.0, block=b) for b in range(2)))
    meta = [e for e in to_perfetto(blocks)["traceEvents"] if e["name"] == "thread_name"]
    assert {(e["tid"], e["args"]["name"]) for e in meta} == {(1, "lane 1"),
                                                             (1001, "lane 1 block 1")}
