"""The cost model: run a Schedule as a discrete-event simulation and predict its timeline.

What a step costs and how transfers share links: ARCHITECTURE.md, "Timelines".

>>> from purlin.spec import collectives
>>> from purlin.snac import plan
>>> from purlin.trace.profiles import Profile
>>> p = Profile("toy", link_bandwidth=1e9, alpha_ns=1000.0)     # 1 GB/s = 1 byte/ns
>>> s = plan(collectives.all_gather(4), "ring", count=1000, dtype="float32")
>>> predict(s, p).end_ns          # (n-1) * (alpha + m / (n beta)), m = 4000 B on 4 ranks
6000.0
"""

from __future__ import annotations

import heapq
import math

from purlin.errors import PlanError
from purlin.snac.ir import Consume, Notify, Schedule
from purlin.trace.events import Timeline, step_event
from purlin.trace.profiles import Profile, get_profile

ISSUE, READY, DATA, MOVING = range(4)


def predict(schedule: Schedule, profile="H200", *, label: str | None = None) -> Timeline:
    """The predicted timeline of one call of ``schedule`` on ``profile`` (a Profile, a
    registered name or a saved JSON file). Times are ns from the call's start; the call's
    latency, launch included, is ``timeline.end_ns`` (also ``meta["latency_ns"]``)."""
    prof = get_profile(profile)
    events = _Simulation(schedule, prof).run()
    latency = max((e.end_ns for e in events), default=0.0)
    return Timeline(tuple(events), schedule, label or f"predicted ({prof.name})",
                    {"source": "predicted", "profile": prof.to_json(), "latency_ns": latency})


def predict_latency(schedule: Schedule, profile="H200") -> float:
    """Predicted ns for one call of ``schedule``, launch included."""
    return predict(schedule, profile).end_ns


class _Flow:
    __slots__ = ("resources", "remaining", "rate", "lane")

    def __init__(self, resources, nbytes, lane):
        self.resources, self.remaining, self.rate, self.lane = resources, float(nbytes), 0.0, lane


class _Lane:
    __slots__ = ("rank", "lane", "steps", "pos", "phase", "step_start", "data_start", "pending")

    def __init__(self, rank, lane, steps):
        self.rank, self.lane, self.steps = rank, lane, steps
        self.pos, self.phase = 0, ISSUE
        self.step_start = self.data_start = 0.0
        self.pending = 0

    def next(self):
        self.pos += 1
        self.phase = ISSUE


