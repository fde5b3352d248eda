"""Lowered instruction tables run end to end by the host interpreter (purlin.atom.host):
every standard collective and strategy, with and without LL transfers, over back-to-back calls
with fresh inputs, equal the reference. This checks what the lowering computes -- addresses,
counts, flag targets, scratch parities, LL tags -- across ranks that wait on each other, which
the CUDA simulator (one block at a time) cannot run; with several blocks per lane and a slow
block, also the lane barriers (without the one before a flag's second notify, 7 of the 8
pipelined cases below fail)."""

from __future__ import annotations

import numpy as np
import pytest

from purlin.atom.host import HostBuffers, run_calls
from purlin.snac import plan
from purlin.spec import STANDARD, reference, standard

STRATEGIES = ("direct-push", "direct-pull", "two-phase", "ring")
REDUCING = ("all-reduce", "reduce-scatter", "reduce")
CASES = [(name, strategy) for name in STANDARD for strategy in STRATEGIES
         if strategy != "two-phase" or name in REDUCING]


def _inputs(sizing, calls: int, seed: int):
    """Integer-valued inputs (exact in every dtype and sum order), new for every call."""
    gen = np.random.default_rng(seed)
    return [[gen.integers(-40, 40, sizing.input_count(r)).astype(np.float64)
             for r in range(sizing.collective.nranks)] for _ in range(calls)]


def _run(schedule, ll: bool, calls: int = 3, seed: int = 0):
    from purlin.atom.lowering import ll_transfers
    from purlin.kernels import isa

    bufs = HostBuffers(schedule, ll=ll)
    xs = _inputs(schedule.sizing, calls, seed)
    lowered = bufs.lower()
    puts = sum(int((low.tables[0][:, isa.OP] == isa.LL_PUT).sum()) for low in lowered)
    assert puts == (len(ll_transfers(schedule)) if ll else 0)
    outs = run_calls(lowered, bufs, xs)
    for call in range(calls):
        for r, want in enumerate(reference(schedule.sizing, xs[call])):
            np.testing.assert_array_equal(outs[call][r], want,
                                          err_msg=f"call {call} rank {r}")


@pytest.mark.parametrize("ll", [False, True], ids=["simple", "ll"])
@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("name,strategy", CASES)
def test_lowered_tables_equal_the_reference(name, strategy, n, ll):
    coll = standard(name, n, root=n - 1)
    for chunks, lanes in ((1, 1), (2, 2)):
        s = plan(coll, strategy, count=24 * n, dtype="float32", chunks=chunks, lanes=lanes)
        _run(s, ll)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "int32"])
def test_ll_all_reduce_in_other_dtypes_and_odd_sizes(dtype):
    """Odd element counts leave a partial last LL unit; the tail must arrive intact."""
    coll = standard("all-reduce", 2)
    for count in (2, 6, 22):
        s = plan(coll, "direct-push", count=count, dtype=dtype)
        _run(s, ll=True, calls=4, seed=count)


def test_int32_avg_truncates_toward_zero_like_the_executor():
    """A hand-built int32 AVG row (the spec refuses integer averages, the ISA has them):
    the interpreter divides the exact sum truncating toward zero, as the executor does."""
    from purlin.kernels import isa
    from purlin.atom.host import _Memory, _run_lane

    a = np.array([-4, -4, 5, 7], dtype=np.int32)
    b = np.array([2, -1, 0, 0], dtype=np.int32)
    out = np.zeros(4, dtype=np.int32)
    pool = np.array([a.ctypes.data, b.ctypes.data], dtype=np.int64)
    row = np.zeros(isa.ROW_WIDTH, dtype=np.int64)
    row[isa.OP], row[isa.DTYPE], row[isa.REDOP] = isa.REDUCE, isa.I32, isa.AVG
    row[isa.COUNT], row[isa.NSRC], row[isa.DIVISOR], row[isa.DST] = 4, 2, 2, out.ctypes.data
    _run_lane([row], pool, 0, _Memory(1.0), 0)
    assert out.tolist() == [-1, -2, 2, 3]  # floor would give -1, -3, 2, 3


