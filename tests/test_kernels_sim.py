"""The executor kernel and its atoms, run in Numba's CUDA simulator.

The simulator must be switched on before ``numba.cuda`` is first imported, so the cases below
run in one child process (``NUMBA_ENABLE_CUDASIM=1 python tests/test_kernels_sim.py OUT``)
and each pytest test checks the verdict of one case. The simulator runs blocks one after
another and fences are no-ops: every WAIT here is either satisfied already or meant to time out.
"""

from __future__ import annotations

import ctypes
import sys
import time
import zlib
from dataclasses import replace

import numpy as np
from simulator import run_cases, simulator_tests

from purlin.atom.host import bf16_bits, bf16_floats

CASES = {}


def case(fn):
    CASES[fn.__name__] = fn
    return fn


# ----------------------------------------------------------------------------------- helpers


GUARD = 0xA5


def _aligned(nbytes: int, offset: int = 0, guard: int = 64) -> tuple[np.ndarray, int]:
    """A byte buffer filled with GUARD and an address 16-byte aligned plus ``offset`` inside it,
    with ``guard`` bytes either side."""
    raw = np.full(nbytes + 2 * guard + 16, GUARD, dtype=np.uint8)
    start = (-raw.ctypes.data) % 16 + guard
    return raw, raw.ctypes.data + start + offset


def _guards_intact(raw: np.ndarray, addr: int, nbytes: int) -> bool:
    at = addr - raw.ctypes.data
    return bool((raw[:at] == GUARD).all() and (raw[at + nbytes:] == GUARD).all())


def _view(raw: np.ndarray, addr: int, count: int, dtype) -> np.ndarray:
    at = addr - raw.ctypes.data
    return raw[at: at + count * np.dtype(dtype).itemsize].view(dtype)


# ------------------------------------------------------------------------------------ copies


@case
def copy_bytes_every_offset_and_length():
    """copy_bytes for every relative misalignment 0..15 and lengths 0..40, 3 threads."""
    from purlin.kernels.atoms import copy_bytes

    rng = np.random.default_rng(0)
    for src_off in (0, 1, 8):
        for dst_off in range(16):
            for n in list(range(41)) + [97, 256]:
                src_raw, src = _aligned(n, src_off)
                dst_raw, dst = _aligned(n, dst_off)
                src_raw[:] = rng.integers(0, 256, src_raw.size, dtype=np.uint8)
                for tid in range(3):
                    copy_bytes(dst, src, n, tid, 3)
                got = _view(dst_raw, dst, n, np.uint8)
                want = _view(src_raw, src, n, np.uint8)
                assert np.array_equal(got, want), (src_off, dst_off, n)
                assert _guards_intact(dst_raw, dst, n), (src_off, dst_off, n)


@case
def shifted_copies_every_offset_and_length():
    """The fused kernel's copy of an odd-aligned piece into bytes nothing else touches
    (``_copy_shifted``): every source offset against every destination offset, lengths 0..50
    and longer, 1-5 threads; aligned 16-byte stores from funnel-shifted source words, the
    row's partial first and last slots in narrow words (the simulator's accesses are checked
    for alignment as a GPU's are). Every byte is written by the thread that owns its slot
    (a later row may wait for that block's flag alone), and every 16-byte word it loads
    holds a byte of the row's source: a word past the row may lie outside the buffer."""
    from purlin.kernels import atoms
    from purlin.kernels.fused import _copy_shifted

    load = atoms.load_v4_u32
    loaded = []

    def recorded(addr):
        loaded.append(int(addr))
        return load(addr)

    rng = np.random.default_rng(4)
    lengths = list(range(51)) + [97, 256, 1001]
    ran = 0
    atoms.load_v4_u32 = recorded
    try:
        for src_off in range(16):
            for dst_off in range(16):
                for n in lengths:
                    src_raw, src = _aligned(n, src_off)
                    dst_raw, dst = _aligned(n, dst_off)
                    src_raw[:] = rng.integers(0, 256, src_raw.size, dtype=np.uint8)
                    threads = int(rng.integers(1, 6))
                    # every byte of the destination changes when written: who wrote it shows
                    _view(dst_raw, dst, n, np.uint8)[:] = ~_view(src_raw, src, n, np.uint8)
                    loaded.clear()
                    for tid in range(threads):
                        before = _view(dst_raw, dst, n, np.uint8).copy()
                        _copy_shifted(dst, src, n, tid, threads)
                        wrote = np.flatnonzero(before != _view(dst_raw, dst, n, np.uint8))
                        owner = ((dst & 15) + wrote) // 16 % threads
                        assert (owner == tid).all(), (src_off, dst_off, n, threads, tid)
                    assert np.array_equal(_view(dst_raw, dst, n, np.uint8),
                                          _view(src_raw, src, n, np.uint8)), \
                        (src_off, dst_off, n, threads)
                    assert _guards_intact(dst_raw, dst, n), (src_off, dst_off, n, threads)
                    outside = [a - src for a in loaded if not (a < src + n and a + 16 > src)]
                    assert not outside, (src_off, dst_off, n, threads, outside[:4])
                    # a whole slot goes by 16-byte loads, partial slots by narrow words
                    whole = (dst + n) // 16 - (dst + 15) // 16 > 0
                    assert bool(loaded) == whole, (src_off, dst_off, n, loaded)
                    ran += 1
    finally:
        atoms.load_v4_u32 = load
    assert ran == 16 * 16 * len(lengths)


@case
def narrow_copies_every_width_offset_and_length():
    """The fused kernel's copy of an odd-aligned piece (``_copy_narrow``): words of 8, 4, 2
    and 1 bytes at every offset that width allows, lengths 0..40 and longer, 3 threads; the
    simulator's accesses are checked for alignment as a GPU's are."""
    from purlin.kernels.fused import _copy_narrow

    rng = np.random.default_rng(3)
    for width in (8, 4, 2, 1):
        for src_off in range(0, 16, width):
            for dst_off in (width % 16, (16 - width) % 16, 0):
                for n in list(range(41)) + [97, 256]:
                    src_raw, src = _aligned(n, src_off)
                    dst_raw, dst = _aligned(n, dst_off)
                    src_raw[:] = rng.integers(0, 256, src_raw.size, dtype=np.uint8)
                    for tid in range(3):
                        _copy_narrow(dst, src, n, tid, 3, width)
                    assert np.array_equal(_view(dst_raw, dst, n, np.uint8),
                                          _view(src_raw, src, n, np.uint8)), (width, n)
                    assert _guards_intact(dst_raw, dst, n), (width, src_off, dst_off, n)


@case
def odd_edges_every_offset_and_length():
    """A word of a row at any alignment (``_load4``: the first ``valid`` bytes, at most 4,
    from two aligned loads; all 4 where it is 4-byte aligned) and a row's partial 16 bytes
    (``_copy_edge``) at every source and destination offset and length 0..16: the bytes
    copied, nothing written past them."""
    from purlin.kernels.fused import _copy_edge, _load4

    rng = np.random.default_rng(5)
    raw, base = _aligned(32)
    raw[:] = rng.integers(0, 256, raw.size, dtype=np.uint8)
    at = base - raw.ctypes.data
    for off in range(16):
        for valid in range(-2, 7):
            want = raw[at + off: at + off + (4 if off % 4 == 0 else max(0, min(valid, 4)))]
            got = int(_load4(base + off, valid))
            assert got == int.from_bytes(want.tobytes(), "little"), (off, valid, hex(got))
    for src_off in range(16):
        for dst_off in range(16):
            for n in range(17):
                src_raw, src = _aligned(16, src_off)
                dst_raw, dst = _aligned(16, dst_off)
                src_raw[:] = rng.integers(0, 256, src_raw.size, dtype=np.uint8)
                _copy_edge(dst, src, n)
                assert np.array_equal(_view(dst_raw, dst, n, np.uint8),
                                      _view(src_raw, src, n, np.uint8)), (src_off, dst_off, n)
                assert _guards_intact(dst_raw, dst, n), (src_off, dst_off, n)


@case
def copy_rows_aligned_and_misaligned():
    """COPY rows through the executor: aligned f32, bf16 at odd 2-byte offsets, 2 lanes x 2."""
    from purlin.kernels import isa, sim

    rng = np.random.default_rng(1)
    jobs = []  # (src_raw, dst_raw, src, dst, count, dtype)
    for count, dtype, code, s_off, d_off in [(37, np.float32, isa.F32, 0, 0),
                                             (1000, np.float32, isa.F32, 0, 0),
                                             (45, np.uint16, isa.BF16, 2, 6),
                                             (33, np.uint16, isa.F16, 6, 6),
                                             (21, np.float64, isa.F64, 8, 8)]:
        nbytes = count * np.dtype(dtype).itemsize
        src_raw, src = _aligned(nbytes, s_off)
        dst_raw, dst = _aligned(nbytes, d_off)
        src_raw[:] = rng.integers(0, 256, src_raw.size, dtype=np.uint8)
        jobs.append((src_raw, dst_raw, src, dst, count, dtype, code))
    lanes = [[], []]
    for i, (_, _, src, dst, count, _, code) in enumerate(jobs):
        lanes[i % 2].append(sim.copy_row(dst, src, count, dtype=code, step=i))
    rank = sim.HostRank(0, lanes, blocks_per_lane=2)
    sim.run_simulated([rank], blocks_per_lane=2, threads=4)
    for src_raw, dst_raw, src, dst, count, dtype, _ in jobs:
        got, want = _view(dst_raw, dst, count, dtype), _view(src_raw, src, count, dtype)
        assert np.array_equal(got.view(np.uint8), want.view(np.uint8)), (count, dtype)
        assert _guards_intact(dst_raw, dst, got.nbytes), (count, dtype)
    assert rank.error_record["code"] == 0


