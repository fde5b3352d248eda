"""Lower a verified Schedule to the executor kernel's instruction tables (purlin.kernels.isa).

Pure numpy: it needs only the base address of every buffer, so it is unit-tested without a GPU
and the same tables serve real GPUs and the CUDA simulator.

* Data steps become COPY / REDUCE rows, preceded by one WAIT row per wait of a Consume.
* A Notify becomes a NOTIFY row that adds 1 per thread block of the lane, so WAIT targets and
  per-call growth are multiplied by ``blocks_per_lane``.
* When a lane has several blocks and a step reads what an earlier step of the same lane wrote
  (or writes what it read), a lane barrier (NOTIFY + WAIT on a lane-local flag) separates them,
  since different blocks may own different parts of the two regions -- unless both steps cover
  exactly the same, 16-byte aligned region, where every thread only meets its own words.
* With two scratch copies, each rank gets an even and an odd table (scratch addresses shifted);
  both share one source pool, the odd table indexing its second half.

>>> from purlin.spec import collectives
>>> from purlin.snac import plan
>>> s = plan(collectives.all_reduce(2), "direct-push", count=8)
>>> bases = {(r, b): (1 + 3 * r + i) << 20 for r in range(2)
...          for i, b in enumerate(("input", "output", "scratch"))}
>>> low = lower(s, bases, {r: (8 + r) << 20 for r in range(2)}, blocks_per_lane=1)
>>> [OPCODE_NAMES[op] for op in low[0].tables[0][:, OP]]
['copy', 'notify', 'wait', 'reduce']
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from purlin.errors import CapabilityError
from purlin.kernels.isa import (AVG, COPY, COUNT, D_ABORT, D_DONE, D_EPOCH, D_ERROR, D_LANES,
                                D_NLANES, D_RANK, D_SRCS, D_TABLE, D_TABLE_ODD, D_TRACE,
                                D_TRACE_ROWS, DESC_WIDTH, DIVISOR, DST, DTYPE, DTYPE_CODES,
                                EPOCH_OFFSET, ERR_WIDTH, FLAG, LANE, NOTIFY, NSRC, OP,
                                OPCODE_NAMES, PEER, PER_CALL, REDOP, REDOP_CODES, REDUCE,
                                ROW_WIDTH, SRC, STEP, VALUE, WAIT)
from purlin.snac.ir import Consume, Flag, Notify, Region, Schedule
from purlin.spec.dtypes import dtype as as_dtype

__all__ = ["CONTROL_AT", "CONTROL_WORDS", "HEAD_WORDS", "LoweredRank", "blob_size", "build_blob",
           "flag_slots", "lower", "OPCODE_NAMES"]

CONTROL_AT = DESC_WIDTH          # the control words follow the descriptor in a rank's block
CONTROL_WORDS = 2 + ERR_WIDTH    # epoch, done counter, error record
HEAD_WORDS = 512                 # what a one-rank launch prefetches (the executor's window)


@dataclass
class LoweredRank:
    """One rank's tables (one per scratch parity), lane row offsets and source pool."""

    rank: int
    tables: list[np.ndarray]      # int64[rows, ROW_WIDTH], even then (maybe) odd
    lane_offsets: np.ndarray      # int64[nlanes + 1]
    srcs: np.ndarray              # int64 source-address pool
    lane_barriers: int            # lane-barrier flags used per call (per lane, max)


def _blob_parts(low: LoweredRank, nlanes: int) -> list[tuple[str, np.ndarray]]:
    parts = [("lanes", low.lane_offsets), ("even", low.tables[0].ravel())]
    if len(low.tables) > 1:
        parts.append(("odd", low.tables[-1].ravel()))
    return parts + [("pool", low.srcs)]


def blob_size(low: LoweredRank, nlanes: int) -> int:
    """int64 words of the rank's contiguous block (at least HEAD_WORDS, so a prefetch of the
    head never reads past it)."""
    used = CONTROL_AT + CONTROL_WORDS + sum(len(a) for _, a in _blob_parts(low, nlanes))
    return max(used, HEAD_WORDS)


