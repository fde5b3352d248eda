"""FP8 (float8_e4m3fn, float8_e5m2) on the cpu datapath, the sm datapath's tables (host
threads) and process mode, against purlin.spec.reference.

Copies must move the bytes (every bit pattern, NaN payloads included). A reduction decodes to
float32, accumulates there in the step's source order and rounds once, on the write, so its
result is ``RNE_fp8(s32)`` where ``s32`` is the float32 accumulation; against the float64
reference ``ref`` that gives

    |out - ref| <= ulp_fp8(ref) / 2 + (k - 1) * 2**-24 * sum_i |x_i|        (k sources)

and, where every partial sum is exact in float32 (any e4m3fn sum of up to 64 ranks; e5m2
while partial sums stay below 256 in magnitude), ``out == RNE_fp8(ref)`` bit for bit.
"""

import subprocess
import sys

import numpy as np
import pytest
import torch

from purlin import atom
from purlin.errors import CapabilityError, ExecutionError
from purlin.runtime import Cluster
from purlin.snac import plan
from purlin.spec import STANDARD, dtype, reference, standard
from purlin.spec.dtypes import FP8, fp8_decode, fp8_encode

STRATEGIES = ["direct-push", "direct-pull", "two-phase", "ring"]
REDUCING = [name for name in STANDARD if standard(name, 2).op.is_reduce]
CHUNK = 7
MANTISSA = {"float8_e4m3fn": 3, "float8_e5m2": 2}
MIN_EXP = {"float8_e4m3fn": -6, "float8_e5m2": -14}   # of the smallest normal


def ulp(values, name):
    """The spacing of FP8 ``name`` at ``|values|`` (the subnormal spacing below the normals)."""
    _, e = np.frexp(np.abs(np.asarray(values, dtype=np.float64)))
    return np.ldexp(1.0, np.maximum(e - 1, MIN_EXP[name]) - MANTISSA[name])


def cases():
    for name in STANDARD:
        for strategy in STRATEGIES:
            if strategy == "two-phase" and name not in REDUCING:
                continue
            for fp8 in FP8:
                for n, chunks, lanes in ((3, 1, 1), (4, 3, 2)):
                    yield pytest.param(name, strategy, fp8, n, chunks, lanes,
                                       id=f"{name}-{strategy}-{fp8}-n{n}-{chunks}x{lanes}")


def bind(name, strategy, fp8, n, chunks=1, lanes=1, op="sum", chunk=CHUNK):
    coll = standard(name, n, root=n - 1, op=op)
    return Cluster.cpu(n).bind(coll, strategy, dtype=fp8, timeout=10.0, chunks=chunks,
                               lanes=lanes, chunk_sizes={x: chunk for x in coll.input.names()})


def finite_fp8(rng, length, fp8, top):
    """Random FP8 bits of both signs, magnitudes from the subnormals up to ``top``."""
    mags = np.exp2(rng.uniform(MIN_EXP[fp8] - MANTISSA[fp8], np.log2(top), length))
    return fp8_encode(mags * rng.choice([-1.0, 1.0], length), fp8)


