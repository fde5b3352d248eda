"""Which engine ran each step, in the ce datapath's predicted timeline."""

import pytest

from purlin.atom.ce import CAPABILITIES
from purlin.trace.engines import label_engines
from purlin.trace.engines import predict_on_ce as predict
from purlin.errors import ExecutionError
from purlin.snac import plan
from purlin.spec import collectives
from purlin.trace import Timeline
from purlin.trace.model import predict as model_predict


def test_predicted_timeline_labels_every_event_with_its_engine():
    s = plan(collectives.all_reduce(2), "two-phase", nbytes=1 << 20, dtype="bfloat16",
             chunks=2, lanes=2, capabilities=CAPABILITIES)
    t = predict(s, "H200")
    assert t.meta["datapath"] == "ce" and t.label.endswith("ce")
    assert t.check() == []
    for e in t.events:
        step = s.steps[e.rank][e.step]
        if e.kind == "consume" and step.op == "sum":
            assert e.engine == "sm"
        elif e.kind == "stage":
            assert e.engine == "ce"
    kinds = {(e.kind, e.engine) for e in t.events}
    assert ("notify", "ce") in kinds and ("wait", "sm") in kinds and ("wait", "ce") in kinds
    # same timing as the cost model: only the labels differ
    plain = model_predict(s, "H200")
    assert [(e.start_ns, e.end_ns) for e in t.events] == \
        [(e.start_ns, e.end_ns) for e in plain.events]


def test_copy_collectives_run_on_copy_engines_only():
    s = plan(collectives.all_gather(4), "ring", nbytes=1 << 20, capabilities=CAPABILITIES)
    assert {e.engine for e in predict(s).events} == {"ce"}


def test_labels_survive_json_and_need_a_schedule():
    s = plan(collectives.all_reduce(2), "direct-push", count=64, capabilities=CAPABILITIES)
    t = predict(s)
    again = Timeline.from_json(t.to_json())
    assert [e.engine for e in again.events] == [e.engine for e in t.events]
    with pytest.raises(ExecutionError, match="schedule"):
        label_engines(Timeline(t.events))
