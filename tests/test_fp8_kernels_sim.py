"""FP8 in the GPU kernels, run in Numba's CUDA simulator: the device codec against torch's
casts, FP8 reduce rows against the cpu datapath bit for bit, FP8 copies and LL transfers
byte-exact, and the fused kernel moving FP8 rows that end on any byte.

As in tests/test_kernels_sim.py, the simulator must be on before ``numba.cuda`` is first
imported, so the cases run in one child process and each pytest test checks one verdict.
"""

from __future__ import annotations

import contextlib
import ctypes
import sys

import numpy as np
from simulator import run_cases, simulator_tests

CASES = {}
FP8 = ("float8_e4m3fn", "float8_e5m2")
GUARD = 0xA5


def case(fn):
    CASES[fn.__name__] = fn
    return fn


def _code(name):
    from purlin.kernels import isa

    return isa.DTYPE_CODES[name]


def _finite_bits(name, rng, count, nan=False):
    """Random FP8 bit patterns: finite ones (any magnitude), with positive NaNs if ``nan``
    (a GPU's NaN result is the canonical positive one; numpy keeps a negative NaN's sign)."""
    from purlin.spec.dtypes import fp8_decode

    every = np.arange(256, dtype=np.uint8)
    values = fp8_decode(every, name)
    ok = np.isfinite(values) | (nan & np.isnan(values) & (every < 0x80))
    return rng.choice(every[ok], count).astype(np.uint8)


def _aligned(nbytes, offset=0, guard=32):
    raw = np.full(nbytes + 2 * guard + 16, GUARD, dtype=np.uint8)
    start = (-raw.ctypes.data) % 16 + guard
    return raw, raw.ctypes.data + start + offset


def _at(raw, addr, nbytes):
    at = addr - raw.ctypes.data
    return raw[at: at + nbytes]


def _untouched_around(raw, addr, nbytes):
    at = addr - raw.ctypes.data
    return bool((raw[:at] == GUARD).all() and (raw[at + nbytes:] == GUARD).all())


@case
def device_codec_matches_torch():
    """Every FP8 bit pattern decodes to torch's float32 bits; float32 values at and around
    every rounding boundary, out of range, inf, NaN and random bits encode as torch casts."""
    from purlin.kernels.fp8 import f32_to_fp8, fp8_to_f32
    from purlin.spec.dtypes import fp8_decode, fp8_encode

    rng = np.random.default_rng(0)
    for name in FP8:
        dt = _code(name)
        every = np.arange(256, dtype=np.uint8)
        want = fp8_decode(every, name).view(np.uint32)
        got = np.array([np.float32(fp8_to_f32(int(b), dt)).view(np.uint32) for b in every])
        assert np.array_equal(want, got), (name, np.nonzero(want != got))
        fin = np.unique(fp8_decode(every, name)[np.isfinite(fp8_decode(every, name))])
        mid = ((fin[1:].astype(np.float64) + fin[:-1]) / 2).astype(np.float32)
        x = np.concatenate([fin, mid, np.nextafter(mid, np.float32(np.inf)),
                            np.nextafter(mid, np.float32(-np.inf)),
                            rng.integers(0, 2 ** 32, 20000, dtype=np.uint64).astype(
                                np.uint32).view(np.float32),
                            np.array([np.inf, np.nan, 449, 464, 57344, 61439, 61440, 1e30,
                                      1e-45], np.float32)]).astype(np.float32)
        x = np.concatenate([x, -x])
        want = fp8_encode(x, name)
        got = np.array([f32_to_fp8(v, dt) for v in x], dtype=np.int64)
        bad = np.nonzero(want.astype(np.int64) != got)[0]
        assert bad.size == 0, (name, [(float(x[b]), int(want[b]), int(got[b])) for b in bad[:5]])


