"""Lower a mixed Schedule (copy-engine copies, SM reductions) to copy-engine stream programs.

Pure Python and numpy: bases and flag addresses in, lists of operations out, so the lowering is
unit-tested without a GPU (``purlin.atom.ce_sim`` even runs it on fake memory).

Details: the notes after the imports; the design: ARCHITECTURE.md, "Atom datapaths".

>>> from purlin.spec import collectives
>>> from purlin.snac import Capabilities, plan
>>> s = plan(collectives.all_reduce(2), "direct-push", count=8,
...          capabilities=Capabilities("ce", can_reduce=False, reduce_engine="sm"))
>>> bases = {(r, b): (1 + 3 * r + i) << 20 for r in range(2)
...          for i, b in enumerate(("input", "output", "scratch"))}
>>> low = lower_ce(s, bases, {r: (8 + r) << 20 for r in range(2)}, {r: (10 + r) << 20
...                for r in range(2)}, devices=(0, 1))
>>> low.ranks[0].engines
('ce', 'ce', 'sm')
>>> [type(op).__name__ for op in low.ranks[0].lanes[0][0]]
['WaitEvent', 'Memcpy', 'Add', 'Add', 'Record']
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from purlin.errors import CapabilityError
from purlin.kernels.isa import (AVG, COPY, COUNT, DIVISOR, DST, DTYPE, DTYPE_CODES, FLAG, LANE,
                                NOTIFY, NSRC, OP, PEER, REDOP, REDOP_CODES, REDUCE, ROW_WIDTH,
                                SRC, STEP, VALUE, WAIT)
from purlin.snac.ir import Flag, Notify, Region, Schedule
from purlin.spec.dtypes import dtype as as_dtype

# How the copy-engine lowering works:
#
# **Engines.** Every step runs on one engine: a data step where the planner put it (``engine``:
# copies on ``ce``, reductions on ``sm``); a Notify on the engine of the last data step before it
# in its lane (the data it announces), a wait-only Consume likewise; a lane with no data at all
# stays on ``ce`` (stream memory operations, no SM).
#
# **Streams.** One CUDA stream per (rank, lane) carries the lane's ce steps: ``Memcpy`` for a copy,
# ``Add`` for a Notify, ``WaitGeq`` for a wait. The lane's sm steps become rows of the existing
# executor table (``purlin.kernels.isa``), one launch per device on the device's main stream.
# Where a lane switches engine the previous engine hands off to the next through a counter of
# its own (ce: ``Add``; sm: a NOTIFY row; the other side waits for it), so each lane keeps its
# program order. The main stream forks the lane streams (``Record`` / ``WaitEvent``), launches the
# executor, joins them, and then *rebases* the rank's counters.
#
# **Side copies.** A rank's copy of its own input into its own memory that no other step reads
# or writes (its own piece of an all-gather, all-to-all or broadcast output) leaves the lane for
# a side stream (lane ``schedule.lanes + lane``), forked where it stood and joined with the
# lane's end; the copies that cross NVLink then run beside it instead of after it. A copy that
# crosses NVLink never moves there: the Notify after it must mean the bytes have landed.
#
# **Counters that graphs can replay.** SNAC's flags only grow: call ``e`` waits for
# ``(e + call) * per_call + value``. Stream operations bake their values in at capture, so a CUDA
# graph could not replay waits whose targets grow with ``e``. Instead every call ends, on the
# owner's main stream after the join, by adding ``-per_call`` to each of its own flags (the
# owner is the only one that waits on them, so all its waits of the call are done). Seen from
# any wait, a flag then holds ``bias + notifies - e * per_call``: the same at every call, so the
# targets are constants, ``(K + call) * per_call + value``. ``K`` (``bias = K * per_call``) is the
# farthest back any wait of the flag looks (2 for acknowledgements of ``call=-2``): it keeps every
# target positive and makes waits on calls before the first satisfied at once. Notifies are
# atomic adds (remote adds commute with the owner's rebase), waits compare ``>=`` as signed
# 64-bit numbers (the driver's cyclic ``GEQ``; the executor's signed compare). Executor WAIT rows
# therefore carry ``PER_CALL = 0`` and the relative target in ``VALUE``.
#
# Units: an executor NOTIFY adds 1 per thread block of the lane, so every notify counts
# ``unit = blocks_per_lane`` (a ce ``Add`` adds ``unit`` at once) and every target is in units.

ENGINES = ("ce", "sm")


# -- operations ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Memcpy:
    """``cudaMemcpyAsync(dst, src, nbytes)`` on the lane's stream (a copy engine)."""

    dst: int
    src: int
    nbytes: int
    step: int


