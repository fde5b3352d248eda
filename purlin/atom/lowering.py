"""Lower a verified Schedule to the executor kernel's instruction tables (purlin.kernels.isa).

Pure numpy: it needs only the base address of every buffer, so it is unit-tested without a GPU
and the same tables serve real GPUs and the CUDA simulator.

Details: the notes after the imports; the design: ARCHITECTURE.md, "Atom datapaths".

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
                                EPOCH_OFFSET, ERR_WIDTH, FLAG, LANE, LL_DATA, LL_GET, LL_PUT,
                                LL_UNIT, NOTIFY, NSRC, OP,
                                OPCODE_NAMES, PEER, PER_CALL, REDOP, REDOP_CODES, REDUCE,
                                ROW_WIDTH, SRC, STEP, VALUE, WAIT)
from purlin.snac.ir import Consume, Flag, Notify, Region, Schedule
from purlin.spec.dtypes import FP8, dtype as as_dtype

# How a schedule becomes tables:
#
# * Data steps become COPY / REDUCE rows, preceded by one WAIT row per wait of a Consume.
# * A Notify becomes a NOTIFY row that adds 1 per thread block of the lane, so WAIT targets and
#   per-call growth are multiplied by ``blocks_per_lane``. Where a lane notifies one flag more
#   than once in a call (chunks pipelined through the lane), a lane barrier comes before each
#   notify after the first: the waiter's target ``k * blocks`` then means every block added
#   ``k`` times (blocks stay within one notify of each other), where a fast block's extra adds
#   could otherwise make it up while a slow block's part is still missing.
# * When a lane has several blocks and a step reads what an earlier step of the same lane wrote
#   (or writes what it read), a lane barrier (NOTIFY + WAIT on a lane-local flag) separates them,
#   since different blocks may own different parts of the two regions -- unless both steps cover
#   exactly the same, 16-byte aligned region, where every thread only meets its own words
#   (never an FP8 reduce row: its threads take 4-byte words, a copy's 16-byte ones).
# * With two scratch copies, each rank gets an even and an odd table (scratch addresses shifted);
#   both share one source pool, the odd table indexing its second half.
# * Scratch is laid out in slots (:func:`scratch_layout`: the planner's overlapping scratch
#   regions merged); where a copy has room for it (``scratch_bytes`` at least
#   :func:`scratch_copy_bytes`), a slot whose regions all start where it starts begins on a
#   ``SLOT_ALIGN`` (128-byte) boundary, so an odd-sized piece does not misalign the pieces after
#   it (the fused kernel needs 16-byte aligned rows); other slots keep their phase.
# * With an LL area (``ll_bases``), each Stage + Notify pair that
#   :func:`ll_transfers` finds safe travels as LL units: an LL_PUT row on the sender instead of
#   COPY + NOTIFY, and an LL_GET row on the receiver instead of the WAIT on that flag (see
#   ``purlin.kernels.isa``: the tags inside the data are the flag). With several blocks per
#   lane a lane barrier follows the LL_GET rows of a step before its data row: LL rows give
#   each thread 8-byte units, data rows 16-byte ones.

__all__ = ["CONTROL_AT", "CONTROL_WORDS", "HEAD_WORDS", "LLTransfers", "LoweredRank", "blob_size",
           "build_blob", "flag_slots", "ll_transfers", "lower", "OPCODE_NAMES",
           "scratch_copy_bytes", "scratch_layout"]

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
    user: tuple = ()              # ((address, bytes) of the input, of the output): what the
    # caller writes before a call and reads after it (purlin.atom.fused_rows.race)


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
               trace_rows: int = 0, control: int | None = None) -> np.ndarray:
    """One rank as a single block of int64 words to be placed at device address ``base``:
    descriptor, control words (epoch, done, error record, all zero), lane offsets, the even
    and odd tables and the source pool, the descriptor's addresses pointing inside. A one-rank
    launch reads its head in one coalesced pass, so the executor's look-ups hit L1. With
    ``control`` (an address), the descriptor uses those control words instead of its own:
    blocks of one rank that must count calls together (:func:`relocate`).

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
    ctl = base + 8 * CONTROL_AT if control is None else control  # another block's: shared
    words[D_EPOCH], words[D_DONE], words[D_ERROR] = ctl, ctl + 8, ctl + 16
    words[D_ABORT], words[D_TRACE], words[D_TRACE_ROWS] = abort, trace, trace_rows
    return words


