"""The cpu datapath across processes: every rank's buffers and flags in shared memory.

Details: the notes after the imports; the design: ARCHITECTURE.md, "Runtime".

>>> import threading
>>> import numpy as np
>>> from purlin.snac import plan
>>> from purlin.spec import collectives
>>> s = plan(collectives.all_reduce(2), "direct-push", count=4, dtype="float64")
>>> lay = layout(s)
>>> arena = ShmArena.create(2, HEADER + lay.size)
>>> runs = [ShmRun(s, r, arena, lay, base=HEADER) for r in range(2)]
>>> runs[0].input[:] = [1, 2, 3, 4]; runs[1].input[:] = 10
>>> threads = [threading.Thread(target=run) for run in runs]
>>> for t in threads: t.start()
>>> for t in threads: t.join()
>>> runs[1].output.tolist()
[11.0, 12.0, 13.0, 14.0]
>>> del runs; arena.close()
"""

from __future__ import annotations

import os
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory

import numpy as np

from purlin.atom import cpu
from purlin.errors import CallMismatchError, ExecutionError, PurlinTimeoutError
from purlin.runtime import fingerprint
from purlin.snac.ir import Consume, Flag, Notify, Schedule
from purlin.spec.dtypes import dtype as as_dtype

# How process mode shares memory:
#
# Process mode on the CPU (ARCHITECTURE.md), the stand-in for symmetric GPU memory: rank 0 creates
# one ``multiprocessing.shared_memory`` block per rank, the names travel to the others (the caller
# says how: ``share``), every process maps every block, and once all have mapped them rank 0
# unlinks the names, so nothing is left in ``/dev/shm`` even if a process dies (until then the
# creator's resource tracker knows them; the others map them untracked). Each process then
# runs only its own rank's lanes of a schedule (:class:`ShmRun`, one thread per lane), reusing the
# cpu atoms; flags are int64 counters in the blocks that only grow, and a wait polls its flag with
# a short sleep until a deadline.
#
# Each block starts with a small header: the rank's process id and what it is doing (running, or
# waiting on which peer, step and flag), its failure record, and -- in rank 0's block -- the abort
# word. A wait that runs past its deadline follows the chain of waiting ranks to the one that is
# not waiting and names it ("is rank 3 alive?"); ranks that are still waiting see the abort word
# and give up with the same diagnosis instead of waiting out their own deadlines.
#
# Ordering: a notify is one aligned 8-byte store issued after the lane's data stores, and a wait
# reads the flag before the data; x86-64 keeps both in order (TSO). Weaker memory models would
# need fences that Python cannot issue.

HEADER = 4096     # bytes at the start of every block, before the callers' regions
ALIGN = 256       # regions start at multiples of this (16-byte vectors on GPUs; cache lines)

# header, int64 slots: status of the rank ...
H_PID, H_STATE, H_PEER, H_STEP, H_OWNER, H_SRC, H_LANE, H_TARGET = range(8)
# ... its failure record ...
H_FAILED, H_F_STEP, H_F_OWNER, H_F_SRC, H_F_LANE, H_F_TARGET, H_F_SEEN, H_F_BLAME = range(8, 16)
# ... and, in rank 0's block, the abort word (1 + the rank that failed first);
# the call the rank has made ready (its flags zeroed), and the fingerprint of the call it makes
H_ABORT = 16
H_READY = 23
H_CALL = 24       # fingerprint.WORDS int64 words: purlin.runtime.fingerprint.Call.encode()
IDLE, RUNNING, WAITING = 0, 1, 2

POLL_MIN, POLL_MAX = 20e-6, 1e-3   # seconds between two looks at a flag (doubling)


def _attach(name: str) -> shared_memory.SharedMemory:
    """Map an existing block without registering it with a resource tracker: only the creator
    tracks (and unlinks) its blocks. A tracker shared by spawned processes would otherwise see
    interleaved register/unregister messages from several processes for one name."""
    if sys.version_info >= (3, 13):
        return shared_memory.SharedMemory(name=name, track=False)
    register = resource_tracker.register
    resource_tracker.register = lambda *args, **kwargs: None
    try:
        return shared_memory.SharedMemory(name=name)
    finally:
        resource_tracker.register = register