@dataclass(frozen=True)
class Add:
    """Atomically add ``value`` (two's complement, 64 bits) to the counter at ``addr``.
    ``what``: notify (a schedule Notify), handoff (to the lane's sm part), rebase (end of call)."""

    addr: int
    value: int
    step: int = -1
    what: str = "notify"


@dataclass(frozen=True)
class WaitGeq:
    """Block the stream until the counter at ``addr`` is >= ``value`` (signed 64-bit compare).
    ``what``: wait (a schedule wait) or handoff (from the lane's sm part)."""

    addr: int
    value: int
    step: int = -1
    what: str = "wait"


@dataclass(frozen=True)
class Write:
    """Write ``value`` to ``addr`` (the executor's call counter: it picks the scratch parity)."""

    addr: int
    value: int


@dataclass(frozen=True)
class Record:
    """Record event ``event`` on the stream (fork, a lane's end, the call's end)."""

    event: str


@dataclass(frozen=True)
class WaitEvent:
    """Make the stream wait for the last record of ``event``."""

    event: str


@dataclass(frozen=True)
class Launch:
    """Launch the executor kernel for ``ranks`` (their sm rows) on the main stream."""

    ranks: tuple


def fork_event(device: int) -> str:
    return f"fork:d{device}"


def side_event(rank: int, lane: int, index: int) -> str:
    return f"side:r{rank}.l{lane}.s{index}"


def done_event(rank: int, lane: int) -> str:
    return f"done:r{rank}.l{lane}"


def end_event(device: int) -> str:
    return f"end:d{device}"


# -- results ------------------------------------------------------------------------------------
@dataclass
class SmTable:
    """The executor rows of one rank's sm steps (as ``purlin.atom.lowering.LoweredRank``)."""

    tables: list            # int64[rows, ROW_WIDTH], per scratch parity
    lane_offsets: np.ndarray
    srcs: np.ndarray

    @property
    def rows(self) -> int:
        return len(self.tables[0])


@dataclass
class CeRank:
    """One rank lowered: per scratch parity, per lane, the stream's operations; the executor
    table of its sm steps (None if it has none); what ends each call (``rebase``) and the
    counters' starting values (``init``: address -> value)."""

    rank: int
    device: int
    engines: tuple          # engine of every step (index as in schedule.steps[rank])
    lanes: list             # [parity][lane] -> tuple of operations ((): lane idle on ce)
    sm: SmTable | None
    rebase: tuple
    init: dict
    handoffs: tuple         # hand-offs per lane and call


@dataclass
class DeviceProgram:
    """What the main stream of a device runs per call: ``head`` (fork, parity, launch), then
    the lanes run, then ``tail`` (join, rebase, end)."""

    device: int
    head: tuple
    tail: tuple


@dataclass
class CeLowered:
    ranks: list
    programs: dict          # device -> [DeviceProgram per parity]
    unit: int               # counter units per notify (= blocks per lane of the executor)
    blocks_per_lane: int
    parities: int

    @property
    def uses_sm(self) -> bool:
        return any(r.sm is not None for r in self.ranks)

    def ops(self, parity: int = 0):
        """Every (stream, operation) of one call, in the order a host issues them."""
        out = []
        for d, programs in self.programs.items():
            prog = programs[parity % len(programs)]
            out += [(f"main:d{d}", op) for op in prog.head]
            for r in self.ranks:
                if r.device != d:
                    continue
                for lane, ops in enumerate(r.lanes[parity % len(r.lanes)]):
                    out += [(f"r{r.rank}.l{lane}", op) for op in ops]
            out += [(f"main:d{d}", op) for op in prog.tail]
        return out


