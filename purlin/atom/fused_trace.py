"""The fused kernel's trace as the interpreter's: which table row each fused op came from, and
its records rewritten row by row, so :func:`purlin.trace.from_sm` reads either unchanged.

The traced fused kernels (``purlin.kernels.fused.fused_trace``) stamp each op of every block
on thread 0: records ``(op index, block, start, end)``, ``ops`` per block. Each op is one row
of the rank's lowered table -- a WAIT, NOTIFY, LL_PUT (a PUT) or COPY / REDUCE (a MOVE, which
reads the LL_GET rows folded into it in place) -- so putting the row in place of the op index
gives the interpreter's record ``(table row, block, start, end)``; a NORM epilogue has no row
(-1, which readers skip).

>>> from purlin.spec import collectives
>>> from purlin.snac import plan
>>> from purlin.atom.lowering import lower
>>> s = plan(collectives.all_reduce(2), "direct-push", count=64, dtype="bfloat16")
>>> bases = {(r, b): (1 + 4 * r + i) << 20 for r in range(2)
...          for i, b in enumerate(("input", "output", "scratch", "ll"))}
>>> low = lower(s, bases, {r: (9 + r) << 20 for r in range(2)},
...             ll_bases={r: bases[(r, "ll")] for r in range(2)})
>>> rows = op_rows(low[0])
>>> [OPCODE_NAMES[int(low[0].tables[0][k, OP])] for k in rows]  # the LL_GET folded
['ll_put', 'reduce']
>>> rec = np.array([[[0, 0, 100, 180], [1, 0, 180, 400]]])  # one block, its two ops
>>> as_row_records(rec, rows, len(low[0].tables[0]))[0].tolist()
[[0, 0, 100, 180], [0, 0, 0, 0], [2, 0, 180, 400]]
"""

from __future__ import annotations

import numpy as np

from purlin.atom.lowering import LoweredRank
from purlin.errors import ExecutionError
from purlin.kernels.isa import LL_GET, OP, OPCODE_NAMES, TRACE_WIDTH

__all__ = ["as_row_records", "lane_records", "op_rows", "program_rows"]


def op_rows(low: LoweredRank, ops: int | None = None) -> np.ndarray:
    """The table row of each op of rank ``low``'s fused program, in program order: every row
    but the LL_GET rows (``purlin.atom.fused.rank_ops`` folds those into the moves reading
    them); ``ops`` (the program's op count) adds -1 for each op past them (a NORM)."""
    rows = np.flatnonzero(low.tables[0][:, OP] != LL_GET).astype(np.int64)
    if ops is None:
        return rows
    if ops < rows.size:
        raise ExecutionError(f"rank {low.rank}'s fused program has {ops} ops but its table "
                             f"{rows.size} rows that become ops: the trace cannot name them")
    return np.concatenate([rows, np.full(ops - rows.size, -1, dtype=np.int64)])


