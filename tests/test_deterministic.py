"""Deterministic mode: every reduced output element summed by one step, in rank order.

``plan(..., deterministic=True)`` and ``Cluster.bind(..., deterministic=True)`` must give
bitwise the same result for the same inputs whatever the strategy, chunks, lanes and arrival
order; strategies that sum hop by hop are refused.
"""

import random
import time

import numpy as np
import pytest

from purlin.atom import cpu as cpu_datapath
from purlin.atom.host import HostBuffers, bf16_bits, bf16_floats, run_calls
from purlin.errors import CapabilityError, PlanError
from purlin.runtime import Cluster
from purlin.snac import DETERMINISTIC_STRATEGIES, check_deterministic, plan
from purlin.spec import collectives
from purlin.spec.collectives import REDUCING, standard
from purlin.spec.dtypes import FP8, fp8_decode, fp8_encode

SHAPES = [(1, 1, "piece"), (3, 2, "piece"), (4, 3, "stage")]  # (chunks, lanes, lanes_by)
NRANKS = 4
COUNT = 4 * 3 * 5


def _order_sensitive(count: int, calls: int, seed: int, dtype) -> list:
    """Inputs whose sum depends on its order: magnitudes 1e-4..1e4, both signs."""
    gen = np.random.default_rng(seed)
    out = []
    for _ in range(calls):
        xs = []
        for _r in range(NRANKS):
            mag = 10.0 ** gen.uniform(-4, 4, count)
            xs.append((mag * gen.choice([-1.0, 1.0], count)).astype(dtype))
        out.append(xs)
    return out


def _rank_order_sum(xs, dtype, rounded=lambda a: a):
    """The deterministic value: float32 accumulation in rank order 0..n-1, one rounding."""
    acc = np.array(rounded(xs[0]), dtype=np.float32)
    for x in xs[1:]:
        acc += np.asarray(rounded(x), dtype=np.float32)
    return acc.astype(dtype) if dtype is not None else acc


def _chain(xs, dtype):
    """A sum built hop by hop, rounded to ``dtype`` at every hop (what a ring does)."""
    acc = np.asarray(xs[0], dtype=dtype)
    for x in xs[1:]:
        acc = (acc.astype(np.float32) + np.asarray(x, dtype=np.float32)).astype(dtype)
    return acc


def test_the_inputs_sum_differently_in_another_order():
    """Otherwise the bitwise checks below would prove nothing: hop-by-hop sums in two orders
    differ in both dtypes, and so do float32 sums of one step in two orders."""
    for dtype in (np.float32, np.float16):
        xs = _order_sensitive(COUNT, 1, 0, dtype)[0]
        assert not np.array_equal(_chain(xs, dtype).view(np.uint8),
                                  _chain(xs[::-1], dtype).view(np.uint8))
    xs = _order_sensitive(COUNT, 1, 0, np.float32)[0]
    assert not np.array_equal(_rank_order_sum(xs, np.float32).view(np.uint8),
                              _rank_order_sum(xs[::-1], np.float32).view(np.uint8))


# -- the planner and the whole-schedule check ---------------------------------------------------
@pytest.mark.parametrize("name", REDUCING)
@pytest.mark.parametrize("strategy", DETERMINISTIC_STRATEGIES)
@pytest.mark.parametrize("n", [2, 3, 4])
def test_qualifying_strategies_plan_deterministically(name, strategy, n):
    for chunks, lanes, by in SHAPES:
        s = plan(standard(name, n, root=n - 1), strategy, count=n * 12, chunks=chunks,
                 lanes=lanes, lanes_by=by, deterministic=True)
        assert check_deterministic(s) == []


@pytest.mark.parametrize("strategy", DETERMINISTIC_STRATEGIES)
def test_reduce_steps_list_their_sources_in_rank_order(strategy):
    """The explicit guarantee: by default a holder adds its own input last (not rank order);
    deterministic=True lists every multi-source reduce step's sources by rank."""
    coll = collectives.all_reduce(4)
    default = plan(coll, strategy, count=48)
    assert any("not in rank order" in p for p in check_deterministic(default))
    s = plan(coll, strategy, count=48, deterministic=True)
    reduces = [st for steps in s.steps for st in steps
               if st.moves_data and st.op != "copy" and len(st.srcs) > 1]
    assert reduces
    if strategy == "direct-pull":  # sources read in place: their ranks are the contributors
        for st in reduces:
            assert [r.rank for r in st.srcs] == sorted(r.rank for r in st.srcs) == [0, 1, 2, 3]


