"""Run a lowered ce program on fake memory, on the CPU: the copy-engine lowering's reference.

Every stream (each device's main stream, each (rank, lane) stream) and every lane of a launched
executor is an actor; a seeded random scheduler runs one operation of a runnable actor at a time,
so several back-to-back calls interleave in many orders. Memory is numpy bytes at made-up
addresses; executor rows are interpreted as ``purlin.kernels.executor`` does (a lane's blocks act
as one: a NOTIFY adds ``VALUE * blocks_per_lane``). Nothing here needs a GPU.

>>> from purlin.spec import collectives
>>> from purlin.snac import Capabilities, plan
>>> s = plan(collectives.all_reduce(2), "two-phase", count=8,
...          capabilities=Capabilities("ce", can_reduce=False, reduce_engine="sm"))
>>> run = CeSim(s, blocks_per_lane=2)
>>> import numpy as np
>>> outs = run.run([[np.arange(8.0), np.ones(8)]] * 3, seed=1)
>>> outs[-1][0].tolist()
[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]
"""

from __future__ import annotations

import random
from bisect import bisect_right

import numpy as np

from purlin.atom.ce_lowering import (Add, Launch, Memcpy, Record, WaitEvent, WaitGeq, Write,
                                     ce_flag_slots, lower_ce)
from purlin.errors import ExecutionError
from purlin.kernels.isa import (AVG, COPY, COUNT, DIVISOR, DST, DTYPE, EPOCH_OFFSET, FLAG,
                                ITEMSIZE, MAX, MIN, NOTIFY, NSRC, OP, PER_CALL, REDOP, REDUCE,
                                SRC, SUM, VALUE, WAIT)
from purlin.snac.ir import Schedule
from purlin.spec.dtypes import dtype as as_dtype

NP_DTYPES = {0: None, 1: np.float16, 2: np.float32, 3: np.int32, 4: np.float64}


class FakeMemory:
    """Byte buffers at made-up device addresses."""

    def __init__(self):
        self.bases: list[int] = []
        self.buffers: list[np.ndarray] = []
        self.next = 1 << 20

    def alloc(self, nbytes: int) -> int:
        base = self.next
        self.next += (max(nbytes, 16) + 4095) // 4096 * 4096 + 4096
        self.bases.append(base)
        self.buffers.append(np.zeros(max(nbytes, 16), dtype=np.uint8))
        return base

    def view(self, addr: int, nbytes: int, dtype=np.uint8) -> np.ndarray:
        k = bisect_right(self.bases, addr) - 1
        buf = self.buffers[k] if k >= 0 else None
        off = addr - self.bases[k] if k >= 0 else -1
        if buf is None or off < 0 or off + nbytes > buf.size:
            raise ExecutionError(f"address {addr:#x} (+{nbytes} bytes) is outside every buffer")
        return buf[off: off + nbytes].view(dtype)

    def load(self, addr: int) -> int:
        return int(self.view(addr, 8, np.int64)[0])

    def add(self, addr: int, value: int) -> None:
        cell = self.view(addr, 8, np.int64)
        cell[0] = np.int64(((int(cell[0]) + value + (1 << 63)) % (1 << 64)) - (1 << 63))


