"""FP8 in the GPU kernels, run in Numba's CUDA simulator: the device codec against torch's
casts, FP8 reduce rows against the cpu datapath bit for bit, FP8 copies and LL transfers
byte-exact, and the fused kernel moving FP8 rows that end on any byte.

As in tests/test_kernels_sim.py, the simulator must be on before ``numba.cuda`` is first
imported, so the cases run in one child process and each pytest test checks one verdict.
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import traceback
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
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
                words = fused_programs(low, bufs, unit)[0].copy()
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


# ------------------------------------------------------------------------ pytest entry points
@pytest.fixture(scope="module")
def verdicts(tmp_path_factory):
    pytest.importorskip("numba.cuda", reason="numba-cuda is needed for the kernel simulator")
    pytest.importorskip("torch", reason="FP8 casts come from torch")
    out = tmp_path_factory.mktemp("sim") / "verdicts.json"
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, __file__, str(out)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    if not out.exists():
        pytest.fail(f"the simulator process failed (rc {proc.returncode}):\n"
                    f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


@pytest.mark.parametrize("name", sorted(CASES))
def test_in_simulator(name, verdicts):
    assert name in verdicts, f"case {name} did not run"
    assert verdicts[name] == "ok", verdicts[name]


def _run_all(out: str) -> None:
    from numba.cuda import config

    if not config.ENABLE_CUDASIM:
        raise SystemExit("set NUMBA_ENABLE_CUDASIM=1 before running the simulator cases")
    verdicts = {}
    for name, fn in CASES.items():
        try:
            fn()
            verdicts[name] = "ok"
        except Exception:  # noqa: BLE001 - every failure is reported to the parent test
            verdicts[name] = traceback.format_exc()
    Path(out).write_text(json.dumps(verdicts, indent=1))


if __name__ == "__main__":
    _run_all(sys.argv[1])