def chain_lanes(lanes, rank: int, primary: int | None = None) -> list:
    """One rank's lane programs made to run one after another (lane order): each active lane
    waits for the previous one's end instead of the fork. Stream waits are invisible to CUDA,
    so a graph's scheduler may serialize independent branches in any order; chaining every
    rank's lanes in the same order makes the order explicit and cannot deadlock (lane l only
    waits on lane l of other ranks, and on earlier calls). Side lanes (index ``primary`` and
    up) stay forked from their lane: they hold only copies, no stream wait, so running them
    in any order cannot block anything."""
    out, prev = [], None
    for lane, ops in enumerate(lanes):
        if primary is not None and lane >= primary:
            out.append(ops)
            continue
        if ops and prev is not None:
            ops = (WaitEvent(done_event(rank, prev)),) + tuple(ops[1:])
        if ops:
            prev = lane
        out.append(ops)
    return out


# -- engines ------------------------------------------------------------------------------------
def assign_engines(schedule: Schedule) -> tuple:
    """The engine (``ce`` or ``sm``) of every step, per rank (the notes after the imports).

    >>> from purlin.spec import collectives
    >>> from purlin.snac import plan
    >>> assign_engines(plan(collectives.all_gather(2), "direct-push", count=4))
    (('ce', 'ce', 'ce', 'ce'), ('ce', 'ce', 'ce', 'ce'))
    """
    out = []
    for rank, steps in enumerate(schedule.steps):
        engines: list = [None] * len(steps)
        for i, step in enumerate(steps):
            if step.moves_data:
                engines[i] = _data_engine(rank, i, step)
        for lane in sorted({s.lane for s in steps}):
            idx = [i for i, s in enumerate(steps) if s.lane == lane]
            known = [engines[i] for i in idx if engines[i] is not None]
            current = known[0] if known else "ce"
            for i in idx:
                if engines[i] is None:
                    engines[i] = current
                current = engines[i]
        out.append(tuple(engines))
    return tuple(out)


def _data_engine(rank: int, index: int, step) -> str:
    engine = step.engine or ("ce" if step.op == "copy" else "sm")
    if engine not in ENGINES:
        raise CapabilityError(f"rank {rank} step {index} runs on engine {engine!r}; the ce "
                              f"datapath drives {' and '.join(ENGINES)}")
    if engine == "ce" and step.op != "copy":
        raise CapabilityError(f"rank {rank} step {index} reduces ({step.op}) on the copy "
                              "engines, which can only copy; plan with the ce datapath's "
                              "capabilities so reductions go to sm")
    return engine


# -- counters -----------------------------------------------------------------------------------
def ce_flag_slots(nranks: int, lanes: int) -> int:
    """uint64 counters per rank: one per (src rank, src lane), then per lane an executor lane
    barrier and a hand-off counter."""
    return nranks * lanes + 2 * lanes


def flag_address(flag_bases, flag: Flag, lanes: int) -> int:
    return flag_bases[flag.owner] + 8 * (flag.src * lanes + flag.lane)


def _barrier_address(flag_bases, rank, lane, nranks, lanes) -> int:
    return flag_bases[rank] + 8 * (nranks * lanes + lane)


def _handoff_address(flag_bases, rank, lane, nranks, lanes) -> int:
    return flag_bases[rank] + 8 * (nranks * lanes + lanes + lane)


def lookback(schedule: Schedule) -> dict:
    """K per flag: how many calls back its farthest wait looks (0 for this call only)."""
    k: dict = {}
    for steps in schedule.steps:
        for s in steps:
            for w in s.waits:
                k[w.flag] = max(k.get(w.flag, 0), -w.call)
    return k


