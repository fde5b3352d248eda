"""One event record for predicted and measured timelines, and the Timeline that holds them.

An :class:`Event` is one span of one step on one (rank, lane) — and, on the GPU, one thread
block of the lane. A Consume step gives up to two events: ``wait`` (until its flags are
released) and ``consume`` (its copy or reduction); a Stage gives ``stage``, a Notify
``notify``. The GPU executor's lane barriers show up as ``barrier`` events.

>>> from purlin.spec import collectives
>>> from purlin.snac import plan
>>> from purlin.trace.model import predict
>>> t = predict(plan(collectives.all_gather(2), "direct-push", count=4), "H200")
>>> t.events[0]
Event(r0.l0 stage step 0 [0.000, ...] us)
>>> len(t.flows()), t.kinds()
(2, ('stage', 'notify', 'wait', 'consume'))
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Mapping

from purlin.snac.ir import Consume, Notify, Schedule, step_peer
from purlin.spec.layout import name_from_json, name_to_json

KINDS = ("stage", "notify", "wait", "consume", "barrier")


@dataclass(frozen=True)
class Event:
    """``kind`` of schedule step ``step`` (index in ``schedule.steps[rank]``) ran on ``lane`` of
    ``rank`` from ``start_ns`` to ``end_ns``. ``bytes`` is the payload written (the
    destination region), 0 for notify and wait; ``source`` says where the timing comes from
    (predicted, measured-cpu, measured-gpu), ``engine`` which datapath engine ran the step,
    ``block`` which thread block of the lane (GPU; 0 elsewhere)."""

    rank: int
    lane: int
    kind: str
    step: int
    start_ns: float
    end_ns: float
    peer: int | None = None
    bytes: int = 0
    names: tuple = ()
    op: str = ""
    source: str = "predicted"
    engine: str = ""
    block: int = 0

    @property
    def duration_ns(self) -> float:
        return self.end_ns - self.start_ns

    @property
    def row(self) -> tuple[int, int]:
        return (self.rank, self.lane)

    def __repr__(self) -> str:
        block = f".b{self.block}" if self.block else ""
        return (f"Event(r{self.rank}.l{self.lane}{block} {self.kind} step {self.step} "
                f"[{self.start_ns / 1e3:.3f}, {self.end_ns / 1e3:.3f}] us)")

    def to_json(self) -> dict:
        out = asdict(self)
        out["names"] = [name_to_json(n) for n in self.names]
        return out

    @classmethod
    def from_json(cls, obj: dict) -> "Event":
        obj = dict(obj)
        obj["names"] = tuple(name_from_json(n) for n in obj.get("names", ()))
        return cls(**obj)


def step_event(schedule: Schedule, rank: int, index: int, kind: str, start_ns: float,
               end_ns: float, source: str, block: int = 0, engine: str = "") -> Event:
    """An event for step ``index`` of ``rank``, its peer, bytes, names and op filled in from
    the schedule."""
    step = schedule.steps[rank][index]
    data = kind in ("stage", "consume") and step.moves_data
    nbytes = step.dst.count * _itemsize(schedule.dtype) if data else 0
    return Event(rank=rank, lane=step.lane, kind=kind, step=index, start_ns=start_ns,
                 end_ns=end_ns, peer=step_peer(step), bytes=nbytes,
                 names=tuple(getattr(step, "names", ())) if data else (),
                 op=step.op if data else "", source=source,
                 engine=(getattr(step, "engine", "") or engine), block=block)


def _itemsize(dtype: str) -> int:
    from purlin.spec.dtypes import dtype as as_dtype

    return as_dtype(dtype).itemsize


@dataclass(frozen=True)
class Timeline:
    """Events of one call of ``schedule``, with a ``label`` and free-form ``meta`` (the model's
    profile, clock offsets and their uncertainty, ...). Times are ns from the timeline's zero.
    """

    events: tuple[Event, ...]
    schedule: Schedule | None = None
    label: str = ""
    meta: Mapping = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self):
        ordered = tuple(sorted(self.events, key=lambda e: (e.start_ns, e.rank, e.lane,
                                                           e.block, e.step, e.end_ns)))
        object.__setattr__(self, "events", ordered)

    def __len__(self) -> int:
        return len(self.events)

    def __iter__(self):
        return iter(self.events)

    def __repr__(self) -> str:
        return (f"<Timeline {self.label or '(unlabelled)'}: {len(self.events)} events, "
                f"{self.duration_ns / 1e3:.3f} us>")

    # -- extent -----------------------------------------------------------------------------
    @property
    def start_ns(self) -> float:
        return min((e.start_ns for e in self.events), default=0.0)

    @property
    def end_ns(self) -> float:
        return max((e.end_ns for e in self.events), default=0.0)

    @property
    def duration_ns(self) -> float:
        """From the earliest start to the latest end."""
        return self.end_ns - self.start_ns if self.events else 0.0

    def rows(self) -> list[tuple[int, int]]:
        """Every (rank, lane) in order (the rows of a figure); from the schedule if there is
        one, so idle lanes keep their row."""
        rows = {e.row for e in self.events}
        if self.schedule is not None:
            rows |= {(r, s.lane) for r, steps in enumerate(self.schedule.steps) for s in steps}
        return sorted(rows)

    def kinds(self) -> tuple[str, ...]:
        present = {e.kind for e in self.events}
        return tuple(k for k in KINDS if k in present)

    # -- selection --------------------------------------------------------------------------
    def where(self, **match) -> "Timeline":
        """The events whose fields equal the given values, e.g. ``where(rank=0, kind="wait")``."""
        events = [e for e in self.events if all(getattr(e, k) == v for k, v in match.items())]
        return replace(self, events=tuple(events))

    def shifted(self, dt_ns: float) -> "Timeline":
        """Every event moved by ``dt_ns``."""
        return replace(self, events=tuple(replace(e, start_ns=e.start_ns + dt_ns,
                                                  end_ns=e.end_ns + dt_ns)
                                          for e in self.events))

    # -- dependencies -----------------------------------------------------------------------
    def flows(self) -> list[tuple[Event, Event]]:
        """(notify event, event it releases) pairs, from the schedule: a Wait for value v of
        flag f in this call is released by the Notify of f that makes it reach v (the v-th).
        The released event is the Consume's ``wait`` event (its ``consume`` event if it has no
        wait event). With several blocks per lane, each block's wait is paired with the last
        block's notify to finish (the one that released it) -- or, where each block waits only
        for the same block of its peers (``meta["block_matched"]``: the fused kernel), with
        that block's notify. Waits on earlier calls are left out (this timeline holds one
        call)."""
        if self.schedule is None:
            return []
        by_step: dict[tuple[int, int, str], list[Event]] = {}
        for e in self.events:
            by_step.setdefault((e.rank, e.step, e.kind), []).append(e)
        notifier = notify_index(self.schedule)
        pairs = []
        for rank, steps in enumerate(self.schedule.steps):
            for index, step in enumerate(steps):
                if not isinstance(step, Consume) or not step.waits:
                    continue
                released = by_step.get((rank, index, "wait")) or \
                    by_step.get((rank, index, "consume")) or []
                for w in step.waits:
                    if w.call != 0 or (w.flag, w.value) not in notifier:
                        continue
                    notifies = by_step.get((w.flag.src, notifier[(w.flag, w.value)], "notify"))
                    if not notifies:
                        continue
                    if self.meta.get("block_matched"):
                        mine = {e.block: e for e in notifies}
                        pairs.extend((mine[r.block], r) for r in released if r.block in mine)
                        continue
                    last = max(notifies, key=lambda e: e.end_ns)
                    pairs.extend((last, r) for r in released)
        return pairs

    def check(self, tolerance_ns: float = 0.0) -> list[str]:
        """What is inconsistent, one sentence each (empty when all is well): an event that
        ends before it starts, two events of one (rank, lane, block) that overlap (events of
        one span are one op that ran them together: the fused kernel's segmented or joined
        op, a merged wait or notify), a released wait or consume that ends before its notify
        started, or a Consume's data part that starts before its notify started."""
        problems = []
        lanes: dict[tuple, list[Event]] = {}
        for e in self.events:
            if e.end_ns < e.start_ns - tolerance_ns:
                problems.append(f"{e!r} ends before it starts")
            lanes.setdefault((e.rank, e.lane, e.block), []).append(e)
        for key, events in lanes.items():
            events.sort(key=lambda e: (e.start_ns, e.end_ns))
            for a, b in zip(events, events[1:]):
                if (a.start_ns, a.end_ns) == (b.start_ns, b.end_ns):
                    continue
                if b.start_ns < a.end_ns - tolerance_ns:
                    problems.append(f"rank {key[0]} lane {key[1]} block {key[2]}: {b!r} starts "
                                    f"before {a!r} ends")
        consumes = {(e.rank, e.step, e.block): e for e in self.events if e.kind == "consume"}
        for n, r in self.flows():
            if r.end_ns < n.start_ns - tolerance_ns:
                problems.append(f"{r!r} ends before {n!r}, which releases it, starts")
            data = consumes.get((r.rank, r.step, r.block))
            if data is not None and data.start_ns < n.start_ns - tolerance_ns:
                problems.append(f"{data!r} starts before {n!r}, which releases it, starts")
        return problems

    # -- export -----------------------------------------------------------------------------
    def to_records(self) -> list[dict]:
        """One dict per event (names as strings, times in ns and µs), for tables and DataFrames."""
        from purlin.spec.collective import _fmt

        out = []
        for e in self.events:
            rec = asdict(e)
            rec["names"] = ", ".join(_fmt(n) for n in e.names)
            rec["duration_ns"] = e.duration_ns
            rec["start_us"], rec["end_us"] = e.start_ns / 1e3, e.end_ns / 1e3
            out.append(rec)
        return out

    def to_dataframe(self):
        """The events as a pandas DataFrame (pandas imported here, on first use)."""
        import pandas as pd

        columns = [*Event.__dataclass_fields__, "duration_ns", "start_us", "end_us"]
        return pd.DataFrame.from_records(self.to_records(), columns=columns)

    def to_json(self) -> dict:
        return {"label": self.label, "meta": _jsonable(self.meta),
                "schedule": self.schedule.to_json() if self.schedule is not None else None,
                "events": [e.to_json() for e in self.events]}

    @classmethod
    def from_json(cls, obj) -> "Timeline":
        import json

        if isinstance(obj, str):
            obj = json.loads(obj)
        schedule = Schedule.from_json(obj["schedule"]) if obj.get("schedule") else None
        return cls(tuple(Event.from_json(e) for e in obj["events"]), schedule,
                   obj.get("label", ""), dict(obj.get("meta", {})))


def notify_index(schedule: Schedule) -> dict:
    """(flag, value) -> index of the Notify step (on rank ``flag.src``) that makes the flag
    reach ``value`` within a call."""
    out = {}
    for rank, steps in enumerate(schedule.steps):
        for index, step in enumerate(steps):
            if isinstance(step, Notify):
                out[(step.flag, step.value)] = index
    return out


def _jsonable(obj):
    if isinstance(obj, Mapping):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, (str, int, float, bool)) or obj is None:
        return obj
    if hasattr(obj, "to_json"):
        return obj.to_json()
    return repr(obj)

