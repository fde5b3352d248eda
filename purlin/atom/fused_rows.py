"""Many small rows on the fused kernel: one flag per peer where a layout sends several pieces.

A layout whose ranks send several pieces to each peer (an all-gather of q, k and v delivered
interleaved) lowers to a row, a notify and a wait per piece: three times the flag operations
of its standard twin, each a block barrier, and rows of a few hundred bytes that each keep
most threads idle. :func:`regroup` merges a rank's notifies of one flag into the last of
them and its waits of one flag into the first, where only data rows lie between (small
ones: :data:`MERGE_BYTES`); :func:`rotations` then spreads the rows between two flag
operations over different threads (``isa.MOVE_ROTATE``), the same rotation wherever two
rows touch the same bytes, so a block still meets only its own items. :func:`segmented`
goes further: one peer's rows of a step become one segmented PUT or MOVE
(``isa.F_OP_PUTS``, ``F_OP_MOVES``, run by the ``fused_seg`` kernels), its threads striding
over the union of the rows' items, so the program has its standard twin's ops (the GQA
all-gather on 4 ranks: 13 ops against 27 a row each). :func:`joined` then makes a rank's LL
PUTs one op and its copies of LL units (with its plain copies that pull from no peer)
another, every layout's (an all-gather on 4 ranks: 2 ops on LL, against 7 rows; the GQA
all-gather's 21). :func:`gathered` then moves a program's waits before the copies and PUTs
between them and its notifies after, so that they run as one poll round and one fence.
ARCHITECTURE.md, "The fused kernel".

>>> from purlin.spec import Collective
>>> from purlin.snac import plan
>>> from purlin.atom.lowering import lower
>>> qkv = Collective([[(r, t) for t in "qkv"] for r in range(2)],
...                  [[(r, t) for t in "qkv" for r in range(2)]] * 2, "copy")
>>> s = plan(qkv, "direct-push", chunk_sizes={(r, t): 8 for r in range(2) for t in "qkv"})
>>> at = {(r, b): (1 + 4 * r + i) << 20 for r in range(2)
...       for i, b in enumerate(("input", "output", "scratch", "ll"))}
>>> low = lower(s, at, {r: (9 + r) << 20 for r in range(2)})
>>> before = [op.kind for op in rank_ops(low[0])]
>>> ops, rot = regrouped(low)
>>> before.count("notify"), [op.kind for op in ops[0]].count("notify"), sorted(rot[0].values())
(3, 1, [2, 2, 4, 4, 6, 8])
>>> seg = segmented(ops, 16)
>>> len(ops[0]), [op.kind for op in seg[0]]
(11, ['moves', 'moves', 'notify', 'wait', 'moves'])
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from purlin.kernels.isa import NARROW_SHIFT
from purlin.atom.fused import (FUSED_COPY_DTYPES, FusedProgram, Segments, Span, _Refused,
                               _accesses, _check_rank, _clash, _meets, part_items, program,
                               program_items, rank_ops)
from purlin.atom.lowering import moved

__all__ = ["MERGE_BYTES", "NARROW_SEGMENT_BYTES", "ROTATE_ITEMS", "ClusterOps", "acked",
           "aligned", "cluster_ops", "cluster_programs", "deadlock_free", "gathered", "joined",
           "launch_ops", "ll_pieces", "merged_flags", "regroup", "regrouped", "rotations",
           "rounds", "segmented", "segmented_pieces", "several_pieces", "shifted_copies"]

MERGE_BYTES = 256 << 10  # data bytes between two merged flag operations, at most: above it a
# flag per piece lets the peer start on the first piece while the next one moves
NARROW_SEGMENT_BYTES = 256 << 10  # odd-aligned rows above it stay rows of their own: a
# segmented op's batches gain where a thread holds a slot or two of each row and cost where
# it holds many (docs/PERF_NOTES.md, "Odd-aligned copies in aligned words")
ROTATE_ITEMS = 4096  # rows rotated past this many items would gain nothing (every thread
# has work) and would cost the kernel a longer loop to find its first item


def _blocking(op) -> bool:
    """Ops a notify must not be moved past (they wait for a peer) or that send (a PUT)."""
    return op.kind in ("wait", "put", "norm") or \
        op.kind == "move" and any(s.is_ll for s in op.sources)


def regroup(r: int, ops: list[tuple]) -> list[tuple]:
    """Rank ``r``'s fused ops with its notifies of one flag merged into the last of them and
    its waits of one flag into the first (the larger value), where only plain data rows of
    at most :data:`MERGE_BYTES` lie between -- or ``ops`` itself (the same object) where
    nothing merges or the result breaks a soundness rule.

    A notify moved later only delays the peer, a wait moved earlier only holds this rank
    longer, and neither passes an op that waits or signals, so no rank waits on what the
    move put off: a merged program is one the peers' programs (merged or not) run with.
    """
    if any(op.kind == "put" for op in ops):  # (its LL rules are checked on the order given)
        return ops
    out = _merge_waits(_merge_notifies(ops))
    if len(out) == len(ops):
        return ops
    try:
        _check_rank(r, out, {})  # the segment rule on the new order
    except _Refused:
        return ops
    return out


def _merge_notifies(ops: list[tuple]) -> list[tuple]:
    out: list = []
    last: dict = {}  # flag -> (index in out, data bytes in out when it was placed)
    moved = 0  # plain data bytes since the last blocking op
    for op in ops:
        if _blocking(op):
            last, moved = {}, 0
        elif op.kind == "move":
            moved += op.nbytes
        elif op.kind == "notify":
            seen = last.get(op.flag)
            if seen is not None and moved - seen[1] <= MERGE_BYTES:
                op = op._replace(value=op.value + out[seen[0]].value)
                out[seen[0]] = None
            last[op.flag] = (len(out), moved)
        out.append(op)
    return [op for op in out if op is not None]


def _merge_waits(ops: list[tuple]) -> list[tuple]:
    out: list = []
    first: dict = {}  # (flag, per call, epoch offset) -> (index in out, data bytes then)
    moved = 0
    for op in ops:
        if op.kind in ("notify", "put", "norm"):
            first, moved = {}, 0
        elif op.kind == "move":
            moved += op.nbytes
        elif op.kind == "wait":
            key = (op.flag, op.per_call, op.epoch_offset)
            seen = first.get(key)
            if seen is not None and moved - seen[1] <= MERGE_BYTES:
                w = out[seen[0]]
                if op.value > w.value:
                    out[seen[0]] = w._replace(value=op.value, peer=op.peer, step=op.step)
                continue
            first[key] = (len(out), moved)
        out.append(op)
    return out


def rotations(ops_by_rank: list[list[tuple]], unit: int, ll: bool = False) -> list[dict]:
    """For each rank, {op index: rotation} of its moves: the rows between two flag operations
    of a rank take consecutive threads (a row's item i is thread (i + rotation) mod the
    rank's threads'), and rows that touch the same bytes -- on any rank, in any segment --
    share their rotation, so each item stays with one block (its flag slot orders it) and,
    inside a segment, with one thread. Rows touching a PUT's or LL transfer's bytes keep 0
    unless ``ll`` (then PUTs and LL moves rotate too, :func:`ll_pieces`, and an LL area's
    units tie no rotations: each is polled by its tag -- except an :func:`acked` one's);
    rows past :data:`ROTATE_ITEMS` keep 0."""
    rows = [(r, k) for r, ops in enumerate(ops_by_rank) for k, op in enumerate(ops)
            if op.kind in ("put", "move")]
    parent = {row: row for row in rows}
    tied = acked(ops_by_rank) if ll else frozenset()

    def find(x):
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    touching: dict = {}  # span -> [(row, writes)]
    segment: dict = {}
    for r, ops in enumerate(ops_by_rank):
        seg = 0
        for k, op in enumerate(ops):
            if op.kind in ("wait", "notify", "norm"):
                seg += 1
                continue
            if op.kind not in ("put", "move"):
                continue
            segment[(r, k)] = (r, seg)
            w, reads = _accesses(op)
            if ll:  # (LL units are polled by their tag: writer and reader need not match)
                w = None if op.kind == "put" and w not in tied else w
                reads = reads if op.kind == "put" else \
                    tuple(x for x, src in zip(reads, op.sources) if not src.is_ll or x in tied)
            if w is not None:
                touching.setdefault(w, []).append(((r, k), True))
            for x in reads:
                touching.setdefault(x, []).append(((r, k), False))
    for span, who in touching.items():
        if any(writes for _, writes in who):
            for row, _ in who[1:]:
                parent[find(row)] = find(who[0][0])
    members: dict = {}
    for row in rows:
        members.setdefault(find(row), []).append(row)
    fill: dict = {}
    out: list = [{} for _ in ops_by_rank]
    for group in sorted(members.values()):
        ops = [ops_by_rank[r][k] for r, k in group]
        items = max(part_items(op, unit) for op in ops)
        fixed = not ll and any(op.kind == "put" or any(s.is_ll for s in op.sources)
                               for op in ops)
        segs = {segment[row] for row in group}
        at = 0 if fixed else max(fill.get(s, 0) for s in segs)
        if at + items > ROTATE_ITEMS:  # (LL: wrap around, so later rows keep spreading
            at = at % ROTATE_ITEMS if ll else 0  # over every thread of a power-of-two grid)
        for s in segs:
            fill[s] = max(fill.get(s, 0), at + items)
        if at:
            for r, k in group:
                out[r][k] = at
    return out


def ll_pieces(ops_by_rank: list[list[tuple]]) -> bool:
    """Does some rank send one peer several LL transfers (a piece each: q, k and v)? Then its
    PUTs and LL moves rotate too (:func:`rotations`), so the pieces of one peer and of all
    peers go on different threads at once; no standard collective's program does (each
    sends a peer one transfer), so theirs stay as they were.

    Rotating LL rows is sound for any assignment of items to threads: an LL unit carries its
    call's tag, so the reader polls it whichever block wrote it; rows sharing bytes with a
    plain row still share its rotation (:func:`rotations`); and "a rank sending LL units to
    a peer hears from it in the same call" holds per rank, not per block -- a rank's next
    call starts only after every block of its call ended, and what it heard from the peer
    in that call was written after the peer's previous call had ended on every block, so no
    block of the peer can still be reading the parity the next-but-one call rewrites. Where
    the rank hears nothing from the peer in the call, that holds per block only
    (:func:`acked`), and those units stay on the blocks that read them."""
    for ops in ops_by_rank:
        peers = [op.peer for op in ops if op.kind == "put"]
        if len(peers) != len(set(peers)):
            return True
    return False


def regrouped(lowered, unit: int = 16) -> tuple[list[list[tuple]], list[dict]]:
    """(each rank's fused ops, each rank's move rotations) of ``lowered`` (checked with
    :func:`purlin.atom.fused.fuse_problem` first): :func:`regroup` on every rank and, where
    it merged something on some rank, :func:`rotations` -- else the ops as
    :func:`purlin.atom.fused.rank_ops` gives them and no rotation (the standard
    collectives' programs stay as they were)."""
    plain = [rank_ops(low, unit) for low in lowered]
    ops = [regroup(low.rank, o) for low, o in zip(lowered, plain)]
    ll = ll_pieces(ops)
    if all(a is b for a, b in zip(ops, plain)) and not ll:
        return plain, [{} for _ in lowered]
    return ops, rotations(ops, unit, ll)


def several_pieces(schedule) -> bool:
    """Does some rank send another several pieces of its input in one call (GQA's q, k and
    v), unchunked? The layouts segmented ops are for (``cluster_programs(...,
    segments=...)``); a standard collective sends each peer one piece.

    >>> from purlin.spec import Collective, collectives
    >>> from purlin.snac import plan
    >>> qkv = Collective([[(r, t) for t in "qkv"] for r in range(2)],
    ...                  [[(r, t) for t in "qkv" for r in range(2)]] * 2, "copy")
    >>> several_pieces(plan(qkv, "direct-push", count=8))
    True
    >>> several_pieces(plan(collectives.all_gather(2), "direct-push", count=8))
    False
    """
    if schedule.chunks != 1:  # (chunked pipelines keep their flags, as their LL transfers do)
        return False
    coll = schedule.sizing.collective
    return any(_runs(row, out) > 1 for r, row in enumerate(coll.input)
               for p, out in enumerate(coll.output) if p != r)


def _runs(row, out) -> int:
    """Pieces of input ``row`` that output ``out`` holds, counted as runs: names next to each
    other in both, in the same order, are one piece (an all-reduce's parts are one)."""
    at = {name: k for k, name in reversed(list(enumerate(out)))}  # (first place in out)
    runs, last = 0, None
    for k, name in enumerate(row):
        if name not in at:
            last = None
            continue
        if last is None or at[name] != at[row[last]] + 1 or k != last + 1:
            runs += 1
        last = k
    return runs


def cluster_programs(lowered, error_of, abort: int, flag_slot, unit: int = 16,
                     segments: bool = False, join: bool = True) -> list:
    """:func:`purlin.atom.fused.program` of every rank of ``lowered`` (of every lane, for
    several: :meth:`ClusterOps.programs`) on the ops of :func:`cluster_ops`
    (``error_of(rank)``: the rank's error record address). A trace of
    the program names the table rows of each op (``purlin.atom.fused_trace.program_rows``)."""
    return cluster_ops(lowered, unit, segments, join).programs(error_of, abort, flag_slot)


def launch_ops(schedule, lowered, unit: int) -> ClusterOps:
    """The ops every rank runs ``schedule`` with on the fused kernel (``lowered``: its
    ranks' tables; several lanes run a program each: ``purlin.atom.fused_lanes``):
    :func:`cluster_ops` with segmented ops for the layouts :func:`several_pieces` finds and LL rows joined --
    what a single-process cluster (``purlin.atom.sm``) and each process of process mode
    (``purlin.torch.sm_path``) build, so that a collective runs the same programs either way.
    (A program ending with an epilogue is its rank's own ops and a NORM op, built apart:
    ``fused.program(..., epilogue=...)``.)"""
    return cluster_ops(lowered, unit, segments=several_pieces(schedule), join=True)


def cluster_ops(lowered, unit: int = 16, segments: bool = False,
                join: bool = True) -> ClusterOps:
    """Every rank's fused ops of ``lowered`` and their rotations: the :func:`regrouped`
    ops; with ``segments`` (for the layouts :func:`several_pieces` finds) the notifies
    before each rank's first wait moved before its copies where they may
    (:func:`notified_early`), then one peer's rows gathered into segmented ops where
    :func:`segmented` can, else the rotated rows; then (``join``) LL rows joined across
    flag operations (:func:`joined`) and each program's flags gathered around its copies
    and PUTs (:func:`gathered`) where a program has no NORM. Odd-aligned rows
    (``Move.narrow``) are first cut at their destination's 16-byte boundaries where they
    may (:func:`shifted_copies`); they join segmented ops as plain copies do (but
    :func:`_own_row`); where no segmented op holds them they spread over threads
    (:func:`rotations`). Each pass decides on every rank's ops at once (flags, partners,
    races), from the tables alone: any process holding all of them gets the same ops.
    Several lanes: a program per (rank, lane) (:func:`purlin.atom.fused_lanes.lane_slots`),
    each judged and rewritten as a rank's."""
    from purlin.atom.fused_lanes import lane_slots

    lowered = lane_slots(lowered)
    ops, rot = regrouped(lowered, unit)
    narrow = any(op.kind == "move" and op.narrow for rank in ops for op in rank)
    if narrow:  # (before segments: a copy cut at its destination's boundaries may join one)
        ops = shifted_copies(ops)
    user = [low.user for low in lowered]
    # (FP8 sums run on fused_narrow alone: no segmented op anywhere in their programs)
    fp8 = any(_fp8_sum(op) for rank in ops for op in rank)
    got = segmented_pieces(ops, unit, user) if segments and not fp8 else None
    if got is not None:
        ops, rot = got
    norm = any(op.kind == "norm" for rank in ops for op in rank)  # (fused_norm: no segments)
    if join and not norm:
        got = None if fp8 else joined(ops, unit, user)
        if got is not None:
            ops, rot = got, aligned(got, unit)
        got = gathered(ops, unit, user)
        if got is not None:
            ops, rot = got, aligned(got, unit)
    if narrow and not any(op.kind in ("puts", "moves") for rank in ops for op in rank):
        # (odd-aligned rows in no segmented op: spread them over threads, or each row between
        # two flag operations waits for the one before on the same threads)
        rot = rotations(ops, unit)
    return ClusterOps(tuple(lowered), tuple(tuple(o) for o in ops), tuple(rot), unit)


@dataclass(frozen=True)
class ClusterOps:
    """:func:`cluster_ops`' result: ``ops[i]`` and ``rotations[i]`` (move rotations by op
    index) of slot ``lowered[i]`` -- a rank's (one lane), or one lane of rank
    ``lowered[i].rank`` (:func:`purlin.atom.fused_lanes.lane_slots`) -- for programs of
    ``unit``-byte items."""

    lowered: tuple
    ops: tuple
    rotations: tuple
    unit: int

    def program(self, rank: int, error: int, abort: int, flag_slot,
                moves: dict | None = None) -> list[FusedProgram]:
        """Rank ``rank``'s :func:`purlin.atom.fused.program` per slot, launched side by side
        (one without lanes; ``error``: the rank's error record's address); ``moves`` (``(old
        address, bytes)`` -> new address, as ``lowering.relocate`` takes): of its table
        relocated there -- its ops with their addresses moved, so that it keeps the flags and
        rotations its peers' programs were written with (the caller checks the moved rows
        with ``fused.fuse_problem``)."""
        return [self._program(i, error, abort, flag_slot, moves)
                for i, low in enumerate(self.lowered) if low.rank == rank]

    def _program(self, i: int, error: int, abort: int, flag_slot, moves=None):
        ops = self.ops[i] if not moves else [_relocated(op, moves) for op in self.ops[i]]
        return program(self.lowered[i], error, abort, flag_slot, self.unit, ops=ops,
                       rotation=self.rotations[i])

    def programs(self, error_of, abort: int, flag_slot) -> list[FusedProgram]:
        """Every slot's program, rank by rank (``error_of(rank)``: its error record's
        address): a launch of all ranks."""
        return [self._program(i, error_of(low.rank), abort, flag_slot)
                for i, low in enumerate(self.lowered)]

    def items(self) -> int:
        """The largest program's items, every rank's: what a launch's grid is sized for, the
        same on every rank (block b of a rank waits only for block b of its peers)."""
        return max(program_items(ops, self.unit) for ops in self.ops)


def _relocated(op, moves: dict):
    """Fused op ``op`` with the addresses ``lowering.relocate`` moves moved: destinations of
    moves and every source (a PUT's destination is a peer's LL area, which never moves)."""
    if op.kind in ("puts", "moves"):
        return op._replace(parts=tuple(_relocated(part, moves) for part in op.parts))
    if op.kind == "put":
        return op._replace(source=moved(op.source, moves))
    if op.kind == "move":
        return op._replace(dst_even=moved(op.dst_even, moves), dst_odd=moved(op.dst_odd, moves),
                           sources=tuple(s._replace(even=moved(s.even, moves),
                                                    odd=moved(s.odd, moves))
                                         for s in op.sources))
    return op


def shifted_copies(ops_by_rank: list[list[tuple]]) -> list[list[tuple]]:
    """The ops with ``isa.NARROW_SHIFT`` added to each odd-aligned copy (``Move.narrow``)
    that may be cut at its destination's 16-byte boundaries (the kernel then stores aligned
    16-byte words from shifted loads, ``_copy_shifted``): one whose destination is aligned
    (the same cut as its items'), or whose destination no other row of the launch, on any
    rank, reads or writes and whose source none writes (its bytes may fall to other blocks
    than its items': only the launch's end orders them for their readers)."""
    out = [list(ops) for ops in ops_by_rank]
    norm = any(op.kind == "norm" for ops in out for op in ops)
    rows = [(r, k, _accesses(part)) for r, ops in enumerate(ops_by_rank)
            for k, op in enumerate(ops) if op.kind in ("put", "move", "puts", "moves")
            for part in _parts(op)]
    touched = _Touched(rows)
    for r, k, acc in rows:  # (a narrow row is in no segmented op: its (r, k) is its own)
        op = out[r][k]
        if op.kind != "move" or not op.narrow:
            continue
        aligned = op.dst_even % 16 == 0 and op.dst_odd % 16 == 0
        if aligned or not norm and not touched.conflict(r, k, acc):
            out[r][k] = op._replace(narrow=op.narrow | NARROW_SHIFT)
    return out


class _Touched:
    """Every span of a launch's rows, to ask at once whether any other row conflicts with
    one (:func:`_accesses_conflict` against each, in numpy: an 8-rank GQA launch has
    thousands of rows)."""

    def __init__(self, rows: list) -> None:
        spans = np.array([(r, k, s.even, s.odd, s.nbytes, i == 0) for r, k, (w, reads) in rows
                          for i, s in enumerate((w, *reads))], dtype=np.int64).reshape(-1, 6)
        self.rank, self.index, self.even, self.odd, self.nbytes, writes = spans.T
        self.writes = writes.astype(bool)

    def _meeting(self, s):
        """Which spans share a byte with span ``s`` (either parity, :func:`_meets`)."""
        out = None
        for x in (s.even, s.odd):
            for y in (self.even, self.odd):
                m = (x < y + self.nbytes) & (y < x + s.nbytes)
                out = m if out is None else out | m
        return out

    def conflict(self, r: int, k: int, acc: tuple) -> bool:
        """Does a row other than rank ``r``'s op ``k`` conflict with accesses ``acc``?"""
        w, reads = acc
        hit = self._meeting(w)
        for x in reads:
            hit |= self._meeting(x) & self.writes
        return bool((hit & ((self.rank != r) | (self.index != k))).any())


# ---------------------------------------------------------------- segmented ops

def _plain_move(op) -> bool:
    return op.kind == "move" and not any(s.is_ll for s in op.sources)


def _conflict(a, b) -> bool:
    """Do data ops ``a`` and ``b`` touch a byte in common that one of them writes?"""
    return _accesses_conflict(_accesses(a), _accesses(b))


def _accesses_conflict(a: tuple, b: tuple) -> bool:
    """:func:`_conflict` on two ops' :func:`_accesses`."""
    (wa, ra), (wb, rb) = a, b
    if _meets(wa, wb):
        return True
    for x in rb:
        if _meets(wa, x):
            return True
    for x in ra:
        if _meets(wb, x):
            return True
    return False


def _partners(ops_by_rank: list[list[tuple]], user: list | None = None) -> dict:
    """{(rank, op index): the other ranks that touch a byte of the op's where one of the two
    writes} for every data op (what tells one peer's plain rows from another's); with
    ``user`` (each rank's ``LoweredRank.user``), a rank's caller writes its input, so a row
    reading a peer's input has that peer for a partner."""
    spans: dict = {}
    for r, ops in enumerate(ops_by_rank):
        for k, op in enumerate(ops):
            if op.kind in ("put", "move"):
                w, reads = _accesses(op)
                spans.setdefault(w, []).append((r, k, True))
                for x in reads:
                    spans.setdefault(x, []).append((r, k, False))
    out: dict = {}
    for who in spans.values():
        for r, k, writes in who:
            out.setdefault((r, k), set()).update(
                r2 for r2, _, w2 in who if r2 != r and (writes or w2))
    inputs = [(q, Span(at, at, nbytes)) for q, ((at, nbytes), _) in enumerate(user or ())
              if nbytes]
    for span, who in spans.items():
        for q, given in inputs:
            if _meets(span, given):
                for r, k, _ in who:
                    if r != q:
                        out[(r, k)].add(q)
    return {row: frozenset(v) for row, v in out.items()}


def _own_row(op) -> bool:
    """Must odd-aligned copy ``op`` stay out of segmented ops? Where it is above
    :data:`NARROW_SEGMENT_BYTES`, or cut at its destination's 16-byte boundaries
    (:func:`shifted_copies`) at different offsets from one on even and odd calls (its items,
    the destination's slots, ``fused.row_items``, would differ between them). The others
    join as plain copies do: the kernel's segment loop moves 16 bytes at any alignment."""
    return op.nbytes > NARROW_SEGMENT_BYTES or \
        bool(op.narrow & NARROW_SHIFT) and (op.dst_even - op.dst_odd) % 16 != 0


def _fp8_sum(op) -> bool:
    """Is ``op`` a move summing FP8 (which only ``fused_narrow`` runs: no segmented ops)?"""
    return op.kind == "move" and op.how is not None and op.dtype in FUSED_COPY_DTYPES


def _key(op, partners) -> tuple:
    """Rows of one key may share a segmented op: PUTs to one peer; moves reading LL units
    of the same peers; plain moves meeting the same other ranks (one peer's pushes or its
    arrivals; the rank's own copies meet none)."""
    if op.kind == "put":
        return ("put", op.peer)
    if op.narrow and _own_row(op):
        return ("narrow", id(op))
    if _fp8_sum(op):  # (FP8 sums: never in a segment)
        return ("fp8 sum", id(op))
    lls = tuple(sorted(s.peer for s in op.sources if s.is_ll))
    return ("move", lls, len(op.sources), op.how, op.dtype, partners if not lls else None)


def _gather(ops: list[tuple], keys: list, bold: bool = False) -> tuple[list, list]:
    """Plain moves moved next to a row of their key across flag operations where that only
    adds ordering: later past waits (a row waits longer), earlier past notifies (a peer
    learns later), never past a row they conflict with. Returns (ops, keys) reordered.

    ``bold``: the order the standard twin's program has, which can also take ordering away
    (the caller checks the result with :func:`race`): a row goes earlier past waits instead,
    to join its key's first row (a peer's pieces copied right after its wait, not after
    every peer's), and a private row (no other rank touches its bytes) later past notifies
    first (the peers hear first, then the rank copies its own pieces)."""
    ops, keys = list(ops), list(keys)
    accs = [_accesses(op) if op.kind in ("put", "move") else None for op in ops]
    moved = True
    while moved:
        moved = False
        for i in range(len(ops)):
            if not _plain_move(ops[i]):
                continue
            if not bold:
                tries = ((-1, ("notify",)), (1, ("wait",)))
            elif keys[i][-1] == frozenset():
                tries = ((1, ("notify",)), (-1, ("wait", "notify")))
            else:  # (not past a notify: a peer's arrivals would join the pushes to it)
                tries = ((-1, ("wait",)),)
            for step, allowed in tries:
                j = _partner_index(ops, keys, accs, i, step, allowed)
                if j is not None:
                    break
            if j is None:
                continue
            op, key, acc = ops.pop(i), keys.pop(i), accs.pop(i)
            at = j + 1 if j < i else j - 1  # after the earlier partner, before the later
            ops.insert(at, op)
            keys.insert(at, key)
            accs.insert(at, acc)
            moved = True
            break
    return ops, keys


def _partner_index(ops, keys, accs, i, step, allowed) -> int | None:
    """The nearest row of ``ops[i]``'s key in direction ``step`` that it may join, past at
    least one flag operation, all of a kind in ``allowed``, else None (``accs``: the rows'
    :func:`_accesses`)."""
    crossed, j = False, i + step
    while 0 <= j < len(ops):
        op = ops[j]
        if op.kind in ("wait", "notify", "norm"):
            if op.kind not in allowed:
                return None
            crossed = True
        elif keys[j] == keys[i]:
            return j if crossed else None
        elif _accesses_conflict(accs[j], accs[i]):
            return None
        j += step
    return None


def _merge_segment(rows: list, keys: list) -> list:
    """One segment's data rows (between two flag operations) as groups of one key each,
    in the order of their first rows; a row joins its key's last group where it may pass
    the rows of the groups after it (no conflict; an LL move never passes a PUT: a poll
    must not come before a send)."""
    groups: list = []  # [key, rows]
    for op, key in zip(rows, keys):
        for g in range(len(groups) - 1, -1, -1):
            if groups[g][0] != key:
                continue
            passed = [a for _, later in groups[g + 1:] for a in later]
            blocking = op.kind == "move" and any(s.is_ll for s in op.sources)
            if all(not _conflict(a, op) and not (blocking and a.kind == "put")
                   for a in passed):
                groups[g][1].append(op)
                break
            groups.append([key, [op]])
            break
        else:
            groups.append([key, [op]])
    return [rows[0] if len(rows) == 1 else Segments(rows[0].kind + "s", tuple(rows))
            for _, rows in groups]


def segmented(ops_by_rank: list[list[tuple]], unit: int, ll: bool = False,
              user: list | None = None) -> list | None:
    """Each rank's ops with one peer's rows of a step gathered into segmented ops
    (:class:`purlin.atom.fused.Segments`): a GQA all-gather's q, k and v to a peer in one
    PUT or MOVE, as many ops as its standard twin. Rows move only where that adds ordering
    (:func:`_gather`) or inside a segment between flag operations, past rows they share no
    written byte with; every row's first item in its union (its effective rotation) must be
    the same as that of every row touching its bytes on any rank (LL units excepted where
    ``ll``: polled by their tag), so a block still meets only its own items. None where
    nothing gathers or a check fails (then the rotated rows, :func:`rotations`).

    First tried on the ops with every rank's waits of one flag merged into the first and its
    notifies into the next of their flag (:func:`merged_flags`: a pulled piece's ready flags
    and acknowledgements, one per piece, as one per peer), where that cannot deadlock. With
    ``user`` (each rank's ``LoweredRank.user``), the standard twin's order is tried on each
    (``_gather(..., bold=True)``: a peer's pieces copied right after its wait), kept where
    :func:`race` finds the ranks still ordered and it leaves no more ops."""
    merged = merged_flags(ops_by_rank)
    for ops in ((merged,) if merged is not None else ()) + (ops_by_rank,):
        got = _segmented(ops, unit, ll)
        bold = None if user is None else _segmented(ops, unit, ll, user)
        if bold is not None and (got is None or sum(map(len, bold)) <= sum(map(len, got))) \
                and race(bold, user) is None:  # (not where it leaves more ops)
            return bold
        if got is not None:
            return got
    return None


def _segmented(ops_by_rank: list[list[tuple]], unit: int, ll: bool,
               user: list | None = None) -> list | None:
    """:func:`segmented` on ``ops_by_rank`` as given; bold (``_gather``) with ``user``."""
    bold = user is not None
    partners = _partners(ops_by_rank, user)
    out = []
    for r, ops in enumerate(ops_by_rank):
        keys = [_key(op, partners.get((r, k))) if op.kind in ("put", "move") else None
                for k, op in enumerate(ops)]
        flat, keys = _gather(ops, keys, bold)
        if not _segment_rule(flat):
            return None
        merged, rows, row_keys = [], [], []
        for op, key in zip(flat + [None], keys + [None]):
            if op is not None and op.kind in ("put", "move"):
                rows.append(op)
                row_keys.append(key)
                continue
            if rows:
                merged += _merge_segment(rows, row_keys)
            rows, row_keys = [], []
            if op is not None:
                merged.append(op)
        out.append(merged)
    if all(len(a) == len(b) for a, b in zip(out, ops_by_rank)):
        return None
    return out if (aligned(out, unit) is not None if ll else _matched(out, unit, False)) \
        else None


def _segment_rule(ops: list[tuple]) -> bool:
    """The soundness rule that moving rows across flag operations can break (the others
    hold as they did: the same rows, PUTs and LL moves where they were): rows between two
    flag operations that touch the same bytes touch the same span."""
    segment: list = []
    for op in ops + [None]:
        if op is None or op.kind in ("wait", "notify", "norm"):
            for i, (w, reads) in enumerate(segment):
                for w2, reads2 in segment[i + 1:]:
                    if any(_clash(w, x) for x in (w2, *reads2)) or \
                            any(_clash(w2, x) for x in reads):
                        return False
            segment = []
        else:
            segment.append(_accesses(op))
    return True


def acked(ops_by_rank: list[list[tuple]]) -> frozenset:
    """The LL areas (:class:`Span`) a PUT writes on a peer that its rank hears nothing from
    in the same call (no wait for the peer's notify of this call, no LL units of the peer):
    a broadcast's root. What keeps its next-but-one call from rewriting units the peer still
    polls is then the peer's acknowledgement, a flag slot per block: block b of the writer
    waits for block b of the reader, so each unit must be written and read by one block.

    >>> from purlin.atom.fused import Put, Wait
    >>> root = [Wait("wait", 0, 1, 1, -2, 1, 0), Put("put", 0, 64, 128, 32, 1, 1)]
    >>> sorted(acked([root, []]))
    [Span(even=64, odd=128, nbytes=64)]
    """
    out = set()
    for ops in ops_by_rank:
        heard = {op.peer for op in ops
                 if op.kind == "wait" and op.epoch_offset == 0 and op.value > 0}
        heard |= {s.peer for op in ops for part in _parts(op) if part.kind == "move"
                  for s in part.sources if s.is_ll}
        out |= {_accesses(part)[0] for op in ops for part in _parts(op)
                if part.kind == "put" and part.peer not in heard}
    return frozenset(out)


def _matched(ops_by_rank: list[list[tuple]], unit: int, ll: bool,
             rotation: list | None = None) -> bool:
    """Does every span written by some row meet only rows that give its items the same
    threads -- the same first item in their union (0 outside segmented ops) plus the row's
    ``rotation`` (none: 0)? LL spans (a PUT's units, an LL move's source) are free where
    ``ll``, but for :func:`acked` ones."""
    tied = acked(ops_by_rank) if ll else frozenset()
    firsts: dict = {}  # span -> {first thread's item offset}
    written: set = set()
    for r, ops in enumerate(ops_by_rank):
        for k, op in enumerate(ops):
            parts = _parts(op)
            if op.kind not in ("puts", "moves", "put", "move"):
                continue
            start = rotation[r].get(k, 0) if rotation else 0
            for part in parts:
                w, reads = _accesses(part)
                if part.kind == "put":
                    spans = [(reads[0], False)] + ([] if ll and w not in tied else [(w, True)])
                else:
                    spans = [(w, True)] + [(x, False) for x, src in zip(reads, part.sources)
                                           if not (ll and src.is_ll and x not in tied)]
                for span, writes in spans:
                    firsts.setdefault(span, set()).add(start)
                    if writes:
                        written.add(span)
                start += part_items(part, unit)
    return all(len(firsts[span]) == 1 for span in written)


def aligned(ops_by_rank: list[list[tuple]], unit: int) -> list[dict] | None:
    """{op index: rotation} for each rank that gives every span which must stay on one
    thread -- an :func:`acked` LL unit, a plain span some op writes -- the same threads at
    every op touching it: the op's first item of the span in its union plus the op's
    rotation. The rotations are differences solved over the ops that share spans (a
    two-root broadcast's readers take their first piece where it lies in its root's joined
    PUTs, the second root's joined PUTs where that puts the second piece); each group's
    first segmented op (else its first op) keeps 0, and no rotation is below 0. None where
    two spans ask one op for different rotations.

    >>> from purlin.atom.fused import Move, Put, Segments, Source, Wait
    >>> put = lambda peer, at: Put("put", 0, at, at + 512, 32, peer, 1)
    >>> read = lambda at: Move("move", 2 * at, 2 * at, 32, (Source(1, at, at + 512, 0, 1),),
    ...                        0, None)
    >>> root = [Wait("wait", 0, 1, 1, -2, 1, 0), Wait("wait", 8, 1, 1, -2, 2, 0),
    ...         Segments("puts", (put(1, 64), put(2, 128)))]
    >>> aligned([root, [read(64)], [read(128)]], 16)
    [{}, {}, {0: 2}]
    """
    tied = acked(ops_by_rank)
    touching: dict = {}  # span -> [(rank, op index, first item in the op's union)]
    written: set = set()
    segmented_ops = set()
    for r, ops in enumerate(ops_by_rank):
        for k, op in enumerate(ops):
            if op.kind not in ("puts", "moves", "put", "move"):
                continue
            if op.kind in ("puts", "moves"):
                segmented_ops.add((r, k))
            start = 0
            for part in _parts(op):
                w, reads = _accesses(part)
                if part.kind == "put":  # (a PUT's units are polled by their tag but for acked)
                    spans = [(reads[0], False)] + ([(w, True)] if w in tied else [])
                else:
                    spans = [(w, True)] + [(x, False) for x, src in zip(reads, part.sources)
                                           if not src.is_ll or x in tied]
                for span, writes in spans:
                    touching.setdefault(span, []).append((r, k, start))
                    if writes:
                        written.add(span)
                start += part_items(part, unit)
    parent: dict = {}  # op -> (parent op, rotation of op minus rotation of parent)

    def find(x):
        up, diff = parent.get(x, (x, 0))
        if up == x:
            return x, 0
        root, above = find(up)
        parent[x] = (root, diff + above)
        return root, diff + above

    for span in written:
        (r0, k0, s0), *rest = touching[span]
        parent.setdefault((r0, k0), ((r0, k0), 0))
        for r, k, s in rest:  # (rotation(r, k) + s == rotation(r0, k0) + s0)
            parent.setdefault((r, k), ((r, k), 0))
            a, da = find((r, k))
            b, db = find((r0, k0))
            want = s0 - s  # rotation(r, k) - rotation(r0, k0)
            if a == b:
                if da - db != want:
                    return None
                continue
            parent[a] = (b, want + db - da)
    groups: dict = {}
    for x in parent:
        groups.setdefault(find(x)[0], []).append(x)
    out: list = [{} for _ in ops_by_rank]
    for members in groups.values():
        members.sort()
        anchor = next((x for x in members if x in segmented_ops), members[0])
        rel = {x: find(x)[1] - find(anchor)[1] for x in members}
        low = min(rel.values())
        for (r, k), v in rel.items():
            if v - min(low, 0):
                out[r][k] = v - min(low, 0)
    return out if _matched(ops_by_rank, unit, True, out) else None


# ---------------------------------------------------------------- LL rows joined across flags

def _ll_row(op) -> str | None:
    """What rows may share a segmented op: "put" (LL PUTs, any peers), "move" (a copy of one
    peer's LL units), "plain" (a plain copy that pulls from no peer -- the rank's own chunk,
    a push into a peer's scratch, a read of its own scratch: it joins a "move" op holding LL
    units, never another plain copy on its own, so plain programs stay as they are); None
    for the others (flag operations among them)."""
    first = _parts(op)[0]
    if first.kind == "put":
        return "put"
    if first.kind != "move" or first.how is not None or any(p.narrow for p in _parts(op)):
        return None
    kinds = {_copy_kind(part) for part in _parts(op)}
    if None in kinds:
        return None
    return "move" if "move" in kinds else "plain"


def _copy_kind(part) -> str | None:
    """A one-source copy's :func:`_ll_row` kind ("move": of LL units; "plain": pulling from
    no peer); None for the rest (reductions' several sources, plain pulls)."""
    if len(part.sources) != 1:
        return None
    src = part.sources[0]
    return "move" if src.is_ll else "plain" if src.peer < 0 else None


def _joins(a: str | None, b: str | None, kinds: tuple) -> str | None:
    """The kind of rows of kinds ``a`` and ``b`` joined, where they may join."""
    if a == b == "put" and "put" in kinds:
        return "put"
    if "move" in kinds and {a, b} <= {"move", "plain"} and "move" in (a, b):
        return "move"
    return None


def _puts_first(ops: list[tuple]) -> list[tuple]:
    """``ops`` with each plain copy that pulls from no peer after the LL PUTs that follow it
    with no flag operation between (none touching what the other writes): the PUTs then
    join, and the copy joins the copies of LL units after them. Only rows swap, never a flag
    operation, so every wait and notify keeps what it orders."""
    ops = list(ops)
    moved = True
    while moved:
        moved = False
        for i in range(len(ops) - 1):
            if _ll_row(ops[i]) == "plain" and _ll_row(ops[i + 1]) == "put" and not any(
                    _conflict(a, b) for a in _parts(ops[i]) for b in _parts(ops[i + 1])):
                ops[i:i + 2] = ops[i + 1], ops[i]
                moved = True
    return ops


def _joined_rank(ops: list[tuple], kinds: tuple = ("put", "move")) -> list[tuple]:
    """One rank's LL rows of a kind (of ``kinds``) that only flag operations separate,
    joined (a plain copy that pulls from no peer with its copies of LL units): the waits
    between them before the first, the notifies after the last (ordering added only), up to
    :data:`MERGE_BYTES` an op (an all-gather of 1 MiB on 4 ranks measured 1.06x slower
    joined)."""
    ops = _puts_first(ops) if "put" in kinds else list(ops)
    i = 0
    while i < len(ops):
        j = i + 1
        while j < len(ops) and ops[j].kind in ("wait", "notify"):
            j += 1
        kind = None if j >= len(ops) else _joins(_ll_row(ops[i]), _ll_row(ops[j]), kinds)
        if kind is None or \
                sum(p.nbytes for p in _parts(ops[i]) + _parts(ops[j])) > MERGE_BYTES or \
                any(_conflict(a, b) for a in _parts(ops[i]) for b in _parts(ops[j])):
            i += 1
            continue
        flags = ops[i + 1:j]
        ops[i:j + 1] = [f for f in flags if f.kind == "wait"] + \
            [Segments(kind + "s", _parts(ops[i]) + _parts(ops[j]))] + \
            [f for f in flags if f.kind == "notify"]
        i = 0  # (a joined op may join the next)
    return ops


def joined(ops_by_rank: list[list[tuple]], unit: int, user: list) -> list | None:
    """Each rank's LL rows of a kind (its PUTs, whichever peers; its copies of LL units)
    that only flag operations separate, as one segmented op: the waits between them moved
    before it, the notifies after it. Every LL unit carries its call's tag, so any thread
    may send or poll it (:func:`ll_pieces`), and ops get ordering only, never lose it; the
    result is kept where it has fewer ops, every plain span still meets one first item
    (:func:`_matched`), every :func:`acked` unit one thread (:func:`aligned`), no
    interleaving deadlocks (:func:`deadlock_free`) and :func:`race` finds the ranks ordered
    with their callers (``user``); else with only the PUTs joined (a two-root broadcast:
    each copy of a root's acknowledged units then starts where its piece lies in the root's
    joined PUTs), else only the copies. None otherwise.

    An all-gather on LL: a rank's PUTs to every peer become one op, and its copies of every
    peer's units another, each with the threads of the whole union polling at once.
    Programs that reduce are left as they are (measured: faster at 8 KiB, slower at 64 KiB
    and with a scalar tail, where the joined PUTs size the grid; docs/PERF_NOTES.md)."""
    if any(part.kind == "move" and part.how is not None
           for ops in ops_by_rank for op in ops for part in _parts(op)):
        return None
    for kinds in (("put", "move"), ("put",), ("move",)):
        out = [_joined_rank(ops, kinds) for ops in ops_by_rank]
        if sum(map(len, out)) < sum(map(len, ops_by_rank)) and \
                aligned(out, unit) is not None and deadlock_free(out) and \
                race(out, user) is None:
            return out
    return None


# ---------------------------------------------------------------- flags gathered around copies

def _free_waits(ops_by_rank: list[list[tuple]]) -> tuple[set, set]:
    """(rank, op index) of every wait that nothing on this rank's side holds up -- the
    notify that brings its flag to its value comes, in the notifying peer's program, before
    any wait of that peer (a ready flag sent at the start of a call) -- and of those
    notifies, which no wait may then move before."""
    free, sends = set(), set()
    for r, ops in enumerate(ops_by_rank):
        for i, w in enumerate(ops):
            if w.kind != "wait" or not 0 <= w.peer < len(ops_by_rank):
                continue
            total = 0
            for j, op in enumerate(ops_by_rank[w.peer]):
                if op.kind == "wait":
                    break
                if op.kind == "notify" and op.flag == w.flag:
                    total += op.value
                    if total >= w.value:
                        free.add((r, i))
                        sends.add((w.peer, j))
                        break
    return free, sends


def _flag_runs(ops: list[tuple]) -> int:
    return sum(1 for a, b in zip([None] + ops, ops)
               if b.kind in ("wait", "notify") and (a is None or a.kind != b.kind))


COPIES = ("move", "moves", "put", "puts")  # what flags are gathered around


def _gathered_rank(ops: list[tuple], free: set, sends: set) -> list[tuple]:
    """One rank's ops with each wait moved before the copies and PUTs before it (and
    before the notifies before it where it is free and they free no one: :func:`_free_waits`),
    and each notify after the copies and PUTs after it -- kept where that leaves fewer runs of
    flag operations (a wait and a copy, a wait and a copy become two waits polled at once
    and two copies; the notifies between them one fence), else ``ops``."""
    tagged = [(op, op.kind == "wait" and i in free, op.kind == "notify" and i in sends)
              for i, op in enumerate(ops)]

    def crosses(notify, wait) -> bool:  # a free wait before a notify that frees no one
        return wait[1] and not notify[2]

    def flag_past_copies(i: int, step: int):  # the first flag operation from i on, or None
        while 0 <= i < len(tagged) and tagged[i][0].kind in COPIES:
            i += step
        return tagged[i] if 0 <= i < len(tagged) else None

    moved = True
    while moved:
        moved = False
        for i in range(len(tagged) - 1):
            a, b = tagged[i], tagged[i + 1]
            if b[0].kind == "wait" and a[0].kind in COPIES:
                # (only towards a wait it joins, or a notify it then passes)
                got = flag_past_copies(i, -1)
                ok = got is not None and (got[0].kind == "wait" or
                                          (got[0].kind == "notify" and crosses(got, b)))
            elif b[0].kind == "wait" and a[0].kind == "notify":
                ok = crosses(a, b)
            elif a[0].kind == "notify" and b[0].kind in COPIES:
                got = flag_past_copies(i + 1, 1)  # (only towards a notify it joins)
                ok = got is not None and (got[0].kind == "notify" or
                                          (got[0].kind == "wait" and crosses(a, got)))
            else:
                ok = False
            if ok:
                tagged[i], tagged[i + 1] = b, a
                moved = True
    out = [op for op, _, _ in tagged]
    return out if _flag_runs(out) < _flag_runs(ops) else list(ops)


def segmented_pieces(ops_by_rank: list[list[tuple]], unit: int, user: list) -> tuple | None:
    """(ops, rotations) of :func:`cluster_programs`' pass for several pieces a peer: the
    notifies before each rank's first wait moved early (:func:`notified_early`), then one
    peer's rows gathered into segmented ops (:func:`segmented`); None where neither
    changes anything."""
    ll = ll_pieces(ops_by_rank)  # (which transfers a rank sends: moving its notifies keeps it)
    got = None
    early = notified_early(ops_by_rank, user)
    if early is not None:
        ops_by_rank = early
        got = early, rotations(early, unit, ll)
    seg = segmented(ops_by_rank, unit, ll, user)
    if seg is not None:
        got = seg, aligned(seg, unit)
    return got


def notified_early(ops_by_rank: list[list[tuple]], user: list) -> list | None:
    """Each rank's notifies before its first wait moved before the copies and PUTs there,
    where :func:`race` then finds no two ranks' data ops unordered (one check over all
    ranks), or None. :func:`regroup` merges a rank's notifies of one flag into the last of
    them, which is always sound; a pulling rank's "my input is ready" then waits for its
    own copies (the GQA all-gather: every peer's pulls wait for the rank's copies of its
    own q, k and v). Telling a peer earlier only lets it run earlier, so no interleaving
    deadlocks that did not before; what it may break is the data, which :func:`race`
    checks."""
    out = []
    for ops in ops_by_rank:
        first = next((i for i, op in enumerate(ops) if op.kind == "wait"), len(ops))
        head = ops[:first]
        out.append([op for op in head if op.kind == "notify"]
                   + [op for op in head if op.kind != "notify"] + list(ops[first:]))
    if out == [list(ops) for ops in ops_by_rank] or race(out, user) is not None:
        return None
    return out


def gathered(ops_by_rank: list[list[tuple]], unit: int, user: list) -> list | None:
    """Each rank's flags gathered around its copies and PUTs (:func:`_gathered_rank`): runs
    of waits and of notifies where they alternated with them (a peer of a two-root
    broadcast: wait, copy, notify, twice; a pulling rank: the same per peer; a contributor
    of a partial all-reduce on LL: an acknowledgement's wait and a PUT per peer), which the
    fused kernel runs as one poll round and one fence each (``kernels/fused.py``). Ordering
    is only added; kept where the copies still meet their rotations (:func:`aligned`), no
    interleaving deadlocks (:func:`deadlock_free`) and :func:`race` finds the ranks ordered
    with their callers. None where nothing moves or a check fails."""
    free, sends = _free_waits(ops_by_rank)
    out = [_gathered_rank(ops, {i for (q, i) in free if q == r},
                          {i for (q, i) in sends if q == r}) for r, ops in enumerate(ops_by_rank)]
    if out == [list(ops) for ops in ops_by_rank]:
        return None
    if aligned(out, unit) is None or not deadlock_free(out) or race(out, user) is not None:
        return None
    return out


# ---------------------------------------------------------------- flags merged across flags

def merged_flags(ops_by_rank: list[list[tuple]], calls: int = 3) -> list | None:
    """Each rank's ops with its waits of one flag (per call, epoch offset) merged into the
    one before (the larger value) and its notifies into the next of their flag, one merge at
    a time and each kept only where the ranks still run ``calls`` calls to the end in no
    more :func:`rounds` than before (no deadlock, no rank made to wait for another's whole
    work) -- or None where nothing merges.

    Sound for the data: a wait moved earlier for a larger value only holds the rank longer,
    and a notify merged into a later one only tells the peer later, so every execution of
    the merged programs is one the original programs allow (a rank slow past a wait, a
    notify's increment seen late); what it can break is progress, which each merge checks."""
    cur = [list(ops) for ops in ops_by_rank]
    if sum(len(ops) for ops in cur) > MERGE_OPS:
        return None
    steps = [[_step(op) for op in ops] for ops in cur]
    most = _rounds(steps, calls)  # (a merge that lengthens the chain of waits serialises ranks)
    if most is None:
        return None
    changed = False
    for kind in ("wait", "notify"):
        for r in range(len(cur)):
            i = 0
            while i < len(cur[r]):
                trial = _merged_at(cur[r], i) if cur[r][i].kind == kind else None
                if trial is not None:
                    tried = [_step(op) for op in trial]
                    got = _rounds(steps[:r] + [tried] + steps[r + 1:], calls)
                    if got is not None and got <= most:
                        cur[r], steps[r], changed = trial, tried, True
                        continue
                i += 1
    return cur if changed else None


MERGE_OPS = 2000  # ops of a cluster past which merged_flags does not search (each merge it
# tries runs every rank's calls once)


def _merged_at(ops: list[tuple], i: int) -> list | None:
    """``ops`` with the wait at ``i`` merged into the wait of its flag before it, or the
    notify at ``i`` into the notify of its flag after it (none in between), else None."""
    op = ops[i]
    if op.kind == "wait":
        key = (op.flag, op.per_call, op.epoch_offset)
        for j in range(i - 1, -1, -1):
            w = ops[j]
            if w.kind == "norm":
                return None
            if w.kind == "wait" and (w.flag, w.per_call, w.epoch_offset) == key:
                if op.value > w.value:
                    w = w._replace(value=op.value, peer=op.peer, step=op.step)
                return ops[:j] + [w] + ops[j + 1:i] + ops[i + 1:]
        return None
    for j in range(i + 1, len(ops)):
        n = ops[j]
        if n.kind == "norm":
            return None
        if n.kind == "notify" and n.flag == op.flag:
            return ops[:i] + ops[i + 1:j] + [n._replace(value=n.value + op.value)] + ops[j + 1:]
    return None


def deadlock_free(ops_by_rank: list[list[tuple]], calls: int = 3) -> bool:
    """Do the ranks' fused ops (rows, segmented ops, flag operations) run ``calls`` calls to
    the end? Flags only grow and a wait or LL poll only needs a flag to reach a value or a
    PUT to have run, so running every rank as far as it can, round after round, finds every
    op that any interleaving can run: if that ends, no interleaving deadlocks. (One block
    stands for each: block b waits only on block b's slots.)"""
    return rounds(ops_by_rank, calls) is not None


def rounds(ops_by_rank: list[list[tuple]], calls: int = 3) -> int | None:
    """Rounds of :func:`deadlock_free`'s run (in each, every rank runs as far as the flags
    and PUTs of the rounds before let it) until every rank ran ``calls`` calls -- the
    longest chain of waits on peers, what a merge must not lengthen -- or None where some
    rank never ends."""
    return _rounds([[_step(op) for op in ops] for ops in ops_by_rank], calls)


def _rounds(steps: list[list[tuple]], calls: int) -> int | None:
    """:func:`rounds` on each rank's ops' :func:`_step` (what :func:`merged_flags` keeps
    between its trials, which change one rank's ops)."""
    # (a round's notifies and PUTs count from the next round on)
    counters: dict = {}
    sent: set = set()  # (LL units' address this call, call) of the PUTs that ran
    pcs = [0] * len(steps)
    total = [len(ops) * calls for ops in steps]
    count = 0
    while pcs != total:
        notified: dict = {}
        put: list = []
        moved = False
        for r, rank_steps in enumerate(steps):
            n = len(rank_steps)
            pc = pcs[r]
            while pc < total[r]:
                call = pc // n
                wait, polls, notify, puts = rank_steps[pc - call * n]
                if wait is not None:
                    flag, per_call, epoch_offset, value = wait
                    target = (call + epoch_offset) * per_call + value
                    if target > 0 and counters.get(flag, 0) < target:
                        break
                if polls and any((odd if call & 1 else even, call) not in sent
                                 for even, odd in polls):
                    break
                if notify is not None:
                    notified[notify[0]] = notified.get(notify[0], 0) + notify[1]
                if puts:
                    put += [(odd if call & 1 else even, call) for even, odd in puts]
                pc += 1
            moved = moved or pc != pcs[r]
            pcs[r] = pc
        if not moved:
            return None
        for flag, value in notified.items():
            counters[flag] = counters.get(flag, 0) + value
        sent.update(put)
        count += 1
    return count


def _step(op) -> tuple:
    """What :func:`rounds` reads of an op: (its wait's flag, per call, epoch offset, value
    or None; the (even, odd) LL units its moves poll; its notify's (flag, value) or None;
    the (even, odd) LL units its PUTs send)."""
    wait = ((op.flag, op.per_call, op.epoch_offset, op.value) if op.kind == "wait" else None)
    notify = (op.flag, op.value) if op.kind == "notify" else None
    polls, puts = [], []
    if op.kind not in ("wait", "notify"):
        for part in _parts(op):
            if part.kind == "move":
                polls += [(s.even, s.odd) for s in part.sources if s.is_ll]
            elif part.kind == "put":
                puts.append((part.dst_even, part.dst_odd))
    return wait, tuple(polls), notify, tuple(puts)


# ---------------------------------------------------------------- races across ranks

def race(ops_by_rank: list[list[tuple]], user: list, calls: int = 3) -> str | None:
    """The first race of the ranks' fused ops over ``calls`` calls, in words, or None: two
    data ops of different ranks touching a byte in common, one of them writing, with neither
    ordered before the other by the flags (a wait after the notify that brings its flag to
    the value it waits for) and LL transfers (an LL move after the PUT it polls). What lets
    a reordering move a row past a wait: this says whether the ranks still agree.
    ``user[r]``: rank r's ((address, bytes) of its input, of its output)
    (``LoweredRank.user``), which the caller writes before each call and reads after it.

    Conservative where a flag has several notifying ranks: a wait is after a rank's notify
    only where the other ranks' notifies of all ``calls`` calls cannot reach its value
    without it. An op per rank stands for each of its blocks (a block meets only its own
    items of every span: :func:`_matched`)."""
    def span(at_bytes):
        return (Span(at_bytes[0], at_bytes[0], at_bytes[1]),)

    ops_by_rank = [[_Caller("caller", span(user[r][0]), ())] + list(ops)
                   + [_Caller("caller", (), span(user[r][1]))]
                   for r, ops in enumerate(ops_by_rank)]
    n = len(ops_by_rank)
    notifiers: dict = {}  # flag -> {rank: [(pc, counter after)]}
    for r, ops in enumerate(ops_by_rank):
        total: dict = {}  # flag -> the rank's notifies of it so far
        for c in range(calls):
            for i, op in enumerate(ops):
                if op.kind == "notify":
                    total[op.flag] = total.get(op.flag, 0) + op.value
                    notifiers.setdefault(op.flag, {}).setdefault(r, []).append(
                        (c * len(ops) + i, total[op.flag]))
    sums = {f: {r: got[-1][1] for r, got in by.items()} for f, by in notifiers.items()}
    puts: dict = {}  # (LL address, call) -> (rank, pc)
    for r, ops in enumerate(ops_by_rank):
        for c in range(calls):
            for i, op in enumerate(ops):
                for part in _parts(op):
                    if part.kind == "put":
                        puts[(part.dst_odd if c & 1 else part.dst_even, c)] = (r, c * len(ops) + i)
    clocks = [[None] * (len(ops) * calls) for ops in ops_by_rank]
    done = [0] * n
    while True:  # (a rank's clock at an op: the latest op of each rank known to be before it)
        moved = False
        for r, ops in enumerate(ops_by_rank):
            while done[r] < len(clocks[r]):
                pc = done[r]
                c, op = divmod(pc, len(ops))[0], ops[pc % len(ops)]
                after = _before(op, c, r, notifiers, sums, puts)
                if after is None:
                    return f"rank {r} op {pc % len(ops)} ({op.kind}) never runs"
                if any(clocks[q][p] is None for q, p in after):
                    break
                clock = list(clocks[r][pc - 1]) if pc else [-1] * n
                for q, p in after:
                    clock = [max(a, b) for a, b in zip(clock, clocks[q][p])]
                clock[r] = pc
                clocks[r][pc] = clock
                done[r] += 1
                moved = True
        if not moved:
            break
    if any(d < len(c) for d, c in zip(done, clocks)):
        return "the ranks do not run every call to the end"
    touches = []  # (start, end, rank, pc, writes)
    for r, ops in enumerate(ops_by_rank):
        for pc in range(len(clocks[r])):
            c, op = divmod(pc, len(ops))[0], ops[pc % len(ops)]
            for part in _parts(op):
                if part.kind == "caller":
                    spans = [(x, True) for x in part.writes] + [(x, False) for x in part.reads]
                elif part.kind in ("put", "move"):
                    w, reads = _accesses(part)
                    spans = [(w, True)] + [(x, False) for x in reads]
                else:
                    continue
                for span, writes in spans:
                    at = span.odd if c & 1 else span.even
                    touches.append((at, at + span.nbytes, r, pc, writes))
    touches.sort()
    open_: list = []
    for t in touches:
        open_ = [o for o in open_ if o[1] > t[0]]
        for o in open_:
            if o[2] != t[2] and (o[4] or t[4]) and not _ordered(clocks, o, t):
                return (f"rank {o[2]} op {o[3] % len(ops_by_rank[o[2]])} of call "
                        f"{o[3] // len(ops_by_rank[o[2]])} and rank {t[2]} op "
                        f"{t[3] % len(ops_by_rank[t[2]])} of call "
                        f"{t[3] // len(ops_by_rank[t[2]])} touch bytes at {max(o[0], t[0]):#x} "
                        "unordered")
        open_.append(t)
    return None


class _Caller(NamedTuple):
    """What the caller does around a call: writes its input first, reads its output last."""

    kind: str  # "caller"
    writes: tuple
    reads: tuple


def _parts(op) -> tuple:
    """The rows of a segmented op, or the op itself."""
    return op.parts if op.kind in ("puts", "moves") else (op,)


def _ordered(clocks, a, b) -> bool:
    return clocks[b[2]][b[3]][a[2]] >= a[3] or clocks[a[2]][a[3]][b[2]] >= b[3]


def _before(op, call, r, notifiers, sums, puts) -> list | None:
    """[(rank, pc)] of the ops of other ranks that op ``op`` of call ``call`` runs after,
    or None where it waits for what never comes."""
    if op.kind == "wait":
        target = (call + op.epoch_offset) * op.per_call + op.value
        if target <= 0:
            return []
        by = notifiers.get(op.flag, {})
        if sum(sums.get(op.flag, {}).values()) < target:
            return None
        out = []
        for q, got in by.items():
            others = sum(v for p, v in sums[op.flag].items() if p != q)
            for pc, total in got:
                if others + total >= target:
                    if others < target:
                        out.append((q, pc))
                    break
        return out
    out = []
    for part in _parts(op):
        if part.kind == "move":
            for s in part.sources:
                if s.is_ll:
                    got = puts.get((s.odd if call & 1 else s.even, call))
                    if got is None:
                        return None
                    out.append(got)
    return out
