"""Export a Timeline as Chrome / Perfetto trace JSON (open it in ui.perfetto.dev or
chrome://tracing).

Process = rank (``pid`` r, named "rank r"), thread = lane (``tid`` l, named "lane l"; on the
GPU, block b > 0 of lane l is ``tid`` l + 1000 b, "lane l block b"). Each event is an "X"
slice with ``ts``/``dur`` in µs and its step, peer, bytes and names as ``args``; every
Notify → wait/consume dependency is a flow ("s" in the notify's slice, "f" with
``"bp": "e"`` in the slice it releases, one ``id`` per pair).

>>> from purlin.spec import collectives
>>> from purlin.snac import plan
>>> from purlin.trace.model import predict
>>> trace = to_perfetto(predict(plan(collectives.all_gather(2), "ring", count=8)))
>>> sorted({e["ph"] for e in trace["traceEvents"]})
['M', 'X', 'f', 's']
"""

from __future__ import annotations

import json
from pathlib import Path

from purlin.trace.events import Event, Timeline

BLOCK_TID_STRIDE = 1000


def _tid(e: Event) -> int:
    return e.lane + BLOCK_TID_STRIDE * e.block


def to_perfetto(timeline: Timeline, path=None) -> dict:
    """The trace as a dict (``{"traceEvents": [...], ...}``); written as JSON to ``path`` if
    given."""
    from purlin.spec.collective import _fmt

    out: list[dict] = []
    threads = sorted({(e.rank, e.lane, e.block) for e in timeline.events} |
                     {(r, lane, 0) for r, lane in timeline.rows()})
    for rank in sorted({r for r, _, _ in threads}):
        out.append({"ph": "M", "name": "process_name", "pid": rank, "tid": 0,
                    "args": {"name": f"rank {rank}"}})
        out.append({"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0,
                    "args": {"sort_index": rank}})
    for rank, lane, block in threads:
        name = f"lane {lane}" + (f" block {block}" if block else "")
        tid = lane + BLOCK_TID_STRIDE * block
        out.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid,
                    "args": {"name": name}})
        out.append({"ph": "M", "name": "thread_sort_index", "pid": rank, "tid": tid,
                    "args": {"sort_index": tid}})
    for e in timeline.events:
        args = {"step": e.step, "peer": e.peer, "bytes": e.bytes, "source": e.source}
        if e.names:
            args["names"] = ", ".join(_fmt(n) for n in e.names)
        if e.op:
            args["op"] = e.op
        if e.engine:
            args["engine"] = e.engine
        out.append({"ph": "X", "name": _slice_name(e), "cat": e.kind, "pid": e.rank,
                    "tid": _tid(e), "ts": e.start_ns / 1e3, "dur": e.duration_ns / 1e3,
                    "args": args})
    for flow_id, (notify, released) in enumerate(timeline.flows(), start=1):
        common = {"name": "notify", "cat": "flow", "id": flow_id}
        out.append({**common, "ph": "s", "pid": notify.rank, "tid": _tid(notify),
                    "ts": _inside(notify)})
        out.append({**common, "ph": "f", "bp": "e", "pid": released.rank,
                    "tid": _tid(released), "ts": _inside(released)})
    trace = {"traceEvents": out, "displayTimeUnit": "ns",
             "otherData": {"label": timeline.label,
                           "schedule": timeline.schedule.title() if timeline.schedule else ""}}
    if path is not None:
        Path(path).write_text(json.dumps(trace))
    return trace


def _inside(e: Event) -> float:
    """A time (µs) inside the event's slice, so a flow end binds to it."""
    return (e.start_ns + e.end_ns) / 2e3


def _slice_name(e: Event) -> str:
    if e.kind in ("stage", "consume") and e.op:
        return f"{e.kind} {e.op}"
    return e.kind