def build_blob(base: int, low: LoweredRank, nlanes: int, abort: int, trace: int = 0,
               trace_rows: int = 0) -> np.ndarray:
    """One rank as a single block of int64 words to be placed at device address ``base``:
    descriptor, control words (epoch, done, error record, all zero), lane offsets, the even
    and odd tables and the source pool, the descriptor's addresses pointing inside. A one-rank
    launch reads its head in one coalesced pass, so the executor's look-ups hit L1.

    >>> import numpy as np
    >>> low = LoweredRank(0, [np.zeros((2, ROW_WIDTH), np.int64)], np.array([0, 2]),
    ...                   np.array([7]), 0)
    >>> words = build_blob(1 << 20, low, 1, abort=99)
    >>> len(words) >= HEAD_WORDS, int(words[D_EPOCH]) == (1 << 20) + 8 * CONTROL_AT
    (True, True)
    """
    words = np.zeros(blob_size(low, nlanes), dtype=np.int64)
    at, where = CONTROL_AT + CONTROL_WORDS, {}
    for name, array in _blob_parts(low, nlanes):
        where[name] = at
        words[at: at + len(array)] = array
        at += len(array)
    addr = {name: base + 8 * i for name, i in where.items()}
    words[D_RANK], words[D_NLANES] = low.rank, nlanes
    words[D_TABLE] = addr["even"]
    words[D_TABLE_ODD] = addr.get("odd", addr["even"])
    words[D_LANES], words[D_SRCS] = addr["lanes"], addr["pool"]
    words[D_EPOCH] = base + 8 * CONTROL_AT
    words[D_DONE] = base + 8 * (CONTROL_AT + 1)
    words[D_ERROR] = base + 8 * (CONTROL_AT + 2)
    words[D_ABORT], words[D_TRACE], words[D_TRACE_ROWS] = abort, trace, trace_rows
    return words


def flag_slots(nranks: int, lanes: int) -> int:
    """uint64 flags per rank: one per (src rank, src lane), then one lane barrier per lane."""
    return nranks * lanes + lanes


def _flag_address(flag_bases, flag: Flag, nlanes: int) -> int:
    return flag_bases[flag.owner] + 8 * (flag.src * nlanes + flag.lane)


def lower(schedule: Schedule, bases: dict, flag_bases: dict, blocks_per_lane: int = 1,
          scratch_bytes: dict | None = None) -> list[LoweredRank]:
    """Instruction tables for every rank of ``schedule``.

    ``bases[(rank, buffer)]`` is the device address of that buffer (buffer in input, output,
    scratch); ``flag_bases[rank]`` the address of the rank's flag array (``flag_slots`` uint64).
    ``scratch_bytes[rank]`` is the byte size of one scratch copy (default: from the schedule).
    """
    dt = as_dtype(schedule.dtype)
    if dt.name not in DTYPE_CODES:
        raise CapabilityError(f"the sm datapath moves {', '.join(DTYPE_CODES)}, not {dt.name}")
    item = dt.itemsize
    n, nlanes, bpl = schedule.nranks, schedule.lanes, blocks_per_lane
    per_call = schedule.flags()
    copy_bytes = scratch_bytes or {r: schedule.scratch[r] * item for r in range(n)}
    parities = range(schedule.scratch_copies)

    def address(region: Region, parity: int) -> int:
        base = bases[(region.rank, region.buffer)] + region.offset * item
        return base + (parity * copy_bytes[region.rank] if region.buffer == "scratch" else 0)

    def aligned(step) -> bool:
        """Every address of the step is 16-byte aligned (in both scratch parities), so the
        atoms give each 16-byte word of a region to the same thread whatever the step, and the
        sub-16-byte tail to block 0."""
        return all(address(r, p) % 16 == 0 for r in (*step.srcs, step.dst) for p in parities)

    out = []
    for rank in range(n):
        lanes_rows: list[list[tuple]] = [[] for _ in range(nlanes)]
        barriers = [0] * nlanes
        # regions the lane wrote / read since its last barrier, with "was the step aligned"
        written: list[list[tuple]] = [[] for _ in range(nlanes)]
        read: list[list[tuple]] = [[] for _ in range(nlanes)]
        for index, step in enumerate(schedule.steps[rank]):
            rows = lanes_rows[step.lane]
            if isinstance(step, Notify):
                rows.append(("notify", index, step))
                continue
            reads = step.srcs if step.moves_data else ()
            dst = (step.dst,) if step.moves_data else ()
            ok = step.moves_data and aligned(step)
            if bpl > 1 and (any(_conflict(r, ok, w) for r in reads for w in written[step.lane])
                            or any(_conflict(d, ok, r) for d in dst for r in read[step.lane])):
                barriers[step.lane] += 1
                rows.append(("barrier", index, barriers[step.lane]))
                written[step.lane], read[step.lane] = [], []
            if isinstance(step, Consume):
                for w in step.waits:
                    rows.append(("wait", index, w))
            if step.moves_data:
                rows.append(("data", index, step))
                written[step.lane].append((step.dst, ok))
                read[step.lane].extend((src, ok) for src in step.srcs)
        pool: list[int] = []
        tables = []
        for parity in parities:
            table = []
            for lane, rows in enumerate(lanes_rows):
                for kind, index, item_ in rows:
                    table.extend(_rows(kind, index, item_, lane, rank, parity, pool, address,
                                       flag_bases, per_call, nlanes, bpl, barriers[lane], n,
                                       schedule))
            tables.append(np.array(table, dtype=np.int64).reshape(-1, ROW_WIDTH))
        counts = [sum(_row_count(kind, bpl) for kind, _, _ in rows) for rows in lanes_rows]
        offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        out.append(LoweredRank(rank, tables, offsets, np.array(pool or [0], dtype=np.int64),
                               max(barriers)))
    return out