def test_a_missing_notify_times_out_in_the_interpreter():
    """The interpreter's waits are bounded: a table whose NOTIFY rows are gone fails with
    PurlinTimeoutError naming the rank and step instead of hanging (rank 0, which waits on
    the missing notifies, or rank 1, which then waits on rank 0: whichever limit a loaded
    machine's threads notice first)."""
    from purlin.errors import PurlinTimeoutError
    from purlin.kernels import isa

    s = plan(standard("all-reduce", 2), "ring", count=16, dtype="float32")
    bufs = HostBuffers(s)
    lowered = bufs.lower()
    for table in lowered[1].tables:
        table[table[:, isa.OP] == isa.NOTIFY, isa.OP] = isa.NOP
    with pytest.raises(PurlinTimeoutError, match=r"rank [01] step \d+: waited for"):
        run_calls(lowered, bufs, _inputs(s.sizing, 1, 0), timeout=0.5)


PIPELINED = [("all-reduce", "ring"), ("all-reduce", "two-phase"), ("all-gather", "ring"),
             ("all-gather", "direct-push"), ("all-to-all", "direct-pull"),
             ("broadcast", "ring"), ("reduce-scatter", "ring"), ("reduce", "direct-push")]


def _run_blocks(schedule, bpl: int, delay: float, calls: int = 2, lowered=None):
    bufs = HostBuffers(schedule)
    xs = _inputs(schedule.sizing, calls, seed=bpl)
    outs = run_calls(lowered(bufs) if lowered else bufs.lower(blocks_per_lane=bpl), bufs, xs,
                     blocks_per_lane=bpl, slow_block_delay=delay)
    return xs, outs


@pytest.mark.parametrize("name,strategy", PIPELINED)
def test_several_blocks_per_lane_with_a_slow_block(name, strategy):
    """Chunks pipelined through one lane of several blocks, the last block slow: the lane
    barriers (before data a block did not write itself, before a flag's second notify) keep
    every result whole."""
    s = plan(standard(name, 3, root=2), strategy, count=3 * 16 * 6, dtype="float32", chunks=6,
             lanes=1)
    xs, outs = _run_blocks(s, bpl=3, delay=0.002)
    for call in range(len(xs)):
        for r, want in enumerate(reference(s.sizing, xs[call])):
            np.testing.assert_array_equal(outs[call][r], want, err_msg=f"call {call} rank {r}")


def test_without_the_barrier_before_a_second_notify_a_slow_block_is_overtaken():
    """The interpreter finds the race the 2 x H200 tuning run found: drop the lane barriers
    the lowering puts before a flag's second notify, and the waiting rank reads a chunk
    before the slow block has written its part of it."""
    from purlin.atom.lowering import LoweredRank
    from purlin.kernels import isa

    s = plan(standard("all-gather", 2), "direct-push", count=2 * 16 * 8, dtype="float32",
             chunks=8, lanes=1)

    def without_notify_barriers(bufs):
        out = []
        for low in bufs.lower(blocks_per_lane=2):
            tables = []
            for t in low.tables:
                keep = np.ones(len(t), bool)
                for i in range(len(t) - 2):  # barrier NOTIFY + WAIT right before a notify
                    if (t[i, isa.OP] == isa.NOTIFY and t[i, isa.PEER] < 0
                            and t[i + 2, isa.OP] == isa.NOTIFY and t[i + 2, isa.PEER] >= 0):
                        keep[i] = keep[i + 1] = False
                tables.append(t[keep])
            assert len(tables[0]) < len(low.tables[0])  # there were such barriers
            offsets = np.array([0, len(tables[0])], dtype=np.int64)  # one lane
            out.append(LoweredRank(low.rank, tables, offsets, low.srcs, low.lane_barriers))
        return out

    xs, outs = _run_blocks(s, bpl=2, delay=0.01, calls=1, lowered=without_notify_barriers)
    wrong = sum(int((outs[0][r] != want).sum())
                for r, want in enumerate(reference(s.sizing, xs[0])))
    assert wrong > 0


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("name", ["all-reduce", "all-gather", "reduce-scatter", "all-to-all",
                                  "broadcast", "reduce"])