# -- lowering -----------------------------------------------------------------------------------
def lower_ce(schedule: Schedule, bases: dict, flag_bases: dict, epoch_addresses: dict,
             devices, blocks_per_lane: int = 1, scratch_bytes: dict | None = None,
             side_copies: bool = True) -> CeLowered:
    """Lower ``schedule`` for the ce datapath.

    ``bases[(rank, buffer)]``: device address of input / output / scratch; ``flag_bases[rank]``:
    address of the rank's ``ce_flag_slots`` uint64 counters; ``epoch_addresses[rank]``: the
    rank's executor call counter (D_EPOCH); ``devices[rank]``: its GPU. ``scratch_bytes[rank]``
    is the byte size of one scratch copy (default: from the schedule). ``side_copies``: move
    the copies :func:`side_copies_of` finds onto side streams (the notes after the imports).
    """
    dt = as_dtype(schedule.dtype)
    item = dt.itemsize
    n, nlanes = schedule.nranks, schedule.lanes
    engines = assign_engines(schedule)
    uses_sm = any("sm" in e for e in engines)
    if uses_sm and dt.name not in DTYPE_CODES:
        raise CapabilityError(f"the sm reductions of the ce datapath move "
                              f"{', '.join(DTYPE_CODES)}, not {dt.name}")
    unit = int(blocks_per_lane) if uses_sm else 1
    per_call = schedule.flags()
    back = lookback(schedule)
    copy_bytes = scratch_bytes or {r: schedule.scratch[r] * item for r in range(n)}
    parities = schedule.scratch_copies

    def address(region: Region, parity: int) -> int:
        base = bases[(region.rank, region.buffer)] + region.offset * item
        return base + (parity * copy_bytes[region.rank] if region.buffer == "scratch" else 0)

    def target(w) -> int:
        p = per_call.get(w.flag, 0)
        return ((back.get(w.flag, 0) + w.call) * p + w.value) * unit

    side = side_copies_of(schedule, engines) if side_copies else frozenset()
    ctx = _Ctx(schedule, engines, address, target, flag_bases, unit, item, n, nlanes, side)
    ranks = [_lower_rank(ctx, rank, devices[rank], parities) for rank in range(n)]
    # starting values (bias) and end-of-call rebase of every flag, on its owner
    for flag, p in per_call.items():
        owner = ranks[flag.owner]
        addr = flag_address(flag_bases, flag, nlanes)
        if back.get(flag, 0):
            owner.init[addr] = back[flag] * p * unit
        owner.rebase = owner.rebase + (Add(addr, -p * unit, what="rebase"),)
    programs = {}
    for d in dict.fromkeys(devices):
        on_d = [r for r in ranks if r.device == d]
        programs[d] = [_device_program(d, on_d, parity, parities, epoch_addresses)
                       for parity in range(parities)]
    return CeLowered(ranks, programs, unit, int(blocks_per_lane), parities)


def side_copies_of(schedule: Schedule, engines=None) -> frozenset:
    """``(rank, step index)`` of every copy-engine copy that can run on a side stream: a rank
    copying its own input into its own memory, with no wait of its own, where no other step of
    any rank reads or writes what it writes. Nothing is ordered after it but the lane's end.

    >>> from purlin.spec import collectives
    >>> from purlin.snac import Capabilities, plan
    >>> s = plan(collectives.all_gather(2), "direct-pull", count=8,
    ...          capabilities=Capabilities("ce", can_reduce=False, reduce_engine="sm"))
    >>> sorted(side_copies_of(s))
    [(0, 1), (1, 1)]
    """
    engines = engines or assign_engines(schedule)
    data = [(r, i, st) for r, steps in enumerate(schedule.steps) for i, st in enumerate(steps)
            if st.moves_data]
    out = set()
    for r, i, st in data:
        if engines[r][i] != "ce" or st.op != "copy" or st.waits or len(st.srcs) != 1:
            continue
        (src,) = st.srcs
        if src.rank != r or src.buffer != "input" or st.dst.rank != r:
            continue
        if any((q, j) != (r, i) and (st.dst.overlaps(other.dst)
                                     or any(st.dst.overlaps(x) for x in other.srcs))
               for q, j, other in data):
            continue
        out.add((r, i))
    return frozenset(out)


@dataclass
class _Ctx:
    schedule: Schedule
    engines: tuple
    address: object
    target: object
    flag_bases: dict
    unit: int
    item: int
    nranks: int
    nlanes: int
    side: frozenset         # (rank, step index) of the copies that go to side streams