def local_buffers(schedule: Schedule, rank: int) -> frozenset:
    """Which of ``rank``'s input and output no other rank's step reads or writes: those may
    live anywhere in ``rank``'s memory (a user's tensor), not only in memory the peers map.

    >>> from purlin.snac import plan
    >>> from purlin.spec import collectives
    >>> sorted(local_buffers(plan(collectives.all_reduce(2), "direct-push", count=8), 0))
    ['input', 'output']
    >>> sorted(local_buffers(plan(collectives.all_reduce(2), "direct-pull", count=8), 0))
    ['output']
    """
    touched = set()
    for q, steps in enumerate(schedule.steps):
        if q == rank:
            continue
        for step in steps:
            if getattr(step, "moves_data", False):
                touched.update(r.buffer for r in (*step.srcs, step.dst) if r.rank == rank)
    return frozenset(b for b in ("input", "output") if b not in touched)


def relocate(low: LoweredRank, moves: dict) -> LoweredRank:
    """``low`` with every data address inside a moved range shifted: ``moves`` maps
    ``(old address, bytes)`` to the new address (the same byte count there). Only data rows'
    DST and the source pool are addresses of buffers; flags and LL areas never move.

    >>> low = LoweredRank(0, [np.zeros((1, ROW_WIDTH), np.int64)], np.array([0, 1]),
    ...                   np.array([1000, 5000]), 0)
    >>> low.tables[0][0, OP], low.tables[0][0, DST] = COPY, 1008
    >>> moved = relocate(low, {(1000, 64): 9000})
    >>> int(moved.tables[0][0, DST]), moved.srcs.tolist()
    (9008, [9000, 5000])
    """
    def shift(values: np.ndarray) -> np.ndarray:
        out = values.copy()
        for (old, nbytes), new in moves.items():
            inside = (values >= old) & (values < old + nbytes)
            out[inside] += new - old
        return out

    tables = []
    for t in low.tables:
        t = t.copy()
        data = np.isin(t[:, OP], (COPY, REDUCE, LL_GET))  # LL_PUT's DST: a peer's LL area
        t[data, DST] = shift(t[data, DST])
        tables.append(t)
    user = tuple((moved(a, moves), n) for a, n in low.user)
    return LoweredRank(low.rank, tables, low.lane_offsets, shift(low.srcs), low.lane_barriers,
                       user)


def moved(address: int, moves: dict) -> int:
    """``address`` shifted as :func:`relocate` shifts it (``moves``: ``(old address,
    bytes)`` -> new address), or itself outside every moved range.

    >>> moved(1008, {(1000, 64): 9000}), moved(1064, {(1000, 64): 9000})
    (9008, 1064)
    """
    for (old, nbytes), new in moves.items():
        if old <= address < old + nbytes:
            return address + new - old
    return address


def flag_slots(nranks: int, lanes: int) -> int:
    """uint64 flags per rank: one per (src rank, src lane), then one lane barrier per lane."""
    return nranks * lanes + lanes


def _flag_address(flag_bases, flag: Flag, nlanes: int) -> int:
    return flag_bases[flag.owner] + 8 * (flag.src * nlanes + flag.lane)


@dataclass(frozen=True)
class LLTransfers:
    """Stage + Notify pairs that travel as LL units: ``puts`` maps (sender rank, stage index)
    to the region staged, ``skip`` holds the (sender rank, notify index) pairs they replace,
    ``gets`` maps (receiver rank, step index, flag) to (region, sender rank)."""

    puts: dict
    skip: frozenset
    gets: dict

    def __len__(self) -> int:
        return len(self.puts)


