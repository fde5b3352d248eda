"""Several lanes on the fused kernel: each rank's lanes merged into one.

The fused kernel spreads every row of a rank over all of the rank's blocks, so the
parallelism lanes give the interpreter (a lane's own blocks) is already in every row; what
lanes add is order -- each lane runs its steps in turn, beside the others. :func:`one_lane`
keeps each lane's order and interleaves the lanes of a rank as one run of the whole cluster
interleaves them: every (rank, lane) runs as far as flags and LL units let it, round after
round, and each rank's rows are taken in the order they ran. Merging only adds order (a row
never passes one of its own lane), and the merged programs must run three calls to the end
(:func:`purlin.atom.fused_rows.deadlock_free`), so every execution of them is one the lanes
allow; the fused kernel's own rules (``purlin.atom.fused.fuse_problem``) then judge the
merged tables as they judge any one-lane table.

>>> from purlin.atom.host import HostBuffers
>>> from purlin.snac import plan
>>> from purlin.spec import collectives
>>> s = plan(collectives.all_reduce(2), "ring", count=64, chunks=2, lanes=2)
>>> low = HostBuffers(s).lower()
>>> [len(x.lane_offsets) - 1 for x in low], [len(x.lane_offsets) - 1 for x in one_lane(low)]
([2, 2], [1, 1])
"""

from __future__ import annotations

import dataclasses

import numpy as np

from purlin.atom.lowering import LoweredRank
from purlin.errors import CapabilityError
from purlin.kernels.isa import (COUNT, DST, DTYPE, EPOCH_OFFSET, FLAG, ITEMSIZE, LL_GET, LL_PUT,
                                NOTIFY, OP, PER_CALL, STEP, VALUE, WAIT)

__all__ = ["one_lane"]


def one_lane(lowered: list[LoweredRank]) -> list[LoweredRank]:
    """``lowered`` with each rank's lanes merged into one (its rows in the order of one run
    of the cluster, each lane's in its own order); one-lane ranks as they are. Raises
    CapabilityError naming a rank and step where merged lanes would not run to the end."""
    if all(len(low.lane_offsets) == 2 for low in lowered):
        return list(lowered)
    order = _run_order(lowered)
    out = []
    for low, rows in zip(lowered, order):
        index = np.asarray(rows, dtype=np.int64)
        out.append(dataclasses.replace(
            low, tables=[t[index] for t in low.tables],
            lane_offsets=np.array([0, len(index)], dtype=np.int64)))
    _check_calls(out)
    return out


def _run_order(lowered: list[LoweredRank]) -> list[list[int]]:
    """Each rank's row indices in the order one call of every (rank, lane) ran them, each as
    far as it could, round after round (the call's flags start where the calls before left
    them: only their growth counts)."""
    lanes = [[list(range(int(a), int(b))) for a, b in zip(low.lane_offsets[:-1],
                                                           low.lane_offsets[1:])]
             for low in lowered]
    pcs = [[0] * len(rank) for rank in lanes]
    order: list[list[int]] = [[] for _ in lowered]
    grown: dict = {}  # flag address -> growth this call
    sent: list = []   # (LL area address, bytes) each LL_PUT of this call wrote
    while any(pc < len(rows) for rank, p in zip(lanes, pcs) for pc, rows in zip(p, rank)):
        moved = False
        for r, low in enumerate(lowered):
            table = low.tables[0]
            for lane, rows in enumerate(lanes[r]):
                while pcs[r][lane] < len(rows):
                    k = rows[pcs[r][lane]]
                    if not _runnable(table[k], grown, sent):
                        break
                    _run(table[k], grown, sent)
                    order[r].append(k)
                    pcs[r][lane] += 1
                    moved = True
        if not moved:
            stuck = [f"rank {r} lane {lane} step "
                     f"{int(lowered[r].tables[0][rows[pcs[r][lane]], STEP])}"
                     for r in range(len(lanes)) for lane, rows in enumerate(lanes[r])
                     if pcs[r][lane] < len(rows)]
            raise CapabilityError(f"the lanes cannot run as one lane a rank on the fused kernel: "
                                  f"{', '.join(stuck)} wait for what no lane of any rank sends "
                                  "first (run it on the interpreter: protocol 'simple' or 'll')")
    return order


def _ll_bytes(row) -> int:
    return 2 * int(row[COUNT]) * ITEMSIZE[int(row[DTYPE])]


def _runnable(row, grown: dict, sent: list) -> bool:
    op = int(row[OP])
    if op == WAIT:  # within one call: its target's growth past the calls before
        target = int(row[EPOCH_OFFSET]) * int(row[PER_CALL]) + int(row[VALUE])
        return target <= 0 or grown.get(int(row[FLAG]), 0) >= target
    if op == LL_GET:  # its units, written by an LL_PUT of this call
        at, size = int(row[FLAG]), _ll_bytes(row)
        return any(a <= at and at + size <= a + n for a, n in sent)
    return True


def _run(row, grown: dict, sent: list) -> None:
    op = int(row[OP])
    if op == NOTIFY:
        grown[int(row[FLAG])] = grown.get(int(row[FLAG]), 0) + int(row[VALUE])
    elif op == LL_PUT:
        sent.append((int(row[DST]), _ll_bytes(row)))


def _check_calls(lowered: list[LoweredRank]) -> None:
    """The merged ranks run three calls to the end, on the rows alone (the fused kernel's
    rules are judged later, on the merged tables)."""
    from purlin.atom.fused import rank_ops
    from purlin.atom.fused_rows import deadlock_free

    try:
        ops = [rank_ops(low, 4) for low in lowered]
    except CapabilityError:
        return  # (the fused kernel refuses these tables anyway, with its own reason)
    if not deadlock_free(ops):
        raise CapabilityError("the ranks' lanes merged into one lane each would not run three "
                              "calls to the end on the fused kernel (run them on the "
                              "interpreter: protocol 'simple' or 'll')")