@case
def reduce_rows_equal_the_cpu_datapath_bit_for_bit():
    """FP8 reduce rows (sum, avg, max, min; 1 to 5 sources; addresses at one offset modulo 4
    -- the 32-bit word path after a scalar head -- or at unrelated ones; two lanes of two
    blocks of four threads) give the cpu datapath's bits: float32 accumulation in source
    order, one rounding on the store, saturation and NaN as torch casts."""
    from purlin.atom.cpu import reduce_into
    from purlin.kernels import isa, sim

    rng = np.random.default_rng(1)
    ops = {"sum": isa.SUM, "avg": isa.AVG, "max": isa.MAX, "min": isa.MIN}
    for name in FP8:
        rows, checks = [[], []], []
        i = 0
        for op, code in ops.items():
            for nsrc, together in ((1, True), (2, True), (3, False), (3, True), (5, False),
                                   (5, True)):
                count = 37 + i
                offsets = [(i % 4) + 4 * s if together else (s + i) % 16 for s in range(nsrc)]
                srcs = [_aligned(count, offset=o % 16) for o in offsets]
                for raw, addr in srcs:
                    _at(raw, addr, count)[:] = _finite_bits(name, rng, count, nan=True)
                out_raw, out = _aligned(count, offset=(i % 4 + 8) if together else (3 * i) % 16)
                rows[i % 2].append(sim.reduce_row(out, [a for _, a in srcs], count,
                                                  dtype=_code(name), redop=code,
                                                  divisor=nsrc, step=i))
                checks.append((op, nsrc, out_raw, out, count, srcs))
                i += 1
        rank = sim.HostRank(0, rows, blocks_per_lane=2)
        sim.run_simulated([rank], blocks_per_lane=2, threads=4)
        assert rank.error_record["code"] == 0, rank.error_record
        for op, nsrc, out_raw, out, count, srcs in checks:
            want = np.zeros(count, np.uint8)
            reduce_into(want, [_at(raw, a, count).copy() for raw, a in srcs], op, nsrc, name)
            got = _at(out_raw, out, count)
            assert np.array_equal(got, want), (name, op, nsrc, got, want)
            assert _untouched_around(out_raw, out, count)