def _lower_rank(ctx: _Ctx, rank: int, device: int, parities: int) -> CeRank:
    steps = ctx.schedule.steps[rank]
    engines = ctx.engines[rank]
    lanes_ops = [[[] for _ in range(ctx.nlanes)] for _ in range(parities)]
    side_ops = [[[] for _ in range(ctx.nlanes)] for _ in range(parities)]
    rows = [[[] for _ in range(ctx.nlanes)] for _ in range(parities)]
    pools = [[] for _ in range(parities)]
    rebase, handoffs = [], []
    has_sm = "sm" in engines
    for lane in range(ctx.nlanes):
        seq = [(i, s) for i, s in enumerate(steps) if s.lane == lane]
        hand = _handoff_address(ctx.flag_bases, rank, lane, ctx.nranks, ctx.nlanes)
        barrier = _barrier_address(ctx.flag_bases, rank, lane, ctx.nranks, ctx.nlanes)
        for parity in range(parities):
            ops, lane_rows = lanes_ops[parity][lane], rows[parity][lane]
            n_hand = n_barrier = 0
            current = None
            written: list = []
            read: list = []
            notified: dict = {}  # flag -> (barriers, hand-offs) at its last sm notify
            for i, step in seq:
                engine = engines[i]
                if current is not None and engine != current:
                    n_hand += 1
                    _handoff(ops, lane_rows, lane, i, current, hand, ctx.unit,
                             n_hand * ctx.unit)
                    written, read = [], []
                current = engine
                if engine == "ce" and (rank, i) in ctx.side:
                    event = side_event(rank, lane, i)
                    ops.append(Record(event))
                    side_ops[parity][lane].append(WaitEvent(event))
                    _ce_step(ctx, side_ops[parity][lane], i, step, parity)
                    continue
                if engine == "ce":
                    _ce_step(ctx, ops, i, step, parity)
                    continue
                reads = step.srcs if step.moves_data else ()
                dst = (step.dst,) if step.moves_data else ()
                # a flag's second sm notify in a call: every block adds the first one before
                # any adds again (purlin.atom.lowering: the same lane barrier)
                again = isinstance(step, Notify) and \
                    notified.get(step.flag) == (n_barrier, n_hand)
                if isinstance(step, Notify):
                    notified[step.flag] = (n_barrier + (again and ctx.unit > 1), n_hand)
                if ctx.unit > 1 and (again or any(r.overlaps(w) for r in reads for w in written)
                                     or any(d.overlaps(r) for d in dst for r in read)):
                    n_barrier += 1
                    lane_rows.append(_row(NOTIFY, lane, i, FLAG=barrier, VALUE=1))
                    lane_rows.append(_row(WAIT, lane, i, FLAG=barrier,
                                          VALUE=n_barrier * ctx.unit))
                    written, read = [], []
                _sm_step(ctx, lane_rows, pools[parity], rank, lane, i, step, parity)
                if step.moves_data:
                    written.append(step.dst)
                    read.extend(step.srcs)
        handoffs.append(n_hand)
        if n_hand:
            rebase.append(Add(hand, -n_hand * ctx.unit, what="rebase"))
        if n_barrier:
            rebase.append(Add(barrier, -n_barrier * ctx.unit, what="rebase"))
    lanes = []
    for parity in range(parities):
        per_lane = []
        aside = side_ops[parity] if any(any(p) for p in side_ops) else []
        for lane, ops in enumerate(lanes_ops[parity] + aside):
            per_lane.append(tuple([WaitEvent(fork_event(device)), *ops,
                                   Record(done_event(rank, lane))]) if ops else ())
        lanes.append(per_lane)
    sm = None
    if has_sm:
        tables = [np.array([r for lane_rows in rows[p] for r in lane_rows],
                           dtype=np.int64).reshape(-1, ROW_WIDTH) for p in range(parities)]
        counts = [len(lane_rows) for lane_rows in rows[0]]
        offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        # both parities index one pool: the odd table's sources follow the even ones
        for p in range(1, parities):
            tables[p][:, SRC] += sum(len(pools[q]) for q in range(p))
        pool = [a for p in range(parities) for a in pools[p]]
        sm = SmTable(tables, offsets, np.array(pool or [0], dtype=np.int64))
    return CeRank(rank, device, engines, lanes, sm, tuple(rebase), {}, tuple(handoffs))


