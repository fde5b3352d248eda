"""Measured timelines: the executors' raw trace records as Timelines, and GPU clock alignment.

* :func:`from_cpu` — the cpu executor's ``(rank, lane, step, kind, start_ns, end_ns)`` tuples
  (``bound(inputs, trace=True)`` then ``bound.last_trace``); zero is the earliest start.
* :func:`from_sm` — the GPU executor's per-block records ``(table row, sub-block, start,
  end)`` in ``%globaltimer`` ns (``Cluster.bind(..., trace_rows=N)``, ``bound.read_trace()``).
  Each GPU has its own clock: pass the offsets of the devices' clocks (:func:`align_clocks`),
  measured with a flag ping-pong (:func:`offset_from_samples`, :func:`ping_pong`); their
  uncertainty goes into the timeline's ``meta``.

>>> import numpy as np
>>> from purlin.runtime import Cluster
>>> from purlin.spec import collectives
>>> ar = Cluster.cpu(2).bind(collectives.all_reduce(2), count=4, dtype="float64")
>>> _ = ar([np.arange(4.0), np.ones(4)], trace=True)
>>> t = from_cpu(ar)
>>> t.start_ns, sorted({e.source for e in t}), t.check()
(0, ['measured-cpu'], [])
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, Mapping, Sequence

import numpy as np

from purlin.errors import ExecutionError, SpecError
from purlin.kernels import isa
from purlin.snac.ir import Consume, Notify, Schedule
from purlin.trace.events import Event, Timeline, step_event

# -- cpu ----------------------------------------------------------------------------------------


def from_cpu(bound_or_records, schedule: Schedule | None = None, *,
             label: str = "measured (cpu)") -> Timeline:
    """A Timeline from a cpu-bound collective's last traced call (or raw records and their
    schedule). Zero is the earliest start."""
    if schedule is None:
        schedule = bound_or_records.schedule
        records = bound_or_records.last_trace
    else:
        records = bound_or_records
    if not records:
        raise ExecutionError("no trace records: run the bound collective with trace=True first")
    zero = min(r[4] for r in records)
    events = tuple(step_event(schedule, rank, index, kind, start - zero, end - zero,
                              "measured-cpu", engine="cpu")
                   for rank, _lane, index, kind, start, end in records)
    return Timeline(events, schedule, label, {"source": "measured-cpu", "zero_ns": zero})


# -- clocks -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ClockOffset:
    """A device's clock minus the reference clock, read at the same instant; the true value
    lies within ``offset_ns ± uncertainty_ns``."""

    offset_ns: float
    uncertainty_ns: float = 0.0
    samples: int = 0

    def to_json(self) -> dict:
        return {"offset_ns": self.offset_ns, "uncertainty_ns": self.uncertainty_ns,
                "samples": self.samples}


@dataclass(frozen=True)
class Clocks:
    """Offsets of every device's clock from the ``reference`` device's (which has 0 ± 0).
    A time stamped on device d is ``t - offset_ns(d)`` on the reference clock."""

    offsets: Mapping[int, ClockOffset] = field(default_factory=dict)
    reference: int = 0

    def offset_ns(self, device: int) -> float:
        return self._get(device).offset_ns

    def uncertainty_ns(self, device: int) -> float:
        return self._get(device).uncertainty_ns

    def _get(self, device: int) -> ClockOffset:
        if device == self.reference:
            return self.offsets.get(device, ClockOffset(0.0))
        if device not in self.offsets:
            raise SpecError(f"no clock offset for GPU {device}; offsets are known for "
                            f"{sorted(self.offsets)} (reference GPU {self.reference})")
        return self.offsets[device]

    def to_json(self) -> dict:
        return {"reference": self.reference,
                "offsets": {str(d): o.to_json() for d, o in sorted(self.offsets.items())}}


def align_clocks(offsets, reference: int | None = None) -> Clocks:
    """Clocks from measured offsets: ``offsets[device]`` is a :class:`ClockOffset`, a number
    (ns, exact) or an ``(offset_ns, uncertainty_ns)`` pair, each relative to one common
    reference device. With ``reference`` given (a device in ``offsets``), the offsets are
    re-expressed relative to it; uncertainties add.

    >>> c = align_clocks({0: 0.0, 1: (1500.0, 40.0), 2: (-300.0, 25.0)}, reference=1)
    >>> c.offset_ns(2), c.uncertainty_ns(2), c.offset_ns(1)
    (-1800.0, 65.0, 0.0)
    """
    if isinstance(offsets, Clocks):
        base, given_ref = dict(offsets.offsets), offsets.reference
    else:
        base, given_ref = {int(d): _as_offset(d, o) for d, o in dict(offsets).items()}, None
    if reference is None:
        reference = given_ref if given_ref is not None else \
            next((d for d, o in base.items() if o.offset_ns == 0 and o.uncertainty_ns == 0),
                 min(base, default=0))
    ref = base.get(reference, ClockOffset(0.0))  # unlisted: the common reference itself
    out = {}
    for d, o in base.items():
        if d == reference:
            out[d] = ClockOffset(0.0, 0.0, o.samples)
        else:
            out[d] = ClockOffset(o.offset_ns - ref.offset_ns,
                                 o.uncertainty_ns + ref.uncertainty_ns, o.samples)
    return Clocks(out, reference)


def _as_offset(device, value) -> ClockOffset:
    if isinstance(value, ClockOffset):
        return value
    if isinstance(value, (int, float, np.integer, np.floating)):
        return ClockOffset(float(value))
    try:
        offset, uncertainty = value
    except (TypeError, ValueError):
        raise SpecError(f"clock offset of GPU {device} must be a ClockOffset, a number of ns "
                        f"or (offset_ns, uncertainty_ns), got {value!r}") from None
    return ClockOffset(float(offset), float(uncertainty))


def offset_from_samples(t_send, t_remote, t_back) -> ClockOffset:
    """The offset of a device's clock from the reference's, from a flag ping-pong.

    Round i: the reference stamps ``t_send[i]`` and raises a flag; the device, seeing it,
    stamps ``t_remote[i]`` (its own clock) and raises its flag; the reference, seeing that,
    stamps ``t_back[i]``. The device's stamp happened between the two reference stamps, so the
    offset lies in ``[t_remote - t_back, t_remote - t_send]`` every round; the answer is the
    middle of the intersection of those intervals and its half width the uncertainty. If the
    intervals do not intersect (a stamp off, or the clocks drift), the round with the shortest
    round trip decides, with half its round trip as the uncertainty.

    >>> offset_from_samples([0, 100], [5010, 5120], [20, 130])
    ClockOffset(offset_ns=5000.0, uncertainty_ns=10.0, samples=2)
    """
    t_send, t_remote, t_back = (np.asarray(a, dtype=np.float64) for a in
                                (t_send, t_remote, t_back))
    if not (t_send.shape == t_remote.shape == t_back.shape) or t_send.size == 0:
        raise SpecError("a ping-pong needs one send, remote and back stamp per round, "
                        f"got {t_send.size}, {t_remote.size} and {t_back.size}")
    if np.any(t_back < t_send):
        raise SpecError("a ping-pong round came back before it was sent: the reference stamps "
                        "are not from one clock")
    lo, hi = float(np.max(t_remote - t_back)), float(np.min(t_remote - t_send))
    if lo <= hi:
        return ClockOffset((lo + hi) / 2, (hi - lo) / 2, int(t_send.size))
    i = int(np.argmin(t_back - t_send))
    return ClockOffset(float(t_remote[i] - (t_send[i] + t_back[i]) / 2),
                       float(t_back[i] - t_send[i]) / 2, int(t_send.size))


def ping_pong(ping: Callable[[], float], pong: Callable[[], float],
              rounds: int = 32) -> ClockOffset:
    """Measure a clock offset by calling ``ping()`` (reads the reference clock, ns), ``pong()``
    (reads the other device's clock) and ``ping()`` again, ``rounds`` times. Host-driven, so
    the uncertainty is about half the host round trip; a GPU flag ping-pong kernel is tighter:
    feed its stamps to :func:`offset_from_samples` instead."""
    stamps = np.empty((rounds, 3))
    for i in range(rounds):
        stamps[i] = (ping(), pong(), ping())
    return offset_from_samples(stamps[:, 0], stamps[:, 1], stamps[:, 2])


def measure_clocks(measure_pair: Callable[[int, int], tuple], devices: Sequence[int],
                   reference: int | None = None) -> Clocks:
    """Clocks of ``devices`` relative to ``reference`` (default: the first): the GPU runtime's
    hook. ``measure_pair(reference, device)`` runs a flag ping-pong between the two and
    returns its ``(t_send, t_remote, t_back)`` stamp arrays (see
    :func:`offset_from_samples`)."""
    devices = list(dict.fromkeys(devices))
    reference = devices[0] if reference is None else reference
    offsets = {reference: ClockOffset(0.0)}
    for d in devices:
        if d != reference:
            offsets[d] = offset_from_samples(*measure_pair(reference, d))
    return Clocks(offsets, reference)


# -- GPU ----------------------------------------------------------------------------------------


def from_sm(bound, clocks: Clocks | Mapping | None = None, *, barriers: bool = True,
            label: str | None = None) -> Timeline:
    """A Timeline from a GPU-bound collective's last call (bind it with ``trace_rows=N``).
    ``clocks`` gives the offsets of the GPUs' clocks (:func:`align_clocks`); without them,
    ranks on different GPUs are compared on clocks that may disagree (said in ``meta``).
    The label (by default) and ``meta["kernel"]`` name the kernel that ran: the interpreter
    or the fused kernel."""
    if not getattr(bound, "trace_rows", 0):
        raise ExecutionError("this collective was bound without tracing: bind it with "
                             "trace_rows=N (rows per block, at least the longest lane's)")
    kernel = getattr(bound, "kernel", None)  # which kernel ran: the interpreter or fused
    if label is None:
        label = f"measured (gpu, {kernel})" if kernel else "measured (gpu)"
    timeline = from_sm_records(bound.schedule, bound.lowered, bound.read_trace(),
                               bound.blocks_per_lane, devices=bound.devices, clocks=clocks,
                               barriers=barriers, label=label,
                               block_matched=getattr(bound, "block_matched", False))
    return replace(timeline, meta={**timeline.meta, "kernel": kernel}) if kernel else timeline


def from_sm_records(schedule: Schedule, lowered, traces, blocks_per_lane: int, *,
                    devices: Sequence[int] | None = None, clocks=None, barriers: bool = True,
                    label: str = "measured (gpu)", block_matched: bool = False) -> Timeline:
    """A Timeline from raw GPU trace records: ``traces[r]`` is int64[lanes * blocks_per_lane,
    trace_rows, 4] of rank r (None: not traced), ``lowered[r]`` its lowered tables. Rows that
    were never written (start or end <= 0) are skipped. Consecutive rows of one block that
    belong to one step and kind (the WAIT rows of a Consume; a lane barrier's NOTIFY and WAIT)
    become one event. ``block_matched``: each block waited only for the same block of its
    peers (the fused kernel), so :meth:`Timeline.flows` pairs them block by block."""
    n = schedule.nranks
    devices = list(devices) if devices is not None else list(range(n))
    if clocks is not None and not isinstance(clocks, Clocks):
        clocks = align_clocks(clocks)
    spans = []  # (rank, lane, step, kind, block, start, end) on the reference clock
    truncated = False
    for r, rec in enumerate(traces):
        if rec is None:
            continue
        rec = np.asarray(rec)
        table = lowered[r].tables[0]  # the step and opcode columns are the same in both
        lane_rows = np.diff(lowered[r].lane_offsets)
        for b in range(rec.shape[0]):
            lane = b // blocks_per_lane
            if lane < len(lane_rows) and lane_rows[lane] > rec.shape[1]:
                truncated = True
            current = None
            for row, sub, start, end in rec[b]:
                if start <= 0 or end <= 0 or not 0 <= row < len(table):
                    continue
                kind = _row_kind(schedule, r, table[row])
                key = (int(table[row, isa.STEP]), kind, int(sub))
                if current is not None and current[0] == key:
                    current[2] = end
                    continue
                if current is not None:
                    spans.append((r, lane, *current))
                current = [key, start, end]
            if current is not None:
                spans.append((r, lane, *current))
    if not spans:
        raise ExecutionError("the GPU trace buffers hold no records: was the collective run "
                             "after binding it with trace_rows=N?")
    aligned = [(r, lane, key, start - (clocks.offset_ns(devices[r]) if clocks else 0),
                end - (clocks.offset_ns(devices[r]) if clocks else 0))
               for r, lane, key, start, end in spans]
    zero = min(s[3] for s in aligned)
    events = []
    for r, lane, (index, kind, sub), start, end in aligned:
        if kind == "barrier":
            if barriers:
                events.append(Event(r, lane, "barrier", index, float(start - zero),
                                    float(end - zero), source="measured-gpu", engine="sm",
                                    block=sub))
            continue
        events.append(step_event(schedule, r, index, kind, float(start - zero),
                                 float(end - zero), "measured-gpu", block=sub, engine="sm"))
    meta = {"source": "measured-gpu", "zero_ns": float(zero), "blocks_per_lane": blocks_per_lane,
            "devices": devices, "truncated": truncated, "block_matched": bool(block_matched)}
    used = sorted(set(devices[r] for r, *_ in spans))
    if clocks is not None:
        meta["clocks"] = clocks.to_json()
        meta["clock_uncertainty_ns"] = {d: clocks.uncertainty_ns(d) for d in used}
        meta["max_clock_uncertainty_ns"] = max(clocks.uncertainty_ns(d) for d in used)
    elif len(used) > 1:
        meta["clock_uncertainty_ns"] = {d: float("inf") for d in used}
        meta["max_clock_uncertainty_ns"] = float("inf")
        meta["warning"] = (f"GPUs {used} were traced without clock offsets: times on "
                           "different GPUs are not comparable")
    else:
        meta["max_clock_uncertainty_ns"] = 0.0  # one clock
    return Timeline(tuple(events), schedule, label, meta)


def _row_kind(schedule: Schedule, rank: int, row) -> str:
    """stage | consume (COPY/REDUCE), notify, wait; stage (LL_PUT), wait (LL_GET); a NOTIFY
    or WAIT with no peer, or whose step is not a Notify / Consume, is a lane barrier."""
    step = schedule.steps[rank][int(row[isa.STEP])]
    op = int(row[isa.OP])
    if op in (isa.COPY, isa.REDUCE):
        return "consume" if isinstance(step, Consume) else "stage"
    if op == isa.NOTIFY:
        return "notify" if isinstance(step, Notify) and row[isa.PEER] >= 0 else "barrier"
    if op == isa.WAIT:
        return "wait" if isinstance(step, Consume) and row[isa.PEER] >= 0 else "barrier"
    if op == isa.LL_PUT:  # a Stage and its Notify in one: the flag travels inside the data
        return "stage"
    if op == isa.LL_GET:  # a Consume's wait: polling the LL units until they land
        return "wait"
    return "barrier"