def ll_transfers(schedule: Schedule, layout: dict | None = None) -> LLTransfers:
    """The Stage + Notify pairs of ``schedule`` that can carry their flag inside the data
    (``layout``: the :class:`ScratchLayout` of the ranks whose scratch :func:`lower` lays out
    in aligned slots; alignment is judged where the bytes will lie).

    A Notify of flag F from a lane to rank p qualifies when, of everything its lane wrote
    before it in the call, exactly one region R lies on p: a one-source copy into p's
    scratch, starting on an 8-byte boundary (its source anywhere: a piece of odd size inside
    a user's buffer too), that nothing else writes and no other rank reads; F grows once per
    call and its only wait anywhere is one ``Wait(F, 1, call=0)`` in the step that reads R;
    and p reads none of the lane's other writes (the Notify's release would have carried
    them too).

    >>> from purlin.spec import collectives
    >>> from purlin.snac import plan
    >>> len(ll_transfers(plan(collectives.all_reduce(2), "direct-push", count=8)))
    2
    >>> len(ll_transfers(plan(collectives.all_reduce(2), "ring", count=8)))
    0
    """
    item = as_dtype(schedule.dtype).itemsize
    per_call = schedule.flags()
    waits: dict = {}
    reads: dict = {}      # rank -> regions its steps read
    writers: dict = {}    # rank -> regions written on it
    for rank, steps in enumerate(schedule.steps):
        for index, step in enumerate(steps):
            for w in step.waits:
                waits.setdefault(w.flag, []).append((rank, index, w))
            if step.moves_data:
                reads.setdefault(rank, []).extend(step.srcs)
                writers.setdefault(step.dst.rank, []).append(step.dst)
    puts, skip, gets = {}, set(), {}
    pieces: dict = {}  # a flag notified once per piece: its (stage, notify, get) found so far
    for rank, steps in enumerate(schedule.steps):
        for lane in range(schedule.lanes):
            written: list = []   # (index, step) of the lane's data steps so far
            since: dict = {}     # flag -> len(written) at its last notify
            for index, step in enumerate(steps):
                if step.lane != lane:
                    continue
                if step.moves_data:
                    written.append((index, step))
                elif isinstance(step, Notify) and per_call.get(step.flag, 0) > 1 and \
                        schedule.chunks == 1:  # (chunked pipelines keep their flags)
                    got = pieces.setdefault(step.flag, [])
                    found = _ll_piece(step, written[since.get(step.flag, 0):], len(got) + 1,
                                      per_call, waits, reads, writers, schedule, item,
                                      layout or {})
                    since[step.flag] = len(written)
                    got.append(None if found is None else (rank, found[0], index, found[1]))
                elif isinstance(step, Notify):
                    found = _ll_pair(step, written, per_call, waits, reads, writers, schedule,
                                     item, layout or {})
                    if found is not None and found[0] not in puts:
                        stage_at, get_key = found
                        puts[(rank, stage_at)] = steps[stage_at].dst
                        skip.add((rank, index))
                        gets[get_key] = (steps[stage_at].dst, rank)
    for flag, got in pieces.items():  # every piece of the flag as LL, or none: its count
        if len(got) != per_call[flag] or any(g is None for g in got) or \
                any((g[0], g[1]) in puts for g in got):
            continue
        for rank, stage_at, index, get_key in got:
            region = schedule.steps[rank][stage_at].dst
            puts[(rank, stage_at)] = region
            skip.add((rank, index))
            gets[get_key] = (region, rank)
    return LLTransfers(puts, frozenset(skip), gets)


def _one_staged_copy(p, written, reads):
    """The one (index, step) of ``written`` that lands on peer ``p``, if it is a plain copy
    from another rank into p's scratch and p reads none of the rest; else None."""
    to_p = [(i, st) for i, st in written if st.dst.rank == p]
    if len(to_p) != 1:
        return None
    stage_at, stage = to_p[0]
    if not (stage.op == "copy" and len(stage.srcs) == 1 and stage.dst.buffer == "scratch"
            and stage.srcs[0].rank != p):
        return None
    if any(r.overlaps(st.dst) for i, st in written if i != stage_at for r in reads.get(p, ())):
        return None
    return stage_at, stage


def _ll_piece(note, since, ordinal, per_call, waits, reads, writers, schedule, item, layout):
    """:func:`_ll_pair` for the ``ordinal``-th notify of a flag that grows once per piece
    (a layout sending several pieces to one peer): of what its lane wrote ``since`` the
    flag's previous notify, exactly one region R lies on the peer p, p reads none of the
    rest, and the flag's wait for ``ordinal`` is the one step that reads R and reads no
    other piece of the flag -- so each piece's units carry its own flag, and the earlier
    pieces' notifies (themselves LL, or the whole flag stays) ordered everything before."""
    flag = note.flag
    p = flag.owner
    staged = _one_staged_copy(p, since, reads)
    if staged is None:
        return None
    stage_at, stage = staged
    region = stage.dst
    mine = [x for x in waits.get(flag, ()) if (x[2].value, x[2].call) == (ordinal, 0)]
    if len(waits.get(flag, ())) != per_call[flag] or len(mine) != 1:
        return None
    rank, index, w = mine[0]
    srcs = schedule.steps[rank][index].srcs
    if region not in srcs or any(r != region and r.buffer == "scratch" for r in srcs):
        return None  # (another piece read on this piece's flag alone would not be there)
    if sum(1 for r in writers.get(p, ()) if r.overlaps(region)) != 1:
        return None
    if any(r.overlaps(region) for q, regs in reads.items() if q != p for r in regs):
        return None
    if sum(1 for r in reads.get(p, ()) if r.overlaps(region)) != 1:
        return None
    if _byte_at(region, item, layout) % LL_DATA:  # (the source may lie anywhere: ll_put)
        return None
    return stage_at, (rank, index, flag)