def program_rows(low: LoweredRank, ops, unit: int = 16) -> list[tuple[int, ...]]:
    """The table rows each op of rank ``low``'s fused program stands for, in program order,
    for programs regrouped, segmented or joined (``purlin.atom.fused_rows``): a data op its
    row, a segmented op each of its parts' rows, a wait merged into another (the larger
    value) the rows of its flag's waits up to its value, a notify merged into another the
    rows of its flag's notifies whose values it sums; a NORM none. ``unit``: the program's.

    >>> from purlin.atom.fused import Segments, rank_ops
    >>> from purlin.spec import collectives
    >>> from purlin.snac import plan
    >>> from purlin.atom.lowering import lower
    >>> s = plan(collectives.all_gather(2), "direct-push", count=64, dtype="bfloat16")
    >>> bases = {(r, b): (1 + 4 * r + i) << 20 for r in range(2)
    ...          for i, b in enumerate(("input", "output", "scratch", "ll"))}
    >>> low = lower(s, bases, {r: (9 + r) << 20 for r in range(2)})[0]
    >>> ops = rank_ops(low)
    >>> [op.kind for op in ops], program_rows(low, ops)
    (['move', 'notify', 'move', 'wait', 'move'], [(0,), (1,), (2,), (3,), (4,)])
    >>> program_rows(low, [Segments("moves", (ops[0], ops[2])), ops[1], ops[3], ops[4]])
    [(0, 2), (1,), (3,), (4,)]
    """
    from purlin.atom.fused import _Refused, _rank_ops

    try:
        base = _rank_ops(low, unit)
    except _Refused as exc:
        raise ExecutionError(f"rank {low.rank}'s trace cannot name its rows: {exc}") from None
    rows = op_rows(low)
    data: dict = {}  # a data op -> its indices in base (in order)
    flags: dict = {}  # (kind, flag) -> its indices in base (in order)
    for j, op in enumerate(base):
        key = (op.kind, op.flag) if op.kind in ("wait", "notify") else op
        (flags if op.kind in ("wait", "notify") else data).setdefault(key, []).append(j)
    out = []
    for op in ops:
        took = []
        if op.kind in ("wait", "notify"):
            pending = flags.get((op.kind, op.flag), [])
            total = 0
            while pending and (base[pending[0]].value <= op.value if op.kind == "wait"
                               else total < op.value):
                total += base[pending[0]].value
                took.append(pending.pop(0))
        elif op.kind != "norm":
            for part in (op.parts if op.kind in ("puts", "moves") else (op,)):
                if data.get(part):
                    took.append(data[part].pop(0))
        out.append(tuple(int(rows[j]) for j in took))
    return out


def as_row_records(records, rows, nrows: int) -> np.ndarray:
    """The fused kernel's records of one rank (int64[blocks, ops, 4]: op index, block, start,
    end) as the interpreter's (int64[blocks, nrows, 4]: table row, block, start, end), each at
    its row's index: ``rows[k]``, op k's row (:func:`op_rows`; -1: none) or rows
    (:func:`program_rows`: an op standing for several rows gives each its span); an op never
    reached (start 0) or without a row leaves its rows all zero."""
    records = np.asarray(records, dtype=np.int64).reshape(-1, np.shape(records)[-2],
                                                          TRACE_WIDTH)
    rows = [(int(x),) if np.ndim(x) == 0 else tuple(x) for x in rows]
    out = np.zeros((records.shape[0], nrows, TRACE_WIDTH), dtype=np.int64)
    for b, block in enumerate(records):
        for k, (op, sub, start, end) in enumerate(block):
            if start <= 0 or not 0 <= op < len(rows):
                continue
            for row in rows[op]:
                if row >= 0:
                    out[b, row] = (row, sub, start, end)
    return out


def lane_records(low: LoweredRank, programs, records) -> np.ndarray:
    """Rank ``low``'s records as the interpreter's (:func:`as_row_records`) from its fused
    programs, one a lane (``purlin.atom.fused_lanes.lane_slots``; ``records[k]``: program
    k's, int64[blocks, ops, 4]): int64[lanes * blocks, table rows, 4], lane l's blocks at
    ``l * blocks``, each row at its index in the rank's table (a lane without rows: zeros)."""
    from purlin.atom.fused_lanes import lane_slots, slot_lanes
    from purlin.kernels.isa import F_UNIT

    records = np.asarray(records, dtype=np.int64)
    blocks, nrows = records.shape[1], len(low.tables[0])
    out = np.zeros(((len(low.lane_offsets) - 1) * blocks, nrows, TRACE_WIDTH), np.int64)
    for slot, lane, prog, rec in zip(lane_slots([low]), slot_lanes(low), programs, records):
        first = int(low.lane_offsets[lane])
        rows = [tuple(x + first if x >= 0 else x for x in r)
                for r in program_rows(slot, prog.op_list, int(prog.words[F_UNIT]))]
        out[lane * blocks:(lane + 1) * blocks] = as_row_records(rec, rows, nrows)
    return out
