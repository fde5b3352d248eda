"""Run a Schedule on the cpu datapath: one thread per (rank, lane), real flags, real waits.

Each thread walks its lane's steps in program order; every step kind is dispatched through one
table. Flags keep growing across calls (call e waits for ``(e + w.call) * per_call + value``),
exactly as on the GPU, so back-to-back calls need no reset.
"""

from __future__ import annotations

import threading
import time

import numpy as np

from purlin.atom import cpu
from purlin.errors import ExecutionError, PurlinTimeoutError
from purlin.snac.ir import Consume, Notify, Schedule, Stage

# raw trace record: (rank, lane, step index, kind, start ns, end ns)
TraceRecord = tuple


class CpuRun:
    """A schedule bound to numpy buffers on the cpu datapath; call it once per collective."""

    def __init__(self, schedule: Schedule, timeout: float = 5.0):
        self.schedule = schedule
        self.timeout = timeout
        cpu.check_dtype(schedule.dtype)
        self.np_dtype = np.dtype(schedule.dtype)
        n = schedule.nranks
        self.memory = cpu.CpuMemory(n, schedule.lanes)
        self.scratch = [np.zeros(c * schedule.scratch_copies, dtype=self.np_dtype)
                        for c in schedule.scratch]
        self.per_call = schedule.flags()
        self.epoch = 0
        self.broken: str | None = None
        self.lane_steps = {(r, lane): [(i, s) for i, s in enumerate(schedule.steps[r])
                                       if s.lane == lane]
                           for r in range(n) for lane in sorted({s.lane for s in
                                                                 schedule.steps[r]})}

    def __call__(self, inputs, outputs, trace: list | None = None) -> None:
        """Run one call: ``inputs[r]`` and ``outputs[r]`` are flat numpy arrays of rank r."""
        if self.broken:
            raise ExecutionError(f"this bound collective failed earlier and its flags are out "
                                 f"of step ({self.broken}); bind it again")
        buffers = [{"input": inputs[r], "output": outputs[r], "scratch": self.scratch[r]}
                   for r in range(self.schedule.nranks)]
        errors: list[tuple[float, BaseException]] = []
        deadline = time.monotonic() + self.timeout
        threads = [threading.Thread(target=self._lane, daemon=True,
                                    args=(key, buffers, deadline, errors, trace))
                   for key in self.lane_steps]
        for t in threads:
            t.start()
        for t in threads:
            t.join(self.timeout + 5)
        if any(t.is_alive() for t in threads):
            self.memory.abort.set()
            self.broken = "a lane thread did not finish"
            raise PurlinTimeoutError(f"{self.schedule.title()}: a lane thread is still running "
                                     f"{self.timeout + 5:.1f} s after its deadline")
        self.epoch += 1
        if errors:
            self.broken = str(errors[0][1])
            errors.sort(key=lambda e: e[0])
            raise errors[0][1]

    def _view(self, buffers, region, call_scratch_shift):
        buf = buffers[region.rank][region.buffer]
        off = region.offset + (call_scratch_shift[region.rank] if region.buffer == "scratch"
                               else 0)
        return buf[off: off + region.count]

    def _lane(self, key, buffers, deadline, errors, trace) -> None:
        rank, lane = key
        s = self.schedule
        parity = self.epoch % s.scratch_copies
        shift = [parity * c for c in s.scratch]
        try:
            for index, step in self.lane_steps[key]:
                where = f"rank {rank} step {index} (lane {lane}, call {self.epoch})"
                t0 = time.perf_counter_ns()
                if isinstance(step, Notify):
                    self.memory.notify(step.flag)
                    _record(trace, rank, lane, index, "notify", t0)
                    continue
                if isinstance(step, Consume) and step.waits:
                    for w in step.waits:
                        # a flag no step notifies grows by 0: wait (and time out) as on a GPU
                        target = (self.epoch + w.call) * self.per_call.get(w.flag, 0) + w.value
                        if target > 0:
                            self.memory.wait(w.flag, target, deadline, where)
                    _record(trace, rank, lane, index, "wait", t0)
                    t0 = time.perf_counter_ns()
                if step.moves_data:
                    dst = self._view(buffers, step.dst, shift)
                    srcs = [self._view(buffers, r, shift) for r in step.srcs]
                    if step.op == "copy":
                        cpu.copy_into(dst, srcs[0])
                    else:
                        cpu.reduce_into(dst, srcs, step.op, s.divisor(step))
                    _record(trace, rank, lane, index,
                            "stage" if isinstance(step, Stage) else "consume", t0)
        except PurlinTimeoutError as exc:
            errors.append((time.monotonic(), exc))
            self.memory.abort.set()
        except Exception as exc:  # a bug, not a timeout: keep it and stop the others
            errors.append((time.monotonic(), ExecutionError(f"rank {rank} lane {lane}: {exc!r}")))
            self.memory.abort.set()


def _record(trace, rank, lane, index, kind, t0) -> None:
    if trace is not None:
        trace.append((rank, lane, index, kind, t0, time.perf_counter_ns()))