# -- the grid ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name, strategy, fp8, n, chunks, lanes", list(cases()))
def test_standard_collective_matches_reference(name, strategy, fp8, n, chunks, lanes):
    reduces = name in REDUCING
    ops = ("sum", "avg", "max", "min") if reduces else ("copy",)
    rng = np.random.default_rng(n * 7 + chunks)
    for op in ops:
        bound = bind(name, strategy, fp8, n, chunks, lanes, op=("sum" if op == "copy" else op))
        sizing = bound.schedule.sizing
        for call in range(2):
            if reduces:  # in range, partial sums exact in float32: top * n <= 256
                inputs = [finite_fp8(rng, sizing.input_count(r), fp8, 32.0) for r in range(n)]
            else:  # every bit pattern, NaNs and infinities included
                inputs = [rng.integers(0, 256, sizing.input_count(r), dtype=np.uint8)
                          for r in range(n)]
            out = None
            if call:  # caller-given outputs full of NaN bits: every element must be written
                out = [np.full(sizing.output_count(r), 0x7F, dtype=np.uint8) for r in range(n)]
            got = bound(inputs, out=out)
            want = reference(sizing, inputs, dtype=fp8)
            for r in range(n):
                where = f"{bound.schedule.title()} {op}: call {call}, rank {r}"
                assert got[r].dtype == np.uint8 and got[r].shape == (sizing.output_count(r),)
                if not reduces:
                    # the reference moves the byte values as numbers: bytes in, same bytes out
                    bytes_ref = reference(sizing, [x.astype(np.float64) for x in inputs])
                    np.testing.assert_array_equal(got[r], bytes_ref[r].astype(np.uint8),
                                                  err_msg=where)
                    continue
                value = fp8_decode(got[r], fp8).astype(np.float64)
                bound_ = ulp(want[r], fp8) / 2  # accumulation is exact here
                assert np.all(np.abs(value - want[r]) <= bound_), where
                # and the one rounding is round-to-nearest-even of the exact result
                np.testing.assert_array_equal(got[r], fp8_encode(want[r].astype(np.float32),
                                                                 fp8), err_msg=where)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_e5m2_sum_within_the_stated_bound_when_float32_rounds(strategy):
    """Values from 2^-16 to 2^12 over 8 ranks: float32 partial sums are not exact, the bound
    with its accumulation term still holds."""
    fp8, n = "float8_e5m2", 8
    bound = bind("all-reduce", strategy, fp8, n, chunks=2, lanes=2, chunk=64)
    rng = np.random.default_rng(5)
    inputs = [finite_fp8(rng, bound.schedule.sizing.input_count(r), fp8, 4096.0)
              for r in range(n)]
    got = bound(inputs)
    want = reference(bound.schedule.sizing, inputs, dtype=fp8)
    magnitude = reference(bound.schedule.sizing, [np.abs(fp8_decode(x, fp8)) for x in inputs])
    for r in range(n):
        err = np.abs(fp8_decode(got[r], fp8).astype(np.float64) - want[r])
        limit = ulp(want[r], fp8) / 2 + (n - 1) * 2.0 ** -24 * magnitude[r]
        assert np.all(err <= limit), f"rank {r}: worst excess {np.max(err - limit)}"


def test_ring_partial_sums_are_rounded_once():
    """Values whose FP8 partial sums would round: 1 + 8 * 2^-4 is 1.5 in e4m3fn, but each
    1 + 2^-4 rounds back to 1 (half an ulp, to even): rounding per hop would give 1."""
    fp8, n = "float8_e4m3fn", 9
    for strategy in STRATEGIES:
        bound = bind("all-reduce", strategy, fp8, n, chunk=1)
        count = bound.schedule.sizing.input_count(0)
        inputs = [fp8_encode(np.full(count, 1.0 if r == 0 else 2.0 ** -4), fp8)
                  for r in range(n)]
        for r, x in enumerate(bound(inputs)):
            assert fp8_decode(x, fp8).tolist() == [1.5] * count, (strategy, r)


# -- NaN, infinity, overflow: as torch's casts do it --------------------------------------------


def one_reduce(fp8, op, per_rank):
    """All-reduce of one element per rank; the output value (all ranks must agree, bitwise)."""
    n = len(per_rank)
    bound = bind("all-reduce", "ring", fp8, n, op=op, chunk=1)
    inputs = [np.full(n, fp8_encode([v], fp8)[0], dtype=np.uint8) for v in per_rank]
    got = bound(inputs)
    assert all(np.array_equal(g, got[0]) for g in got)
    return got[0][0], fp8_decode(got[0][:1], fp8)[0]