@pytest.mark.parametrize("name", REDUCING)
@pytest.mark.parametrize("n", [3, 4])
def test_ring_is_refused_with_the_reason(name, n):
    with pytest.raises(PlanError) as err:
        plan(standard(name, n), "ring", count=n * 8, deterministic=True)
    msg = str(err.value)
    assert "strategy 'ring'" in msg and "hop by hop" in msg
    assert "direct-push, direct-pull, push-pull, two-phase" in msg
    assert "rank" in msg and "step" in msg
    with pytest.raises(PlanError, match="hop by hop"):
        Cluster.cpu(n).bind(standard(name, n), "ring", count=n * 8, deterministic=True)


def test_ring_on_two_ranks_is_one_step_and_allowed():
    """Two ranks: ring's one reduce reads both inputs at once, the same sum as direct-push."""
    assert check_deterministic(plan(collectives.all_reduce(2), "ring", count=8,
                                    deterministic=True)) == []


def test_the_check_names_the_step_that_breaks_it():
    problems = check_deterministic(plan(collectives.all_reduce(3), "ring", count=6))
    assert problems and problems[0].startswith("rank ")
    assert "step" in problems[0] and "already reduced from ranks" in problems[0]


def test_copy_collectives_are_deterministic_with_any_strategy():
    for strategy in ("ring", "direct-push", "direct-pull"):
        s = plan(collectives.all_gather(4), strategy, count=16, deterministic=True)
        assert check_deterministic(s) == []


def test_deterministic_must_be_a_bool():
    with pytest.raises(PlanError, match="deterministic must be True or False"):
        plan(collectives.all_reduce(2), "direct-push", count=8, deterministic=1)


# -- the cpu datapath ---------------------------------------------------------------------------
@pytest.fixture
def shuffled_arrivals(monkeypatch):
    """Every data step on the cpu datapath sleeps a random 0..0.3 ms first, so ranks and lanes
    arrive in a different order on every call."""
    copy, reduce = cpu_datapath.copy_into, cpu_datapath.reduce_into
    rng = random.Random(7)

    def slow_copy(*args, **kwargs):
        time.sleep(rng.random() * 3e-4)
        copy(*args, **kwargs)

    def slow_reduce(*args, **kwargs):
        time.sleep(rng.random() * 3e-4)
        reduce(*args, **kwargs)

    monkeypatch.setattr(cpu_datapath, "copy_into", slow_copy)
    monkeypatch.setattr(cpu_datapath, "reduce_into", slow_reduce)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_bitwise_across_100_calls_strategies_and_shapes(dtype, shuffled_arrivals):
    name = np.dtype(dtype).name
    coll = collectives.all_reduce(NRANKS)
    calls = _order_sensitive(COUNT, 100, seed=1, dtype=dtype)
    want = [_rank_order_sum(xs, dtype) for xs in calls]
    configs = [(st, *shape) for st in DETERMINISTIC_STRATEGIES for shape in SHAPES]
    cluster = Cluster.cpu(NRANKS)
    bound = {c: cluster.bind(coll, c[0], count=COUNT, dtype=name, chunks=c[1], lanes=c[2],
                             lanes_by=c[3], deterministic=True) for c in configs}
    for k, xs in enumerate(calls):
        config = configs[k % len(configs)]
        outs = bound[config](xs)
        for r, o in enumerate(outs):
            assert np.array_equal(o.view(np.uint8), want[k].view(np.uint8)), \
                f"call {k} rank {r} with {config} differs from the rank-order sum"
    # the same inputs again through every configuration: the very same bits
    xs = calls[0]
    for c in configs:
        for o in bound[c](xs):
            assert np.array_equal(o.view(np.uint8), want[0].view(np.uint8)), c


@pytest.mark.parametrize("fp8", FP8)
def test_fp8_bitwise_across_100_shuffled_calls_strategies_and_shapes(fp8, shuffled_arrivals):
    """FP8 sums: the float32 rank-order sum of the decoded inputs, rounded once, on every
    call whatever the configuration and arrival order."""
    coll = collectives.all_reduce(NRANKS)
    configs = [(st, *shape) for st in DETERMINISTIC_STRATEGIES for shape in SHAPES]
    cluster = Cluster.cpu(NRANKS)
    bound = {c: cluster.bind(coll, c[0], count=COUNT, dtype=fp8, chunks=c[1], lanes=c[2],
                             lanes_by=c[3], deterministic=True) for c in configs}
    order = random.Random(3)
    for k, values in enumerate(_order_sensitive(COUNT, 100, seed=6, dtype=np.float32)):
        xs = [fp8_encode(v / 100, fp8) for v in values]  # e5m2: sums round in float32 too
        want = fp8_encode(_rank_order_sum([fp8_decode(x, fp8) for x in xs], None), fp8)
        config = configs[order.randrange(len(configs))]
        for r, o in enumerate(bound[config](xs)):
            assert np.array_equal(o, want), f"call {k} rank {r} with {config}"