class ShmArena:
    """One shared-memory block per rank, all mapped in this process.

    ``create`` (rank 0) makes the blocks, ``attach`` (the others) maps them by name; after every
    rank has attached, the creator calls :meth:`unlink`. :meth:`array` views a region of any
    rank's block as a numpy array.
    """

    def __init__(self, blocks: list, creator: bool):
        self.blocks = blocks
        self.creator = creator
        self.nbytes = blocks[0].size if blocks else 0
        self._raw = [np.ndarray(b.size, dtype=np.uint8, buffer=b.buf) for b in blocks]
        self.headers = [self.array(r, 0, HEADER // 8, np.int64) for r in range(len(blocks))]
        self._unlinked = False

    @classmethod
    def create(cls, nranks: int, nbytes: int) -> "ShmArena":
        """Make ``nranks`` zeroed blocks of ``nbytes`` (at least HEADER) each."""
        nbytes = max(int(nbytes), HEADER)
        blocks = []
        try:
            for _ in range(nranks):
                blocks.append(shared_memory.SharedMemory(create=True, size=nbytes))
        except Exception:
            for shm in blocks:
                shm.close()
                shm.unlink()
            raise
        return cls(blocks, creator=True)

    @classmethod
    def attach(cls, names) -> "ShmArena":
        return cls([_attach(name) for name in names], creator=False)

    @property
    def names(self) -> list[str]:
        return [b.name for b in self.blocks]

    def unlink(self) -> None:
        """Remove the names (the mappings stay valid); once every rank has attached."""
        if self.creator and not self._unlinked:
            self._unlinked = True
            for b in self.blocks:
                try:
                    b.unlink()  # also tells the resource tracker
                except FileNotFoundError:
                    pass

    def array(self, rank: int, offset: int, count: int, dtype) -> np.ndarray:
        """``count`` elements of ``dtype`` from byte ``offset`` of rank ``rank``'s block."""
        dt = np.dtype(dtype)
        end = offset + count * dt.itemsize
        if offset < 0 or end > self.nbytes:
            raise ExecutionError(f"region [{offset}, {end}) lies outside the {self.nbytes}-byte "
                                 f"shared block of rank {rank}")
        return self._raw[rank][offset:end].view(dt)

    def close(self) -> None:
        """Unmap (and, for the creator, unlink) the blocks; views still held keep them mapped."""
        self.unlink()
        self.headers = []
        self._raw = []
        for b in self.blocks:
            try:
                b.close()
            except BufferError:  # a view is still alive: the mapping goes with the process
                pass
        self.blocks = []


def open_arena(rank: int, nranks: int, nbytes: int, share) -> ShmArena:
    """Create (rank 0) or attach (others) the blocks, then unlink the names.

    ``share(obj)`` must return rank 0's ``obj`` on every rank and return only once every rank
    has called it (a broadcast, e.g. ``torch.distributed.broadcast_object_list``).
    """
    arena = ShmArena.create(nranks, nbytes) if rank == 0 else None
    try:
        names = share(arena.names if arena else None)
        if arena is None:
            arena = ShmArena.attach(names)
        share(None)  # everyone has mapped the blocks
    except BaseException:
        if arena is not None:
            arena.close()
        raise
    arena.unlink()
    arena.headers[rank][H_PID] = os.getpid()
    return arena


def announce(arena: ShmArena, rank: int, call: fingerprint.Call) -> None:
    """Write the fingerprint of the call ``rank`` is making into its header, where its peers
    read it (:func:`calls`): the index last, after a zero, so a reader never takes half of
    one call and half of another for a call."""
    head = arena.headers[rank]
    words = call.encode()
    head[H_CALL] = 0
    head[H_CALL + 1: H_CALL + fingerprint.WORDS] = words[1:]
    head[H_CALL] = words[0]


def calls(arena: ShmArena) -> list:
    """Every rank's announced :class:`purlin.runtime.fingerprint.Call` (None: none yet)."""
    out = []
    for head in arena.headers:
        for _ in range(100):
            first = int(head[H_CALL])
            words = head[H_CALL: H_CALL + fingerprint.WORDS].tolist()
            if first == int(head[H_CALL]) == words[0]:
                break
        out.append(fingerprint.Call.decode(words))
    return out


def agree(arena: ShmArena, rank: int, call: fingerprint.Call, timeout: float) -> None:
    """The barrier of a first use: return once every rank has announced ``call`` and made it
    ready (its flags zeroed); raise :class:`CallMismatchError` as soon as a rank announces
    another call at this index (and stop the others waiting), PurlinTimeoutError naming
    where the others are after ``timeout`` seconds."""
    head, abort = arena.headers[rank], arena.headers[0]
    head[H_READY] = call.index
    deadline = time.monotonic() + timeout
    delay = POLL_MIN
    while True:
        # the abort word before the calls: a rank aborts after it read the call it disagrees
        # with, so a mismatch that caused the abort read here is in the calls read next
        aborted = int(abort[H_ABORT])
        # readiness before the calls: a rank announces its call before it says it is ready,
        # so the calls read next hold every ready rank's (read after, a rank that announced
        # and got ready between the two reads would pass unseen)
        ready = all(int(h[H_READY]) >= call.index for h in arena.headers)
        seen = calls(arena)
        why = fingerprint.disagreement(seen, call.index)
        if why:
            abort[H_ABORT] = abort[H_ABORT] or rank + 1
            raise CallMismatchError(f"rank {rank}: {mismatch(arena, call.index) or why}")
        if ready:
            return
        if aborted:
            raise PurlinTimeoutError(
                f"rank {rank} gave up waiting for the others to reach call {call.index} "
                f"({call}): rank {aborted - 1} failed" + _where(seen, rank))
        if time.monotonic() > deadline:
            abort[H_ABORT] = rank + 1
            late = [r for r, h in enumerate(arena.headers) if int(h[H_READY]) < call.index]
            raise PurlinTimeoutError(
                f"rank {rank} timed out after {timeout:.3g} s waiting for rank(s) "
                f"{', '.join(map(str, late))} to reach call {call.index} ({call})" +
                _where(seen, rank))
        time.sleep(delay)
        delay = min(2 * delay, POLL_MAX)


GRACE = 2.0  # seconds a rank that saw a mismatch waits for the others to announce their call


def mismatch(arena: ShmArena, index: int, grace: float = GRACE) -> str | None:
    """How the ranks' calls differ at call ``index`` (None: they agree), once every rank has
    announced it or ``grace`` seconds have passed -- so that every rank's message names what
    every rank called, not only the first ones there."""
    end = time.monotonic() + grace
    while True:
        seen = calls(arena)
        if all(c is not None and c.index >= index for c in seen) or time.monotonic() > end:
            return fingerprint.disagreement(seen, index)
        time.sleep(POLL_MAX)


def _where(seen, rank: int) -> str:
    where = fingerprint.positions(seen, rank)
    return f"; {where}" if where else ""


# -- placing a schedule in the blocks ------------------------------------------------------------


def round_up(nbytes: int, align: int = ALIGN) -> int:
    return (int(nbytes) + align - 1) // align * align


@dataclass(frozen=True)
class Layout:
    """Byte offsets of a schedule's regions inside one slice of every rank's block.

    The slice is the same for every rank (symmetric); inside it rank r has ``flags`` (one
    int64 per (src rank, lane) and one lane-barrier flag per lane, as the GPU lowering needs),
    an abort record that only rank 0's copy uses, for the sm datapath's fused kernel a slot per
    block of every flag (``block_flags``: ``isa.F_MAX_BLOCKS`` int64 per flag, 0 when there
    are none), then its input, output and scratch (one copy of ``scratch_bytes[r]``, times the
    schedule's scratch copies). ``control_end``: the bytes before the input, which hold every
    counter of the slice (zero them before first use).
    """

    size: int
    flags: int
    flag_count: int
    abort: int
    offsets: tuple            # per rank: (input, output, scratch[, ll]) byte offsets
    scratch_bytes: tuple      # per rank, bytes of one scratch copy
    ll_bytes: tuple = ()      # per rank, bytes of its LL area (all copies); () without LL
    block_flags: int = 0      # offset of the flags' slots per block (fused kernel), else 0
    control_end: int = 0      # end of flags, abort record and slots per block

    def offset(self, rank: int, buffer: str) -> int:
        return self.offsets[rank][("input", "output", "scratch", "ll").index(buffer)]

    @property
    def has_ll(self) -> bool:
        return bool(self.ll_bytes)


ABORT_WORDS = 16


def layout(schedule: Schedule, ll: bool = False, block_flags: bool = False) -> Layout:
    """The slice layout of ``schedule`` (pure: every rank computes the same). ``ll``: each
    rank also gets an LL area after its scratch (``purlin.atom.lowering.ll_area_bytes`` per
    scratch copy) for the sm datapath's LL transfers; ``block_flags``: a slot per block of each
    flag after the abort record, for the sm datapath's fused kernel.

    >>> from purlin.snac import plan
    >>> from purlin.spec import collectives
    >>> lay = layout(plan(collectives.all_gather(2), "direct-push", count=8))
    >>> lay.offset(0, "input"), lay.offset(0, "output"), lay.size
    (256, 512, 1024)
    >>> lay = layout(plan(collectives.all_gather(2), "direct-push", count=8), ll=True)
    >>> lay.offset(0, "ll"), lay.ll_bytes, lay.size
    (1024, (544, 544), 1792)
    >>> lay = layout(plan(collectives.all_gather(2), "direct-push", count=8), block_flags=True)
    >>> lay.block_flags, lay.control_end, lay.offset(0, "input")
    (256, 6400, 6400)
    """
    from purlin.atom.lowering import flag_slots, ll_area_bytes, scratch_copy_bytes
    from purlin.kernels.isa import F_MAX_BLOCKS
    from purlin.spec.dtypes import dtype as as_dtype

    item = as_dtype(schedule.dtype).itemsize
    sizing = schedule.sizing
    n = schedule.nranks
    flag_count = flag_slots(n, schedule.lanes)
    abort = round_up(flag_count * 8, 64)
    slots = round_up(abort + ABORT_WORDS * 8) if block_flags else 0
    control_end = slots + flag_count * F_MAX_BLOCKS * 8 if block_flags else abort + ABORT_WORDS * 8
    start = round_up(control_end)
    offsets, scratch, ends, lls = [], [], [], []
    copies = scratch_copy_bytes(schedule)  # 16-byte multiples with the lowering's slots
    for r in range(n):
        one = copies[r]
        at_in = start
        at_out = at_in + round_up(sizing.input_count(r) * item)
        at_scr = at_out + round_up(sizing.output_count(r) * item)
        end = at_scr + round_up(one * schedule.scratch_copies)
        if ll:
            lls.append(ll_area_bytes(one) * schedule.scratch_copies)
            offsets.append((at_in, at_out, at_scr, end))
            end += round_up(lls[-1])
        else:
            offsets.append((at_in, at_out, at_scr))
        ends.append(end)
        scratch.append(one)
    return Layout(max(ends), 0, flag_count, abort, tuple(offsets), tuple(scratch), tuple(lls),
                  slots, control_end)


# -- running one rank ----------------------------------------------------------------------------


class ShmRun:
    """This process's rank of ``schedule``, placed at byte ``base`` of every block.

    ``input`` and ``output`` are numpy views of this rank's regions: write the input, call the
    object (it returns when this rank's lanes are done, or raises), read the output.
    """

    def __init__(self, schedule: Schedule, rank: int, arena: ShmArena, lay: Layout,
                 base: int = HEADER, timeout: float = 10.0):
        cpu.check_dtype(schedule.dtype)
        # FP8 is held as its bits, scratch too: a sum must be one step to round once
        self.fp8 = schedule.dtype if schedule.dtype in cpu.FP8 else None
        if self.fp8:
            from purlin.atom.sm import check_fp8_reduction

            check_fp8_reduction(schedule, "process-mode")
        self.schedule, self.rank, self.arena, self.timeout = schedule, rank, arena, timeout
        dt = as_dtype(schedule.dtype).numpy()
        sizing = schedule.sizing
        n, lanes = schedule.nranks, schedule.lanes
        self.lanes = lanes
        self.buffers = []
        for r in range(n):
            scratch_count = lay.scratch_bytes[r] * schedule.scratch_copies // dt.itemsize
            self.buffers.append({
                "input": arena.array(r, base + lay.offset(r, "input"), sizing.input_count(r), dt),
                "output": arena.array(r, base + lay.offset(r, "output"),
                                      sizing.output_count(r), dt),
                "scratch": arena.array(r, base + lay.offset(r, "scratch"), scratch_count, dt),
            })
        self.copy_elems = [lay.scratch_bytes[r] // dt.itemsize for r in range(n)]
        self.flags = [arena.array(r, base + lay.flags, lay.flag_count, np.int64)
                      for r in range(n)]
        self.headers = arena.headers
        self.per_call = schedule.flags()
        self.epoch = 0
        self.broken: str | None = None
        self.lane_steps = {lane: [(i, s) for i, s in enumerate(schedule.steps[rank])
                                  if s.lane == lane]
                           for lane in sorted({s.lane for s in schedule.steps[rank]})}

    @property
    def input(self) -> np.ndarray:
        return self.buffers[self.rank]["input"]

    @property
    def output(self) -> np.ndarray:
        return self.buffers[self.rank]["output"]

    def zero_flags(self) -> None:
        """Reset this rank's flags (before any peer may notify them)."""
        self.flags[self.rank][:] = 0

    def __call__(self) -> None:
        """Run this rank's part of one call; raise PurlinTimeoutError if a peer never comes."""
        if self.broken:
            raise ExecutionError(f"rank {self.rank}: this collective failed earlier and its "
                                 f"flags are out of step ({self.broken}); start a new "
                                 "communicator")
        deadline = time.monotonic() + self.timeout
        errors: list = []
        head = self.headers[self.rank]
        head[H_STATE] = RUNNING
        lanes = list(self.lane_steps)
        if len(lanes) == 1:
            self._lane(lanes[0], deadline, errors)
        else:
            threads = [threading.Thread(target=self._lane, args=(lane, deadline, errors),
                                        daemon=True, name=f"purlin-r{self.rank}-l{lane}")
                       for lane in lanes]
            for t in threads:
                t.start()
            for t in threads:
                t.join(self.timeout + 5.0)
            if any(t.is_alive() for t in threads):
                errors.append((1, PurlinTimeoutError(
                    f"rank {self.rank}: a lane thread is still running {self.timeout + 5:.1f} s "
                    "after the call's deadline")))
        head[H_STATE] = IDLE
        self.epoch += 1
        if errors:
            errors.sort(key=lambda e: e[0])  # a rank's own timeout before "gave up" messages
            self.broken = str(errors[0][1])
            raise errors[0][1]

    # -- the lane loop ---------------------------------------------------------------------------
    def _lane(self, lane: int, deadline: float, errors: list) -> None:
        s = self.schedule
        shift = [(self.epoch % s.scratch_copies) * c for c in self.copy_elems]
        try:
            for index, step in self.lane_steps[lane]:
                if isinstance(step, Notify):
                    self._notify(step.flag)
                    continue
                if isinstance(step, Consume):
                    for w in step.waits:
                        target = (self.epoch + w.call) * self.per_call.get(w.flag, 0) + w.value
                        if target > 0:
                            self._wait(w.flag, target, deadline, index)
                if step.moves_data:
                    dst = self._view(step.dst, shift)
                    srcs = [self._view(r, shift) for r in step.srcs]
                    if step.op == "copy":
                        cpu.copy_into(dst, srcs[0], self.fp8)
                    else:
                        cpu.reduce_into(dst, srcs, step.op, s.divisor(step), self.fp8)
        except (PurlinTimeoutError, CallMismatchError) as exc:
            errors.append((0 if getattr(exc, "own", False) else 1, exc))
        except Exception as exc:  # a bug, not a timeout: stop the peers too
            self._abort()
            errors.append((0, ExecutionError(f"rank {self.rank} lane {lane}: {exc!r}")))

    def _view(self, region, shift) -> np.ndarray:
        buf = self.buffers[region.rank][region.buffer]
        off = region.offset + (shift[region.rank] if region.buffer == "scratch" else 0)
        return buf[off: off + region.count]

    def _notify(self, flag: Flag) -> None:
        """Atom notify: one aligned 8-byte store; only this lane writes this flag."""
        self.flags[flag.owner][flag.src * self.lanes + flag.lane] += 1

    def _wait(self, flag: Flag, target: int, deadline: float, step: int) -> None:
        """Atom wait: poll the flag (sleeping a little longer each time) until ``target``."""
        counters, i = self.flags[flag.owner], flag.src * self.lanes + flag.lane
        if counters[i] >= target:
            return
        head = self.headers[self.rank]
        head[H_PEER], head[H_STEP] = flag.src, step
        head[H_OWNER], head[H_SRC], head[H_LANE], head[H_TARGET] = (flag.owner, flag.src,
                                                                    flag.lane, target)
        head[H_STATE] = WAITING
        abort = self.headers[0]
        delay = POLL_MIN
        looks = 0
        while counters[i] < target:
            if abort[H_ABORT]:
                head[H_STATE] = RUNNING
                raise self._gave_up(flag, target, step, int(abort[H_ABORT]) - 1)
            if time.monotonic() > deadline:
                raise self._timed_out(flag, target, step, int(counters[i]))
            looks += 1
            if looks % 16 == 0:  # a peer making another call never comes: say so now
                why = self._disagreement()
                if why:
                    head[H_STATE] = IDLE
                    self._abort()
                    why = mismatch(self.arena, calls(self.arena)[self.rank].index) or why
                    exc = CallMismatchError(f"rank {self.rank} step {step}: {why}")
                    exc.own = True
                    raise exc
            time.sleep(delay)
            delay = min(2 * delay, POLL_MAX)
        head[H_STATE] = RUNNING

    # -- failure -------------------------------------------------------------------------------
    def _abort(self) -> None:
        self.headers[0][H_ABORT] = self.rank + 1

    def _disagreement(self) -> str | None:
        """How the ranks' announced calls differ at this rank's call (None: they agree, or
        no call was announced)."""
        seen = calls(self.arena)
        mine = seen[self.rank]
        return None if mine is None else fingerprint.disagreement(seen, mine.index)

    def _where(self) -> str:
        """' (how the ranks' calls differ, or where the late ones are)', or ''."""
        seen = calls(self.arena)
        mine = seen[self.rank]
        if mine is None:
            return ""
        text = fingerprint.disagreement(seen, mine.index) or fingerprint.positions(seen,
                                                                                   self.rank)
        return f" ({text})" if text else ""

    def _timed_out(self, flag, target, step, seen) -> PurlinTimeoutError:
        blame, chain = self._blame(flag.src)
        head = self.headers[self.rank]
        head[H_F_STEP], head[H_F_OWNER], head[H_F_SRC] = step, flag.owner, flag.src
        head[H_F_LANE], head[H_F_TARGET], head[H_F_SEEN] = flag.lane, target, seen
        head[H_F_BLAME] = blame
        head[H_FAILED] = 1
        head[H_STATE] = IDLE
        self._abort()
        exc = PurlinTimeoutError(
            f"rank {self.rank} step {step} timed out after {self.timeout:.3g} s waiting on "
            f"{flag} >= {target} from rank {flag.src}: saw {seen} — {chain}{self._where()}")
        exc.own = True
        exc.missing = blame
        return exc

    def _blame(self, peer: int) -> tuple[int, str]:
        """Follow waiting ranks from ``peer`` to the first one that is not waiting."""
        seen = [self.rank]
        rank = peer
        while rank not in seen and self.headers[rank][H_STATE] == WAITING:
            seen.append(rank)
            rank = int(self.headers[rank][H_PEER])
        hops = seen[1:]
        if rank in seen:  # a cycle of waiting ranks: nobody is missing, the schedules differ
            return peer, ("every rank on the way is waiting on another: do all ranks make the "
                          "same calls in the same order?")
        via = "".join(f"rank {h} is itself waiting on rank "
                      f"{int(self.headers[h][H_PEER])}; " for h in hops)
        head = self.headers[rank]
        if head[H_FAILED] and rank != self.rank:
            # it stopped waiting because it timed out itself (its record is written before
            # its state changes): the rank it blamed is the one missing, not it
            via += f"rank {rank} timed out itself waiting on rank {int(head[H_F_SRC])}; "
            rank = int(head[H_F_BLAME])
        gone = _process_gone(int(self.headers[rank][H_PID]))
        return rank, f"{via}is rank {rank} alive?" + (
            f" (its process {int(self.headers[rank][H_PID])} has exited)" if gone else "")

    def _gave_up(self, flag, target, step, first: int) -> ExecutionError:
        why = self._disagreement()
        if why:  # the rank that stopped us saw the ranks make different calls
            why = mismatch(self.arena, calls(self.arena)[self.rank].index) or why
            exc = CallMismatchError(f"rank {self.rank} step {step}: {why}")
            exc.own = False
            return exc
        head = self.headers[first]
        if first == self.rank or not head[H_FAILED]:
            cause = f"rank {first} failed"
            missing = first
        else:
            f = Flag(int(head[H_F_OWNER]), int(head[H_F_SRC]), int(head[H_F_LANE]))
            missing = int(head[H_F_BLAME])
            cause = (f"rank {first} step {int(head[H_F_STEP])} timed out waiting on {f} >= "
                     f"{int(head[H_F_TARGET])} from rank {f.src}: saw {int(head[H_F_SEEN])}")
        exc = PurlinTimeoutError(
            f"rank {self.rank} step {step} gave up waiting on {flag} >= {target} from rank "
            f"{flag.src}: {cause} — is rank {missing} alive?{self._where()}")
        exc.own = False
        exc.missing = missing
        return exc


def _process_gone(pid: int) -> bool:
    """True if ``pid`` has exited (a zombie counts as exited); False if unknown or alive."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return False