def test_torch_casts_as_documented():
    """The rounding rules ARCHITECTURE.md states are torch's: e4m3fn saturates to +-448 (its
    infinity too), e5m2 overflows to +-inf, NaN stays NaN, ties go to even."""
    big = np.array([480.0, 1e6, np.inf, -np.inf, np.nan], dtype=np.float32)
    e4 = fp8_decode(fp8_encode(big, "float8_e4m3fn"), "float8_e4m3fn")
    assert e4[:4].tolist() == [448.0, 448.0, 448.0, -448.0] and np.isnan(e4[4])
    e5 = fp8_decode(fp8_encode(np.array([61440.0, 1e6, -np.inf, np.nan]), "float8_e5m2"),
                    "float8_e5m2")
    assert e5[:3].tolist() == [np.inf, np.inf, -np.inf] and np.isnan(e5[3])
    assert fp8_decode(fp8_encode([1.0625, 1.1875], "float8_e4m3fn"),
                      "float8_e4m3fn").tolist() == [1.0, 1.25]


@pytest.mark.parametrize("fp8", FP8)
def test_overflow_nan_and_inf_follow_torch(fp8):
    top = 448.0 if fp8 == "float8_e4m3fn" else 57344.0
    bits, value = one_reduce(fp8, "sum", [top, top, top])
    assert bits == fp8_encode([3 * top], fp8)[0]  # float32 3 * top, cast once by torch
    assert value == (448.0 if fp8 == "float8_e4m3fn" else np.inf)
    for op in ("sum", "avg", "max", "min"):
        assert np.isnan(one_reduce(fp8, op, [1.0, np.nan, 2.0])[1]), op
    if fp8 == "float8_e5m2":
        assert one_reduce(fp8, "sum", [np.inf, 1.0])[1] == np.inf
        assert np.isnan(one_reduce(fp8, "sum", [np.inf, -np.inf])[1])
        assert one_reduce(fp8, "max", [-np.inf, 3.0])[1] == 3.0


# -- torch tensors in, torch tensors out ---------------------------------------------------------


@pytest.mark.parametrize("fp8", FP8)
def test_torch_float8_tensors_in_and_out(fp8):
    tdt = getattr(torch, fp8)
    n = 3
    gather = bind("all-gather", "ring", fp8, n, chunk=4)
    xs = [torch.randn(2, 2).to(tdt) for _ in range(n)]
    got = gather(xs)
    assert all(isinstance(g, torch.Tensor) and g.dtype == tdt for g in got)
    whole = torch.cat([x.reshape(-1) for x in xs])
    assert all(torch.equal(g.view(torch.uint8), whole.view(torch.uint8)) for g in got)

    allreduce = bind("all-reduce", "two-phase", fp8, n, chunk=2)
    xs = [torch.randn(2, 3).to(tdt) for _ in range(n)]
    got = allreduce(xs)
    assert all(g.dtype == tdt and g.shape == (2, 3) for g in got)
    want = reference(allreduce.schedule.sizing, xs)[0]  # decodes the float8 tensors itself
    expect = torch.from_numpy(want.astype(np.float32)).to(tdt).view(torch.uint8)
    assert all(torch.equal(g.reshape(-1).view(torch.uint8), expect) for g in got)

    outs = [torch.empty(6, dtype=tdt) for _ in range(n)]
    assert all(a is b for a, b in zip(allreduce(xs, out=outs), outs))
    assert all(torch.equal(o.view(torch.uint8), expect) for o in outs)
    with pytest.raises(ExecutionError, match=f"input of rank 0 is float16; this binding moves "
                                             f"{fp8}"):
        allreduce([x.to(torch.float16) for x in xs])


# -- the dtypes and the other datapaths ---------------------------------------------------------


def test_fp8_dtypes():
    for name, alias, tdt in (("float8_e4m3fn", "e4m3", torch.float8_e4m3fn),
                             ("float8_e5m2", "fp8_e5m2", torch.float8_e5m2)):
        d = dtype(name)
        assert (d.itemsize, d.is_float, d.is_fp8) == (1, True, True)
        assert dtype(alias) is d and dtype(tdt) is d and d.numpy() == np.uint8
    assert not dtype("bf16").is_fp8