def test_reduce_scatter_and_avg_bitwise_across_strategies(shuffled_arrivals):
    cluster = Cluster.cpu(NRANKS)
    xs = _order_sensitive(COUNT, 1, seed=3, dtype=np.float32)[0]
    for op in ("sum", "avg"):
        coll = collectives.reduce_scatter(NRANKS, op=op)
        results = []
        for st in DETERMINISTIC_STRATEGIES:
            for chunks, lanes, by in SHAPES:
                b = cluster.bind(coll, st, count=COUNT, chunks=chunks, lanes=lanes,
                                 lanes_by=by, deterministic=True)
                results.append(np.concatenate(b(xs)))
        for other in results[1:]:
            assert np.array_equal(results[0].view(np.uint8), other.view(np.uint8))
        total = _rank_order_sum(xs, None)
        want = total / NRANKS if op == "avg" else total
        assert np.array_equal(results[0].view(np.uint8), want.astype(np.float32).view(np.uint8))


def test_auto_picks_only_qualifying_strategies(monkeypatch):
    """Where auto would pick ring (a table's choice), deterministic=True takes two-phase."""
    from purlin.runtime import auto

    real = auto.rules  # what auto picks on a cpu cluster

    def ring_first(collective, size, strategy=None):
        return real(collective, size, strategy or "ring")

    monkeypatch.setattr(auto, "rules", ring_first)
    cluster = Cluster.cpu(3)
    coll = collectives.all_reduce(3)
    assert cluster.bind(coll, "auto", count=48).schedule.strategy == "ring"
    b = cluster.bind(coll, "auto", count=48, deterministic=True)
    assert b.schedule.strategy in DETERMINISTIC_STRATEGIES
    xs = _order_sensitive(48, 1, seed=4, dtype=np.float32)[0][:3]
    want = _rank_order_sum(xs, np.float32)
    assert all(np.array_equal(o.view(np.uint8), want.view(np.uint8)) for o in b(xs))


def test_gpu_clusters_take_deterministic():
    """GPU clusters bind deterministic=True (every protocol sums a step's sources in the
    order listed, one rounding): here the bind gets past the plan and stops at the missing
    GPU; a hop-by-hop strategy is refused by the plan, as on the cpu datapath."""
    for kind in ("local", "virtual"):
        cluster = Cluster(kind, 3, (0, 1, 2) if kind == "local" else (0, 0, 0))
        with pytest.raises(CapabilityError) as caught:
            cluster.bind(collectives.all_reduce(3), count=12, deterministic=True)
        assert "deterministic" not in str(caught.value) and "GPU" in str(caught.value)
        with pytest.raises(PlanError, match="deterministic=True"):
            cluster.bind(collectives.all_reduce(3), "ring", count=12, deterministic=True)


# -- the lowered tables on the host interpreter (what the GPU kernels run) ---------------------
def _host_round(dtype_name):
    if dtype_name == "bfloat16":
        return lambda x: bf16_floats(bf16_bits(x))
    if dtype_name in FP8:
        return lambda x: fp8_decode(fp8_encode(x, dtype_name), dtype_name)  # saturating
    return lambda x: np.asarray(x, dtype=dtype_name).astype(np.float32)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float8_e4m3fn"])
def test_lowered_tables_bitwise_across_strategies_blocks_and_slow_blocks(dtype):
    coll = collectives.all_reduce(NRANKS)
    calls = _order_sensitive(COUNT, 3, seed=5, dtype=np.float64)
    rounded = _host_round(dtype)
    store = np.float32 if dtype == "bfloat16" else dtype
    want = []
    for xs in calls:
        w = _rank_order_sum(xs, None, rounded)
        if dtype in FP8:
            want.append(fp8_decode(fp8_encode(w, dtype), dtype))
            continue
        want.append(bf16_floats(bf16_bits(w)) if dtype == "bfloat16"
                    else w.astype(store).astype(np.float32))
    for st in DETERMINISTIC_STRATEGIES:
        for (chunks, lanes, by), bpl in zip(SHAPES, (1, 3, 2)):
            s = plan(coll, st, count=COUNT, dtype=dtype, chunks=chunks, lanes=lanes,
                     lanes_by=by, deterministic=True)
            bufs = HostBuffers(s)
            outs = run_calls(bufs.lower(blocks_per_lane=bpl), bufs, calls,
                             blocks_per_lane=bpl, slow_block_delay=0.001 if bpl > 1 else 0.0)
            for k in range(len(calls)):
                for r in range(NRANKS):
                    got = np.asarray(outs[k][r], dtype=np.float32)
                    assert np.array_equal(got.view(np.uint32), want[k].view(np.uint32)), \
                        (st, chunks, lanes, bpl, k, r)