def _conflict(region: Region, aligned: bool, earlier: tuple) -> bool:
    """Does touching ``region`` need a lane barrier after ``earlier`` = (region, aligned)?

    Not when both steps cover exactly the same region with aligned addresses: then each
    thread only touches words it touched itself, and the barrier between rows orders them."""
    other, other_aligned = earlier
    if not region.overlaps(other):
        return False
    return not (region == other and aligned and other_aligned)


def _row_count(kind: str, bpl: int) -> int:
    return 2 if kind == "barrier" else 1


def _rows(kind, index, item, lane, rank, parity, pool, address, flag_bases, per_call, nlanes,
          bpl, lane_barriers, nranks, schedule):
    row = [0] * ROW_WIDTH
    row[LANE], row[STEP], row[PEER] = lane, index, -1
    if kind == "notify":
        row[OP], row[FLAG], row[VALUE] = NOTIFY, _flag_address(flag_bases, item.flag, nlanes), 1
        row[PEER] = item.flag.owner
        return [row]
    if kind == "wait":
        w = item
        row[OP], row[FLAG] = WAIT, _flag_address(flag_bases, w.flag, nlanes)
        row[VALUE], row[EPOCH_OFFSET] = w.value * bpl, w.call
        # a flag nobody notifies grows by 0 per call: the wait then times out, as it should
        row[PER_CALL] = per_call.get(w.flag, 0) * bpl
        row[PEER] = w.flag.src
        return [row]
    if kind == "barrier":
        flag = flag_bases[rank] + 8 * (nranks * nlanes + lane)
        notify, wait = list(row), list(row)
        notify[OP], notify[FLAG], notify[VALUE] = NOTIFY, flag, 1
        wait[OP], wait[FLAG] = WAIT, flag
        wait[VALUE], wait[PER_CALL] = item * bpl, lane_barriers * bpl
        return [notify, wait]
    step = item
    dtype_code = DTYPE_CODES[schedule.dtype]
    row[DTYPE], row[COUNT], row[DST] = dtype_code, step.dst.count, address(step.dst, parity)
    row[SRC], row[NSRC] = len(pool), len(step.srcs)
    pool.extend(address(src, parity) for src in step.srcs)
    others = {r.rank for r in (*step.srcs, step.dst)} - {rank}
    row[PEER] = min(others) if others else -1
    if step.op == "copy":
        row[OP] = COPY
    else:
        row[OP], row[REDOP] = REDUCE, REDOP_CODES[step.op]
        if step.op == "avg":
            row[REDOP], row[DIVISOR] = AVG, schedule.divisor(step)
    return [row]
