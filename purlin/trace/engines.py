"""Which engine ran each step: timelines labelled for datapaths that mix engines.

On the ce datapath copies run on copy engines and reductions on SMs; a predicted timeline of
such a schedule carries the engine of every event.

>>> from purlin.atom.ce import CAPABILITIES
>>> from purlin.spec import collectives
>>> from purlin.snac import plan
>>> s = plan(collectives.all_reduce(2), "direct-push", count=64, capabilities=CAPABILITIES)
>>> sorted({(e.kind, e.engine) for e in predict_on_ce(s).events})
[('consume', 'sm'), ('notify', 'ce'), ('stage', 'ce'), ('wait', 'sm')]
"""

from __future__ import annotations

from dataclasses import replace

from purlin.atom.ce_lowering import assign_engines
from purlin.errors import ExecutionError
from purlin.trace.events import Timeline
from purlin.trace.model import predict


def label_engines(timeline: Timeline) -> Timeline:
    """The timeline with every event's ``engine`` set to the engine that runs its step on the
    ce datapath (copies ``ce``, reductions ``sm``, notifies and waits as their lane's data)."""
    if timeline.schedule is None:
        raise ExecutionError("label_engines needs a timeline that carries its schedule")
    engines = assign_engines(timeline.schedule)
    events = tuple(replace(e, engine=engines[e.rank][e.step]) for e in timeline.events)
    return replace(timeline, events=events, meta={**dict(timeline.meta), "datapath": "ce"})


def predict_on_ce(schedule, profile="H200", *, label: str | None = None) -> Timeline:
    """The cost model's timeline of ``schedule`` with engines labelled as the ce datapath
    runs it (see :func:`label_engines`)."""
    timeline = predict(schedule, profile, label=label)
    return label_engines(replace(timeline, label=label or f"{timeline.label} ce"))
