"""Hand-built instruction tables in host memory: for tests, the CUDA simulator and GPU checks.

Rows are built with :func:`copy_row`, :func:`reduce_row`, :func:`notify_row` and
:func:`wait_row` and grouped per lane; :func:`build_table` turns lanes into the int64 table,
lane offsets and source pool of ``isa.py``. :class:`HostRank` keeps all of a rank's arrays
(table, counters, error record, trace) in numpy memory and writes its descriptor, so under
``NUMBA_ENABLE_CUDASIM=1`` :func:`run_simulated` can run the executor on it.

>>> import numpy as np
>>> src, dst = np.arange(4, dtype=np.float32), np.zeros(4, dtype=np.float32)
>>> table, lanes, pool = build_table([[copy_row(dst.ctypes.data, src.ctypes.data, 4)]])
>>> table.shape, lanes.tolist(), pool.tolist() == [src.ctypes.data]
((1, 16), [0, 1], True)
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from purlin.errors import SpecError
from purlin.kernels import isa

# ------------------------------------------------------------------------------------- rows


def _row(op, **columns) -> dict:
    return {"op": op, **columns}


def copy_row(dst: int, src: int, count: int, dtype: int = isa.F32, step: int = 0,
             peer: int = -1) -> dict:
    """COPY ``count`` elements of ``dtype`` (a code of ``isa``) from ``src`` to ``dst``."""
    return _row(isa.COPY, dst=dst, srcs=[src], count=count, dtype=dtype, step=step, peer=peer)


def reduce_row(dst: int, srcs: Sequence[int], count: int, dtype: int = isa.F32,
               redop: int = isa.SUM, divisor: int | None = None, step: int = 0,
               peer: int = -1) -> dict:
    """REDUCE ``count`` elements of every address in ``srcs`` into ``dst``."""
    return _row(isa.REDUCE, dst=dst, srcs=list(srcs), count=count, dtype=dtype, redop=redop,
                divisor=len(srcs) if divisor is None else divisor, step=step, peer=peer)


def notify_row(flag: int, value: int = 1, step: int = 0, peer: int = -1) -> dict:
    """NOTIFY: each block of the lane adds ``value`` to the flag at ``flag``."""
    return _row(isa.NOTIFY, flag=flag, value=value, step=step, peer=peer)


def wait_row(flag: int, value: int, per_call: int, epoch_offset: int = 0, step: int = 0,
             peer: int = -1) -> dict:
    """WAIT until the flag reaches ``(epoch + epoch_offset) * per_call + value``."""
    return _row(isa.WAIT, flag=flag, value=value, per_call=per_call,
                epoch_offset=epoch_offset, step=step, peer=peer)


def ll_put_row(units: int, src: int, count: int, dtype: int = isa.F32, step: int = 0,
               peer: int = -1) -> dict:
    """LL_PUT ``count`` elements from ``src`` as LL units at ``units`` (see ``isa``)."""
    return _row(isa.LL_PUT, dst=units, srcs=[src], count=count, dtype=dtype, step=step,
                peer=peer)


def ll_get_row(dst: int, units: int, count: int, dtype: int = isa.F32, step: int = 0,
               peer: int = -1) -> dict:
    """LL_GET ``count`` elements from the LL units at ``units`` into ``dst``."""
    return _row(isa.LL_GET, dst=dst, srcs=[units], flag=units, count=count, dtype=dtype,
                step=step, peer=peer)


def ll_pack(data: bytes, tag: int) -> np.ndarray:
    """What LL_PUT writes for ``data`` with ``tag``: uint32[units, 4] of (lo, tag, hi, tag).

    >>> ll_pack(bytes(range(10)), 7).tolist()
    [[50462976, 7, 117835012, 7], [2312, 7, 0, 7]]
    """
    padded = bytes(data) + bytes(-len(data) % isa.LL_DATA)
    words = np.frombuffer(padded, dtype="<u4").reshape(-1, 2)
    out = np.empty((len(words), 4), dtype=np.uint32)
    out[:, 0], out[:, 2] = words[:, 0], words[:, 1]
    out[:, 1] = out[:, 3] = tag
    return out


def build_table(lanes: Sequence[Sequence[dict]], pool: list | None = None):
    """(table int64[rows, ROW_WIDTH], lane offsets int64[nlanes + 1], source pool int64[]).

    Pass a ``pool`` list to share one source pool between tables (even and odd): it is
    extended in place and the returned pool array holds all of it.
    """
    rows, offsets = [], [0]
    pool = [] if pool is None else pool
    for lane, lane_rows in enumerate(lanes):
        for spec in lane_rows:
            row = np.zeros(isa.ROW_WIDTH, dtype=np.int64)
            row[isa.OP] = spec["op"]
            row[isa.LANE] = lane
            row[isa.DTYPE] = spec.get("dtype", isa.F32)
            row[isa.REDOP] = spec.get("redop", isa.SUM)
            row[isa.DST] = spec.get("dst", 0)
            row[isa.COUNT] = spec.get("count", 0)
            srcs = spec.get("srcs", [])
            row[isa.NSRC] = len(srcs)
            row[isa.SRC] = len(pool)
            pool.extend(srcs)
            row[isa.FLAG] = spec.get("flag", 0)
            row[isa.VALUE] = spec.get("value", 0)
            row[isa.PER_CALL] = spec.get("per_call", 0)
            row[isa.EPOCH_OFFSET] = spec.get("epoch_offset", 0)
            row[isa.STEP] = spec.get("step", 0)
            row[isa.PEER] = spec.get("peer", -1)
            row[isa.DIVISOR] = spec.get("divisor", 1)
            rows.append(row)
        offsets.append(len(rows))
    table = np.stack(rows) if rows else np.zeros((0, isa.ROW_WIDTH), dtype=np.int64)
    return table, np.array(offsets, dtype=np.int64), np.array(pool or [0], dtype=np.int64)


def descriptor(rank: int, table: int, lanes: int, nlanes: int, srcs: int, epoch: int,
               done: int, error: int, abort: int, trace: int = 0, trace_rows: int = 0,
               table_odd: int | None = None) -> np.ndarray:
    """One rank's descriptor (int64[DESC_WIDTH]) from the addresses of its arrays
    (``table_odd``: the table for odd calls, by default the same table)."""
    desc = np.zeros(isa.DESC_WIDTH, dtype=np.int64)
    desc[isa.D_RANK] = rank
    desc[isa.D_TABLE] = table
    desc[isa.D_TABLE_ODD] = table if table_odd is None else table_odd
    desc[isa.D_LANES] = lanes
    desc[isa.D_NLANES] = nlanes
    desc[isa.D_SRCS] = srcs
    desc[isa.D_EPOCH] = epoch
    desc[isa.D_DONE] = done
    desc[isa.D_ERROR] = error
    desc[isa.D_ABORT] = abort
    desc[isa.D_TRACE] = trace
    desc[isa.D_TRACE_ROWS] = trace_rows
    return desc


def error_record(err: np.ndarray) -> dict:
    """The error record as a dict keyed by the ``E_*`` names (``code`` 0: no error)."""
    names = ["code", "rank", "step", "flag", "expected", "seen", "lane", "block", "peer"]
    return {name: int(err[i]) for i, name in enumerate(names)}


# -------------------------------------------------------------------------------- host ranks


class HostRank:
    """A rank's table, counters, error record and trace in numpy memory.

    ``abort`` is the uint64[1] array shared by every rank of a cluster (made if not given).
    ``odd_lanes``, if given, are the rows run on odd calls (same number of rows per lane).
    The arrays must outlive any kernel that uses their addresses; this object holds them.
    """

    def __init__(self, rank: int, lanes: Sequence[Sequence[dict]], blocks_per_lane: int = 1,
                 abort: np.ndarray | None = None, trace_rows: int = 0,
                 odd_lanes: Sequence[Sequence[dict]] | None = None):
        self.rank = rank
        self.nlanes = len(lanes)
        pool: list[int] = []
        self.table, self.lanes, _ = build_table(lanes, pool)
        self.table_odd = self.table
        if odd_lanes is not None:
            self.table_odd, odd_offsets, _ = build_table(odd_lanes, pool)
            if not np.array_equal(odd_offsets, self.lanes):
                raise SpecError(f"odd table rows per lane {np.diff(odd_offsets).tolist()} "
                                 f"differ from the even table's {np.diff(self.lanes).tolist()}")
        self.pool = np.array(pool or [0], dtype=np.int64)
        self.epoch = np.zeros(1, dtype=np.uint64)
        self.done = np.zeros(1, dtype=np.uint64)
        self.error = np.zeros(isa.ERR_WIDTH, dtype=np.int64)
        self.abort = np.zeros(1, dtype=np.uint64) if abort is None else abort
        blocks = max(self.nlanes, 1) * blocks_per_lane
        self.trace_rows = trace_rows
        self.trace = np.full((blocks, max(trace_rows, 1), isa.TRACE_WIDTH), -1, dtype=np.int64)
        self.desc = descriptor(
            rank, self.table.ctypes.data, self.lanes.ctypes.data, self.nlanes,
            self.pool.ctypes.data, self.epoch.ctypes.data, self.done.ctypes.data,
            self.error.ctypes.data, self.abort.ctypes.data,
            self.trace.ctypes.data if trace_rows else 0, trace_rows, self.table_odd.ctypes.data)

    @classmethod
    def from_lowered(cls, low, abort: np.ndarray | None = None) -> "HostRank":
        """A host rank running the tables of ``purlin.atom.lowering.lower`` (a LoweredRank)."""
        host = cls(low.rank, [[]], abort=abort)
        host.table = np.ascontiguousarray(low.tables[0])
        host.table_odd = np.ascontiguousarray(low.tables[-1])
        host.lanes = np.ascontiguousarray(low.lane_offsets, dtype=np.int64)
        host.pool = np.ascontiguousarray(low.srcs, dtype=np.int64)
        host.nlanes = len(host.lanes) - 1
        host.desc[isa.D_TABLE], host.desc[isa.D_TABLE_ODD] = (host.table.ctypes.data,
                                                              host.table_odd.ctypes.data)
        host.desc[isa.D_LANES] = host.lanes.ctypes.data
        host.desc[isa.D_SRCS] = host.pool.ctypes.data
        host.desc[isa.D_NLANES] = host.nlanes
        return host

    @property
    def error_record(self) -> dict:
        return error_record(self.error)


def run_simulated(ranks: Sequence[HostRank], blocks_per_lane: int = 1, threads: int = 8,
                  timeout_ns: int = 10_000_000, pdl: bool = False) -> np.ndarray:
    """Launch the executor once in the CUDA simulator over ``ranks`` (blocks run one by one).

    Every rank gets ``max(nlanes) * blocks_per_lane`` blocks. Returns the descriptor array
    that was passed (keep it alive as long as the ranks).
    """
    from purlin.kernels.executor import kernel_for
    from purlin.kernels.intrinsics import SIMULATOR
    from purlin.kernels.launch import Launcher

    if not SIMULATOR:
        raise RuntimeError("run_simulated needs NUMBA_ENABLE_CUDASIM=1 set before numba is "
                           "imported; on a GPU use purlin.kernels.launch.Launcher")
    desc = np.ascontiguousarray(np.stack([r.desc for r in ranks]))
    nlanes = max(max(r.nlanes for r in ranks), 1)
    kernel = kernel_for(t for r in ranks for t in (r.table, r.table_odd) if t is not None)
    launcher = Launcher(0, len(ranks), nlanes, blocks_per_lane, threads, pdl=pdl, kernel=kernel)
    launcher(desc.ctypes.data, timeout_ns=timeout_ns)
    return desc