# ----------------------------------------------------------------------------------- reduces


def _expected(srcs: list[np.ndarray], dtype: str, op: str) -> np.ndarray:
    """What the kernel computes: accumulate in order, in float32 for 16-bit floats."""
    if dtype in ("bfloat16", "float16"):
        vals = [bf16_floats(s) if dtype == "bfloat16" else s.view(np.float16).astype(np.float32)
                for s in srcs]
    elif dtype == "int32":
        vals = [s.astype(np.int64) for s in srcs]
    else:
        vals = list(srcs)
    acc = vals[0].copy()
    for v in vals[1:]:
        acc = {"sum": acc + v, "avg": acc + v, "max": np.maximum(acc, v),
               "min": np.minimum(acc, v)}[op]
    if op == "avg":
        if dtype == "int32":
            acc = np.sign(acc) * (np.abs(acc) // len(srcs))
        else:
            acc = acc / acc.dtype.type(len(srcs))
    if dtype == "bfloat16":
        return bf16_bits(acc)
    if dtype == "float16":
        return acc.astype(np.float16).view(np.uint16)
    if dtype == "int32":
        return acc.astype(np.int32)  # wraps like the kernel's 32-bit store
    return acc


def _random(rng, dtype: str, count: int) -> np.ndarray:
    if dtype == "bfloat16":
        return bf16_bits(rng.standard_normal(count).astype(np.float32) * 10)
    if dtype == "float16":
        return (rng.standard_normal(count) * 10).astype(np.float16).view(np.uint16)
    if dtype == "int32":
        return rng.integers(-2**31, 2**31, count, dtype=np.int64).astype(np.int32)
    return (rng.standard_normal(count) * 10).astype(dtype)


def _reduce_case(dtype: str, offsets: tuple[int, int, int, int], count: int = 45):
    """Reduce 3 sources with every op (4 rows over 2 lanes x 2 blocks); exact vs numpy."""
    from purlin.kernels import isa, sim

    code = isa.DTYPE_CODES[dtype]
    store = np.dtype(np.uint16 if dtype in ("bfloat16", "float16") else dtype)
    size = np.dtype(store).itemsize
    rng = np.random.default_rng(zlib.crc32(f"{dtype}{offsets}".encode()))
    ops = ["sum", "max", "min", "avg"]
    keep, lanes, checks = [], [[], []], []
    for i, op in enumerate(ops):
        srcs, addrs = [], []
        for off in offsets[1:]:
            raw, addr = _aligned(count * size, off)
            _view(raw, addr, count, store)[:] = _random(rng, dtype, count)
            srcs.append(_view(raw, addr, count, store).copy())
            addrs.append(addr)
            keep.append(raw)
        out_raw, out = _aligned(count * size, offsets[0])
        keep.append(out_raw)
        lanes[i % 2].append(sim.reduce_row(out, addrs, count, dtype=code,
                                           redop=isa.REDOP_CODES[op], step=i))
        checks.append((op, out_raw, out, srcs))
    rank = sim.HostRank(0, lanes, blocks_per_lane=2)
    sim.run_simulated([rank], blocks_per_lane=2, threads=4)
    for op, out_raw, out, srcs in checks:
        got = _view(out_raw, out, count, store)
        want = _expected(srcs, dtype, op)
        assert np.array_equal(got.view(np.uint8), want.view(np.uint8)), (
            f"{dtype} {op} offsets {offsets}: got {got[:8]} want {want[:8]}")
        assert _guards_intact(out_raw, out, got.nbytes), f"{dtype} {op}: wrote outside"


for _dtype in ("bfloat16", "float16", "float32", "int32", "float64"):
    for _name, _offsets in (("aligned", (0, 0, 0, 0)),
                            ("same_phase", (8, 8, 8, 8)),
                            ("mixed_phase", (0, 8, 0, 8))):
        def _make(dtype=_dtype, offsets=_offsets):
            return lambda: _reduce_case(dtype, offsets)

        _fn = _make()
        _fn.__name__ = f"reduce_3_sources_{_dtype}_{_name}"
        case(_fn)


@case
def half_conversions_round_to_nearest_even():
    """The simulated bf16/f16 packers round ties to even and keep NaN a NaN."""
    from purlin.kernels import intrinsics as I

    ties = np.array([1.0 + 2**-8, 1.0 + 3 * 2**-8, -(1.0 + 2**-8), 3.0e38, 1e-40],
                    dtype=np.float32)
    for x in ties:
        word = I.f32x2_to_bf16x2(x, np.float32(0))
        assert word & 0xFFFF == int(bf16_bits(np.array([x]))[0]), x
        assert word >> 16 == 0
    nan = I.f32x2_to_bf16x2(np.float32("nan"), np.float32(1))
    assert np.isnan(I.bits_to_f32((nan & 0xFFFF) << 16))
    assert I.f32x2_to_f16x2(np.float32(1 + 2**-11), np.float32(-2)) == (
        int(np.float16(1.0).view(np.uint16)) | int(np.float16(-2.0).view(np.uint16)) << 16)


# ----------------------------------------------------------------------- flags, epochs, errors


@case
def notify_and_satisfied_waits_across_epochs():
    """NOTIFY adds VALUE per block; WAIT targets follow the epoch; the 3rd call times out."""
    from purlin.kernels import isa, sim

    flags = np.zeros(4, dtype=np.uint64)
    flags[0] = 5
    flags[2] = 7
    addr = flags.ctypes.data
    lanes = [[sim.notify_row(addr + 8, value=3, step=0),
              sim.wait_row(addr, value=2, per_call=2, step=1),          # (epoch)*2 + 2 <= 5
              sim.wait_row(addr + 16, value=7, per_call=7, epoch_offset=-1, step=2),  # 7 * epoch
              sim.notify_row(addr + 24, value=1, step=3)]]
    rank = sim.HostRank(3, lanes, blocks_per_lane=2)
    for call in range(2):
        sim.run_simulated([rank], blocks_per_lane=2, threads=4, timeout_ns=10**9)
        assert rank.error_record["code"] == 0, rank.error_record
        assert int(rank.epoch[0]) == call + 1 and int(rank.done[0]) == 0
        assert int(flags[1]) == 6 * (call + 1) and int(flags[3]) == 2 * (call + 1)
    # epoch 2: the first wait now needs 2 * 2 + 2 = 6 > 5
    sim.run_simulated([rank], blocks_per_lane=2, threads=4, timeout_ns=1_000_000)
    rec = rank.error_record
    assert rec == {"code": isa.ERR_TIMEOUT, "rank": 3, "step": 1, "flag": addr, "expected": 6,
                   "seen": 5, "lane": 0, "block": 0, "peer": -1}, rec
    assert int(rank.abort[0]) >= 1
    assert int(flags[1]) == 6 * 2 + 3 * 2, "the NOTIFY before the wait ran in both blocks"
    assert int(flags[3]) == 4, "rows after a failed wait must not run"
    assert int(rank.epoch[0]) == 3 and int(rank.done[0]) == 0, "every block still checks out"


@case
def one_rank_block_prefetched_in_one_pass():
    """A rank laid out as one block (lowering.build_blob) and launched with head_words: copies,
    reductions, notifies, satisfied waits and the epoch in its control words, over two calls."""
    from purlin.atom.lowering import CONTROL_AT, HEAD_WORDS, LoweredRank, blob_size, build_blob
    from purlin.kernels import isa, sim
    from purlin.kernels.launch import Launcher

    rng = np.random.default_rng(7)
    a, b = (rng.standard_normal(37).astype(np.float32) for _ in range(2))
    copied, summed = np.zeros(37, np.float32), np.zeros(37, np.float32)
    flags = np.zeros(2, dtype=np.uint64)
    flags[1] = 100
    f = flags.ctypes.data
    lanes = [[sim.copy_row(copied.ctypes.data, a.ctypes.data, 37, step=0),
              sim.notify_row(f, value=1, step=1),
              sim.wait_row(f + 8, value=3, per_call=1, step=2),       # epoch + 3 <= 100
              sim.reduce_row(summed.ctypes.data, [a.ctypes.data, b.ctypes.data], 37, step=3)]]
    table, offsets, pool = sim.build_table(lanes)
    low = LoweredRank(5, [table], offsets, pool, 0)
    abort = np.zeros(1, dtype=np.uint64)
    blob = np.zeros(blob_size(low, 1), dtype=np.int64)
    blob[:] = build_blob(blob.ctypes.data, low, 1, abort.ctypes.data)
    launcher = Launcher(0, 1, nlanes=1, blocks_per_lane=2, threads=8, head_words=HEAD_WORDS)
    assert launcher.head_words == HEAD_WORDS
    for call in range(2):
        copied[:] = 0
        summed[:] = 0
        launcher(blob.ctypes.data, 0, 10**9)
        error = sim.error_record(blob[CONTROL_AT + 2: CONTROL_AT + 2 + isa.ERR_WIDTH])
        assert error["code"] == 0, error
        assert np.array_equal(copied, a) and np.allclose(summed, a + b, rtol=1e-6)
        assert int(blob[CONTROL_AT]) == call + 1, "epoch lives in the block's control words"
        assert int(blob[CONTROL_AT + 1]) == 0, "done counter back to 0"
        assert int(flags[0]) == 2 * (call + 1), "one notify per block"
    # a launch of several ranks never prefetches (their descriptors are a table, not blocks)
    assert Launcher(0, 2, nlanes=1, blocks_per_lane=1, threads=8, head_words=512).head_words == 0


@case
def timeout_record_and_abort_across_ranks():
    """Rank 0 times out; rank 1 in the same launch sees ABORT and records ERR_ABORTED."""
    from purlin.kernels import isa, sim

    flags = np.zeros(3, dtype=np.uint64)
    marker = np.zeros(4, dtype=np.float32)
    one = np.ones(4, dtype=np.float32)
    abort = np.zeros(1, dtype=np.uint64)
    f = flags.ctypes.data
    rank0 = sim.HostRank(0, [
        [sim.wait_row(f, value=1, per_call=1, step=4, peer=1),
         sim.copy_row(marker.ctypes.data, one.ctypes.data, 4, step=5)],
        [sim.wait_row(f + 8, value=1, per_call=1, step=6, peer=1)],
    ], blocks_per_lane=2, abort=abort)
    rank1 = sim.HostRank(1, [[sim.wait_row(f + 16, value=9, per_call=9, step=7, peer=0)]],
                         blocks_per_lane=2, abort=abort)
    start = time.perf_counter()
    sim.run_simulated([rank0, rank1], blocks_per_lane=2, threads=2, timeout_ns=20_000_000)
    elapsed = time.perf_counter() - start
    rec0, rec1 = rank0.error_record, rank1.error_record
    assert rec0 == {"code": isa.ERR_TIMEOUT, "rank": 0, "step": 4, "flag": f, "expected": 1,
                    "seen": 0, "lane": 0, "block": 0, "peer": 1}, rec0
    assert rec1["code"] == isa.ERR_ABORTED and rec1["rank"] == 1 and rec1["step"] == 7, rec1
    assert rec1["expected"] == 9 and rec1["peer"] == 0, rec1
    assert int(abort[0]) >= 1
    assert not marker.any(), "the copy after the failed wait ran"
    assert elapsed < 5, f"waits after ABORT should end at once, took {elapsed:.1f} s"
    for rank in (rank0, rank1):
        assert int(rank.epoch[0]) == 1 and int(rank.done[0]) == 0


@case
def epochs_bump_per_launch_with_padded_lanes():
    """Two ranks, 3 and 1 lanes (rank 1 padded): each EPOCH counts launches, DONE returns to 0."""
    from purlin.kernels import sim

    ranks = [sim.HostRank(0, [[], [], []], blocks_per_lane=2),
             sim.HostRank(1, [[]], blocks_per_lane=2, abort=None)]
    for call in range(3):
        sim.run_simulated(ranks, blocks_per_lane=2, threads=2)
        for rank in ranks:
            assert int(rank.epoch[0]) == call + 1 and int(rank.done[0]) == 0


@case
def odd_calls_run_the_odd_table():
    """Even epochs run D_TABLE, odd epochs D_TABLE_ODD (one shared source pool)."""
    from purlin.kernels import sim

    a, b = np.full(8, 1.0, dtype=np.float32), np.full(8, 2.0, dtype=np.float32)
    out = np.zeros(8, dtype=np.float32)
    rank = sim.HostRank(0, [[sim.copy_row(out.ctypes.data, a.ctypes.data, 8)]],
                        odd_lanes=[[sim.copy_row(out.ctypes.data, b.ctypes.data, 8)]])
    assert rank.pool.tolist() == [a.ctypes.data, b.ctypes.data]
    for call, want in enumerate([1.0, 2.0, 1.0, 2.0]):
        out[:] = 0
        sim.run_simulated([rank], threads=2)
        assert (out == want).all(), (call, out)


@case
def the_pdl_executor_runs_the_same_rows():
    """executor_pdl (programmatic dependent launch) runs a table exactly as executor does."""
    from purlin.kernels import sim

    a, b = np.arange(8, dtype=np.float32), np.full(8, 2.0, dtype=np.float32)
    out = np.zeros(8, dtype=np.float32)
    flags = np.zeros(1, dtype=np.uint64)
    rank = sim.HostRank(0, [[sim.reduce_row(out.ctypes.data, [a.ctypes.data, b.ctypes.data], 8),
                             sim.notify_row(flags.ctypes.data)]])
    sim.run_simulated([rank], threads=4, pdl=True)
    assert (out == a + b).all() and int(flags[0]) == 1 and int(rank.epoch[0]) == 1


@case
def trace_records_when_tracing_is_on():
    """Thread 0 writes (row, sub-block, start, end) per row; rows past D_TRACE_ROWS are not."""
    from purlin.kernels import isa, sim

    flags = np.zeros(2, dtype=np.uint64)
    f = flags.ctypes.data
    lanes = [[sim.notify_row(f + 8)],
             [sim.notify_row(f), sim.notify_row(f), sim.notify_row(f)]]
    rank = sim.HostRank(0, lanes, blocks_per_lane=2, trace_rows=2)
    # one spare block's worth of records after the 4 real ones catches writes past the end
    rank.trace = np.full((5, 2, isa.TRACE_WIDTH), -1, dtype=np.int64)
    rank.desc[isa.D_TRACE] = rank.trace.ctypes.data
    sim.run_simulated([rank], blocks_per_lane=2, threads=2)
    trace = rank.trace  # [block_in_rank, trace_rows, TRACE_WIDTH]
    for block in range(4):
        lane, sub = divmod(block, 2)
        rows = [0] if lane == 0 else [1, 2]  # lane 1's third row (3) is past D_TRACE_ROWS
        for i, row in enumerate(rows):
            r, s, t0, t1 = trace[block, i]
            assert (r, s) == (row, sub), (block, trace[block])
            assert 0 < t0 <= t1, (block, trace[block])
        if lane == 0:
            assert (trace[block, 1] == -1).all(), "wrote an unused slot"
    assert (trace[4] == -1).all(), "wrote past the trace buffer"
    assert int(flags[0]) == 6 and int(flags[1]) == 2

    plain = sim.HostRank(0, lanes, blocks_per_lane=2)  # tracing off: D_TRACE is 0
    sim.run_simulated([plain], blocks_per_lane=2, threads=2)
    assert plain.desc[isa.D_TRACE] == 0 and int(flags[0]) == 12


@case
def ll_put_then_get_round_trip_with_a_tail():
    """LL_PUT writes (lo, tag, hi, tag) units, tag = epoch + 1; LL_GET unpacks them, the
    odd tail byte by byte, and writes nothing past the end."""
    from purlin.kernels import isa, sim

    count = 13  # bfloat16: 26 bytes -> 4 units, the last one 2 data bytes
    src_raw, src = _aligned(2 * count)
    units_raw, units = _aligned(4 * isa.LL_UNIT)
    dst_raw, dst = _aligned(2 * count)
    for call in range(2):
        data = np.random.default_rng(call).integers(0, 256, 2 * count, dtype=np.uint8)
        _view(src_raw, src, 2 * count, np.uint8)[:] = data
        rank = sim.HostRank(0, [[sim.ll_put_row(units, src, count, isa.BF16),
                                 sim.ll_get_row(dst, units, count, isa.BF16)]])
        rank.epoch[0] = call
        sim.run_simulated([rank], threads=3)
        assert rank.error_record["code"] == 0, rank.error_record
        got = _view(units_raw, units, 16, np.uint32).reshape(4, 4)
        assert (got == sim.ll_pack(data.tobytes(), call + 1)).all(), (call, got)
        assert (_view(dst_raw, dst, 2 * count, np.uint8) == data).all(), call
        assert _guards_intact(dst_raw, dst, 2 * count), "wrote past the destination"
        assert _guards_intact(units_raw, units, 4 * isa.LL_UNIT), "wrote past the units"


@case
def ll_get_times_out_on_last_calls_tag():
    """Units still holding the previous call's tag are not this call's data: LL_GET times
    out and names the units' address, this call's tag and the tag it saw."""
    from purlin.kernels import isa, sim

    units_raw, units = _aligned(2 * isa.LL_UNIT)
    _view(units_raw, units, 8, np.uint32)[:] = sim.ll_pack(bytes(16), 1).ravel()
    dst_raw, dst = _aligned(16)
    rank = sim.HostRank(0, [[sim.ll_get_row(dst, units, 4, step=3, peer=1)]])
    rank.epoch[0] = 1  # this call's tag is 2
    sim.run_simulated([rank], threads=2, timeout_ns=20_000_000)
    rec = rank.error_record
    assert rec["code"] == isa.ERR_TIMEOUT and rec["flag"] == units, rec
    assert (rec["expected"], rec["seen"], rec["step"], rec["peer"]) == (2, 1, 3, 1), rec
    assert int(rank.abort[0]) >= 1


@case
def ll_rows_of_a_lowered_all_reduce():
    """A direct-push all-reduce lowered with LL areas: rank 0's table (its peer's LL units
    written beforehand, as rank 1 would) sums correctly and leaves its own half in rank 1's
    LL area, tagged with the call."""
    from purlin.atom.lowering import ll_area_bytes, lower
    from purlin.kernels import isa, sim
    from purlin.snac import plan
    from purlin.spec import collectives

    count = 10  # float32
    s = plan(collectives.all_reduce(2), "direct-push", count=count, dtype="float32")
    xs = [np.arange(count, dtype=np.float32) + 100 * r for r in range(2)]
    outs = [np.zeros(count, dtype=np.float32) for _ in range(2)]
    scratch_bytes = {r: -(-s.scratch[r] * 4 // 16) * 16 for r in range(2)}
    scratch = [np.zeros(scratch_bytes[r] * s.scratch_copies // 4 + 4, dtype=np.float32)
               for r in range(2)]
    ll = [np.zeros(ll_area_bytes(scratch_bytes[r]) * s.scratch_copies // 4, dtype=np.uint32)
          for r in range(2)]
    flags = [np.zeros(16, dtype=np.uint64) for _ in range(2)]
    bases = {}
    for r in range(2):
        bases[(r, "input")], bases[(r, "output")] = xs[r].ctypes.data, outs[r].ctypes.data
        bases[(r, "scratch")] = scratch[r].ctypes.data
    lowered = lower(s, bases, {r: flags[r].ctypes.data for r in range(2)},
                    scratch_bytes=scratch_bytes, ll_bases={r: ll[r].ctypes.data for r in range(2)})
    ops = [isa.OPCODE_NAMES[op] for op in lowered[0].tables[0][:, isa.OP]]
    assert ops == ["ll_put", "ll_get", "reduce"], ops
    # rank 1's put into rank 0's LL area, as the GPU would have done it (call 0: tag 1)
    put1 = lowered[1].tables[0][0]
    src1 = int(lowered[1].srcs[put1[isa.SRC]])
    at = (int(put1[isa.DST]) - ll[0].ctypes.data) // 4
    units = sim.ll_pack(ctypes.string_at(src1, 4 * int(put1[isa.COUNT])), 1).ravel()
    ll[0][at: at + units.size] = units
    rank0 = sim.HostRank.from_lowered(lowered[0])
    sim.run_simulated([rank0], threads=4)
    assert rank0.error_record["code"] == 0, rank0.error_record
    assert (outs[0] == xs[0] + xs[1]).all(), outs[0]
    put0 = lowered[0].tables[0][0]
    src0 = int(lowered[0].srcs[put0[isa.SRC]])
    at = (int(put0[isa.DST]) - ll[1].ctypes.data) // 4
    want = sim.ll_pack(ctypes.string_at(src0, 4 * int(put0[isa.COUNT])), 1).ravel()
    assert (ll[1][at: at + want.size] == want).all(), "rank 0's units in rank 1's LL area"
    assert not flags[0].any() and not flags[1].any(), "an LL pair notified a flag"


# ------------------------------------------------------------------------------- fused LL


def _fused_setup(collective, dtype: str, count: int, seed: int = 0, use_ll: bool = True):
    """Host buffers and lowered LL tables for every rank of ``collective`` (direct-push)."""
    from purlin.atom.lowering import ll_area_bytes, lower
    from purlin.snac import plan

    s = plan(collective, "direct-push", count=count, dtype=dtype)
    n, item = s.nranks, np.dtype(_NP[dtype]).itemsize
    rng = np.random.default_rng(seed)
    xs = [_random(rng, dtype, s.sizing.input_count(r)) for r in range(n)]
    outs = [np.zeros(s.sizing.output_count(r), dtype=_NP[dtype]) for r in range(n)]
    scratch_bytes = {r: -(-s.scratch[r] * item // 16) * 16 for r in range(n)}
    scratch = [np.zeros(scratch_bytes[r] * s.scratch_copies + 16, dtype=np.uint8)
               for r in range(n)]
    ll = [np.zeros(ll_area_bytes(scratch_bytes[r]) * s.scratch_copies // 4 + 4, dtype=np.uint32)
          for r in range(n)]
    flags = [np.zeros(64, dtype=np.uint64) for _ in range(n)]
    bases = {}
    for r in range(n):
        bases[(r, "input")], bases[(r, "output")] = xs[r].ctypes.data, outs[r].ctypes.data
        bases[(r, "scratch")] = scratch[r].ctypes.data
    lowered = lower(s, bases, {r: flags[r].ctypes.data for r in range(n)},
                    scratch_bytes=scratch_bytes,
                    ll_bases={r: ll[r].ctypes.data for r in range(n)} if use_ll else None)
    return s, xs, outs, ll, lowered, (scratch, flags)


_NP = {"bfloat16": np.uint16, "float32": np.float32, "int32": np.int32}


def _peer_units(lowered, ll, to: int, call: int) -> None:
    """Write into rank ``to``'s LL area the units every other rank's LL_PUT rows of call
    ``call`` would have written (tag call + 1, the parity's table)."""
    from purlin.kernels import isa, sim

    for low in lowered:
        if low.rank == to:
            continue
        table = low.tables[call % len(low.tables)]
        for row in table:
            if row[isa.OP] != isa.LL_PUT or row[isa.PEER] != to:
                continue
            src = int(low.srcs[row[isa.SRC]])
            size = int(row[isa.COUNT]) * isa.ITEMSIZE[int(row[isa.DTYPE])]
            units = sim.ll_pack(ctypes.string_at(src, size), call + 1).ravel()
            at = (int(row[isa.DST]) - ll[to].ctypes.data) // 4
            ll[to][at: at + units.size] = units


def _run_fused(low, blocks: int = 3, threads: int = 4, timeout_ns: int = 10_000_000,
               flag_slot=None, unit: int = 16):
    from purlin.atom.fused import program
    from purlin.kernels import fused, isa

    err = np.zeros(isa.ERR_WIDTH, dtype=np.int64)
    abort = np.zeros(1, dtype=np.uint64)
    prog = program(low, error=err.ctypes.data, abort=abort.ctypes.data,
                   flag_slot=flag_slot or (lambda a: a), unit=unit)
    words = prog.words.copy()
    counters = np.zeros(isa.F_MAX_BLOCKS, dtype=np.int64)

    def launch():  # the program holds the addresses of err and abort: keep them alive here
        fused.fused[blocks, threads](words.ctypes.data, 1, blocks, timeout_ns, words.size,
                                     counters.ctypes.data)
        return err, abort, words

    return counters, err, abort, launch


@case
def fused_all_reduce_equals_the_interpreter_bit_for_bit():
    """Rank 0 of a 3-rank all-reduce, fused with 16- and with 8-byte items (bf16; float32
    with 8), over two calls (even and odd LL parities, tags 1 and 2): the same bits as the
    interpreter's rows, its units in both peers' areas, every block's call counter at 2."""
    from purlin.kernels import isa, sim
    from purlin.spec import collectives

    for dtype, unit in (("bfloat16", 16), ("bfloat16", 8), ("float32", 8)):
        s, xs, outs, ll, lowered, keep = _fused_setup(collectives.all_reduce(3), dtype, 24)
        counters, err, abort, launch = _run_fused(lowered[0], unit=unit)
        for call in range(2):
            _peer_units(lowered, ll, 0, call)
            launch()
            assert err[isa.E_CODE] == 0, (unit, err)
            fused_out = outs[0].copy()
            outs[0][:] = 0
            rank0 = sim.HostRank.from_lowered(lowered[0])
            rank0.epoch[0] = call
            sim.run_simulated([rank0], threads=4)
            assert rank0.error_record["code"] == 0, rank0.error_record
            assert (fused_out == outs[0]).all(), (unit, call, fused_out, outs[0])
            if dtype == "bfloat16":
                want = bf16_bits(sum(bf16_floats(x).astype(np.float64) for x in xs))
                assert (np.abs(fused_out.astype(np.int32) - want.astype(np.int32)) <= 1).all()
        assert (counters[:3] == 2).all() and counters[3] == 0, counters[:4]  # per block
        for q in (1, 2):  # rank 0's units of the odd call sit in rank q's odd parity, tag 2
            row = next(r for r in lowered[0].tables[1] if r[isa.OP] == isa.LL_PUT
                       and r[isa.PEER] == q)
            at = (int(row[isa.DST]) - ll[q].ctypes.data) // 4
            want = sim.ll_pack(xs[0].tobytes(), 2).ravel()
            assert (ll[q][at: at + want.size] == want).all(), (unit, q)


@case
def fused_four_byte_halves_equal_the_interpreter():
    """8-byte reduce-scatter and all-gather (bf16: 4-byte chunks), rank 0 fused in halves of
    LL units over two calls: its (data, tag) half in the peer's area (all-gather; the
    reduce-scatter's rank 0 sends with a flag, and receives LL), then the same bits as the
    interpreter's rows."""
    from purlin.kernels import isa, sim
    from purlin.spec import collectives

    for coll in (collectives.reduce_scatter(2), collectives.all_gather(2)):
        s, xs, outs, ll, lowered, keep = _fused_setup(coll, "bfloat16", 4)
        _, err, abort, launch = _run_fused(lowered[0], blocks=2, threads=2, unit=4)
        for call in range(2):
            _peer_units(lowered, ll, 0, call)
            launch()
            assert err[isa.E_CODE] == 0, (coll.name, err)
            table = lowered[0].tables[call % len(lowered[0].tables)]
            for put in (r for r in table if r[isa.OP] == isa.LL_PUT):  # all-gather's
                word = np.frombuffer(ctypes.string_at(int(lowered[0].srcs[put[isa.SRC]]), 4),
                                     np.uint32)[0]
                at = (int(put[isa.DST]) - ll[1].ctypes.data) // 4
                assert list(ll[1][at: at + 2]) == [word, call + 1], (coll.name, ll[1][at:])
            fused_out = outs[0].copy()
            outs[0][:] = 0
            rank0 = sim.HostRank.from_lowered(lowered[0])
            rank0.epoch[0] = call
            sim.run_simulated([rank0], threads=4)
            assert (fused_out == outs[0]).all(), (coll.name, call, fused_out, outs[0])


@case
def fused_all_gather_and_int32_all_to_all():
    """Copy sinks: a 3-rank all-gather (float32) and an int32 all-to-all, rank 0 fused,
    against numpy."""
    from purlin.kernels import isa
    from purlin.spec import collectives

    s, xs, outs, ll, lowered, keep = _fused_setup(collectives.all_gather(3), "float32", 12)
    _, err, abort, launch = _run_fused(lowered[0], blocks=2, threads=3)
    _peer_units(lowered, ll, 0, 0)
    launch()
    assert err[isa.E_CODE] == 0, err
    assert (outs[0] == np.concatenate(xs)).all(), outs[0]
    s, xs, outs, ll, lowered, keep = _fused_setup(collectives.all_to_all(2), "int32", 8, seed=3)
    _, err, abort, launch = _run_fused(lowered[0], unit=8)
    _peer_units(lowered, ll, 0, 0)
    launch()
    assert err[isa.E_CODE] == 0, err
    assert (outs[0] == np.concatenate([xs[0][:4], xs[1][:4]])).all(), (outs[0], xs)


def _fused_flags_rank0(dtype: str, count: int, blocks: int, threads: int):
    """A 2-rank all-reduce on the simple protocol, fused (push, notify, wait, reduce): rank 0
    run with rank 1's push and notifies already landed (every block's slot at 1)."""
    from purlin.kernels import isa
    from purlin.spec import collectives

    s, xs, outs, ll, lowered, (scratch, flags) = _fused_setup(collectives.all_reduce(2),
                                                              dtype, count, use_ll=False)
    ops = [isa.OPCODE_NAMES[op] for op in lowered[0].tables[0][:, isa.OP]]
    assert ops == ["copy", "notify", "wait", "reduce"], ops
    slots = [np.zeros(flags[r].size * isa.F_MAX_BLOCKS, dtype=np.int64) for r in range(2)]

    def flag_slot(address):
        r = next(q for q in range(2) if 0 <= address - flags[q].ctypes.data < flags[q].nbytes)
        index = (address - flags[r].ctypes.data) // 8
        return slots[r].ctypes.data + index * isa.F_MAX_BLOCKS * 8

    wait = next(row for row in lowered[0].tables[0] if row[isa.OP] == isa.WAIT)
    mine = (flag_slot(int(wait[isa.FLAG])) - slots[0].ctypes.data) // 8
    slots[0][mine: mine + blocks] = 1
    push = next(row for row in lowered[1].tables[0] if row[isa.OP] == isa.COPY)
    at = int(push[isa.DST]) - scratch[0].ctypes.data
    scratch[0][at: at + xs[1].nbytes] = xs[1].view(np.uint8)  # rank 1's push, landed
    counters, err, abort, launch = _run_fused(lowered[0], blocks=blocks, threads=threads,
                                           flag_slot=flag_slot)
    launch()
    assert err[isa.E_CODE] == 0, err
    return s, xs, outs, lowered, scratch, slots, flag_slot, (mine, wait), (counters, err, abort,
                                                                           launch)


def _norm_reference(total, residual, weight, hidden, eps, dtype):
    """residual + total rounded, then rms_norm(residual) * weight with one rounding: the
    epilogue's definition, in float64 from the rounded residual."""
    f32 = bf16_floats if dtype == "bfloat16" else (lambda x: x)
    back = bf16_bits if dtype == "bfloat16" else (lambda x: x.astype(np.float32))
    r = back(f32(total).astype(np.float32) + f32(residual).astype(np.float32))
    rows = f32(r).astype(np.float64).reshape(-1, hidden)
    inv = 1 / np.sqrt((rows ** 2).mean(axis=1, keepdims=True) + eps)
    y = back((rows * inv * f32(weight).astype(np.float64)).astype(np.float32).ravel())
    return r, y


@case
def fused_epilogue_adds_the_residual_and_normalizes_rows():
    """A 2-rank all-reduce ending with the epilogue (rank 0 fused, LL): after each of two
    calls, the residual holds residual + sum and the output rms_norm(residual) * weight
    (within a rounding of float64). A block that owns every chunk of its rows (one block:
    bfloat16 with 8- and 4-byte units, float32 with 16; or rows of one chunk on three blocks)
    leaves the row sums area alone; where it does not (more chunks than a block keeps), every
    chunk's row sum is in its slot with the call's tag; a slot that never fills times out
    naming it. The one-shot kernel built for the same add + RMSNorm (``purlin.kernels.epilogue``,
    the user epilogue ``rms_norm``: its program also holds the weight's address) gives every
    8-byte LL case the same bits and call counters. (The simulator runs a grid's blocks one after another: a
    block can wait only for its own slots.)"""
    from purlin.atom.fused import Epilogue, oneshot_problem, program, row_sums_bytes
    from purlin.kernels import epilogue as ep, fused, isa
    from purlin.kernels.executor import MAX_THREADS
    from purlin.spec import collectives

    eps = 1e-5
    ran_oneshot = []
    cases = (("bfloat16", 8, 1, 4, 32, 96), ("float32", 16, 1, 4, 32, 96),
             ("bfloat16", 4, 1, 4, 32, 96), ("bfloat16", 8, 3, 4, 16, 96),
             ("bfloat16", 4, 1, 2, 8, 2080))  # the last: 520 chunks, more than a block keeps
    for dtype, unit, blocks, threads, hidden, count in cases:
        s, xs, outs, ll, lowered, keep = _fused_setup(collectives.all_reduce(2), dtype, count)
        rng = np.random.default_rng(7)
        residual = _random(rng, dtype, count)
        weight = _random(rng, dtype, hidden)
        sums = np.zeros(row_sums_bytes(outs[0].nbytes, unit, threads) // 8, np.int64)
        err = np.zeros(isa.ERR_WIDTH, dtype=np.int64)
        abort = np.zeros(1, dtype=np.uint64)
        e = Epilogue(outs[0].ctypes.data, residual.ctypes.data, weight.ctypes.data,
                     sums.ctypes.data, hidden, eps)
        words = program(lowered[0], err.ctypes.data, abort.ctypes.data, lambda a: a, unit,
                        epilogue=e, threads=threads).words.copy()
        counters = np.zeros(isa.F_MAX_BLOCKS, dtype=np.int64)
        if dtype == "bfloat16":
            total = bf16_bits(bf16_floats(xs[0]) + bf16_floats(xs[1]))
        else:
            total = xs[0] + xs[1]
        traded = outs[0].nbytes // (unit * threads) > MAX_THREADS
        for call in range(2):
            _peer_units(lowered, ll, 0, call)
            want_r, want_y = _norm_reference(total, residual.copy(), weight, hidden, eps, dtype)
            before = residual.copy(), counters.copy()
            fused.fused_norm[blocks, threads](words.ctypes.data, 1, blocks, 10_000_000,
                                              words.size, counters.ctypes.data)
            assert err[isa.E_CODE] == 0, (dtype, err)
            if oneshot_problem(words) is None:  # the same call on the one-shot kernel
                got = residual.copy(), outs[0].copy(), counters.copy()
                residual[:], counters[:] = before
                outs[0][:] = 0
                stat, finish, fn = ep.rms_norm_functions(hidden, eps)
                code = {"bfloat16": isa.BF16, "float32": isa.F32}[dtype]
                oneshot = ep.kernels(ep.Form(fn, code, (True,), True, stat, 1, finish))[0]
                extra = replace(e, extras=(0, 0, weight.ctypes.data))  # out, row out, weight
                words2 = program(lowered[0], err.ctypes.data, abort.ctypes.data, lambda a: a,
                                 unit, epilogue=extra, threads=threads).words.copy()
                oneshot[blocks, threads](words2.ctypes.data, 1, blocks, 10_000_000, words2.size,
                                         counters.ctypes.data)
                assert err[isa.E_CODE] == 0, (dtype, err)
                for a, b in zip((residual, outs[0], counters), got):
                    assert (a == b).all(), (dtype, unit, blocks, call, a, b)
                ran_oneshot.append((dtype, unit, blocks))
            if dtype == "bfloat16":
                assert (residual == want_r).all(), (call, residual, want_r)
                ulps = np.abs(outs[0].astype(np.int32) - want_y.astype(np.int32))
                assert ulps.max() <= 1, (call, outs[0], want_y)
            else:
                assert np.allclose(residual, want_r, rtol=1e-6, atol=0), call
                assert np.allclose(outs[0], want_y, rtol=1e-5, atol=1e-6), call
            tags = sums.reshape(-1, 2)[:, 0] >> 32
            assert (tags == (call + 1 if traded else 0)).all(), (dtype, blocks, call, tags)
        if blocks == 1 and count == 96:
            # call 3 on two blocks of rows of two chunks: block 0's first row needs block
            # 1's slot, still call 2's
            _peer_units(lowered, ll, 0, 2)
            counters[1] = 2
            sums.reshape(-1, 2)[:, 0] = 2 << 32
            fused.fused_norm[2, threads](words.ctypes.data, 1, 2, 2_000_000, words.size,
                                         counters.ctypes.data)
            assert err[isa.E_CODE] == isa.ERR_TIMEOUT, (dtype, err)
            chunk = (int(err[isa.E_FLAG]) - sums.ctypes.data) // 16
            assert chunk in (1, 3), (err, sums.ctypes.data)  # a chunk of block 1 in row 0
            assert err[isa.E_EXPECTED] == 3 and err[isa.E_SEEN] == 2, err  # call 2's tag
    # the one-shot kernel ran every LL case on 8-byte units with the same bits
    assert ran_oneshot == [(d, 8, b) for d, b in (("bfloat16", 1), ("bfloat16", 3))
                           for _ in range(2)], ran_oneshot


@case
def fused_flags_have_a_slot_per_block():
    """The simple protocol fused, float32: rank 0 sums correctly, pushes its input into rank
    1's scratch and adds 1 to each of rank 1's block slots; a block whose slot was not
    notified times out naming the lowered flag."""
    from purlin.kernels import isa

    s, xs, outs, lowered, scratch, slots, flag_slot, (mine, wait), (_, err, abort, launch) = \
        _fused_flags_rank0("float32", 16, blocks=2, threads=2)
    assert (outs[0] == xs[0] + xs[1]).all(), outs[0]
    notify = next(row for row in lowered[0].tables[0] if row[isa.OP] == isa.NOTIFY)
    theirs = (flag_slot(int(notify[isa.FLAG])) - slots[1].ctypes.data) // 8
    assert list(slots[1][theirs: theirs + 3]) == [1, 1, 0]
    at = int(lowered[0].tables[0][0][isa.DST]) - scratch[1].ctypes.data
    assert (scratch[1][at: at + 64].view(np.float32) == xs[0]).all()
    slots[0][mine + 1] = 0  # call 1: block 1 never hears from rank 1
    slots[0][mine] = 2
    launch()
    assert err[isa.E_CODE] == isa.ERR_TIMEOUT and err[isa.E_BLOCK] == 1, err
    assert (err[isa.E_FLAG], err[isa.E_EXPECTED], err[isa.E_SEEN]) == \
        (int(wait[isa.FLAG]), 2, 0), err


@case
def fused_bfloat16_pairs_and_unrolled_copies():
    """Enough items per thread for the plain fast paths: the push copies four items in
    flight, the bfloat16 reduce two (a thread's last single item loaded twice, stored once)
    -- the same bits as numpy; 41 whole items on 6 threads give threads different counts in
    one round; with a partial last item (35 whole items on 6 threads: the tail's thread holds
    six items, the tail in its last pair and loaded with its copy's whole items), the row's
    bytes only."""
    from purlin.kernels import isa

    for count in (8 * 41, 8 * 35 + 3, 8 * 35 + 1):
        s, xs, outs, lowered, scratch, *_ = _fused_flags_rank0("bfloat16", count, blocks=2,
                                                               threads=3)
        want = bf16_bits(bf16_floats(xs[0]) + bf16_floats(xs[1]))
        assert (outs[0][:count] == want).all(), (count, np.nonzero(outs[0][:count] != want))
        at = int(lowered[0].tables[0][0][isa.DST]) - scratch[1].ctypes.data
        assert (scratch[1][at: at + xs[0].nbytes] == xs[0].view(np.uint8)).all(), count
        end = at + xs[0].nbytes  # the push's partial item: the row's bytes only
        assert (scratch[1][end: end + (-end) % 16] == 0).all(), count


@case
def fused_times_out_naming_the_units_and_the_peer():
    """No peer ran: the fused kernel records a timeout naming a unit of rank 0's LL area, this
    call's tag (1) against the 0 it saw, the peer and step of the row, and raises ABORT."""
    from purlin.kernels import isa
    from purlin.spec import collectives

    s, xs, outs, ll, lowered, keep = _fused_setup(collectives.all_reduce(2), "float32", 8)
    _, err, abort, launch = _run_fused(lowered[0], blocks=1, threads=2,
                                       timeout_ns=20_000_000)
    launch()
    get = next(r for r in lowered[0].tables[0] if r[isa.OP] == isa.LL_GET)
    start = ll[0].ctypes.data
    assert err[isa.E_CODE] == isa.ERR_TIMEOUT, err
    assert start <= err[isa.E_FLAG] < start + ll[0].nbytes, err
    assert (err[isa.E_EXPECTED], err[isa.E_SEEN]) == (1, 0), err
    assert (err[isa.E_PEER], err[isa.E_STEP]) == (1, get[isa.STEP]), err
    assert int(abort[0]) >= 1


@case
def fused_scalar_tails_store_the_rows_bytes_only():
    """Rows one element (or a few) past whole items: rank 0's fused program, with its peers'
    LL units (or pushes and flags) already landed, gives the reference -- bfloat16 and int32
    all-reduces on 16- and 8-byte items (threads holding whole items before the partial one),
    an all-gather whose own-piece copy takes the four-in-flight path, and no byte after an
    output row is touched."""
    import ctypes

    from purlin.atom.fused import fused_unit
    from purlin.atom.host import HostBuffers, fused_programs
    from purlin.kernels import fused, isa, sim
    from purlin.snac import plan
    from purlin.spec import collectives, reference

    # (collective, dtype, elements of each whole piece, of the last piece, protocol)
    cases = [(collectives.all_reduce(3), "bfloat16", 16, 1, "fused"),
             (collectives.all_reduce(2), "bfloat16", 16, 3, "fused-ll"),
             (collectives.all_reduce(2, op="max"), "int32", 8, 1, "fused"),
             (collectives.all_reduce(2), "float32", 8, 3, "fused-ll"),
             (collectives.all_gather(2), "bfloat16", 16, 5, "fused"),
             (collectives.all_reduce(2), "bfloat16", 88, 1, "fused")]  # (several items a thread)
    for coll, dtype, each, tail, protocol in cases:
        names = coll.input.names()
        item = isa.ITEMSIZE[isa.DTYPE_CODES[dtype]]
        sizes = {k: each for k in names}
        sizes[names[-1]] = tail
        sizing = coll.sized(chunk_sizes=sizes, dtype=dtype)
        s = plan(coll, "direct-push", sizing=sizing)
        bufs = HostBuffers(s, ll=protocol == "fused-ll")
        n = s.nranks
        for r in range(n):  # guard bytes after every output
            bufs.outputs[r] = np.zeros(sizing.output_count(r) + 8, bufs.np_dtype)
            bufs.outputs[r][sizing.output_count(r):] = GUARD
        low = bufs.lower()
        unit, problem = fused_unit(low, protocol)
        assert problem is None, (coll.name, dtype, problem)
        words = fused_programs(low, bufs, unit, segments=False)[0].copy()
        rng = np.random.default_rng(tail)
        xs = [_random(rng, dtype, sizing.input_count(r)) for r in range(n)]
        if dtype == "int32":
            xs = [x % 1000 for x in xs]
        for r in range(n):
            bufs.inputs[r][:xs[r].size] = xs[r].view(bufs.np_dtype)
        for peer in range(1, n):  # what the peers' rows of call 0 leave on rank 0
            for row in low[peer].tables[0]:
                if row[isa.OP] == isa.LL_PUT and row[isa.PEER] == 0:
                    size = int(row[isa.COUNT]) * item
                    data = ctypes.string_at(int(low[peer].srcs[row[isa.SRC]]), size)
                    units = sim.ll_pack(data + bytes(-size % 16), 1)  # whole items' units
                    ctypes.memmove(int(row[isa.DST]), units.tobytes(), units.nbytes)
                elif row[isa.OP] == isa.COPY and any(
                        0 <= int(row[isa.DST]) - m.ctypes.data < m.nbytes
                        for m in (bufs.scratch[0], bufs.outputs[0])):  # a push to rank 0
                    size = int(row[isa.COUNT]) * item
                    ctypes.memmove(int(row[isa.DST]), int(low[peer].srcs[row[isa.SRC]]), size)
        for f in bufs.block_flags:
            f[:] = 1 << 40  # every wait of rank 0 satisfied
        counters = np.zeros(isa.F_MAX_BLOCKS, dtype=np.int64)
        fused.fused[2, 3](words.ctypes.data, 1, 2, 10_000_000, words.size, counters.ctypes.data)
        assert bufs.fused_error[isa.E_CODE] == 0, (coll.name, bufs.fused_error)
        count = sizing.output_count(0)
        got = bufs.outputs[0][:count]
        floats = [bf16_floats(x) if dtype == "bfloat16" else x.astype(np.float64) for x in xs]
        want = reference(sizing, floats)[0]
        if dtype == "bfloat16":
            assert (np.abs(bf16_floats(got) - want) <= 0.02 * (1 + np.abs(want))).all(), \
                (coll.name, bf16_floats(got), want)
        else:
            assert np.array_equal(got.astype(np.float64), want.astype(np.dtype(_NP.get(
                dtype, np.float32))).astype(np.float64)), (coll.name, got, want)
        assert (bufs.outputs[0][count:] == GUARD).all(), (coll.name, bufs.outputs[0][count:])


@case
def fused_rotated_rows_of_a_gqa_all_gather():
    """An all-gather of q, k, v per rank delivered interleaved (rows of unequal size, merged
    flags and rotated rows, purlin.atom.fused_rows; or LL, a transfer per piece): with every
    rank's call 0 run by the host interpreter (its pushes and flags landed), each rank's
    program run again by the kernel gives the reference -- 16- and 8-byte items, a scalar
    tail, 2 and 3 blocks."""
    from purlin.atom.fused import fused_unit
    from purlin.atom.host import HostBuffers, fused_programs, run_fused_calls
    from purlin.kernels import fused, isa
    from purlin.snac import plan
    from purlin.spec import Collective, reference

    for n, dtype, each, tail, protocol, (blocks, threads) in (
            (3, "bfloat16", 16, 0, "fused", (2, 3)),
            (3, "float32", 4, 1, "fused-ll", (3, 2)),
            (4, "bfloat16", 8, 3, "fused", (2, 4))):
        coll = Collective([[(r, t) for t in "qkv"] for r in range(n)],
                          [[(r, t) for t in "qkv" for r in range(n)]] * n, "copy")
        sizes = {(r, t): each * (4 if t == "q" else 1) for r in range(n) for t in "qkv"}
        sizes[(n - 1, "v")] += tail
        s = plan(coll, "direct-push", chunk_sizes=sizes, dtype=dtype)
        bufs = HostBuffers(s, ll=protocol == "fused-ll")
        low = bufs.lower()
        unit, problem = fused_unit(low, protocol)
        assert problem is None, problem
        programs = [w.copy() for w in fused_programs(low, bufs, unit, segments=False)]
        rotated = [int(w[isa.F_HEAD + k * isa.OP_WIDTH + isa.MOVE_ROTATE]) for w in programs
                   for k in range(int(w[isa.F_NOPS]))
                   if w[isa.F_HEAD + k * isa.OP_WIDTH + isa.OP_KIND] == isa.F_OP_MOVE]
        assert any(rotated) or protocol == "fused-ll", rotated  # (LL: a transfer per piece)
        rng = np.random.default_rng(n + tail)
        xs = [[rng.integers(-40, 40, s.sizing.input_count(r)).astype(np.float64)
               for r in range(n)]]
        run_fused_calls(programs, bufs, xs, blocks=blocks, threads=threads)
        want = reference(s.sizing, xs[0])
        for r in range(n):
            bufs.outputs[r][:] = 0
            counters = np.zeros(isa.F_MAX_BLOCKS, dtype=np.int64)
            w = programs[r]
            fused.fused[blocks, threads](w.ctypes.data, 1, blocks, 10_000_000, w.size,
                                         counters.ctypes.data)
            assert bufs.fused_error[isa.E_CODE] == 0, (n, dtype, r, bufs.fused_error)
            got = bufs.outputs[r][:len(want[r])].astype(np.float64)
            if dtype == "bfloat16":
                got = bf16_floats(bufs.outputs[r][:len(want[r])])
            assert np.array_equal(got, want[r]), (n, dtype, r, got, want[r])


def _kernel_outputs(kernel, programs, bufs, want, name: str):
    """(rank, its output's first ``len(want[rank])`` elements) after ``kernel`` (2 blocks of
    3 threads) ran each rank's program once more (call 0 again), for every rank that
    receives something; a rank's error record must stay clear."""
    from purlin.kernels import isa

    for r, w in enumerate(programs):
        if not len(want[r]):
            continue
        bufs.outputs[r][:] = 0
        counters = np.zeros(isa.F_MAX_BLOCKS, dtype=np.int64)
        kernel[2, 3](w.ctypes.data, 1, 2, 10_000_000, w.size, counters.ctypes.data)
        assert bufs.fused_error[isa.E_CODE] == 0, (name, r, bufs.fused_error)
        yield r, bufs.outputs[r][:len(want[r])]


@case
def fused_random_layouts_of_unequal_rows():
    """Seeded random layouts of unequal pieces (copies and reductions, scalar tails, 2..6
    ranks, four dtypes, direct-push and direct-pull, both protocols): every rank's fused
    program, run again by the kernel after the host interpreter ran call 0, gives the
    reference."""
    from test_fused_rows import random_layout

    from purlin.atom.fused import fused_unit, kernel_name
    from purlin.atom.host import HostBuffers, fused_programs, run_fused_calls
    from purlin.kernels import isa
    from purlin.kernels.launch import KERNELS
    from purlin.snac import plan
    from purlin.spec import reference

    rng = np.random.default_rng(11)
    ran = 0
    for _ in range(10):
        n = int(rng.integers(2, 7))
        dtype = str(rng.choice(["bfloat16", "float16", "float32", "int32"]))
        coll, sizes = random_layout(rng, n, dtype)
        strategy = str(rng.choice(["direct-push", "direct-pull"]))
        protocol = str(rng.choice(["fused", "fused-ll"]))
        s = plan(coll, strategy, chunk_sizes=sizes, dtype=dtype)
        bufs = HostBuffers(s, ll=protocol == "fused-ll")
        low = bufs.lower()
        unit, problem = fused_unit(low, protocol)
        if problem is not None:
            continue
        programs = [w.copy() for w in fused_programs(low, bufs, unit, segments=False)]
        # (a piece of odd size placed before others: odd-aligned copies on the copy-only
        # build, LL units on the narrow one)
        kernel = KERNELS[kernel_name(programs)][0]
        xs = [[rng.integers(-40, 40, s.sizing.input_count(r)).astype(np.float64)
               for r in range(n)]]
        for x in xs[0]:
            x[x == 0] = 3
        run_fused_calls(programs, bufs, xs, blocks=2, threads=3)
        want = reference(s.sizing, xs[0])
        for r, got in _kernel_outputs(kernel, programs, bufs, want, coll.name):
            got = bf16_floats(got) if dtype == "bfloat16" else \
                (got.view(np.float16) if dtype == "float16" else got).astype(np.float64)
            tol = 0.02 if dtype in ("bfloat16", "float16") else 0
            assert (np.abs(got - want[r]) <= tol * (1 + np.abs(want[r]))).all(), \
                (coll.name, strategy, protocol, dtype, r, got, want[r])
        ran += 1
    assert ran >= 5, ran


@case
def fused_odd_pieces_in_segmented_ops():
    """Pieces of odd size (GQA's q, k, v one element longer each; seeded random layouts of
    odd pieces) pulled, pushed and ringed on the segmented copy build: a peer's odd-aligned
    rows in one segmented op, some cut at their destination's 16-byte boundaries (the
    destination's slots, funnel-shifted loads), some in 16-byte items at any alignment --
    every rank's program, run again by the kernel after the host interpreter ran call 0,
    gives the reference."""
    from test_fused_rows import _narrow_rows, gqa, gqa_sizes, random_layout

    from purlin.atom.fused import kernel_name
    from purlin.atom.host import HostBuffers, fused_programs, run_fused_calls
    from purlin.kernels import isa
    from purlin.kernels.launch import KERNELS
    from purlin.snac import plan
    from purlin.spec import reference

    rng = np.random.default_rng(5)
    layouts = [(gqa(n), {k: v + 1 for k, v in gqa_sizes(n, 8).items()}, "bfloat16", st)
               for n, st in ((3, "direct-pull"), (4, "direct-push"), (3, "ring"))]
    while len(layouts) < 7:
        coll, sizes = random_layout(rng, int(rng.integers(2, 5)), "bfloat16",
                                    odd_pieces=True, copies=1.0)
        layouts.append((coll, sizes, "bfloat16", str(rng.choice(["direct-push",
                                                                  "direct-pull"]))))
    cut = [0, 0]
    ran = 0
    for coll, sizes, dtype, strategy in layouts:
        s = plan(coll, strategy, chunk_sizes=sizes, dtype=dtype)
        bufs = HostBuffers(s)
        low = bufs.lower()
        programs = [w.copy() for w in fused_programs(low, bufs, 16)]
        name = kernel_name(programs)
        if not name.startswith("fused-seg-copy"):  # (-narrow: segments cut unaligned)
            continue
        for w in programs:
            rows = _narrow_rows(w)
            cut[0] += int((rows & isa.NARROW_SHIFT != 0).sum())
            cut[1] += int((rows & isa.NARROW_SHIFT == 0).sum())
        kernel = KERNELS[name][0]
        n = len(programs)
        xs = [[rng.integers(-40, 40, s.sizing.input_count(r)).astype(np.float64)
               for r in range(n)]]
        run_fused_calls(programs, bufs, xs, blocks=2, threads=3)
        want = reference(s.sizing, xs[0])
        for r, got in _kernel_outputs(kernel, programs, bufs, want, coll.name):
            assert np.array_equal(bf16_floats(got), want[r]), (coll.name, strategy, r)
        ran += 1
    assert ran >= 5 and min(cut) > 0, (ran, cut)


@case
def fused_odd_piece_edges_on_threads_of_their_own():
    """Segmented ops of many odd pieces cut at their destination's 16-byte boundaries (two or
    three ranks' pieces interleaved in every output, pulled and pushed), each piece as many
    slots as the launch has threads or half as many, so that the union's owners of their
    partial first and last slots are a few threads, several slots each; and pieces of
    1..23 elements (one-slot rows): the kernel built for them (``fused_seg_copy_narrow``)
    copies those slots first, one a thread (an aligned destination's last by its owner,
    ``fused._segments``). Every output, filled
    with guard bytes, then written by every rank's program run again by the kernel after
    the host interpreter ran call 0, holds the reference, the guards either side intact."""
    from collections import Counter

    from purlin.atom.fused import kernel_name
    from purlin.atom.host import HostBuffers, fused_programs, run_fused_calls
    from purlin.kernels import isa
    from purlin.kernels.launch import KERNELS
    from purlin.snac import plan
    from purlin.spec import Collective, reference

    rng = np.random.default_rng(13)
    aligned = 0  # cut rows at an aligned destination ending inside a slot
    for n, each, strategy, blocks, threads in (
            (2, [41] * 8, "direct-pull", 2, 3), (3, [41] * 6, "direct-push", 3, 4),
            (2, [249] * 8, "direct-pull", 2, 32),  # (32 edges on 64 threads: every second)
            (2, [int(k) for k in rng.integers(1, 24, 8)], "direct-pull", 1, 4)):
        inputs = [[(r, t) for t in range(len(each))] for r in range(n)]
        coll = Collective(inputs, [[(r, t) for t in range(len(each)) for r in range(n)]] * n,
                          "copy", name="interleaved odd pieces")
        s = plan(coll, strategy, chunk_sizes={(r, t): each[t] for r in range(n)
                                              for t in range(len(each))}, dtype="bfloat16")
        bufs = HostBuffers(s)
        guarded = [_aligned(out.nbytes) for out in bufs.outputs]
        bufs.outputs = [_view(raw, at, out.size, np.uint16)
                        for (raw, at), out in zip(guarded, bufs.outputs)]
        programs = [w.copy() for w in fused_programs(bufs.lower(), bufs, 16)]
        assert kernel_name(programs) == "fused-seg-copy-narrow", (n, each, strategy)
        most = 0  # partial slots on one thread, were each copied by its owner in the union
        for w in programs:
            for k in range(int(w[isa.F_NOPS])):
                at = isa.F_HEAD + k * isa.OP_WIDTH
                if w[at + isa.OP_KIND] != isa.F_OP_MOVES:
                    continue
                owners = Counter()
                for seg in range(int(w[at + isa.SEG_COUNT])):
                    rec = int(w[at + isa.SEG_TABLE]) + seg * isa.OP_WIDTH
                    if not w[rec + isa.MOVE_NARROW] & isa.NARROW_SHIFT:
                        continue
                    dst, nbytes = int(w[rec + isa.MOVE_DST]), int(w[rec + isa.MOVE_BYTES])
                    aligned += dst % 16 == 0 and nbytes % 16 != 0
                    for j in {0, ((dst & 15) + nbytes - 1) >> 4}:  # its first and last slots
                        d = (dst & -16) + 16 * j
                        if d < dst or d + 16 > dst + nbytes:
                            owners[(int(w[rec + isa.MOVE_ROTATE]) + j +
                                    int(w[at + isa.SEG_ROTATE])) % (blocks * threads)] += 1
                most = max(most, max(owners.values(), default=0))
        assert most >= 3, (n, each, strategy, most)
        xs = [[rng.integers(-40, 40, s.sizing.input_count(r)).astype(np.float64)
               for r in range(n)]]
        run_fused_calls(programs, bufs, xs, blocks=blocks, threads=threads)
        want = reference(s.sizing, xs[0])
        for out in bufs.outputs:
            out[:] = GUARD * 0x101
        for w in programs:
            counters = np.zeros(isa.F_MAX_BLOCKS, dtype=np.int64)
            KERNELS["fused-seg-copy-narrow"][0][blocks, threads](w.ctypes.data, 1, blocks,
                                                                 10_000_000, w.size,
                                                                 counters.ctypes.data)
            assert bufs.fused_error[isa.E_CODE] == 0, (n, each, strategy, bufs.fused_error)
        for r, ((raw, at), out) in enumerate(zip(guarded, bufs.outputs)):
            assert np.array_equal(bf16_floats(out), want[r]), (n, each, strategy, r)
            assert _guards_intact(raw, at, out.nbytes), (n, each, strategy, r)
    assert aligned > 0, aligned


@case
def fused_rotated_ll_pieces():
    """LL transfers of several pieces per peer rotated onto different threads (the GQA
    all-gather and random copy layouts, 2..8 ranks, odd sizes, four dtypes, 8- and 4-byte
    units, 1..3 blocks): after the host interpreter ran call 0, each rank's program run
    again by the kernel -- its PUTs' LL units first wiped -- writes the same LL units as
    the interpreter (rotated PUTs) and gives the reference (rotated LL moves)."""
    from test_fused_rows import gqa, gqa_sizes, random_layout
    from test_fused_seg_sim import _sent

    from purlin.atom.fused import fused_unit, kernel_name, rank_ops
    from purlin.atom.fused_rows import ll_pieces
    from purlin.atom.host import HostBuffers, fused_programs, run_fused_calls
    from purlin.kernels import isa
    from purlin.kernels.launch import KERNELS
    from purlin.snac import plan
    from purlin.spec import reference

    item = {"bfloat16": 2, "float16": 2, "float32": 4, "int32": 4}
    rng = np.random.default_rng(25)
    cases = [(gqa(n), gqa_sizes(n, 16 // item[dt] * m, extra), dt, blocks, threads)
             for n, dt, m, extra, blocks, threads in (
                 (2, "bfloat16", 1, 0, 2, 3), (3, "float32", 3, 1, 3, 2),
                 (4, "float16", 2, 0, 1, 8), (5, "int32", 1, 2, 2, 4),
                 (8, "bfloat16", 1, 0, 2, 4), (8, "float32", 1, 0, 2, 3))]
    while len(cases) < 14:
        n = int(rng.integers(2, 9))
        dt = str(rng.choice(list(item)))
        coll, sizes = random_layout(rng, n, dt)
        if coll.name == "random copy layout":
            cases.append((coll, sizes, dt, int(rng.integers(1, 4)), int(rng.integers(1, 5))))
    ran = 0
    for coll, sizes, dtype, blocks, threads in cases:
        n = coll.nranks
        s = plan(coll, "direct-push", chunk_sizes=sizes, dtype=dtype)
        bufs = HostBuffers(s, ll=True)
        low = bufs.lower()
        unit, problem = fused_unit(low, "fused-ll")
        if problem is not None:
            continue
        if not ll_pieces([rank_ops(x, unit) for x in low]):
            continue
        programs = [w.copy() for w in fused_programs(low, bufs, unit, segments=False)]
        puts = [[(int(w[at + isa.PUT_DST]), int(w[at + isa.PUT_BYTES]),
                  int(w[at + isa.PUT_ROTATE]))
                 for at in (isa.F_HEAD + k * isa.OP_WIDTH for k in range(int(w[isa.F_NOPS])))
                 if w[at + isa.OP_KIND] == isa.F_OP_PUT] for w in programs]
        assert any(rot for rank in puts for _, _, rot in rank), puts  # (PUTs rotated)
        xs = [[rng.integers(-40, 40, s.sizing.input_count(r)).astype(np.float64)
               for r in range(n)]]
        for x in xs[0]:
            x[x == 0] = 3
        run_fused_calls(programs, bufs, xs, blocks=blocks, threads=threads)
        want = reference(s.sizing, xs[0])

        def units(dst, nbytes):  # a PUT's LL units on even calls
            return dst, 2 * unit * -(-nbytes // unit)

        # (a piece after one of odd size: the narrow build, and its LL units' bytes past the
        # row are not the interpreter's zeros)
        kernel = KERNELS[kernel_name(programs)][0]
        sent = {(dst, nb): _sent(*units(dst, nb), nb) for rank in puts for dst, nb, _ in rank}
        for r in range(n):
            for dst, nb, _ in puts[r]:
                at, size = units(dst, nb)
                ctypes.memset(at, 0, size)
            bufs.outputs[r][:] = 0
            counters = np.zeros(isa.F_MAX_BLOCKS, dtype=np.int64)
            w = programs[r]
            kernel[blocks, threads](w.ctypes.data, 1, blocks, 10_000_000, w.size,
                                    counters.ctypes.data)
            assert bufs.fused_error[isa.E_CODE] == 0, (coll.name, r, bufs.fused_error)
            got = bufs.outputs[r][:len(want[r])]
            got = bf16_floats(got) if dtype == "bfloat16" else \
                (got.view(np.float16) if dtype == "float16" else got).astype(np.float64)
            tol = 0.02 if dtype in ("bfloat16", "float16") else 0
            assert (np.abs(got - want[r]) <= tol * (1 + np.abs(want[r]))).all(), \
                (coll.name, dtype, r, got, want[r])
        for (dst, nb), was in sent.items():
            assert _sent(*units(dst, nb), nb) == was, (coll.name, dtype, hex(dst))
        ran += 1
    assert ran >= 8, ran


@case
def fused_lanes_in_one_launch():
    """Several lanes, a program each (``purlin.atom.fused_lanes``): a rank's programs run as
    rank slots of one launch (every slot on the same grid) after the host ran call 0, and
    give the reference -- the two-root broadcast with each root's half in a lane of its own,
    an all-reduce of 2 lanes on LL units, an all-gather whose ranks' chunks alternate
    lanes. (One rank at a time: the plans' data crosses one hop, so what call 0 left in the
    peers' memory is all a rank reads.)"""
    from purlin.atom.fused import fused_unit
    from purlin.atom.host import HostBuffers, bf16_floats, fused_programs, run_fused_calls
    from purlin.kernels import fused, isa
    from purlin.snac import plan
    from purlin.spec import Collective, collectives, reference

    n = 4
    two_roots = Collective([["a"], ["b"]] + [[] for _ in range(n - 2)], [["a", "b"]] * n,
                           "copy")
    for s, protocol in (
            (plan(two_roots, "direct-pull", chunk_sizes={"a": 40, "b": 48}, dtype="bfloat16",
                  lanes=2), "fused"),
            (plan(collectives.all_reduce(n), "direct-push", count=96, dtype="float32",
                  chunks=2, lanes=2), "fused-ll"),
            (plan(collectives.all_gather(n), "direct-push", count=4 * 24, dtype="bfloat16",
                  lanes=2), "fused")):
        bufs = HostBuffers(s, ll=protocol == "fused-ll")
        low = bufs.lower()
        unit, problem = fused_unit(low, protocol)
        assert problem is None, problem
        programs = fused_programs(low, bufs, unit)
        assert len(programs) > n, len(programs)
        rng = np.random.default_rng(7)
        xs = [[rng.integers(-40, 40, s.sizing.input_count(r)).astype(np.float64)
               for r in range(n)]]
        run_fused_calls(programs, bufs, xs, blocks=2, threads=3)
        want = reference(s.sizing, xs[0])
        for r in range(n):
            mine = [w for w in programs if int(w[isa.F_RANK]) == r]
            stride = max(w.size for w in mine)
            table = np.zeros(stride * len(mine), dtype=np.int64)
            for k, w in enumerate(mine):
                table[k * stride:k * stride + w.size] = w
            bufs.outputs[r][:] = 0
            counters = np.zeros(len(mine) * isa.F_MAX_BLOCKS, dtype=np.int64)
            fused.fused[2 * len(mine), 3](table.ctypes.data, len(mine), 2, 10_000_000,
                                          stride, counters.ctypes.data)
            assert bufs.fused_error[isa.E_CODE] == 0, (s.title(), r, bufs.fused_error)
            got = bufs.outputs[r][:len(want[r])]
            got = bf16_floats(got) if s.dtype == "bfloat16" else got.astype(np.float64)
            assert np.array_equal(got, want[r]), (s.title(), r, got, want[r])


# ------------------------------------------------------------------------ pytest entry points


verdicts, test_in_simulator = simulator_tests(__file__, CASES)


if __name__ == "__main__":
    run_cases(CASES, sys.argv[1])
