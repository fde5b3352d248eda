"""FP8 and deterministic mode on real GPUs (virtual ranks on one GPU: ``Cluster.virtual``).

* FP8 copy collectives move the bytes on every protocol (the fused kernel included);
* FP8 reductions give the cpu datapath's bits (float32 accumulation in source order, one
  rounding) within half an FP8 ulp of the float64 reference, and sums built hop by hop are
  refused;
* ``deterministic=True`` gives the very same bits over 100 calls whose configuration
  (strategy, protocol, chunks, lanes) and timing (a random load on a side stream, a shuffled
  launch order) change on every call, equal to the rank-order sum and to the cpu datapath's.

Skipped, with the reason, where no GPU is visible.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from purlin.errors import CapabilityError
from purlin.snac import DETERMINISTIC_STRATEGIES
from purlin.spec import collectives, reference, standard
from purlin.spec.dtypes import FP8, fp8_decode, fp8_encode

pytestmark = pytest.mark.gpu

N = 4
PROTOCOLS = ("simple", "ll", "fused", "fused-ll")
MANTISSA = {"float8_e4m3fn": 3, "float8_e5m2": 2}
MIN_EXP = {"float8_e4m3fn": -6, "float8_e5m2": -14}


@pytest.fixture(scope="module")
def torch():
    import torch

    return torch


@pytest.fixture(scope="module")
def cluster():
    from purlin.runtime import Cluster

    return Cluster.virtual(N)


def _ulp(values, name):
    _, e = np.frexp(np.abs(np.asarray(values, dtype=np.float64)))
    return np.ldexp(1.0, np.maximum(e - 1, MIN_EXP[name]) - MANTISSA[name])


def _write_bits(torch, bound, bits):
    for r, b in enumerate(bits):
        bound.inputs[r].view(torch.uint8)[:b.size].copy_(torch.from_numpy(b))


def _read_bits(torch, bound):
    sizing = bound.schedule.sizing
    return [bound.outputs[r][:sizing.output_count(r)].view(torch.uint8).cpu().numpy()
            for r in range(bound.schedule.nranks)]


def _run(bound):
    bound.launch()
    bound.check()


# -- FP8 copies -----------------------------------------------------------------------------
COPIES = [("all-gather", s) for s in ("direct-push", "direct-pull", "ring")] + \
    [("all-to-all", s) for s in ("direct-push", "direct-pull")] + \
    [("broadcast", s) for s in ("direct-push", "direct-pull")]


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("name,strategy", COPIES)
def test_fp8_copies_move_the_bytes_on_every_protocol(torch, cluster, name, strategy, fp8):
    """Every bit pattern (NaNs too), 64-element pieces (the fused kernel runs them: asserted)
    and 7-element ones (rows ending on odd bytes), on each protocol, two calls."""
    coll = standard(name, N, root=N - 1)
    rng = np.random.default_rng(len(name))
    for chunk in (64, 7):
        for protocol in PROTOCOLS:
            bound = cluster.bind(coll, strategy, dtype=fp8, protocol=protocol, fallback=True,
                                 chunk_sizes={x: chunk for x in coll.input.names()})
            if chunk == 64 and strategy == "direct-push":
                assert bound.protocol == protocol, (protocol, bound.protocol)
            sizing = bound.schedule.sizing
            for call in range(2):
                bits = [rng.integers(0, 256, sizing.input_count(r), dtype=np.uint8)
                        for r in range(N)]
                _write_bits(torch, bound, bits)
                _run(bound)
                want = reference(sizing, [b.astype(np.float64) for b in bits])
                for r, got in enumerate(_read_bits(torch, bound)):
                    np.testing.assert_array_equal(
                        got, want[r].astype(np.uint8),
                        err_msg=f"{bound.schedule.title()} {bound.protocol} call {call} r{r}")


# -- FP8 reductions -------------------------------------------------------------------------
def _finite(rng, length, fp8, top=32.0):
    mags = np.exp2(rng.uniform(MIN_EXP[fp8] - MANTISSA[fp8], np.log2(top), length))
    return fp8_encode(mags * rng.choice([-1.0, 1.0], length), fp8)


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("name", ["all-reduce", "reduce-scatter", "reduce"])
def test_fp8_sums_are_the_cpu_datapaths_bits_within_half_an_ulp(torch, cluster, name, fp8):
    """sum, avg, max, min on the strategies that sum each element in one step, simple, LL
    and fused (the narrow build's 8-byte units; ``auto`` takes it too)."""
    from purlin.runtime import Cluster

    rng = np.random.default_rng(3)
    cpu = Cluster.cpu(N)
    for op in ("sum", "avg", "max", "min"):
        coll = standard(name, N, root=N - 1, op=op)
        sizes = {x: 37 for x in coll.input.names()}
        for strategy in ("direct-push", "direct-pull", "two-phase", "auto"):
            for protocol in ("simple", "ll", "fused"):
                options = {} if strategy == "auto" else {"protocol": protocol,
                                                         "fallback": True}
                bound = cluster.bind(coll, strategy, dtype=fp8, chunk_sizes=sizes, **options)
                fused = strategy == "auto" or protocol == "fused"
                assert bound.protocol.startswith("fused") == fused, (strategy, bound.protocol)
                assert not fused or {k.launcher.kernel for k in bound.launches} == \
                    {"fused-narrow"}, [k.launcher.kernel for k in bound.launches]
                sizing = bound.schedule.sizing
                bits = [_finite(rng, sizing.input_count(r), fp8) for r in range(N)]
                _write_bits(torch, bound, bits)
                _run(bound)
                on_cpu = cpu.bind(coll, bound.schedule.strategy, dtype=fp8,
                                  chunk_sizes=sizes)(bits)
                want = reference(sizing, bits, dtype=fp8)
                for r, got in enumerate(_read_bits(torch, bound)):
                    where = f"{bound.schedule.title()} {op} {bound.protocol} rank {r}"
                    np.testing.assert_array_equal(got, on_cpu[r], err_msg=where)
                    value = fp8_decode(got, fp8).astype(np.float64)
                    assert np.all(np.abs(value - want[r]) <= _ulp(want[r], fp8) / 2), where


def test_fp8_sums_built_hop_by_hop_are_refused(cluster):
    with pytest.raises(CapabilityError, match="reduces FP8 in one rounding only"):
        cluster.bind(collectives.all_reduce(N), "ring", count=64, dtype="float8_e4m3fn")


# -- deterministic mode ---------------------------------------------------------------------
def _order_sensitive(rng, count):
    return [(10.0 ** rng.uniform(-4, 4, count)) * rng.choice([-1.0, 1.0], count)
            for _ in range(N)]


def _as_dtype(torch, values, dtype):
    """Values held in ``dtype`` (bits for FP8), and those values as float32."""
    if dtype in FP8:
        bits = fp8_encode(np.clip(values, -200, 200), dtype)
        return bits, fp8_decode(bits, dtype)
    t = torch.tensor(values, dtype=torch.float32).to(getattr(torch, dtype))
    return t, t.float().numpy()


def _rank_order(torch, floats, dtype, op):
    """The deterministic value: float32 accumulation in rank order, one rounding."""
    acc = np.array(floats[0], dtype=np.float32)
    for x in floats[1:]:
        acc = (acc + np.asarray(x, np.float32)).astype(np.float32)
    if op == "avg":
        acc = (acc / np.float32(N)).astype(np.float32)
    if dtype in FP8:
        return fp8_encode(acc, dtype)
    return torch.from_numpy(acc).to(getattr(torch, dtype))


def _configs():
    out = []
    for strategy in DETERMINISTIC_STRATEGIES:
        for protocol in PROTOCOLS:
            for chunks, lanes, by in ((1, 1, "piece"), (3, 2, "piece"), (2, 2, "stage")):
                out.append((strategy, protocol, chunks, lanes, by))
    return out


def _noise(torch, rng):
    """A matmul of random size on a side stream, started just before the collective: it
    holds some SMs for a while, so the collective's blocks start and arrive in another
    order."""
    side = torch.cuda.Stream()
    k = int(rng.integers(64, 1024))
    a = torch.randn(k, k, device="cuda")
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(int(rng.integers(0, 4))):
            a = a @ a
            a = a / (a.abs().max() + 1)
    return side, a


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32", "float8_e4m3fn"])
@pytest.mark.parametrize("op", ["sum", "avg"])
def test_deterministic_bitwise_over_100_shuffled_calls_strategies_and_protocols(
        torch, cluster, dtype, op):
    from purlin.runtime import Cluster

    coll = collectives.all_reduce(N, op=op)
    count = N * 3 * 2 * 64 + 5  # every shape's pieces, and a scalar tail
    configs = _configs()
    bound = {c: cluster.bind(coll, c[0], count=count, dtype=dtype, chunks=c[2], lanes=c[3],
                             lanes_by=c[4], protocol=c[1], fallback=True, deterministic=True)
             for c in configs}
    cpu = None
    if dtype != "bfloat16":  # numpy has no bfloat16
        cpu = Cluster.cpu(N).bind(coll, "direct-push", count=count, dtype=dtype,
                                  deterministic=True)
    rng = np.random.default_rng(11)
    order = random.Random(5)
    first = None
    for call in range(100):
        config = configs[order.randrange(len(configs))]
        b = bound[config]
        held, floats = zip(*(_as_dtype(torch, x, dtype) for x in _order_sensitive(rng, count)))
        if dtype in FP8:
            _write_bits(torch, b, held)
        else:
            for r, t in enumerate(held):
                b.inputs[r][:count].copy_(t)
        order.shuffle(b.launches)  # one launch per device: the order GPUs are started in
        side, keep = _noise(torch, rng)
        b.launch()
        torch.cuda.current_stream().wait_stream(side)
        b.check()
        want = _rank_order(torch, floats, dtype, op)
        outs = (_read_bits(torch, b) if dtype in FP8 else
                [o[:count].cpu() for o in b.outputs])
        for r, got in enumerate(outs):
            same = (np.array_equal(got, want) if dtype in FP8 else
                    torch.equal(got.view(torch.int16 if got.element_size() == 2 else
                                         torch.int32),
                                want.view(torch.int16 if want.element_size() == 2 else
                                          torch.int32)))
            assert same, f"call {call} rank {r} with {config} differs from the rank-order sum"
        if cpu is not None and call % 10 == 0:
            host = [np.asarray(h) if dtype in FP8 else h.numpy() for h in held]
            on_cpu = cpu(host)
            mine = outs[0] if dtype in FP8 else outs[0].numpy()
            assert np.array_equal(np.asarray(on_cpu[0]).view(np.uint8),
                                  np.asarray(mine).view(np.uint8)), (call, config)
        if first is None:
            first = (held, outs[0])
    held, want0 = first  # the first inputs again through every configuration: the same bits
    for c, b in bound.items():
        if dtype in FP8:
            _write_bits(torch, b, held)
        else:
            for r, t in enumerate(held):
                b.inputs[r][:count].copy_(t)
        _run(b)
        got = _read_bits(torch, b)[0] if dtype in FP8 else b.outputs[0][:count].cpu()
        assert (np.array_equal(got, want0) if dtype in FP8 else torch.equal(got, want0)), c


def test_deterministic_on_the_ce_datapath_gives_the_sm_bits(torch, cluster):
    """A mixed schedule (copies on copy engines, sums on the executor) in deterministic mode:
    the sm datapath's bits."""
    coll = collectives.all_reduce(N)
    count = 4096
    rng = np.random.default_rng(2)
    xs = [torch.tensor(x, dtype=torch.float32).to(torch.bfloat16)
          for x in _order_sensitive(rng, count)]
    results = []
    for datapath in ("sm", "ce"):
        for strategy in ("direct-push", "two-phase"):
            b = cluster.bind(coll, strategy, count=count, dtype="bfloat16", datapath=datapath,
                             deterministic=True)
            results.append(b([x.cuda() for x in xs])[0].cpu())
    assert all(torch.equal(results[0], other) for other in results[1:])
