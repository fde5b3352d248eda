"""verify(schedule): run a schedule symbolically over several back-to-back calls and prove it.

It checks, and names rank, step and flag when something fails:

(a) every output slot ends with exactly the right name, or reduction of names, of this call;
(b) every Consume reads data that a Notify/Wait pair orders after the Stage that wrote it;
(c) no region is written while a peer, the user (between calls) or another lane may still use
    it, within a call and across calls (scratch reuse, inputs read in place);
(d) every wait is eventually satisfied: the wait graph has no cycle and no wait asks for more
    than its flag ever reaches.

Happens-before is tracked with vector clocks over threads = (rank, lane), plus one "user"
thread per rank that stands for whatever the application does with the buffers between calls.

>>> from purlin.spec import collectives
>>> from purlin.snac import plan
>>> report = verify(plan(collectives.all_reduce(2), "ring", count=8, check=False))
>>> report.ok, report.calls
(True, 2)
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from purlin.errors import VerificationError
from purlin.snac.ir import Notify, Region, Schedule, render_step
from purlin.snac.symbolic import Memory, Term
from purlin.spec.collective import _fmt


@dataclass
class Race:
    """Two accesses to overlapping memory that nothing orders."""

    first: tuple          # (rank, step index, call) or ("user", rank, call)
    second: tuple
    region: Region
    message: str


@dataclass
class Report:
    """What verification found. ``ok`` is True when there is nothing to report."""

    schedule: Schedule
    calls: int
    events: int
    errors: list[str] = field(default_factory=list)
    races: list[Race] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.errors and not self.races

    def __str__(self) -> str:
        head = (f"verify: {self.schedule.title()}: {self.events} events over {self.calls} "
                "back-to-back calls")
        if self.ok:
            return head + ": outputs correct, no races, no deadlock"
        lines = [head + ":"] + [f"  - {e}" for e in self.errors]
        lines += [f"  - {r.message}" for r in self.races]
        return "\n".join(lines)

    def raise_if_failed(self) -> "Report":
        if not self.ok:
            first = (self.errors + [r.message for r in self.races])[0]
            more = len(self.errors) + len(self.races) - 1
            tail = f" (and {more} more problem(s); see verify(...).errors/races)" if more else ""
            raise VerificationError(first + tail)
        return self


def verify(schedule: Schedule, collective=None, *, calls: int | None = None,
           raise_on_error: bool = False, max_races: int | None = 20) -> Report:
    """Prove ``schedule`` computes its collective over back-to-back calls; return a Report.

    ``collective`` defaults to the schedule's own (passing another checks against that one).
    With ``raise_on_error`` a failure raises VerificationError with a one-sentence message.
    Race detection stops after ``max_races`` races (None: report them all).
    """
    if collective is not None and collective != schedule.collective:
        report = Report(schedule, 0, 0, [f"schedule is for {schedule.collective.name} but was "
                                         f"checked against {collective.name}"])
    else:
        report = _Analysis(schedule, calls or max(2, schedule.scratch_copies + 1),
                           max_races).run()
    return report.raise_if_failed() if raise_on_error else report


class _Analysis:
    def __init__(self, schedule: Schedule, calls: int, max_races: int | None = 20):
        self.s = schedule
        self.max_races = max_races
        self.calls = calls
        self.errors: list[str] = []
        self.races: list[Race] = []
        self.sizing = schedule.sizing
        n = schedule.nranks
        # threads: one per (rank, lane) with steps, then one user thread per rank
        self.lanes = [sorted({st.lane for st in schedule.steps[r]}) for r in range(n)]
        self.tid = {}
        for r in range(n):
            for lane in self.lanes[r]:
                self.tid[(r, lane)] = len(self.tid)
        self.user_tid = [len(self.tid) + r for r in range(n)]
        self.nthreads = len(self.tid) + n
        self.per_call = schedule.flags()
        self.buf_size = {}
        for r in range(n):
            self.buf_size[(r, "input")] = self.sizing.input_count(r)
            self.buf_size[(r, "output")] = self.sizing.output_count(r)
            self.buf_size[(r, "scratch")] = schedule.scratch[r] * schedule.scratch_copies

    # -- helpers ------------------------------------------------------------------------------
    def where(self, rank, index, call) -> str:
        step = self.s.steps[rank][index]
        return f"rank {rank} step {index} (lane {step.lane} {step.kind}, call {call})"

    def physical(self, region: Region, call: int) -> Region:
        if region.buffer != "scratch" or self.s.scratch_copies == 1:
            return region
        shift = (call % self.s.scratch_copies) * self.s.scratch[region.rank]
        return Region(region.rank, region.buffer, region.offset + shift, region.count)

    def static_checks(self) -> bool:
        ok = True
        n = self.s.nranks
        for r, steps in enumerate(self.s.steps):
            for i, st in enumerate(steps):
                if st.rank != r:
                    self.errors.append(f"step {i} listed under rank {r} says it runs on rank "
                                       f"{st.rank}")
                    ok = False
                if not 0 <= st.lane < self.s.lanes:  # executors index flags by lane
                    self.errors.append(f"rank {r} step {i} runs on lane {st.lane}, outside the "
                                       f"schedule's lanes 0..{self.s.lanes - 1}")
                    ok = False
                for w in st.waits:
                    if w.flag.owner != r:
                        self.errors.append(
                            f"rank {r} step {i} waits on {w.flag}, which lives in rank "
                            f"{w.flag.owner}'s memory; a rank waits only on its own flags")
                        ok = False
                    grow = self.per_call.get(w.flag, 0)
                    if grow == 0:
                        self.errors.append(f"rank {r} step {i} waits on {w.flag} >= {w.value}, "
                                           "but no step ever notifies that flag: it would wait "
                                           "for ever")
                        ok = False
                    elif not 1 <= w.value <= grow:
                        self.errors.append(
                            f"rank {r} step {i} waits on {w.flag} >= {w.value}, but the flag "
                            f"grows by {grow} per call: it would wait for ever")
                        ok = False
                if isinstance(st, Notify) and not 0 <= st.flag.owner < n:
                    self.errors.append(f"rank {r} step {i} notifies rank {st.flag.owner}, "
                                       f"outside the ranks 0..{n - 1}")
                    ok = False
                if isinstance(st, Notify) and (st.flag.src != r or st.flag.lane != st.lane):
                    self.errors.append(
                        f"rank {r} step {i} (lane {st.lane}) notifies {st.flag}, which only "
                        f"lane {st.flag.lane} of rank {st.flag.src} may add to")
                    ok = False
                if st.moves_data:
                    for reg in (*st.srcs, st.dst):
                        size = self.buf_size.get((reg.rank, reg.buffer))
                        if size is None or reg.offset < 0 or reg.end > (
                                size if reg.buffer != "scratch" else self.s.scratch[reg.rank]):
                            self.errors.append(f"rank {r} step {i} touches {reg!r}, outside "
                                               "that buffer")
                            ok = False
                    if st.dst.buffer == "input":
                        self.errors.append(f"rank {r} step {i} writes {st.dst!r}: inputs are "
                                           "never modified by an out-of-place collective")
                        ok = False
                    if any(src.count != st.dst.count for src in st.srcs):
                        self.errors.append(f"rank {r} step {i} moves regions of different "
                                           f"sizes: {render_step(st)}")
                        ok = False
        # notify values must count up 1, 2, ... per flag in program order
        seen: dict = {}
        for r, steps in enumerate(self.s.steps):
            for i, st in enumerate(steps):
                if isinstance(st, Notify):
                    seen[st.flag] = seen.get(st.flag, 0) + 1
                    if st.value != seen[st.flag]:
                        self.errors.append(
                            f"rank {r} step {i} notifies {st.flag} ={st.value}, but it is "
                            f"notify number {seen[st.flag]} of that flag in the call")
                        ok = False
        return ok

    # -- the run ------------------------------------------------------------------------------
    def run(self) -> Report:
        report = Report(self.s, self.calls, 0, self.errors, self.races)
        if not self.static_checks():
            return report
        order = self.happens_before()
        report.events = len(order)
        if self.errors:
            return report
        self.check_races()
        if not self.races:
            self.symbolic(order)
        return report

    def happens_before(self) -> list:
        """Process events in an order consistent with program order and flags; compute vector
        clocks. Returns the processing order (event ids); records deadlocks as errors."""
        s, calls, n = self.s, self.calls, self.s.nranks
        lane_steps = {(r, lane): [i for i, st in enumerate(s.steps[r]) if st.lane == lane]
                      for r in range(n) for lane in self.lanes[r]}
        # events: ("step", rank, index, call) per thread in order, then user boundary events
        self.ev_thread: list[int] = []
        self.ev_pos: list[int] = []
        self.ev_info: list[tuple] = []
        self.vc: list[np.ndarray] = []
        pos = [0] * self.nthreads              # events processed per thread
        cursor = {key: (0, 0) for key in lane_steps}   # (call, k) next step per lane thread
        user_done = [0] * n                    # boundary events processed per rank
        notify_events: dict = {}               # flag -> [event id] in order
        clock = [np.zeros(self.nthreads, dtype=np.int64) for _ in range(self.nthreads)]
        last_user_vc = [None] * n
        order = []

        def add_event(thread, info, vc):
            eid = len(self.ev_info)
            pos[thread] += 1
            vc[thread] = pos[thread]
            self.ev_thread.append(thread)
            self.ev_pos.append(pos[thread])
            self.ev_info.append(info)
            self.vc.append(vc)
            clock[thread] = vc
            order.append(eid)
            return eid

        progress = True
        while progress:
            progress = False
            for (r, lane), idxs in lane_steps.items():
                t = self.tid[(r, lane)]
                while True:
                    call, k = cursor[(r, lane)]
                    if call >= calls:
                        break
                    if call > user_done[r]:   # previous call's boundary not passed yet
                        break
                    st = s.steps[r][idxs[k]]
                    vc = clock[t].copy()
                    if call > 0 and k == 0:
                        np.maximum(vc, last_user_vc[r], out=vc)
                    blocked = False
                    for w in st.waits:
                        target = (call + w.call) * self.per_call[w.flag] + w.value
                        if target <= 0:
                            continue
                        evs = notify_events.get(w.flag, [])
                        if len(evs) < target:
                            blocked = True
                            break
                        np.maximum(vc, self.vc[evs[target - 1]], out=vc)
                    if blocked:
                        break
                    eid = add_event(t, ("step", r, idxs[k], call), vc)
                    if isinstance(st, Notify):
                        notify_events.setdefault(st.flag, []).append(eid)
                    k += 1
                    cursor[(r, lane)] = (call + 1, 0) if k == len(idxs) else (call, k)
                    progress = True
            for r in range(n):
                while user_done[r] < calls and all(
                        cursor[(r, lane)][0] > user_done[r] for lane in self.lanes[r]):
                    t = self.user_tid[r]
                    vc = clock[t].copy()
                    for lane in self.lanes[r]:
                        np.maximum(vc, clock[self.tid[(r, lane)]], out=vc)
                    add_event(t, ("user", r, user_done[r]), vc)
                    last_user_vc[r] = self.vc[-1]
                    user_done[r] += 1
                    progress = True
        stuck = [(key, cursor[key]) for key in lane_steps if cursor[key][0] < calls]
        if stuck:
            self.errors.append(self._deadlock_message(stuck, lane_steps, notify_events))
        return order

    def _deadlock_message(self, stuck, lane_steps, notify_events) -> str:
        parts = []
        for (r, lane), (call, k) in stuck[:4]:
            i = lane_steps[(r, lane)][k]
            st = self.s.steps[r][i]
            waiting = [w for w in st.waits
                       if len(notify_events.get(w.flag, [])) <
                       (call + w.call) * self.per_call[w.flag] + w.value]
            if waiting:
                w = waiting[0]
                parts.append(f"{self.where(r, i, call)} waits on {w.flag} >= {w.value} "
                             f"from rank {w.flag.src} lane {w.flag.lane}")
            else:
                parts.append(f"{self.where(r, i, call)} waits for its previous call to end")
        more = f" (and {len(stuck) - 4} more lanes)" if len(stuck) > 4 else ""
        return "deadlock: " + "; ".join(parts) + more + " - no lane can make progress"

    # -- races --------------------------------------------------------------------------------
    def _hb(self, a: int, b: int) -> bool:
        return self.vc[b][self.ev_thread[a]] >= self.ev_pos[a]

    def _describe(self, eid: int) -> str:
        info = self.ev_info[eid]
        if info[0] == "user":
            return f"the application on rank {info[1]} between calls {info[2]} and {info[2] + 1}"
        _, r, i, call = info
        return self.where(r, i, call)

    def check_races(self) -> None:
        accesses: dict = {}   # (rank, buffer) -> list of (start, stop, is_write, eid)
        for eid, info in enumerate(self.ev_info):
            if info[0] == "user":
                _, r, call = info
                for buf in ("input", "output"):
                    size = self.buf_size[(r, buf)]
                    if size:
                        accesses.setdefault((r, buf), []).append((0, size, True, eid))
                continue
            _, r, i, call = info
            st = self.s.steps[r][i]
            if not st.moves_data:
                continue
            for src in st.srcs:
                p = self.physical(src, call)
                accesses.setdefault((p.rank, p.buffer), []).append((p.offset, p.end, False, eid))
            p = self.physical(st.dst, call)
            accesses.setdefault((p.rank, p.buffer), []).append((p.offset, p.end, True, eid))
        for (rank, buf), items in accesses.items():
            items.sort()
            active: list = []
            for start, stop, is_write, eid in items:
                active = [a for a in active if a[1] > start]
                for a_start, a_stop, a_write, a_eid in active:
                    if not (is_write or a_write):
                        continue
                    if self.ev_thread[a_eid] == self.ev_thread[eid]:
                        continue
                    if self._hb(a_eid, eid) or self._hb(eid, a_eid):
                        continue
                    region = Region(rank, buf, max(start, a_start), min(stop, a_stop) -
                                    max(start, a_start))
                    first, second = sorted((a_eid, eid))
                    kind = "written" if (is_write and a_write) else "written and read"
                    self.races.append(Race(
                        self.ev_info[first], self.ev_info[second], region,
                        f"race on {region!r}: {kind} by {self._describe(first)} and by "
                        f"{self._describe(second)} with no notify/wait ordering them"))
                    if self.max_races is not None and len(self.races) >= self.max_races:
                        return
                active.append((start, stop, is_write, eid))

    # -- symbolic execution -------------------------------------------------------------------
    def symbolic(self, order) -> None:
        coll = self.s.collective
        mem = Memory()
        red = coll.op.reduce_op
        for r in range(self.s.nranks):
            if self.buf_size[(r, "input")]:
                mem.write(r, "input", 0, [(0, self.buf_size[(r, "input")], Term(((r, 0, 0),)))])
        for eid in order:
            info = self.ev_info[eid]
            if info[0] == "user":
                _, r, call = info
                self._check_outputs(mem, r, call)
                size = self.buf_size[(r, "input")]
                if size:
                    mem.write(r, "input", 0, [(0, size, Term(((r, 0, call + 1),)))])
                if self.buf_size[(r, "output")]:
                    mem.write(r, "output", 0, [(0, self.buf_size[(r, "output")], None)])
                continue
            _, r, i, call = info
            st = self.s.steps[r][i]
            if not st.moves_data:
                continue
            reads = []
            for src in st.srcs:
                p = self.physical(src, call)
                pieces = mem.read(p.rank, p.buffer, p.offset, p.end)
                for a, b, term in pieces:
                    if term is None:
                        self.errors.append(
                            f"{self.where(r, i, call)} reads {src!r}, which holds no data at "
                            "that point (nothing staged it, or it was not yet staged)")
                        return
                reads.append([(a, b, t.shifted(src.offset - st.dst.offset)) for a, b, t in pieces])
            out = self._combine(st, reads, red, r, i, call)
            if out is None:
                return
            d = self.physical(st.dst, call)
            mem.write(d.rank, d.buffer, d.offset, out)

    def _combine(self, st, reads, red, r, i, call):
        if st.op == "copy":
            return reads[0]
        cuts = sorted({x for pieces in reads for a, b, _ in pieces for x in (a, b)})
        out = []
        want = "sum" if st.op == "avg" else st.op
        for a, b in zip(cuts, cuts[1:]):
            contribs = []
            for pieces in reads:
                term = next(t for s0, s1, t in pieces if s0 <= a < s1)
                if term.divided or (term.op not in (None, want)):
                    self.errors.append(
                        f"{self.where(r, i, call)} applies {st.op} to data already reduced "
                        f"with {term.op}{' and averaged' if term.divided else ''}")
                    return None
                contribs.extend(term.contribs)
            out.append((a, b, Term(tuple(sorted(contribs)), want, st.op == "avg")))
        return out

    def _check_outputs(self, mem, r, call) -> None:
        coll, sz = self.s.collective, self.sizing
        for q, name in enumerate(coll.output[r]):
            off, cnt = sz.output_offset(r, q), sz.chunk_count(name)
            if cnt == 0:
                continue
            srcs = coll.sources(name)
            contribs = tuple(sorted((s, sz.input_offset(s, p) - off, call) for s, p in srcs))
            if len(contribs) == 1:
                expect = (contribs, None, False)
            else:
                red = coll.op.reduce_op
                expect = (contribs, "sum" if red == "avg" else red, red == "avg")
            for a, b, term in mem.read(r, "output", off, off + cnt):
                if term is not None and term.key() == expect:
                    continue
                got = "nothing" if term is None else self._explain(term, call, off + a)
                self.errors.append(
                    f"rank {r} output position {q} (chunk {_fmt(name)!r}, elements "
                    f"{off + a}..{off + b}) ends call {call} holding {got}, expected "
                    f"{self._explain(Term(*expect), call, off + a)}")
                return

    def _explain(self, term: Term, call: int, base: int) -> str:
        """Name the input chunks a term is made of; ``base`` is the output element it is at."""
        sz, coll = self.sizing, self.s.collective
        parts = []
        for s, delta, c in term.contribs:
            at = base + delta
            label = f"rank {s} input element {at}"
            for p, name in enumerate(coll.input[s]):
                start = sz.input_offset(s, p)
                if start <= at < start + sz.chunk_count(name):
                    label = f"{_fmt(name)!r} of rank {s}" + (f" (+{at - start})" if at > start
                                                             else "")
            if c != call:
                label += f" from call {c}"
            parts.append(label)
        counts = Counter(parts)
        text = " + ".join(k if v == 1 else f"{v} x {k}" for k, v in counts.items())
        if term.op and len(term.contribs) > 1:
            text = f"{term.op}({text})" + (" / n" if term.divided else "")
        return text