class CeSim:
    """``schedule`` lowered for the ce datapath onto fake memory; ``run`` executes calls."""

    def __init__(self, schedule: Schedule, blocks_per_lane: int = 1, devices=None,
                 lowered_hook=None):
        self.schedule = schedule
        n, lanes = schedule.nranks, schedule.lanes
        self.item = as_dtype(schedule.dtype).itemsize
        self.np_dtype = as_dtype(schedule.dtype).numpy()
        sizing = schedule.sizing
        self.mem = FakeMemory()
        self.bases, flag_bases, epochs = {}, {}, {}
        for r in range(n):
            self.bases[(r, "input")] = self.mem.alloc(sizing.input_count(r) * self.item)
            self.bases[(r, "output")] = self.mem.alloc(sizing.output_count(r) * self.item)
            self.bases[(r, "scratch")] = self.mem.alloc(
                schedule.scratch[r] * self.item * schedule.scratch_copies)
            flag_bases[r] = self.mem.alloc(8 * ce_flag_slots(n, lanes))
            epochs[r] = self.mem.alloc(8)
        self.epochs = epochs
        self.flag_bases = flag_bases
        self.devices = tuple(devices) if devices is not None else tuple(range(n))
        self.lowered = lower_ce(schedule, self.bases, flag_bases, epochs, self.devices,
                                blocks_per_lane=blocks_per_lane)
        if lowered_hook is not None:
            self.lowered = lowered_hook(self.lowered)
        for low in self.lowered.ranks:
            for addr, value in low.init.items():
                self.mem.add(addr, value)

    def counters(self) -> dict:
        """Every rank's counters (flags, barriers, hand-offs) as lists."""
        n, lanes = self.schedule.nranks, self.schedule.lanes
        return {r: self.mem.view(self.flag_bases[r], 8 * ce_flag_slots(n, lanes),
                                 np.int64).tolist() for r in range(n)}

    def run(self, inputs_per_call, seed: int = 0, max_ops: int = 1_000_000) -> list:
        """Run ``len(inputs_per_call)`` back-to-back calls (``inputs_per_call[c][r]``: rank r's
        input of call c); returns, per call, every rank's output as its main stream saw it
        right after that call."""
        rng = random.Random(seed)
        low, sizing = self.lowered, self.schedule.sizing
        calls = len(inputs_per_call)
        snaps = [[None] * self.schedule.nranks for _ in range(calls)]
        actors = []
        for d, programs in low.programs.items():
            ranks = [r.rank for r in low.ranks if r.device == d]
            ops = []
            for c in range(calls):
                prog = programs[c % len(programs)]
                ops += [("set", c, ranks), *[(op, c) for op in prog.head],
                        *[(op, c) for op in prog.tail], ("snap", c, ranks)]
            actors.append(_Actor(f"main:d{d}", ops))
        for r in low.ranks:
            for lane in range(len(r.lanes[0])):  # side lanes after the schedule's lanes
                ops = [(op, c) for c in range(calls)
                       for op in r.lanes[c % len(r.lanes)][lane]]
                if ops:
                    actors.append(_Actor(f"r{r.rank}.l{lane}", ops))
        records: dict = {}
        done = 0
        while True:
            live = [a for a in actors if not a.finished]
            if not live:
                break
            runnable = [a for a in live if self._ready(a, records)]
            if not runnable:
                raise ExecutionError("deadlock: " + "; ".join(
                    f"{a.name} blocked at {a.ops[a.pc]!r}" for a in live))
            actor = rng.choice(runnable)
            spawned = self._step(actor, records, inputs_per_call, snaps, sizing)
            actors.extend(spawned)
            done += 1
            if done > max_ops:
                raise ExecutionError("the simulation ran past max_ops")
        return snaps

    # -- one operation ------------------------------------------------------------------------
    def _ready(self, a: "_Actor", records) -> bool:
        if a.children:
            if any(not ch.finished for ch in a.children):
                return False
            return True
        item = a.ops[a.pc]
        if a.kernel is not None:
            return self._row_ready(a, item)
        op = item[0]
        if isinstance(op, WaitGeq):
            return self.mem.load(op.addr) >= op.value
        if isinstance(op, WaitEvent):
            return records.get(op.event, 0) >= item[1] + 1
        return True

    def _step(self, a: "_Actor", records, inputs_per_call, snaps, sizing) -> list:
        if a.children:  # the launch on this stream has finished: bump each rank's call counter
            for r in a.launched:
                self.mem.add(self.epochs[r], 1)
            a.children, a.launched = [], ()
            a.pc += 1
            return []
        item = a.ops[a.pc]
        if a.kernel is not None:
            self._row(a, item)
            a.pc += 1
            return []
        op, c = item[0], item[1]
        spawned = []
        if op == "set":
            for r in item[2]:
                x = np.asarray(inputs_per_call[c][r], dtype=self.np_dtype)
                self.mem.view(self.bases[(r, "input")], x.size * self.item,
                              self.np_dtype)[:] = x
        elif op == "snap":
            for r in item[2]:
                k = sizing.output_count(r)
                snaps[c][r] = self.mem.view(self.bases[(r, "output")], k * self.item,
                                            self.np_dtype).copy()
        elif isinstance(op, Memcpy):
            self.mem.view(op.dst, op.nbytes)[:] = self.mem.view(op.src, op.nbytes)
        elif isinstance(op, Add):
            self.mem.add(op.addr, op.value)
        elif isinstance(op, Write):
            cell = self.mem.view(op.addr, 8, np.int64)
            cell[0] = op.value
        elif isinstance(op, Record):
            records[op.event] = records.get(op.event, 0) + 1
        elif isinstance(op, Launch):
            spawned = self._launch(op)
            a.children, a.launched = spawned, op.ranks
            return spawned  # pc stays: the stream continues when the kernel has finished
        a.pc += 1
        return spawned

    def _launch(self, op: Launch) -> list:
        out = []
        for r in op.ranks:
            sm = self.lowered.ranks[r].sm
            epoch = self.mem.load(self.epochs[r])
            table = sm.tables[epoch & 1 if len(sm.tables) > 1 else 0]
            for lane in range(len(sm.lane_offsets) - 1):
                rows = table[sm.lane_offsets[lane]: sm.lane_offsets[lane + 1]]
                if len(rows):
                    out.append(_Actor(f"kernel r{r}.l{lane}", list(rows), kernel=(r, epoch)))
        return out

    def _row_ready(self, a: "_Actor", row) -> bool:
        if row[OP] != WAIT:
            return True
        _, epoch = a.kernel
        target = (epoch + int(row[EPOCH_OFFSET])) * int(row[PER_CALL]) + int(row[VALUE])
        return target <= 0 or self.mem.load(int(row[FLAG])) >= target

    def _row(self, a: "_Actor", row) -> None:
        r, _ = a.kernel
        op = row[OP]
        if op == NOTIFY:
            self.mem.add(int(row[FLAG]), int(row[VALUE]) * self.lowered.blocks_per_lane)
        elif op in (COPY, REDUCE):
            srcs = self.lowered.ranks[r].sm.srcs
            code, count = int(row[DTYPE]), int(row[COUNT])
            nbytes = count * ITEMSIZE[code]
            dt = NP_DTYPES[code]
            if dt is None:
                raise ExecutionError("the ce simulation does not model bfloat16")
            first = int(row[SRC])
            addrs = [int(srcs[first + k]) for k in range(1 if op == COPY else int(row[NSRC]))]
            vals = [self.mem.view(x, nbytes, dt).copy() for x in addrs]
            if op == COPY:
                out = vals[0]
            else:
                redop = int(row[REDOP])
                stack = np.stack(vals)
                if redop in (SUM, AVG):
                    out = stack.sum(0)
                    if redop == AVG:
                        out = out / int(row[DIVISOR])
                elif redop == MAX:
                    out = stack.max(0)
                elif redop == MIN:
                    out = stack.min(0)
            self.mem.view(int(row[DST]), nbytes, dt)[:] = np.asarray(out, dtype=dt)


class _Actor:
    def __init__(self, name, ops, kernel=None):
        self.name, self.ops, self.kernel = name, ops, kernel
        self.pc = 0
        self.children: list = []
        self.launched: tuple = ()

    @property
    def finished(self) -> bool:
        return self.pc >= len(self.ops) and not self.children