def _handoff(ops, lane_rows, lane, index, frm, counter, unit, reached) -> None:
    """The engine that ran the lane so far adds ``unit`` to the lane's hand-off counter; the
    next one waits until it reaches ``reached`` (this call's hand-offs so far, in units)."""
    if frm == "ce":
        ops.append(Add(counter, unit, index, "handoff"))
        lane_rows.append(_row(WAIT, lane, index, FLAG=counter, VALUE=reached))
    else:
        lane_rows.append(_row(NOTIFY, lane, index, FLAG=counter, VALUE=1))
        ops.append(WaitGeq(counter, reached, index, "handoff"))


def _ce_step(ctx: _Ctx, ops, index, step, parity) -> None:
    if isinstance(step, Notify):
        ops.append(Add(flag_address(ctx.flag_bases, step.flag, ctx.nlanes), ctx.unit, index))
        return
    for w in step.waits:
        ops.append(WaitGeq(flag_address(ctx.flag_bases, w.flag, ctx.nlanes), ctx.target(w),
                           index))
    if step.moves_data:
        (src,) = step.srcs
        nbytes = step.dst.count * ctx.item
        if nbytes:
            ops.append(Memcpy(ctx.address(step.dst, parity), ctx.address(src, parity), nbytes,
                              index))


def _sm_step(ctx: _Ctx, lane_rows, pool, rank, lane, index, step, parity) -> None:
    if isinstance(step, Notify):
        lane_rows.append(_row(NOTIFY, lane, index, PEER=step.flag.owner, VALUE=1,
                              FLAG=flag_address(ctx.flag_bases, step.flag, ctx.nlanes)))
        return
    for w in step.waits:
        # PER_CALL stays 0: the target is relative to the rebased counter (notes at the top)
        lane_rows.append(_row(WAIT, lane, index, PEER=w.flag.src, VALUE=ctx.target(w),
                              FLAG=flag_address(ctx.flag_bases, w.flag, ctx.nlanes)))
    if not step.moves_data:
        return
    others = {r.rank for r in (*step.srcs, step.dst)} - {rank}
    row = _row(COPY if step.op == "copy" else REDUCE, lane, index,
               PEER=min(others) if others else -1, DTYPE=DTYPE_CODES[ctx.schedule.dtype],
               COUNT=step.dst.count, DST=ctx.address(step.dst, parity), SRC=len(pool),
               NSRC=len(step.srcs))
    if step.op != "copy":
        row[REDOP] = REDOP_CODES[step.op]
        if step.op == "avg":
            row[REDOP], row[DIVISOR] = AVG, ctx.schedule.divisor(step)
    pool.extend(ctx.address(src, parity) for src in step.srcs)
    lane_rows.append(row)


_COLUMNS = {"FLAG": FLAG, "VALUE": VALUE, "PEER": PEER, "DTYPE": DTYPE, "COUNT": COUNT,
            "DST": DST, "SRC": SRC, "NSRC": NSRC}


def _row(op, lane, index, **fields) -> list:
    row = [0] * ROW_WIDTH
    row[OP], row[LANE], row[STEP], row[PEER] = op, lane, index, -1
    for name, value in fields.items():
        row[_COLUMNS[name]] = value
    return row


def _device_program(device, ranks, parity, parities, epoch_addresses) -> DeviceProgram:
    head = [Record(fork_event(device))]
    sm_ranks = tuple(r.rank for r in ranks if r.sm is not None)
    if sm_ranks:
        if parities > 1:  # the executor picks its scratch parity from its call counter
            head += [Write(epoch_addresses[r], parity) for r in sm_ranks]
        head.append(Launch(sm_ranks))
    tail = [WaitEvent(done_event(r.rank, lane)) for r in ranks
            for lane, ops in enumerate(r.lanes[parity]) if ops]
    tail += [op for r in ranks for op in r.rebase]
    tail.append(Record(end_event(device)))
    return DeviceProgram(device, tuple(head), tuple(tail))
