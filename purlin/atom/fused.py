"""Fuse lowered tables into block-matched programs: the input of :mod:`purlin.kernels.fused`.

Pure numpy, like :mod:`purlin.atom.lowering`, whose one-lane tables it reads for every rank at
once. The program format, the soundness rules and the epilogue: ARCHITECTURE.md, "The fused
kernel" and "Add a fused epilogue".

>>> from purlin.spec import collectives
>>> from purlin.snac import plan
>>> from purlin.atom.lowering import lower
>>> s = plan(collectives.all_reduce(2), "direct-push", count=64, dtype="bfloat16")
>>> bases = {(r, b): (1 + 4 * r + i) << 20 for r in range(2)
...          for i, b in enumerate(("input", "output", "scratch", "ll"))}
>>> low = lower(s, bases, {r: (9 + r) << 20 for r in range(2)},
...             ll_bases={r: bases[(r, "ll")] for r in range(2)})
>>> fuse_problem(low) is None, [op.kind for op in rank_ops(low[0])]
(True, ['put', 'move'])

Rank 0's program can end with an epilogue over rows of 16 elements (32 bytes) where its
blocks' threads take whole rows in chunks:

>>> e = Epilogue(bases[(0, "output")], 1 << 30, 2 << 30, 3 << 30, hidden=16, eps=1e-5)
>>> epilogue_problem(low[0], e, unit=8, threads=2) is None
True
>>> epilogue_problem(low[0], e, unit=8, threads=3)
'rank 0: a row of 32 bytes is not whole chunks of 3 threads x 8 bytes'
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from purlin.atom.lowering import LoweredRank
from purlin.errors import CapabilityError
from purlin.kernels.occupancy import resident_blocks
from purlin.kernels.isa import (COPY, COUNT, DIVISOR, DST, DTYPE, EPOCH_OFFSET, F_ABORT,
                                F_DIVISOR, F_DTYPE, F_ERROR, F_HEAD, F_MAX_BLOCKS, F_NOPS,
                                F_OP_MOVE, F_OP_MOVES, F_OP_NORM, F_OP_NOTIFY, F_OP_PUT,
                                F_OP_PUTS, F_OP_WAIT, F_RANK, SEG_COUNT, SEG_CUT, SEG_TABLE,
                                F_REDOP, MAX_THREADS, MOVE_BYTES, MOVE_DST, MOVE_NSRC,
                                MOVE_SOURCES, NARROW_SHIFT,
                                F_UNIT, FLAG, ITEMSIZE, LL_GET, LL_PUT, NOTIFY, NSRC, OP, OP_KIND,
                                OP_WIDTH, OPCODE_NAMES, PEER, PER_CALL, PUT_BYTES, PUT_SRC, REDOP,
                                REDUCE, SOURCE_ADDR, SOURCE_LL, SOURCE_WIDTH, SRC, STEP, VALUE,
                                WAIT)

# Why the soundness rules (ARCHITECTURE.md, "The fused kernel") suffice:
#
# * Every thread takes the same items of every row on every rank, so where two rows cover the
#   same bytes, item i is block b's on both sides and block b's flag slots order them.
# * A row's last item may be partial (a scalar tail): its thread reads the whole aligned item
#   and stores only the row's bytes.
# * Rows of one rank between two flag operations meet only as the same span, so each thread
#   meets only its own items there, in program order: no lane barrier is needed.
# * COPY / REDUCE rows read an LL_GET's destination whole, so they can poll the LL units in
#   place and the LL_GET and its scratch disappear.
# * A rank sending LL units to a peer hears from it in the same call (an LL unit or a flag), so
#   the peer cannot run two calls ahead into the LL parity still being read -- or waits for
#   the peer's acknowledgement of an earlier call (a broadcast's root), which orders block b's
#   units after block b's reads only: item i stays block b's on both sides (rows do;
#   ``fused_rows.aligned`` where rows are joined).

__all__ = ["Epilogue", "FusedProgram", "Move", "Norm", "Notify", "Put", "Reduction", "Segments",
           "Source", "Span", "UNITS", "Wait", "epilogue_problem", "fuse_problem",
           "copies_only", "cut_segments", "fused_problems", "fused_unit", "grid", "kernel_name",
           "oneshot_problem", "program", "rank_ops",
           "row_grid", "row_sums_bytes", "round_blocks", "segmented_program", "threads_grid"]

FUSED_DTYPES = (0, 1, 2, 3)  # bfloat16, float16, float32, int32 (isa codes)
FUSED_COPY_DTYPES = (5, 6)  # FP8 (isa E4M3, E5M2): moved as bytes; summed on the narrow builds


class _Refused(Exception):
    """A table the fused kernel must not run (the message says why)."""


# A rank's fused ops (:func:`rank_ops`). Each record's first field names its kind, so that a
# list of them reads as ("wait", ...), ("move", ...) in a repr and in a test.
class Wait(NamedTuple):
    """Wait until the lowered ``flag`` reaches ``(epoch + epoch_offset) * per_call + value``."""

    kind: str  # "wait"
    flag: int
    per_call: int
    value: int
    epoch_offset: int
    peer: int
    step: int


class Notify(NamedTuple):
    """Add ``value`` to the lowered ``flag`` (a peer's)."""

    kind: str  # "notify"
    flag: int
    value: int


class Put(NamedTuple):
    """Send ``nbytes`` at ``source`` as LL units to a peer's LL area (two parities)."""

    kind: str  # "put"
    source: int
    dst_even: int
    dst_odd: int
    nbytes: int
    peer: int
    step: int


class Reduction(NamedTuple):
    """How a move combines its sources: isa reduce op code and the AVG divisor."""

    redop: int
    divisor: int


class Source(NamedTuple):
    """A move's source: plain memory, or (``is_ll``) a peer's LL units read in place, with the
    address on even and on odd calls and, for LL, the sending peer and step (else -1)."""

    is_ll: int
    even: int
    odd: int
    peer: int
    step: int


class Move(NamedTuple):
    """Write ``nbytes`` at ``dst_even`` / ``dst_odd`` from ``sources`` (a copy when ``how`` is
    None, else their reduction); ``narrow``: a one-source copy at addresses not all 16-byte
    aligned, its items moved in words of that many bytes (``isa.MOVE_NARROW``; 0: aligned)."""

    kind: str  # "move"
    dst_even: int
    dst_odd: int
    nbytes: int
    sources: tuple
    dtype: int
    how: Reduction | None
    narrow: int = 0


class Norm(NamedTuple):
    """The epilogue after the last move."""

    kind: str  # "norm"
    epilogue: "Epilogue"


class Segments(NamedTuple):
    """Several :class:`Put` or several :class:`Move` rows run as one op (``isa.F_OP_PUTS``,
    ``isa.F_OP_MOVES``): the block's threads stride over the union of their items, ``parts``
    in union order (``purlin.atom.fused_rows.segmented`` builds them)."""

    kind: str  # "puts" or "moves"
    parts: tuple


class Span(NamedTuple):
    """Bytes a data op touches: ``nbytes`` at ``even`` on even calls, at ``odd`` on odd."""

    even: int
    odd: int
    nbytes: int


@dataclass(frozen=True)
class FusedProgram:
    """One rank's fused program: ``words`` (int64: header, ops, sources), the number of ops,
    and ``items``, its largest row in items of its unit (what the grid is sized for);
    ``op_list``: the ops it was written from (what a trace's records name)."""

    words: np.ndarray
    ops: int
    items: int
    segments: int = 0  # segmented ops (isa.F_OP_PUTS, F_OP_MOVES): only fused_seg runs them
    op_list: tuple = ()


@dataclass(frozen=True)
class Epilogue:
    """What the fused kernel does after an all-reduce, in the same launch: ``residual +=
    result`` and then ``result = rms_norm(residual) * weight`` row by row (rows of ``hidden``
    elements; float32 inside, one rounding to the element type), as a decoder layer does
    after its row-parallel products are summed. Addresses: ``target`` -- the all-reduce's
    output (the destination of the rank's last move), ``residual`` (read and written),
    ``weight`` (``hidden`` elements) and ``sums``, :func:`row_sums_bytes` of device memory for
    the row sums (zero before the first call)."""

    target: int
    residual: int
    weight: int
    sums: int
    hidden: int
    eps: float
    # a user epilogue's words after the parameter entry (purlin.kernels.epilogue: output,
    # row output, extra tensors' addresses)
    extras: tuple = ()


def row_sums_bytes(nbytes: int, unit: int, threads: int) -> int:
    """Bytes of the row sums area of an :class:`Epilogue` over ``nbytes`` of output: one
    16-byte slot per ``threads * unit`` bytes.

    >>> row_sums_bytes(8192, 8, 128)
    128
    """
    return max(1, nbytes // (unit * threads)) * 16


def epilogue_problem(low: LoweredRank, epilogue: Epilogue, unit: int,
                     threads: int) -> str | None:
    """Why rank ``low``'s fused program cannot end with ``epilogue`` when its blocks have
    ``threads`` threads taking ``unit`` bytes each (a sentence), or None: the last op must be
    the move into the target (a float sum), whole rows, and each row whole chunks of
    ``threads * unit`` bytes, at most ``threads`` of them.

    (The module's example ends with one.)
    """
    try:  # (the NORM builds take no piece of odd size inside a user's buffer)
        ops = _rank_ops(low, unit, narrow_units=False)
    except _Refused as exc:
        return str(exc)
    return _epilogue_problem(low.rank, ops, epilogue, unit, threads)


def _epilogue_problem(r: int, ops: list[tuple], epilogue: Epilogue, unit: int,
                      threads: int) -> str | None:
    """:func:`epilogue_problem` on rank ``r``'s fused ops (taken without narrow units)."""
    last = ops[-1] if ops else None
    if last is None or last.kind != "move" or last.dst_even != epilogue.target or \
            last.dst_odd != epilogue.target:
        return f"rank {r}: its last op is not the move into the epilogue's target"
    if last.dtype not in (0, 1, 2) or last.how is None or last.how.redop != 0:
        how = None if last.how is None else tuple(last.how)
        return f"rank {r}: the epilogue follows a float sum, not dtype code {last.dtype} / {how}"
    row = epilogue.hidden * ITEMSIZE[last.dtype]
    if epilogue.hidden < 1 or last.nbytes % row:
        return f"rank {r}: {last.nbytes} bytes are not whole rows of {epilogue.hidden} elements"
    if row % (threads * unit):
        return (f"rank {r}: a row of {row} bytes is not whole chunks of {threads} threads x "
                f"{unit} bytes")
    if row // (threads * unit) > threads:  # a block's threads read a row's sums at once
        return (f"rank {r}: a row of {row} bytes is {row // (threads * unit)} chunks of "
                f"{threads} threads x {unit} bytes, more than {threads}")
    return None


def rank_ops(low: LoweredRank, unit: int = 16, narrow_units: bool = True) -> list[tuple]:
    """The rank's rows as fused ops (:class:`Wait`, :class:`Notify`, :class:`Put`,
    :class:`Move`), LL_GET rows folded into the moves that read them. Raises CapabilityError
    naming the rank and row when the rank cannot be fused. ``unit``: the bytes a thread takes
    at a time (16, or 8 -- one LL unit each); ``narrow_units``: as :func:`fuse_problem`'s
    ``narrow``."""
    try:
        return _rank_ops(low, unit, narrow_units)
    except _Refused as exc:
        raise CapabilityError(f"cannot fuse: {exc}") from None


def _rank_ops(low: LoweredRank, unit: int = 16, narrow_units: bool = True) -> list[tuple]:
    r = low.rank
    if len(low.lane_offsets) != 2:  # (fuse_problem and fused_rows take a program a lane)
        raise _Refused(f"rank {r} runs {len(low.lane_offsets) - 1} lanes in one program (a "
                       "fused program runs one lane: plan with lanes=1)")
    even, odd = low.tables[0], low.tables[-1]
    ops, gets, used = [], {}, set()
    for k, (a, b) in enumerate(zip(even, odd)):
        op = int(a[OP])
        if op not in (WAIT, NOTIFY, LL_PUT, LL_GET, COPY, REDUCE) or int(b[OP]) != op:
            raise _Refused(f"rank {r} row {k} is a {OPCODE_NAMES[op]}")
        if op == WAIT:
            ops.append(Wait("wait", int(a[FLAG]), int(a[PER_CALL]), int(a[VALUE]),
                            int(a[EPOCH_OFFSET]), int(a[PEER]), int(a[STEP])))
            continue
        if op == NOTIFY:
            ops.append(Notify("notify", int(a[FLAG]), int(a[VALUE])))
            continue
        dt = int(a[DTYPE])
        if dt in FUSED_COPY_DTYPES and op == REDUCE and not (narrow_units and unit == 8):
            raise _Refused(f"rank {r} row {k}: the fused kernel sums FP8 only in 8-byte units "
                           f"on its narrow builds, not in {unit}-byte ones (the interpreter "
                           "sums it too: protocol 'simple' or 'll')")
        if dt not in FUSED_DTYPES + FUSED_COPY_DTYPES:
            raise _Refused(f"rank {r}: the fused kernel does not move dtype code {dt}")
        nbytes = int(a[COUNT]) * ITEMSIZE[dt]
        srcs_a = [int(x) for x in low.srcs[a[SRC]: a[SRC] + max(1, a[NSRC])]]
        srcs_b = [int(x) for x in low.srcs[b[SRC]: b[SRC] + max(1, b[NSRC])]]
        addresses = [int(a[DST]), int(b[DST]), *srcs_a, *srcs_b]
        # a last partial item (a scalar tail) is fine: its thread reads the whole aligned
        # item and stores only the row's bytes. Other addresses (pieces of odd size inside a
        # user's buffer) are fine too: in 16-byte items a one-source plain copy moves each
        # item in narrower words (Move.narrow, the copy-only builds); in 8- and 4-byte units
        # the narrow builds load and store every word as its address allows
        # (narrow_program; ``narrow_units``), copies, PUTs and reductions alike.
        narrow = 0
        if any(x % unit for x in addresses):
            ll_source = (srcs_a[0], srcs_b[0]) in gets
            if (op != COPY or len(srcs_a) != 1 or ll_source) if unit == 16 else \
                    (not narrow_units or op == LL_GET):
                raise _Refused(f"rank {r} row {k} ({OPCODE_NAMES[op]}) moves {nbytes} bytes, "
                               f"not at {unit}-byte aligned addresses")
            if unit == 16:
                narrow = word_width(addresses)
        if op == LL_PUT:
            ops.append(Put("put", srcs_a[0], int(a[DST]), int(b[DST]), nbytes, int(a[PEER]),
                           int(a[STEP])))
        elif op == LL_GET:
            gets[(int(a[DST]), int(b[DST]))] = _Get(srcs_a[0], srcs_b[0], nbytes,
                                                    int(a[PEER]), int(a[STEP]))
        else:
            how = Reduction(int(a[REDOP]), int(a[DIVISOR])) if op == REDUCE else None
            sources = []
            for s_a, s_b in zip(srcs_a, srcs_b):
                got = gets.get((s_a, s_b))
                if got is not None and got.nbytes == nbytes:
                    sources.append(Source(1, got.even, got.odd, got.peer, got.step))
                    used.add((s_a, s_b))
                else:
                    sources.append(Source(0, s_a, s_b, -1, -1))
            ops.append(Move("move", int(a[DST]), int(b[DST]), nbytes, tuple(sources), dt, how,
                            narrow))
    if set(gets) - used:
        raise _Refused(f"rank {r} keeps an LL transfer's data for a row that does not read "
                       "it whole")
    _check_rank(r, ops, gets)
    return ops


def word_width(addresses) -> int:
    """The widest word (8, 4, 2 or 1 bytes) every address is aligned to.

    >>> word_width([0, 4096 + 6]), word_width([8, 24]), word_width([16, 32])
    (2, 8, 8)
    """
    width = 8
    while width > 1 and any(x % width for x in addresses):
        width //= 2
    return width


class _Get(NamedTuple):
    """An LL_GET row, folded into the move that reads its destination: the LL units it polls
    (``even``, ``odd``), its bytes and the sending peer and step."""

    even: int
    odd: int
    nbytes: int
    peer: int
    step: int


def _check_rank(r: int, ops: list[tuple], gets: dict) -> None:
    """Within the rank (or one lane of it): one element type and reduction, LL areas read
    only through moves, no two data rows between flag operations touching the same bytes
    (every LL peer heard from: :func:`_check_heard`, on the whole rank)."""
    moves = [op for op in ops if op.kind == "move"]
    kinds = {(op.dtype, op.how) for op in moves if op.how is not None}
    if len({op.dtype for op in moves}) > 1 or len(kinds) > 1:
        raise _Refused(f"rank {r} mixes element types or reductions")
    got = [Span(dst[0], dst[1], g.nbytes) for dst, g in gets.items()]
    for op in ops:
        if op.kind in ("put", "move"):
            w, reads = _accesses(op)
            plain = [x for x, src in zip(reads, op.sources if op.kind == "move" else (None,))
                     if not (src and src.is_ll)]
            if any(_meets(x, g) for x in (w, *plain) for g in got):
                raise _Refused(f"rank {r} touches an LL transfer's destination other than "
                               "by reading it whole (it is never written when fused)")
    segment: list = []
    for op in ops + [Notify("notify", -1, 0)]:  # the end closes the last segment
        if op.kind in ("wait", "notify"):
            for i, (w, reads) in enumerate(segment):
                for w2, reads2 in segment[i + 1:]:
                    if w and any(_clash(w, x) for x in (w2, *reads2) if x) or \
                            w2 and any(_clash(w2, x) for x in reads):
                        raise _Refused(f"rank {r} has two rows between flag operations that "
                                       "touch the same bytes")
            segment = []
        else:
            segment.append(_accesses(op))


def _check_heard(r: int, programs: list[list[tuple]]) -> None:
    """Rank ``r`` (its programs, one a lane) hears in the same call from every peer it sends
    LL units to: a wait on the peer's flag or LL units read from it, in any lane -- the
    rank's lanes run in one launch, so its next call starts after all of them ended."""
    ops = [op for prog in programs for op in prog]
    put_peers = {op.peer for op in ops if op.kind == "put"}
    heard = {op.peer for op in ops if op.kind == "wait"} | \
        {s.peer for op in ops if op.kind == "move" for s in op.sources if s.is_ll}
    if put_peers - heard:
        raise _Refused(f"rank {r} puts to rank {min(put_peers - heard)} without hearing from "
                       "it in the same call")


def _accesses(op) -> tuple:
    """(written :class:`Span` or None, read spans) of a data op (an LL unit doubles the
    bytes)."""
    if op.kind == "put":
        return (Span(op.dst_even, op.dst_odd, 2 * op.nbytes),
                (Span(op.source, op.source, op.nbytes),))
    n = op.nbytes
    return (Span(op.dst_even, op.dst_odd, n),
            tuple(Span(s.even, s.odd, 2 * n if s.is_ll else n) for s in op.sources))


def _clash(a: tuple, b: tuple) -> bool:
    """Spans that share bytes without being the same span: different threads would meet."""
    return a != b and _meets(a, b)


def _meets(a: tuple, b: tuple) -> bool:
    """Do spans ``a`` and ``b`` share a byte (in either parity)?"""
    # (written out: the bind's ordering checks call it millions of times for 8 ranks)
    ae, ao, an, be, bo, bn = a.even, a.odd, a.nbytes, b.even, b.odd, b.nbytes
    return (ae < be + bn and be < ae + an or ae < bo + bn and bo < ae + an
            or ao < be + bn and be < ao + an or ao < bo + bn and bo < ao + an)


def _check_ranks(ops_by_rank: list[list[tuple]]) -> None:
    """Across ranks (and flag operations of one rank): a written span meets another span only
    where both are the same span."""
    narrow = [(r, op) for r, ops in enumerate(ops_by_rank) for op in ops
              if op.kind == "move" and op.narrow]
    if narrow:  # only the copy-only builds copy odd-aligned rows: every rank must be one
        for r, ops in enumerate(ops_by_rank):
            for op in ops:
                if op.kind == "put" or op.kind == "move" and (
                        op.how is not None or len(op.sources) != 1 or op.sources[0].is_ll):
                    raise _Refused(
                        f"rank {narrow[0][0]} copies {narrow[0][1].nbytes} bytes at addresses "
                        f"aligned to {narrow[0][1].narrow} bytes, which only a program of "
                        f"plain copies runs, and rank {r} also "
                        f"{'sends LL units' if op.kind == 'put' else 'reduces or reads LL units'}")
    spans = []  # (rank, op index, span, writes)
    for r, ops in enumerate(ops_by_rank):
        for k, op in enumerate(ops):
            if op.kind in ("put", "move"):
                w, reads = _accesses(op)
                spans.append((r, k, w, True))
                spans += [(r, k, x, False) for x in reads]
    for i, (r, k, a, wa) in enumerate(spans):
        for r2, k2, b, wb in spans[i + 1:]:
            if (wa or wb) and (r, k) != (r2, k2) and _meets(a, b) and a != b:
                raise _Refused(f"rank {r} and rank {r2} touch overlapping but different "
                               "bytes: their items would fall to different blocks")


UNITS = {"fused": (16,), "fused-ll": (8, 4)}  # bytes a thread takes at a time, largest first
# ... and those the narrow builds take pieces at any address in (the last resort)
NARROW_UNITS = {"fused": (8,), "fused-ll": (8, 4)}


def fused_unit(lowered: list[LoweredRank], protocol: str) -> tuple[int, str | None]:
    """(unit, None) for the largest unit ``protocol``'s fused programs can take on the ranks
    of ``lowered`` ("fused": 16-byte items; "fused-ll": 8-byte LL units, else 4-byte halves
    of them for rows of 4-byte multiples -- an 8-byte message's chunks), or (the smallest
    unit, why not even that). 8- and 4-byte units at addresses they are not aligned to (the
    narrow builds, ``NARROW_UNITS``: on "fused" too, in plain 8-byte items) are the last
    resort: a plan whose rows all align to some unit takes that one."""
    for narrow, units in ((False, UNITS[protocol]), (True, NARROW_UNITS[protocol])):
        for unit in units:
            problem = fuse_problem(lowered, unit, narrow)
            if problem is None:
                return unit, None
    unit = UNITS[protocol][-1]  # (why not, said in the protocol's own smallest unit)
    return unit, fuse_problem(lowered, unit, False)


def fuse_problem(lowered: list[LoweredRank], unit: int = 16,
                 narrow: bool = True) -> str | None:
    """Why the ranks of ``lowered`` cannot run as fused programs taking ``unit`` bytes per
    thread at a time (a sentence naming the rank and row), or None; ``narrow``: 8- and
    4-byte units may copy, send and sum pieces at addresses they are not aligned to (the
    narrow builds, :func:`narrow_program`). Several lanes: each (rank, lane) judged as a
    program of its own (:func:`purlin.atom.fused_lanes.lane_slots`)."""
    from purlin.atom.fused_lanes import lane_slots

    try:
        slots = lane_slots(lowered)
        ops = [_rank_ops(low, unit, narrow) for low in slots]
        for low in lowered:
            _check_heard(low.rank, [o for s, o in zip(slots, ops) if s.rank == low.rank])
        _check_ranks(ops)
    except _Refused as exc:
        return str(exc)
    return None


def program(low: LoweredRank, error: int, abort: int, flag_slot, unit: int = 16,
            epilogue: Epilogue | None = None, threads: int = 0, ops: list | None = None,
            rotation: dict | None = None) -> FusedProgram:
    """The fused program of rank ``low`` (check the whole cluster with :func:`fuse_problem`
    first): ``error`` is the address of the rank's error record (``isa.ERR_WIDTH`` words),
    ``abort`` that of the cluster's abort word, ``flag_slot(address)`` the address of block
    0's slot for a lowered flag (block b's is ``8 * b`` further); every thread takes ``unit``
    bytes (16; 8: one LL unit, twice the threads for LL transfers; 4: half an LL unit) of a
    row at a time -- every rank of a cluster the same (:func:`fused_unit` picks it).
    ``epilogue`` (checked by :func:`epilogue_problem` for blocks of ``threads`` threads):
    a NORM op after the last move (its ops :func:`rank_ops`'s without narrow units). ``ops``
    and ``rotation``: the rank's ops and the rotation of each move (by op index) as
    :func:`regrouped` gives them (else :func:`rank_ops`'s, no rotation)."""
    if unit not in (4, 8, 16):
        raise CapabilityError(f"a fused program moves 16, 8 or 4 bytes per thread at a time, "
                              f"not {unit}")
    ops = rank_ops(low, unit, epilogue is None) if ops is None else list(ops)
    if epilogue is not None:
        problem = _epilogue_problem(low.rank, ops, epilogue, unit, threads)
        if problem:
            raise CapabilityError(f"cannot end with the epilogue: {problem}")
        ops.append(Norm("norm", epilogue))
    moves = [op for op in ops if op.kind == "move"] + \
        [part for op in ops if op.kind == "moves" for part in op.parts]
    dt = moves[0].dtype if moves else 0
    how = next((op.how for op in moves if op.how is not None), Reduction(0, 1))
    segs = [op for op in ops if op.kind in ("puts", "moves")]
    records = sum(len(op.parts) for op in segs)
    # segmented ops' bucket indexes right after the ops (in the words a block keeps in shared
    # memory), then their records (none of either: as before segments)
    index_at = F_HEAD + OP_WIDTH * len(ops)
    records_at = index_at + sum(_index_shape(op, unit)[1] for op in segs)
    sources_at = records_at + OP_WIDTH * records
    nsources = sum(len(op.sources) for op in moves) + (epilogue is not None)
    if epilogue is not None:  # its extra words, in whole source entries
        nsources += -(-len(epilogue.extras) // SOURCE_WIDTH)
    words = np.zeros(sources_at + SOURCE_WIDTH * nsources, dtype=np.int64)
    words[[F_RANK, F_NOPS, F_DTYPE, F_REDOP, F_DIVISOR, F_ERROR, F_ABORT, F_UNIT]] = \
        [low.rank, len(ops), dt, how[0], how[1], error, abort, unit]
    at = sources_at
    for k, op in enumerate(ops):
        if op.kind == "wait":
            row = (F_OP_WAIT, flag_slot(op.flag), op.per_call, op.value, op.epoch_offset,
                   op.peer, op.step, op.flag)
        elif op.kind == "notify":
            row = (F_OP_NOTIFY, flag_slot(op.flag), op.value)
        elif op.kind == "put":
            row = (F_OP_PUT, op.source, op.dst_even, op.dst_odd, op.nbytes, op.peer, op.step,
                   (rotation or {}).get(k, 0))
        elif op.kind in ("puts", "moves"):
            row, index_at, records_at, at = _segmented_row(words, op, index_at, records_at,
                                                           at, unit, (rotation or {}).get(k, 0))
        elif op.kind == "norm":  # its parameters take one source entry
            e = op.epilogue
            nbytes, chunk = moves[-1].nbytes, unit * threads
            row = (F_OP_NORM, e.target, e.target, nbytes, 1, at, nbytes // chunk,
                   e.hidden * ITEMSIZE[moves[-1].dtype] // chunk)
            eps = int(np.float32(e.eps).view(np.int32))
            words[at: at + SOURCE_WIDTH] = (e.residual, e.weight, e.sums, e.hidden, eps)
            words[at + SOURCE_WIDTH: at + SOURCE_WIDTH + len(e.extras)] = e.extras
            at += SOURCE_WIDTH * (1 + -(-len(e.extras) // SOURCE_WIDTH))
        else:
            row = (F_OP_MOVE, op.dst_even, op.dst_odd, op.nbytes, len(op.sources), at,
                   (rotation or {}).get(k, 0), op.narrow)
            for src in op.sources:
                words[at: at + SOURCE_WIDTH] = src
                at += SOURCE_WIDTH
        words[F_HEAD + OP_WIDTH * k: F_HEAD + OP_WIDTH * k + len(row)] = row
    return FusedProgram(words, len(ops), program_items(ops, unit), len(segs), tuple(ops))


def program_items(ops, unit: int) -> int:
    """The items of ``unit`` bytes a program of ``ops`` spreads over its threads (its
    largest row or segmented op's union; a partial item counts): what its grid is sized
    for (``FusedProgram.items``)."""
    moves = [op for op in ops if op.kind == "move"] + \
        [part for op in ops if op.kind == "moves" for part in op.parts]
    items = -(-max([op.nbytes for op in ops if op.kind == "put"]
                   + [op.nbytes for op in moves] + [unit]) // unit)
    return max([items] + [_union_items(op, unit) for op in ops if op.kind in ("puts", "moves")])


def row_items(nbytes: int, unit: int, narrow: int = 0, dst: int = 0) -> int:
    """Items a row of ``nbytes`` is cut into, one a thread: ``unit`` bytes each, the last
    one maybe partial; for a copy cut at its destination ``dst``'s 16-byte boundaries
    (``narrow`` holds ``isa.NARROW_SHIFT``), the destination's 16-byte slots it touches.

    >>> row_items(40, 16), row_items(40, 16, NARROW_SHIFT | 2, dst=14)
    (3, 4)
    """
    if narrow & NARROW_SHIFT:
        return ((dst & 15) + nbytes + 15) >> 4
    return -(-nbytes // unit)


def part_items(op, unit: int) -> int:
    """:func:`row_items` of a :class:`Put` or :class:`Move` (its even destination: a cut
    copy's destinations share their offset from a 16-byte boundary where it joins a
    segmented op)."""
    return row_items(op.nbytes, unit, op.narrow if op.kind == "move" else 0, op.dst_even)


def _union_items(op: Segments, unit: int) -> int:
    """Items the threads stride over in a segmented op (:func:`part_items` of each part)."""
    return sum(part_items(part, unit) for part in op.parts)


def _index_shape(op: Segments, unit: int) -> tuple[int, int]:
    """(log2 of a bucket's items, buckets) of a segmented op's bucket index
    (``isa.SEG_INDEX``): about two buckets a segment, so a thread's walk from its bucket's
    record crosses a segment or two.

    >>> _index_shape(Segments("moves", (Move("move", 0, 0, 16 * 100, (), 0, None),) * 3), 16)
    (5, 10)
    """
    items = _union_items(op, unit)
    shift = max(0, (items // (2 * len(op.parts))).bit_length() - 1)
    return shift, max(1, -(-items // (1 << shift)))


def _segmented_row(words: np.ndarray, op: Segments, index_at: int, records_at: int, at: int,
                   unit: int, rotation: int) -> tuple:
    """A segmented op's words: its bucket index written at ``index_at``, its records at
    ``records_at`` (and its moves' sources at ``at``): (its row, the next index's word, the
    next record's word, the next source's word)."""
    first, start = records_at, 0
    shift, buckets = _index_shape(op, unit)
    firsts = []  # each record's first item in the union
    for part in op.parts:
        firsts.append(start)
        if part.kind == "put":
            rec = (F_OP_PUT, part.source, part.dst_even, part.dst_odd, part.nbytes, part.peer,
                   part.step, start)
        else:
            rec = (F_OP_MOVE, part.dst_even, part.dst_odd, part.nbytes, len(part.sources), at,
                   start, part.narrow)
            for src in part.sources:
                words[at: at + SOURCE_WIDTH] = src
                at += SOURCE_WIDTH
        words[records_at: records_at + len(rec)] = rec
        records_at += OP_WIDTH
        start += part_items(part, unit)
    # bucket b's record: the last one starting at or before its first item (an empty
    # segment's record starts where the next one does; the walk steps over it)
    bucket_firsts = np.arange(buckets, dtype=np.int64) << shift
    holder = np.searchsorted(np.asarray(firsts, dtype=np.int64), bucket_firsts, "right") - 1
    words[index_at: index_at + buckets] = first + OP_WIDTH * holder
    kind = F_OP_PUTS if op.kind == "puts" else F_OP_MOVES
    cut = sum(part.kind == "move" and bool(part.narrow & NARROW_SHIFT)
              and (part.dst_even % 16 != 0 or part.dst_odd % 16 != 0) for part in op.parts)
    row = (kind, len(op.parts), first, start, rotation, index_at, shift, cut)
    return row, index_at + buckets, records_at, at


def _op_words(words: np.ndarray, k: int) -> np.ndarray:
    """Word ``k`` of each op of the fused program ``words``."""
    return words[F_HEAD + k: F_HEAD + OP_WIDTH * int(words[F_NOPS]): OP_WIDTH]


def _segmented(words: np.ndarray) -> np.ndarray:
    """Which ops of the fused program ``words`` are segmented (``isa.F_OP_PUTS``,
    ``isa.F_OP_MOVES``)."""
    return np.isin(_op_words(words, OP_KIND), (F_OP_PUTS, F_OP_MOVES))


def segmented_program(words: np.ndarray) -> bool:
    """Does the fused program ``words`` hold segmented ops (``isa.F_OP_PUTS``,
    ``isa.F_OP_MOVES``; then the ``fused_seg`` kernels run it, launcher name "fused-seg")?"""
    return bool(_segmented(words).any())


def cut_segments(words: np.ndarray) -> bool:
    """Does the fused program ``words`` hold a segmented op with pieces cut at unaligned
    destinations (``isa.SEG_CUT``; a copy-only launch then runs ``fused-seg-copy-narrow``)?"""
    return bool((_segmented(words) & (_op_words(words, SEG_CUT) != 0)).any())


def copies_only(words: np.ndarray) -> bool:
    """Does the fused program ``words`` only copy plain memory in 16-byte items -- every data
    op a MOVE (or a segmented one's records) of one source that is not LL units, no PUT, no
    NORM? The ``fused_copy`` kernels, built without the rest, run such programs.

    >>> from purlin.atom.host import HostBuffers
    >>> from purlin.snac import plan
    >>> from purlin.spec import collectives
    >>> def rank0(coll, ll):
    ...     low = HostBuffers(plan(coll, "direct-push", count=4096), ll=ll).lower()
    ...     return program(low[0], 0, 0, int, 16).words
    >>> copies_only(rank0(collectives.all_gather(4), False))
    True
    >>> copies_only(rank0(collectives.all_gather(4), True))  # LL units
    False
    >>> copies_only(rank0(collectives.all_reduce(4), False))  # sums
    False
    """
    if int(words[F_UNIT]) != 16:
        return False
    for kind, rec in _data_records(words):
        if kind != F_OP_MOVE:  # a PUT, a NORM
            return False
        if int(words[rec + MOVE_NSRC]) != 1 or \
                int(words[int(words[rec + MOVE_SOURCES]) + SOURCE_LL]) != 0:
            return False
    return True


def kernel_name(programs, traced: bool = False) -> str:
    """The Launcher name of the fused kernel that runs ``programs`` (one launch's words; no
    NORM): "fused", with "-seg" where one holds segmented ops, "-copy" where every one
    :func:`copies_only` (then "-narrow" where one has :func:`cut_segments`), else "-narrow"
    where one is a :func:`narrow_program`, and "-trace" for the traced twin. Each is the one
    kernel source compiled with only the code its programs need (``purlin.kernels.fused``)."""
    programs = list(programs)
    name = "fused"
    if any(segmented_program(w) for w in programs):
        name += "-seg"
        if any(fp8_sums(w) for w in programs):  # (fused_rows.cluster_programs keeps them apart)
            raise RuntimeError("FP8 sums run on fused-narrow only, but these programs hold "
                               "segmented ops (fused_rows.cluster_programs builds them "
                               "without): a bug, please report it")
    if programs and all(copies_only(w) for w in programs):
        name += "-copy"
        if any(cut_segments(w) for w in programs):
            name += "-narrow"
    elif any(narrow_program(w) for w in programs):
        name += "-narrow"
    return name + "-trace" if traced else name


def _data_records(words: np.ndarray):
    """(kind, word) of every PUT and MOVE of the fused program ``words``, a segmented op's
    records each as its own (kind ``F_OP_PUT`` / ``F_OP_MOVE``), and (kind, word) of the
    other ops (NORM: ``F_OP_NORM``); waits and notifies left out."""
    for k in range(int(words[F_NOPS])):
        at = F_HEAD + k * OP_WIDTH
        kind = int(words[at + OP_KIND])
        if kind in (F_OP_PUTS, F_OP_MOVES):
            first = int(words[at + SEG_TABLE])
            for rec in range(first, first + OP_WIDTH * int(words[at + SEG_COUNT]), OP_WIDTH):
                yield (F_OP_PUT if kind == F_OP_PUTS else F_OP_MOVE), rec
        elif kind not in (F_OP_WAIT, F_OP_NOTIFY):
            yield kind, at


def fp8_sums(words: np.ndarray) -> bool:
    """Does the fused program ``words`` sum FP8 (a MOVE of several sources)?"""
    return int(words[F_DTYPE]) in FUSED_COPY_DTYPES and any(
        kind == F_OP_MOVE and int(words[at + MOVE_NSRC]) > 1
        for kind, at in _data_records(words))


def narrow_program(words: np.ndarray) -> bool:
    """Does the fused program ``words`` move a piece at addresses not aligned to its unit (a
    piece of odd size inside a user's buffer), or sum FP8? Copy-only programs of 16-byte
    items copy such pieces themselves (``isa.MOVE_NARROW``); programs of 8- and 4-byte units
    that do either run on the narrow builds (``purlin.kernels.fused.fused_narrow``)."""
    unit = int(words[F_UNIT])
    if fp8_sums(words):
        return True
    for kind, at in _data_records(words):
        if kind == F_OP_PUT:
            addresses = [words[at + PUT_SRC]]
        elif kind == F_OP_MOVE:
            first = int(words[at + MOVE_SOURCES])
            entries = [first + s * SOURCE_WIDTH for s in range(int(words[at + MOVE_NSRC]))]
            addresses = [words[at + MOVE_DST], words[at + MOVE_DST + 1]] + \
                [words[e + SOURCE_ADDR + p] for e in entries if words[e + SOURCE_LL] == 0
                 for p in (0, 1)]
        else:
            continue
        if any(int(a) % unit for a in addresses):
            return True
    return False


def oneshot_problem(words: np.ndarray) -> str | None:
    """Why the one-shot epilogue kernel (:mod:`purlin.kernels.epilogue`) cannot run the fused
    program ``words`` (a sentence), or None: it runs the direct-push all-reduce on LL
    transfers ending with the epilogue -- a PUT of the rank's input to each peer, one MOVE
    summing one LL source per PUT and that input into the epilogue's target, the NORM --
    on 8-byte units of bfloat16, float16 or float32.

    >>> from purlin.spec import collectives
    >>> from purlin.snac import plan
    >>> from purlin.atom.lowering import lower
    >>> s = plan(collectives.all_reduce(2), "direct-push", count=64, dtype="bfloat16")
    >>> at = {(r, b): (1 + 4 * r + i) << 20 for r in range(2)
    ...       for i, b in enumerate(("input", "output", "scratch", "ll"))}
    >>> low = lower(s, at, {r: (9 + r) << 20 for r in range(2)},
    ...             ll_bases={r: at[(r, "ll")] for r in range(2)})
    >>> e = Epilogue(at[(0, "output")], 1 << 30, 2 << 30, 3 << 30, hidden=16, eps=1e-5)
    >>> oneshot_problem(program(low[0], 0, 0, int, 8, e, threads=2).words) is None
    True
    >>> oneshot_problem(program(low[0], 0, 0, int, 8).words)
    'rank 0: its program is not PUTs, one MOVE and the NORM epilogue'
    """
    head = [int(x) for x in words[:F_HEAD]]
    r, nops = head[F_RANK], head[F_NOPS]
    if head[F_UNIT] != 8:
        return f"rank {r}: its threads take {head[F_UNIT]} bytes at a time, not one LL unit's 8"
    if narrow_program(words):
        return f"rank {r}: it moves a piece at addresses not aligned to 8 bytes"
    if head[F_DTYPE] not in (0, 1, 2) or head[F_REDOP] != 0:
        return (f"rank {r}: it sums dtype code {head[F_DTYPE]} with reduce op code "
                f"{head[F_REDOP]}, not a float sum")
    kinds = [int(words[F_HEAD + k * OP_WIDTH + OP_KIND]) for k in range(nops)]
    if nops < 3 or kinds[-2:] != [F_OP_MOVE, F_OP_NORM] or \
            any(kind != F_OP_PUT for kind in kinds[:-2]):
        return f"rank {r}: its program is not PUTs, one MOVE and the NORM epilogue"
    move = F_HEAD + (nops - 2) * OP_WIDTH
    nbytes, nsrc, first = (int(words[move + w]) for w in (MOVE_BYTES, MOVE_NSRC, MOVE_SOURCES))
    sources = [[int(x) for x in words[first + s * SOURCE_WIDTH:][:SOURCE_WIDTH]]
               for s in range(nsrc)]
    plain = [s for s in sources if s[SOURCE_LL] == 0]
    if len(plain) != 1 or len(sources) - 1 != nops - 2:
        return (f"rank {r}: its move reads {len(plain)} plain and {len(sources) - len(plain)} "
                f"LL sources; the one-shot kernel reads its input and one LL source per PUT")
    for k in range(nops - 2):
        put = F_HEAD + k * OP_WIDTH
        if int(words[put + PUT_SRC]) != plain[0][SOURCE_ADDR] or \
                int(words[put + PUT_BYTES]) != nbytes:
            return f"rank {r}: PUT {k} sends other bytes than the move's input"
    return None


def grid(items: int, ranks_in_launch: int = 1, sms: int = 132,
         unit: int = 16) -> tuple[int, int]:
    """(blocks per rank, threads) for fused programs of ``items`` items of ``unit`` bytes:
    about one item per thread, 128 threads per block up to 16 KiB, 256 up to 128 KiB, else
    512, at most 32 blocks per rank below 4 MiB and every SM above, and few enough for every
    rank slot of the launch (a rank's, or a lane's: ``purlin.atom.fused_lanes``) to be
    resident (:func:`purlin.kernels.occupancy.resident_blocks`).

    >>> grid(512), grid(4096), grid(1 << 16), grid(1 << 16, ranks_in_launch=8), grid(1 << 24)
    ((4, 128), (16, 256), (32, 512), (16, 512), (132, 512))
    """
    nbytes = items * unit
    threads = 128 if nbytes <= 16 << 10 else 256 if nbytes <= 128 << 10 else 512
    most = 32 if nbytes < 4 << 20 else F_MAX_BLOCKS
    blocks = max(1, min(most, -(-items // threads)))
    return max(1, min(blocks, resident_blocks(sms, threads) // ranks_in_launch)), threads


def round_blocks(items: int, blocks: int, threads: int, most: int) -> int:
    """``blocks``, or one more (at most ``most``) where that saves the rank's threads a round
    over ``items`` -- a size a few elements past a whole one, whose last partial item would
    otherwise give one thread a round of its own (every thread's loads wait for it).

    >>> round_blocks(8192, 32, 256, 64), round_blocks(8193, 32, 256, 64)
    (32, 33)
    >>> round_blocks(8193, 32, 256, 32), round_blocks(3 * 8192, 32, 256, 64)
    (32, 32)
    """
    rounds = -(-items // (blocks * threads))
    if rounds > 1 and blocks < most and items <= (rounds - 1) * (blocks + 1) * threads:
        return blocks + 1
    return blocks


def threads_grid(nbytes: int, unit: int, threads: int, sms: int = 132) -> tuple[int, int] | None:
    """(blocks per rank, threads) with one ``unit``-byte item per thread of blocks of
    ``threads`` over ``nbytes``, or None where that takes more blocks than a fused launch
    runs or than fit at once.

    >>> threads_grid(8192, 8, 64), threads_grid(1 << 24, 8, 32)
    ((16, 64), None)
    """
    blocks = -(-nbytes // (unit * threads))
    return (blocks, threads) if blocks <= min(F_MAX_BLOCKS, resident_blocks(sms, threads)) else None


def row_grid(nbytes: int, row_bytes: int, sms: int = 132) -> tuple[int, int] | None:
    """(blocks per rank, threads) of 16-byte items on which every block of a fused
    all-reduce of ``nbytes`` owns whole rows of ``row_bytes`` -- so its RMSNorm epilogue
    (:class:`Epilogue`) sums each row inside one block, with no row sums traded between
    blocks: a row per block of ``row_bytes / 16`` threads (a multiple of 32, at most
    ``MAX_THREADS``, one block per SM), or one row on one block of ``MAX_THREADS``. None
    where neither fits (the all-reduce's own grid then trades row sums).

    >>> row_grid(8192, 8192), row_grid(64 * 8192, 8192), row_grid(16384, 16384)
    ((1, 512), (64, 512), (1, 512))
    >>> row_grid(32 * 16384, 16384), row_grid(3 * 2000, 2000)
    (None, None)
    """
    if row_bytes <= 0 or nbytes % row_bytes or row_bytes % 16:
        return None
    rows, threads = nbytes // row_bytes, row_bytes // 16
    if threads <= MAX_THREADS and threads % 32 == 0 and rows <= min(F_MAX_BLOCKS, sms):
        return rows, threads
    if rows == 1 and threads % MAX_THREADS == 0 and threads // MAX_THREADS <= MAX_THREADS:
        return 1, MAX_THREADS
    return None


def fused_problems(schedule) -> dict:
    """For each fused protocol of the sm datapath, why ``schedule`` cannot run on the fused
    kernel (a sentence) or None -- decided on the lowered tables with stand-in addresses laid
    out as the sm datapath lays out its buffers (16-byte aligned, scratch copies rounded up).

    >>> from purlin.spec import collectives
    >>> from purlin.snac import plan
    >>> fused_problems(plan(collectives.all_reduce(2), "direct-push", count=64))
    {'fused': None, 'fused-ll': None}
    >>> ring = plan(collectives.all_reduce(2), "ring", count=64, chunks=2, lanes=2)
    >>> fused_problems(ring)  # a program per lane (purlin.atom.fused_lanes)
    {'fused': None, 'fused-ll': None}
    """
    from purlin.atom.lowering import lower, scratch_copy_bytes

    n = schedule.nranks
    scratch = scratch_copy_bytes(schedule)
    bases, ll = {}, {}
    for r in range(n):
        for k, buffer in enumerate(("input", "output", "scratch", "ll", "flags")):
            bases[(r, buffer)] = (1 + 8 * r + k) << 40
        ll[r] = bases[(r, "scratch")] + scratch[r] * schedule.scratch_copies
    flags = {r: bases[(r, "flags")] for r in range(n)}  # 1 TiB apart: room for any buffer
    out = {}
    for protocol, ll_bases in (("fused", None), ("fused-ll", ll)):
        low = lower(schedule, bases, flags, blocks_per_lane=1, scratch_bytes=scratch,
                    ll_bases=ll_bases)
        out[protocol] = fused_unit(low, protocol)[1]
    return out