def _ll_pair(note, written, per_call, waits, reads, writers, schedule, item, layout):
    """((stage index), (receiver rank, step index, flag)) if ``note`` can travel as LL."""
    flag = note.flag
    p = flag.owner
    staged = _one_staged_copy(p, written, reads)
    if staged is None:
        return None
    stage_at, stage = staged
    region = stage.dst
    if per_call.get(flag) != 1 or len(waits.get(flag, ())) != 1:
        return None
    rank, index, w = waits[flag][0]
    if (w.value, w.call) != (1, 0) or region not in schedule.steps[rank][index].srcs:
        return None
    if sum(1 for r in writers.get(p, ()) if r.overlaps(region)) != 1:
        return None
    # once LL, R is written by p's own LL_GET: nobody elsewhere may read it off p
    if any(r.overlaps(region) for q, regs in reads.items() if q != p for r in regs):
        return None
    if _byte_at(region, item, layout) % LL_DATA:  # (the source may lie anywhere: ll_put)
        return None
    return stage_at, (rank, index, flag)


@dataclass(frozen=True)
class ScratchLayout:
    """One rank's scratch slots: ``starts[k]`` (element offset of slot k, ascending) lies at
    byte ``at[k]`` of a copy; ``nbytes``: the bytes of one copy (a multiple of 16)."""

    starts: tuple
    at: tuple
    nbytes: int

    def byte_offset(self, offset: int, item: int) -> int:
        """The byte of a copy where element ``offset`` of the planner's scratch lies."""
        import bisect

        k = bisect.bisect_right(self.starts, offset) - 1
        if k < 0:
            return offset * item
        return self.at[k] + (offset - self.starts[k]) * item