class _Simulation:
    def __init__(self, schedule: Schedule, profile: Profile):
        from purlin.spec.dtypes import dtype as as_dtype

        self.schedule, self.profile = schedule, profile
        self.item = as_dtype(schedule.dtype).itemsize
        self.lanes = []
        for rank, steps in enumerate(schedule.steps):
            for lane in sorted({s.lane for s in steps}):
                self.lanes.append(_Lane(rank, lane, [(i, s) for i, s in enumerate(steps)
                                                     if s.lane == lane]))
        self.link_per_ns = profile.link_bandwidth / 1e9
        self.hbm_per_ns = profile.hbm_bandwidth / 1e9
        self.flows: list[_Flow] = []
        self.heap: list[tuple[float, int, int]] = []
        self.seq = 0
        self.notified: dict = {}
        self.waiters: dict = {}
        self.events: list = []
        self.flows_changed = False

    # -- the event loop ---------------------------------------------------------------------
    def push(self, time: float, lane: int) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (time, self.seq, lane))

    def run(self) -> list:
        now = 0.0
        for k in range(len(self.lanes)):
            self.push(self.profile.launch_ns, k)
        while self.heap or self.flows:
            t_ready = self.heap[0][0] if self.heap else math.inf
            t_flow = min((now + f.remaining / f.rate for f in self.flows), default=math.inf)
            t = min(t_ready, t_flow)
            if math.isinf(t):
                break
            tol = 1e-9 * max(1.0, t)
            finished = [f for f in self.flows if now + f.remaining / f.rate <= t + tol]
            for f in self.flows:
                f.remaining -= f.rate * (t - now)
            now = t
            if finished:
                done = set(map(id, finished))
                self.flows = [f for f in self.flows if id(f) not in done]
                self.flows_changed = True
                for f in finished:
                    lane = self.lanes[f.lane]
                    lane.pending -= 1
                    if lane.pending == 0:
                        self.push(now, f.lane)
            while self.heap and self.heap[0][0] <= now:
                _, _, k = heapq.heappop(self.heap)
                self.advance(k, now)
            if self.flows_changed:
                self.share()
        stuck = [ln for ln in self.lanes if ln.pos < len(ln.steps)]
        if stuck:
            ln = stuck[0]
            idx, step = ln.steps[ln.pos]
            raise PlanError(f"the cost model cannot finish: rank {ln.rank} lane {ln.lane} step "
                            f"{idx} waits on {', '.join(map(repr, step.waits))}, which no "
                            "Notify of this call satisfies")
        return self.events

    def advance(self, k: int, now: float) -> None:
        """Run lane ``k`` from time ``now`` until it has to wait (issue cost, flag, data)."""
        ln = self.lanes[k]
        while ln.pos < len(ln.steps):
            index, step = ln.steps[ln.pos]
            if ln.phase == ISSUE:
                ln.step_start, ln.phase = now, READY
                if self.profile.step_ns > 0:
                    self.push(now + self.profile.step_ns, k)
                    return
            if ln.phase == READY:
                if isinstance(step, Notify):
                    self.record(ln, index, "notify", ln.step_start, now)
                    key = (step.flag, step.value)
                    self.notified[key] = now
                    for waiter in self.waiters.pop(key, ()):
                        self.push(now, waiter)
                    ln.next()
                    continue
                ln.phase = DATA
                if isinstance(step, Consume) and step.waits:
                    release = self.release(step, k)
                    if release is None:
                        ln.phase = READY
                        return
                    release = max(release, now)
                    self.record(ln, index, "wait", ln.step_start, release)
                    ln.data_start = release
                    if release > now:
                        self.push(release, k)
                        return
                else:
                    ln.data_start = ln.step_start
            if ln.phase == DATA:
                if not step.moves_data:
                    ln.next()
                    continue
                flows = self.transfers(step, k)
                if not flows:
                    self.record(ln, index, "consume" if isinstance(step, Consume) else "stage",
                                ln.data_start, now)
                    ln.next()
                    continue
                self.flows.extend(flows)
                self.flows_changed = True
                ln.pending, ln.phase = len(flows), MOVING
                return
            if ln.phase == MOVING:
                self.record(ln, index, "consume" if isinstance(step, Consume) else "stage",
                            ln.data_start, now)
                ln.next()

    def release(self, step: Consume, k: int):
        """When every wait of ``step`` in this call is satisfied, or None (lane ``k`` now waits
        for the first missing Notify). Waits on earlier calls count as satisfied."""
        release = 0.0
        for w in step.waits:
            if w.call != 0:
                continue
            key = (w.flag, w.value)
            if key not in self.notified:
                self.waiters.setdefault(key, []).append(k)
                return None
            release = max(release, self.notified[key] + self.profile.alpha_ns)
        return release

    def record(self, ln: _Lane, index: int, kind: str, start: float, end: float) -> None:
        self.events.append(step_event(self.schedule, ln.rank, index, kind, start, end,
                                      "predicted"))

    # -- data movement ----------------------------------------------------------------------
    def transfers(self, step, k: int) -> list[_Flow]:
        dst = step.dst
        if self.profile.topology == "gpu":  # every rank's bytes through the one GPU's memory
            moved = (sum(src.count for src in step.srcs) + dst.count) * self.item
            return [_Flow((("hbm", 0),), moved, k)] if moved else []
        flows, local = [], 0
        for src in step.srcs:
            nbytes = src.count * self.item
            if src.rank != dst.rank:
                flows.append(_Flow(self.link(src.rank, dst.rank), nbytes, k))
            else:
                local += nbytes
        if local and not math.isinf(self.hbm_per_ns):
            flows.append(_Flow((("hbm", dst.rank),), local + dst.count * self.item, k))
        if math.isinf(self.link_per_ns):
            flows = [f for f in flows if f.resources[0][0] == "hbm"]
        return [f for f in flows if f.remaining > 0]

    def link(self, a: int, b: int) -> tuple:
        if self.profile.topology == "mesh":
            return (("link", a, b),)
        return (("tx", a), ("rx", b))

    def capacity(self, resource) -> float:
        return self.hbm_per_ns if resource[0] == "hbm" else self.link_per_ns

    def share(self) -> None:
        """Max-min fair rates: fill every transfer's rate equally until a resource saturates,
        freeze the transfers through it, repeat with what is left."""
        self.flows_changed = False
        users: dict = {}
        for f in self.flows:
            for r in f.resources:
                users.setdefault(r, []).append(f)
        left = {r: self.capacity(r) for r in users}
        count = {r: len(fs) for r, fs in users.items()}
        frozen: set[int] = set()
        while len(frozen) < len(self.flows):
            bottleneck = min((r for r in count if count[r] > 0), key=lambda r: left[r] / count[r])
            rate = left[bottleneck] / count[bottleneck]
            for f in users[bottleneck]:
                if id(f) in frozen:
                    continue
                f.rate = max(rate, 1e-12)  # a saturated link still drains
                frozen.add(id(f))
                for r in f.resources:
                    left[r] -= rate
                    count[r] -= 1