def test_import_purlin_stays_torch_free():
    """Importing, binding FP8 and moving its bytes need no torch; only the codec imports it."""
    code = ("import sys, numpy as np, purlin; from purlin.runtime import Cluster; "
            "from purlin.spec import standard; "
            "b = Cluster.cpu(2).bind(standard('all-gather', 2), count=4, dtype='e5m2'); "
            "out = b([np.arange(2, dtype=np.uint8), np.arange(2, 4, dtype=np.uint8)]); "
            "assert out[1].tolist() == [0, 1, 2, 3], out; "
            "assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("datapath", ["sm", "ce"])
@pytest.mark.parametrize("fp8", FP8)
def test_gpu_datapaths_refuse_fp8_sums_built_hop_by_hop(datapath, fp8):
    """The GPU kernels keep FP8 in FP8 buffers, so a sum must be one step to round once: a
    3-rank ring is refused at bind, naming the step, before anything touches a GPU; a
    direct-push all-reduce and a ring all-gather get past that check (here they stop at the
    missing GPU)."""
    module = atom.load(datapath)
    bound = module.SmBound if datapath == "sm" else module.CeBound
    extra = {"trace_rows": 0} if datapath == "sm" else {}

    def bind_here(name, strategy):
        schedule = plan(standard(name, 3), strategy, count=12, dtype=fp8,
                        capabilities=atom.capabilities(datapath))
        return bound(None, schedule, timeout=1.0, blocks_per_lane=1, threads=128, **extra)

    with pytest.raises(CapabilityError, match=f"the {datapath} datapath reduces FP8 in one "
                                              r"rounding only, .* builds its sums hop by hop: "
                                              r"rank \d+ step \d+"):
        bind_here("all-reduce", "ring")
    for name, strategy in (("all-reduce", "direct-push"), ("all-gather", "ring")):
        with pytest.raises(CapabilityError) as caught:
            bind_here(name, strategy)
        assert "FP8" not in str(caught.value) and "GPU" in str(caught.value), caught.value


# -- the GPU kernels' tables on the host interpreter ---------------------------------------------
def gpu_cases():
    for name in STANDARD:
        reduces = name in REDUCING
        for strategy in ("direct-push", "direct-pull", "two-phase", "ring"):
            if strategy == "two-phase" and not reduces or strategy == "ring" and reduces:
                continue  # (a 3-rank ring sum is refused on the GPUs: it rounds every hop)
            for fp8 in FP8:
                yield pytest.param(name, strategy, fp8, id=f"{name}-{strategy}-{fp8}")


@pytest.mark.parametrize("name, strategy, fp8", list(gpu_cases()))
def test_gpu_tables_give_the_cpu_datapaths_bits(name, strategy, fp8):
    """The tables the sm datapath runs (lowered for 1 and 3 blocks per lane, LL and flags),
    on host threads with a slow block: copies move the bytes, sums (and avg, max, min) give
    the cpu datapath's bits -- one rounding of the float32 sum in source order -- within
    ulp/2 of the float64 reference."""
    from purlin.atom.host import HostBuffers, run_calls

    n, reduces = 3, name in REDUCING
    rng = np.random.default_rng(len(name) + len(strategy))
    for op in (("sum", "avg", "max", "min") if reduces else ("sum",)):
        coll = standard(name, n, root=n - 1, op=op)
        sizes = {x: CHUNK + 4 for x in coll.input.names()}
        schedule = plan(coll, strategy, dtype=fp8, chunk_sizes=sizes,
                        capabilities=atom.capabilities("sm"))
        atom.load("sm").check_fp8_reduction(schedule)
        sizing = schedule.sizing
        inputs = [finite_fp8(rng, sizing.input_count(r), fp8, 32.0) if reduces else
                  rng.integers(0, 256, sizing.input_count(r), dtype=np.uint8) for r in range(n)]
        cpu = Cluster.cpu(n).bind(coll, strategy, dtype=fp8, chunk_sizes=sizes)(inputs)
        for ll, blocks in ((False, 1), (True, 3)):
            bufs = HostBuffers(schedule, ll=ll)
            values = [fp8_decode(x, fp8).astype(np.float64) for x in inputs]
            outs = _host_bits(bufs, blocks, inputs) if not reduces else run_calls(
                bufs.lower(blocks_per_lane=blocks), bufs, [values], blocks_per_lane=blocks,
                slow_block_delay=0.001 if blocks > 1 else 0.0)[0]
            want = reference(sizing, inputs, dtype=fp8)
            for r in range(n):
                where = f"{schedule.title()} {op} ll={ll} blocks={blocks} rank {r}"
                got = outs[r] if not reduces else fp8_encode(outs[r].astype(np.float32), fp8)
                np.testing.assert_array_equal(got, cpu[r], err_msg=where)
                if reduces:
                    value = fp8_decode(got, fp8).astype(np.float64)
                    assert np.all(np.abs(value - want[r]) <= ulp(want[r], fp8) / 2), where


def _host_bits(bufs, blocks, inputs):
    """One call of a copy collective's tables on host threads with the inputs' bytes written
    as they are (the interpreter's own loads would decode them); the outputs' bytes."""
    from purlin.atom import host

    low = bufs.lower(blocks_per_lane=blocks)
    real_store, real_load = host._store, host._load

    def store(addr, values, code):  # the inputs: their bytes
        host._bytes(addr, len(values))[:] = np.asarray(values).astype(np.uint8)

    def load(addr, count, code):
        return host._bytes(addr, count).copy()

    host._store, host._load = store, load
    try:
        outs = host.run_calls(low, bufs, [[x.astype(np.float64) for x in inputs]],
                              blocks_per_lane=blocks, slow_block_delay=0.001)
    finally:
        host._store, host._load = real_store, real_load
    return [o.astype(np.uint8) for o in outs[0]]


# -- process mode (shared memory, a thread per rank here) ------------------------------------------
@pytest.mark.parametrize("fp8", FP8)
def test_process_mode_moves_fp8_and_sums_it_in_one_rounding(fp8):
    """ShmRun, the code every process of process mode runs: an all-gather moves every byte, a
    direct-push and a two-phase sum give the cpu datapath's bits; a 3-rank ring sum (its
    scratch holds FP8, so it would round every hop) is refused naming the step."""
    import threading

    from purlin.runtime.shm import HEADER, ShmArena, ShmRun, layout

    def run_all(schedule, inputs):
        lay = layout(schedule)
        arena = ShmArena.create(schedule.nranks, HEADER + lay.size)
        try:
            runs = [ShmRun(schedule, r, arena, lay, timeout=10.0)
                    for r in range(schedule.nranks)]
            for run, x in zip(runs, inputs):
                run.input[:] = x
            threads = [threading.Thread(target=run) for run in runs]
            for t in threads:
                t.start()
            for t in threads:
                t.join(30)
            return [run.output.copy() for run in runs]
        finally:
            arena.close()

    n, rng = 3, np.random.default_rng(9)
    sizes = lambda coll: {x: CHUNK for x in coll.input.names()}  # noqa: E731
    coll = standard("all-gather", n)
    s = plan(coll, "direct-push", dtype=fp8, chunk_sizes=sizes(coll))
    xs = [rng.integers(0, 256, s.sizing.input_count(r), dtype=np.uint8) for r in range(n)]
    outs = run_all(s, xs)
    assert all(np.array_equal(o, np.concatenate(xs)) for o in outs)
    coll = standard("all-reduce", n)
    for strategy in ("direct-push", "two-phase"):
        s = plan(coll, strategy, dtype=fp8, chunk_sizes=sizes(coll))
        xs = [finite_fp8(rng, s.sizing.input_count(r), fp8, 32.0) for r in range(n)]
        want = Cluster.cpu(n).bind(coll, strategy, dtype=fp8, chunk_sizes=sizes(coll))(xs)
        for got, w in zip(run_all(s, xs), want):
            np.testing.assert_array_equal(got, w, err_msg=strategy)
    ring = plan(coll, "ring", dtype=fp8, chunk_sizes=sizes(coll))
    with pytest.raises(CapabilityError, match=r"process-mode datapath reduces FP8 in one "
                                              r"rounding only.*rank \d+ step \d+"):
        ShmRun(ring, 0, None, None)