def test_ll_with_several_blocks_per_lane_and_a_slow_block(name, n):
    coll = standard(name, n, root=n - 1)
    for chunks, lanes, bpl in ((1, 1, 2), (2, 2, 3)):
        s = plan(coll, "direct-push", count=16 * 6 * n + 2 * n, dtype="float32",
                 chunks=chunks, lanes=lanes)
        bufs = HostBuffers(s, ll=True)
        xs = _inputs(s.sizing, 2, seed=bpl)
        outs = run_calls(bufs.lower(blocks_per_lane=bpl), bufs, xs, blocks_per_lane=bpl,
                         slow_block_delay=0.002)
        for call in range(2):
            for r, want in enumerate(reference(s.sizing, xs[call])):
                np.testing.assert_array_equal(outs[call][r], want,
                                              err_msg=f"call {call} rank {r} bpl {bpl}")


def test_ll_without_the_barrier_after_the_get_reads_another_blocks_units():
    from purlin.atom.lowering import LoweredRank
    from purlin.kernels import isa

    s = plan(standard("all-reduce", 2), "direct-push", count=2 * 16 * 8, dtype="float32")
    bufs = HostBuffers(s, ll=True)

    def without_get_barriers(low):
        t = low.tables[0]
        keep = np.ones(len(t), bool)
        for i in range(1, len(t) - 1):
            if t[i - 1, isa.OP] == isa.LL_GET and t[i, isa.OP] == isa.NOTIFY \
                    and t[i, isa.PEER] < 0:
                keep[i] = keep[i + 1] = False
        assert not keep.all()
        return LoweredRank(low.rank, [x[keep] for x in low.tables],
                           np.array([0, int(keep.sum())], dtype=np.int64), low.srcs,
                           low.lane_barriers)

    lowered = [without_get_barriers(low) for low in bufs.lower(blocks_per_lane=2)]
    xs = _inputs(s.sizing, 1, seed=7)
    outs = run_calls(lowered, bufs, xs, blocks_per_lane=2, slow_block_delay=0.01)
    wrong = sum(int((outs[0][r] != want).sum())
                for r, want in enumerate(reference(s.sizing, xs[0])))
    assert wrong > 0


@pytest.mark.parametrize("name,strategy", CASES)
def test_local_buffers_may_move_to_other_memory(name, strategy):
    """The buffers ``local_buffers`` names, moved by ``relocate`` to fresh memory (a user's
    tensor in process mode): the results land there and equal the reference, and the old
    regions, filled with garbage, are never read."""
    from purlin.atom.lowering import local_buffers, relocate

    n = 3
    s = plan(standard(name, n, root=n - 1), strategy, count=24 * n, dtype="float32",
             chunks=2, lanes=2)
    bufs = HostBuffers(s)
    lowered = bufs.lower()
    moved_any = False
    for r in range(n):
        moves = {}
        for b in local_buffers(s, r):
            arrays = bufs.inputs if b == "input" else bufs.outputs
            old = arrays[r]
            new = np.zeros_like(old)
            moves[(old.ctypes.data, old.nbytes)] = new.ctypes.data
            old[:] = np.frombuffer(b"\xff" * old.nbytes, old.dtype)  # garbage (NaN)
            arrays[r] = new  # run_calls writes inputs to / reads outputs from the new memory
            moved_any = True
        lowered[r] = relocate(lowered[r], moves)
    xs = _inputs(s.sizing, 2, seed=11)
    outs = run_calls(lowered, bufs, xs)
    for call in range(2):
        for r, want in enumerate(reference(s.sizing, xs[call])):
            np.testing.assert_array_equal(outs[call][r], want, err_msg=f"call {call} rank {r}")
    if strategy == "direct-push" and name == "all-reduce":
        assert moved_any