@case
def copies_and_ll_transfers_move_the_bytes():
    """FP8 copy rows and LL put/get move every bit pattern (NaNs included) byte-exact, at
    odd offsets and lengths, touching nothing past the row."""
    from purlin.kernels import isa, sim

    for name in FP8:
        rows, checks = [[]], []
        for k, (length, offset) in enumerate([(256, 0), (255, 1), (17, 3), (1, 15)]):
            src_raw, src = _aligned(length, offset)
            _at(src_raw, src, length)[:] = np.arange(length, dtype=np.uint8)[::-1]
            dst_raw, dst = _aligned(length, (offset * 5) % 16)
            rows[0].append(sim.copy_row(dst, src, length, dtype=_code(name), step=k))
            checks.append((src_raw, src, dst_raw, dst, length))
        rank = sim.HostRank(0, rows, blocks_per_lane=2)
        sim.run_simulated([rank], blocks_per_lane=2, threads=4)
        for src_raw, src, dst_raw, dst, length in checks:
            assert np.array_equal(_at(dst_raw, dst, length), _at(src_raw, src, length))
            assert _untouched_around(dst_raw, dst, length)
        # LL: 13 bytes out as units, polled back
        length = 13
        src = np.arange(7, 7 + length, dtype=np.uint8)
        units = np.zeros(2 * isa.LL_UNIT // 4, dtype=np.uint32)
        back_raw, back = _aligned(length)
        rank = sim.HostRank(0, [[sim.ll_put_row(units.ctypes.data, src.ctypes.data, length,
                                                dtype=_code(name), step=0),
                                 sim.ll_get_row(back, units.ctypes.data, length,
                                                dtype=_code(name), step=1)]])
        sim.run_simulated([rank], threads=4)
        assert rank.error_record["code"] == 0, rank.error_record
        assert np.array_equal(_at(back_raw, back, length), src)
        assert _untouched_around(back_raw, back, length)


@case
def fused_kernel_moves_fp8_rows_ending_on_any_byte():
    """A 2-rank FP8 all-gather and all-to-all whose pieces end 1, 2 or 3 bytes past whole
    items, rank 0 fused (16- and 8-byte items, flags or LL) with its peer's data already
    landed: the output is the bytes, and no byte after it is touched."""
    from purlin.atom.fused import fused_unit
    from purlin.atom.host import HostBuffers, fused_programs
    from purlin.kernels import fused, isa, sim
    from purlin.snac import plan
    from purlin.spec import collectives

    for name in FP8:
        for coll in (collectives.all_gather(2), collectives.all_to_all(2)):
            for tail, protocol in ((1, "fused"), (3, "fused-ll"), (2, "fused-ll"),
                                   (33, "fused")):
                names = coll.input.names()
                sizes = {k: 32 for k in names}
                sizes[names[-1]] = tail
                sizing = coll.sized(chunk_sizes=sizes, dtype=name)
                s = plan(coll, "direct-push", sizing=sizing)
                bufs = HostBuffers(s, ll=protocol == "fused-ll")
                for r in range(2):
                    bufs.outputs[r] = np.zeros(sizing.output_count(r) + 8, np.uint8)
                    bufs.outputs[r][sizing.output_count(r):] = GUARD
                low = bufs.lower()
                unit, problem = fused_unit(low, protocol)
                assert problem is None, (coll.name, tail, problem)
                words = fused_programs(low, bufs, unit, segments=False)[0].copy()
                rng = np.random.default_rng(tail)
                xs = [rng.integers(0, 256, sizing.input_count(r), dtype=np.uint8)
                      for r in range(2)]
                for r in range(2):
                    bufs.inputs[r][:xs[r].size] = xs[r]
                for row in low[1].tables[0]:  # what rank 1's rows of call 0 leave on rank 0
                    size = int(row[isa.COUNT])
                    if row[isa.OP] == isa.LL_PUT and row[isa.PEER] == 0:
                        data = ctypes.string_at(int(low[1].srcs[row[isa.SRC]]), size)
                        units = sim.ll_pack(data + bytes(-size % 16), 1)
                        ctypes.memmove(int(row[isa.DST]), units.tobytes(), units.nbytes)
                    elif row[isa.OP] == isa.COPY and any(
                            0 <= int(row[isa.DST]) - m.ctypes.data < m.nbytes
                            for m in (bufs.scratch[0], bufs.outputs[0])):
                        ctypes.memmove(int(row[isa.DST]), int(low[1].srcs[row[isa.SRC]]), size)
                for f in bufs.block_flags:
                    f[:] = 1 << 40
                counters = np.zeros(isa.F_MAX_BLOCKS, dtype=np.int64)
                fused.fused[2, 3](words.ctypes.data, 1, 2, 10_000_000, words.size,
                                  counters.ctypes.data)
                assert bufs.fused_error[isa.E_CODE] == 0, (coll.name, bufs.fused_error)
                count = sizing.output_count(0)
                from purlin.spec import reference

                want = reference(sizing, [x.astype(np.float64) for x in xs])[0]
                got = bufs.outputs[0]
                assert np.array_equal(got[:count], want.astype(np.uint8)), (coll.name, tail)
                assert (got[count:] == GUARD).all(), (coll.name, tail, got[count:])


def _kernel_rows_on_host_threads(threads: int):
    """``purlin.atom.host``'s table threads with the kernels' data rows: COPY, REDUCE, LL_PUT
    and LL_GET run ``purlin.kernels.atoms``, block ``b`` of ``B`` as ``threads`` lane threads
    ``b * threads + t`` of ``B * threads`` one after another (a schedule the executor's
    barrier after every row allows); NOTIFY and WAIT stay the host's. Returns the function to
    put back."""
    from purlin.atom import host
    from purlin.kernels import atoms, isa

    plain = host._run_lane
    abort = np.zeros(1, np.int64)

    def run_lane(rows, pool, epoch, mem, rank, block=0, blocks=1, delay=0.0):
        lane_threads = blocks * threads
        for row in rows:
            op, code = int(row[isa.OP]), int(row[isa.DTYPE])
            dst, count = int(row[isa.DST]), int(row[isa.COUNT])
            nbytes = count * isa.ITEMSIZE.get(code, 1)
            src = int(pool[row[isa.SRC]])
            srcs = np.ascontiguousarray(pool[row[isa.SRC]: row[isa.SRC] + row[isa.NSRC]],
                                        np.int64)
            if op not in (isa.REDUCE, isa.COPY, isa.LL_PUT, isa.LL_GET):
                plain([row], pool, epoch, mem, rank, block, blocks, delay)
                continue
            for tid in range(block * threads, (block + 1) * threads):
                if op == isa.REDUCE:
                    atoms.reduce_row(dst, srcs.ctypes.data, int(row[isa.NSRC]), count, code,
                                     int(row[isa.REDOP]), int(row[isa.DIVISOR]), tid,
                                     lane_threads, True)
                elif op == isa.COPY:
                    atoms.copy_bytes(dst, src, nbytes, tid, lane_threads)
                elif op == isa.LL_PUT:
                    atoms.ll_put(dst, src, nbytes, atoms.ll_tag(epoch), tid, lane_threads)
                else:
                    err, seen = atoms.ll_get(dst, src, nbytes, atoms.ll_tag(epoch), tid,
                                             lane_threads, 20_000_000_000, abort.ctypes.data)
                    assert err == 0, (rank, int(row[isa.STEP]), err, seen)

    host._run_lane = run_lane
    return plain


@case
def saturating_fp8_sums_on_the_deterministic_strategies_and_protocols():
    """4 ranks summing e4m3fn values up to 192 (float32 sums up to 768: many saturate to
    +-448), odd counts (parts end on odd bytes, a scalar tail), every deterministic strategy,
    simple and LL tables (a fused bind of an FP8 sum runs these), chunks and lanes by piece
    or stage, one and two blocks a lane: the kernels' rows give the rank-order float32 sum
    encoded once and the cpu datapath's bits, under this torch's casts and under an older
    torch's whose overflow gave NaN (the host codec saturates itself)."""
    from fp8_older_torch import older_torch_casts

    from purlin.atom import host
    from purlin.atom.cpu import reduce_into
    from purlin.kernels import isa
    from purlin.snac import DETERMINISTIC_STRATEGIES, plan
    from purlin.spec import collectives
    from purlin.spec.dtypes import fp8_decode, fp8_encode

    n, name = 4, "float8_e4m3fn"
    rng = np.random.default_rng(11)
    plain = _kernel_rows_on_host_threads(threads=16)  # 16+: a row's sub-16-byte tail in block 0
    ll_rows = 0
    try:
        for count in (n * 3 * 2 * 64 + 5, 4 * 16 + 3):
            common = rng.choice([-1.0, 1.0], count)  # most ranks agree in sign: big sums
            values = [10.0 ** np.where(rng.random(count) < 0.2, rng.uniform(-4, 1, count),
                                       rng.uniform(1.9, 2.5, count))
                      * np.where(rng.random(count) < 0.85, common, -common) for _ in range(n)]
            bits = [fp8_encode(np.clip(v, -200, 200), name) for v in values]
            floats = [fp8_decode(b, name) for b in bits]
            acc = floats[0].copy()
            for x in floats[1:]:
                acc = (acc + x).astype(np.float32)
            assert (np.abs(acc) > 448).sum() > count // 20, "too few saturating sums"
            for casts in ("this torch", "older torch"):
                with older_torch_casts() if casts == "older torch" else _nothing():
                    want = fp8_encode(acc, name)
                    cpu = np.zeros(count, np.uint8)
                    reduce_into(cpu, bits, "sum", n, name)
                assert np.array_equal(want, cpu), casts
                assert fp8_decode(want, name)[np.abs(acc) > 448].tolist() == \
                    (448.0 * np.sign(acc[np.abs(acc) > 448])).tolist(), casts
            coll = collectives.all_reduce(n, op="sum")
            for strategy in DETERMINISTIC_STRATEGIES:
                for ll in (False, True):
                    for chunks, lanes, by, blocks in ((1, 1, "piece", 1), (3, 2, "piece", 2),
                                                      (2, 2, "stage", 1)):
                        s = plan(coll, strategy, count=count, dtype=name, chunks=chunks,
                                 lanes=lanes, lanes_by=by, deterministic=True)
                        bufs = host.HostBuffers(s, ll=ll)
                        low = bufs.lower(blocks_per_lane=blocks)
                        ll_rows += sum(int((t[:, isa.OP] == isa.LL_GET).sum())
                                       for r in low for t in r.tables)
                        for r in range(n):
                            bufs.outputs[r][:] = 0
                        outs = host.run_calls(low, bufs, [[f.astype(np.float64)
                                                           for f in floats]] * 2,
                                              blocks_per_lane=blocks, timeout=60.0)
                        where = (count, strategy, "ll" if ll else "simple", chunks, lanes, by,
                                 blocks)
                        for call in range(2):
                            for r in range(n):
                                got = fp8_encode(outs[call][r], name)
                                bad = np.nonzero(got != want)[0]
                                assert bad.size == 0, (where, call, r, bad[:4].tolist(),
                                                       got[bad[:4]].tolist(),
                                                       want[bad[:4]].tolist())
    finally:
        host._run_lane = plain
    assert ll_rows > 0, "no LL rows ran"


@contextlib.contextmanager
def _nothing():
    yield


# ------------------------------------------------------------------------ pytest entry points
verdicts, test_in_simulator = simulator_tests(__file__, CASES)


if __name__ == "__main__":
    run_cases(CASES, sys.argv[1])
