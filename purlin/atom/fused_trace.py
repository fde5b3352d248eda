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

__all__ = ["as_row_records", "fused_protocol", "op_rows", "traced_kernel"]

# the Launcher's name of each fused kernel's traced twin
TRACED = {"fused": "fused-trace", "fused-norm": "fused-norm-trace"}


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


def as_row_records(records, rows, nrows: int) -> np.ndarray:
    """The fused kernel's records of one rank (int64[blocks, ops, 4]: op index, block, start,
    end) as the interpreter's (int64[blocks, nrows, 4]: table row, block, start, end), each at
    its row's index; an op never reached (start 0) or without a row stays all zero."""
    records = np.asarray(records, dtype=np.int64).reshape(-1, np.shape(records)[-2],
                                                          TRACE_WIDTH)
    rows = np.asarray(rows, dtype=np.int64)
    out = np.zeros((records.shape[0], nrows, TRACE_WIDTH), dtype=np.int64)
    for b, block in enumerate(records):
        for k, (op, sub, start, end) in enumerate(block):
            if start <= 0 or not 0 <= op < rows.size or rows[op] < 0:
                continue
            out[b, rows[op]] = (rows[op], sub, start, end)
    return out


def traced_kernel(kernel: str) -> str:
    """The Launcher name of fused ``kernel``'s traced twin ("fused" -> "fused-trace")."""
    if kernel not in TRACED:
        raise ExecutionError(f"the {kernel} kernel has no traced twin; "
                             f"{', '.join(TRACED)} do")
    return TRACED[kernel]


def fused_protocol(schedule, asked: str = "auto") -> str:
    """The sm protocol that traces ``schedule`` on the kernel the benchmarks time: ``asked``,
    or for "auto" the fused kernel where it runs the schedule (on LL transfers up to
    ``purlin.atom.sm.LL_MAX_BYTES``), else the interpreter ("simple").

    >>> from purlin.snac import plan
    >>> from purlin.spec import collectives
    >>> fused_protocol(plan(collectives.all_reduce(4), "direct-push", nbytes=8192))
    'fused-ll'
    >>> fused_protocol(plan(collectives.all_reduce(4), "ring", nbytes=8192, lanes=2))
    'simple'
    """
    if asked != "auto":
        return asked
    from purlin.atom.fused import fused_problems
    from purlin.atom.sm import LL_MAX_BYTES

    problems = fused_problems(schedule)
    order = ("fused-ll", "fused") if schedule.sizing.message_bytes <= LL_MAX_BYTES else \
        ("fused", "fused-ll")
    return next((p for p in order if problems[p] is None), "simple")