def scratch_layout(schedule: Schedule) -> dict:
    """Per rank, its :class:`ScratchLayout`: the scratch regions of every step merged into
    slots where they overlap; a slot whose regions all start at its start (a piece staged
    whole) begins at the next ``SLOT_ALIGN``-byte boundary, any other keeps its offset's
    phase modulo ``SLOT_ALIGN`` bytes (its regions' alignment is what it was).

    >>> from purlin.spec import collectives
    >>> from purlin.snac import plan
    >>> sizing = collectives.all_reduce(3).sized(chunk_sizes={0: 8, 1: 8, 2: 1},
    ...                                          dtype="bfloat16")
    >>> s = plan(sizing.collective, "direct-push", sizing=sizing)
    >>> s.scratch[0] * 2, scratch_layout(s)[0]
    (68, ScratchLayout(starts=(0, 17), at=(0, 128), nbytes=256))
    """
    item = as_dtype(schedule.dtype).itemsize
    regions: dict = {r: [] for r in range(schedule.nranks)}
    for steps in schedule.steps:
        for step in steps:
            if not step.moves_data:
                continue
            for reg in (*step.srcs, step.dst):
                if reg.buffer == "scratch":
                    regions[reg.rank].append((reg.offset, reg.end))
    out = {}
    for r, regs in regions.items():
        slots: list = []  # [start, end, every region starts at start]
        for start, end in sorted(regs):
            if slots and start < slots[-1][1]:
                slots[-1][1] = max(slots[-1][1], end)
                slots[-1][2] = slots[-1][2] and start == slots[-1][0]
            else:
                slots.append([start, end, True])
        starts, at, cursor = [], [], 0
        for start, end, whole in slots:
            phase = start * item % SLOT_ALIGN
            byte = max(cursor, start * item) if not whole else cursor
            byte = -(-byte // SLOT_ALIGN) * SLOT_ALIGN if whole else \
                byte + (phase - byte) % SLOT_ALIGN
            starts.append(start)
            at.append(byte)
            cursor = byte + (end - start) * item
        size = max(cursor, schedule.scratch[r] * item)
        out[r] = ScratchLayout(tuple(starts), tuple(at), -(-size // SLOT_ALIGN) * SLOT_ALIGN)
    return out


# a scratch slot's alignment: a cache line, so a piece of an odd size (one element past a
# whole one) does not put every warp of the pieces after it across one line more
SLOT_ALIGN = 128


def _byte_at(region: Region, item: int, layout: dict) -> int:
    """Where ``region`` starts in its buffer, in bytes (scratch: in ``layout``'s slots)."""
    lay = layout.get(region.rank) if region.buffer == "scratch" else None
    return lay.byte_offset(region.offset, item) if lay else region.offset * item


def scratch_copy_bytes(schedule: Schedule) -> dict:
    """Bytes of one scratch copy per rank that give :func:`lower` room for the aligned slots
    of :func:`scratch_layout` (what the sm datapath and the host interpreter allocate)."""
    return {r: lay.nbytes for r, lay in scratch_layout(schedule).items()}


def ll_area_bytes(scratch_bytes: int) -> int:
    """Bytes of LL area per scratch copy: one 16-byte unit per 8 bytes of scratch."""
    return scratch_bytes // LL_DATA * LL_UNIT + LL_UNIT


def lower(schedule: Schedule, bases: dict, flag_bases: dict, blocks_per_lane: int = 1,
          scratch_bytes: dict | None = None, ll_bases: dict | None = None) -> list[LoweredRank]:
    """Instruction tables for every rank of ``schedule``.

    ``bases[(rank, buffer)]`` is the device address of that buffer (buffer in input, output,
    scratch); ``flag_bases[rank]`` the address of the rank's flag array (``flag_slots`` uint64).
    ``scratch_bytes[rank]`` is the byte size of one scratch copy (default: from the schedule).
    ``ll_bases[rank]``: the address of the rank's LL area (``ll_area_bytes`` per scratch copy),
    to send the pairs :func:`ll_transfers` finds as LL units.
    """
    dt, sizing = as_dtype(schedule.dtype), schedule.sizing
    if dt.name not in DTYPE_CODES:
        raise CapabilityError(f"the sm datapath moves {', '.join(DTYPE_CODES)}, not {dt.name}")
    item, fp8 = dt.itemsize, dt.name in FP8
    n, nlanes, bpl = schedule.nranks, schedule.lanes, blocks_per_lane
    per_call = schedule.flags()
    copy_bytes = scratch_bytes or {r: schedule.scratch[r] * item for r in range(n)}
    parities = range(schedule.scratch_copies)
    # the aligned slots where a copy has room for them, else the planner's offsets
    slots = {r: lay for r, lay in scratch_layout(schedule).items()
             if copy_bytes[r] >= lay.nbytes}

    def scratch_byte(region: Region) -> int:
        return _byte_at(region, item, slots)

    def address(region: Region, parity: int) -> int:
        if region.buffer != "scratch":
            return bases[(region.rank, region.buffer)] + region.offset * item
        return (bases[(region.rank, "scratch")] + scratch_byte(region)
                + parity * copy_bytes[region.rank])

    ll = ll_transfers(schedule, slots) if ll_bases is not None else \
        LLTransfers({}, frozenset(), {})

    def ll_address(region: Region, parity: int) -> int:
        per_copy = ll_area_bytes(copy_bytes[region.rank])
        return (ll_bases[region.rank] + parity * per_copy
                + scratch_byte(region) // LL_DATA * LL_UNIT)

    def aligned(step) -> bool:
        """Every address of the step is 16-byte aligned (in both scratch parities), so the
        atoms give each 16-byte word of a region to the same thread whatever the step, and the
        sub-16-byte tail to block 0. Not an FP8 reduce row: it gives a thread 4-byte words
        (thread i the bytes a copy's thread i // 4 has), so it never counts as aligned."""
        if step.op != "copy" and fp8:
            return False
        return all(address(r, p) % 16 == 0 for r in (*step.srcs, step.dst) for p in parities)

    out = []
    for rank in range(n):
        lanes_rows: list[list[tuple]] = [[] for _ in range(nlanes)]
        barriers = [0] * nlanes
        # regions the lane wrote / read since its last barrier, with "was the step aligned"
        written: list[list[tuple]] = [[] for _ in range(nlanes)]
        read: list[list[tuple]] = [[] for _ in range(nlanes)]
        # the lane's barrier count at each flag's last notify in this call
        notified: list[dict] = [{} for _ in range(nlanes)]

        def barrier(lane: int, index: int) -> None:
            """A lane barrier before step ``index``: every block of the lane has finished all
            rows so far, so nothing written or read before it can meet another block again."""
            barriers[lane] += 1
            lanes_rows[lane].append(("barrier", index, barriers[lane]))
            written[lane], read[lane] = [], []

        for index, step in enumerate(schedule.steps[rank]):
            rows = lanes_rows[step.lane]
            if isinstance(step, Notify):
                if (rank, index) not in ll.skip:
                    if bpl > 1 and notified[step.lane].get(step.flag) == barriers[step.lane]:
                        # a second notify of one flag in a call: every block of the lane must
                        # have added the first before any adds again, or a fast block's second
                        # add could make up the target while a slow block's data is missing
                        barrier(step.lane, index)
                    notified[step.lane][step.flag] = barriers[step.lane]
                    rows.append(("notify", index, step))
                continue
            reads = step.srcs if step.moves_data else ()
            dst = (step.dst,) if step.moves_data else ()
            # LL rows split their bytes over the lane's threads in 8-byte units, COPY and
            # REDUCE in 16-byte ones: a thread may meet another block's words
            ok = step.moves_data and aligned(step) and (rank, index) not in ll.puts
            if bpl > 1 and (any(_conflict(r, ok, w) for r in reads for w in written[step.lane])
                            or any(_conflict(d, ok, r) for d in dst for r in read[step.lane])):
                barrier(step.lane, index)
            if isinstance(step, Consume):
                landed = []  # regions LL_GET rows of this step wrote
                for w in step.waits:
                    got = ll.gets.get((rank, index, w.flag))
                    rows.append(("ll_get", index, got) if got else ("wait", index, w))
                    if got:
                        landed.append(got[0])
                if bpl > 1 and any(r.overlaps(g) for r in reads for g in landed):
                    barrier(step.lane, index)
            if step.moves_data:
                rows.append(("ll_put" if (rank, index) in ll.puts else "data", index, step))
                written[step.lane].append((step.dst, ok))
                read[step.lane].extend((src, ok) for src in step.srcs)
        pool: list[int] = []
        tables = []
        for parity in parities:
            table = []
            for lane, rows in enumerate(lanes_rows):
                for kind, index, item_ in rows:
                    if kind in ("ll_put", "ll_get"):
                        table.append(_ll_row(kind, index, item_, lane, parity, pool, address,
                                             ll_address, schedule))
                        continue
                    table.extend(_rows(kind, index, item_, lane, rank, parity, pool, address,
                                       flag_bases, per_call, nlanes, bpl, barriers[lane], n,
                                       schedule))
            tables.append(np.array(table, dtype=np.int64).reshape(-1, ROW_WIDTH))
        counts = [sum(_row_count(kind, bpl) for kind, _, _ in rows) for rows in lanes_rows]
        offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        user = tuple((bases.get((rank, b), 0), count(rank) * item) for b, count in
                     (("input", sizing.input_count), ("output", sizing.output_count)))
        out.append(LoweredRank(rank, tables, offsets, np.array(pool or [0], dtype=np.int64),
                               max(barriers), user))
    return out


def _ll_row(kind, index, item, lane, parity, pool, address, ll_address, schedule) -> list:
    row = [0] * ROW_WIDTH
    row[LANE], row[STEP], row[DTYPE] = lane, index, DTYPE_CODES[schedule.dtype]
    if kind == "ll_put":
        step = item
        row[OP], row[COUNT], row[PEER] = LL_PUT, step.dst.count, step.dst.rank
        row[DST], row[SRC], row[NSRC] = ll_address(step.dst, parity), len(pool), 1
        pool.append(address(step.srcs[0], parity))
        return row
    region, sender = item
    units = ll_address(region, parity)
    row[OP], row[COUNT], row[PEER] = LL_GET, region.count, sender
    row[DST], row[SRC], row[NSRC], row[FLAG] = address(region, parity), len(pool), 1, units
    pool.append(units)
    return row


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
