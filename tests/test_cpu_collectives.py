"""Every collective x strategy x rank count on the cpu datapath against purlin.spec.reference.

Each case plans (and so verifies) a schedule, checks ``verify`` on it again, binds it to
``Cluster.cpu(n)`` and runs it on fresh random inputs (never zeros) over back-to-back calls:
outputs must equal the float64 reference, inputs must be left unchanged, and every output
element must be written (the second call writes into buffers pre-filled with garbage).
"""

import numpy as np
import pytest

from purlin.errors import ExecutionError, PlanError, SpecError
from purlin.runtime import Cluster
from purlin.snac import verify
from purlin.spec import STANDARD, Collective, copy, reduce, reference, standard

STRATEGIES = ["direct-push", "direct-pull", "two-phase", "ring"]
REDUCING = [name for name in STANDARD if standard(name, 2).op.is_reduce]
COPYING = [name for name in STANDARD if name not in REDUCING]
ONE_SHOT = (1, 1)       # chunks, lanes
PIPELINED = (3, 2)
CHUNK = 5               # elements per chunk name: 3 pieces of 2, 2, 1


def cases():
    for name in STANDARD:
        for strategy in STRATEGIES:
            if strategy == "two-phase" and name not in REDUCING:
                continue
            for n in range(2, 9):
                yield pytest.param(name, strategy, n, ONE_SHOT, id=f"{name}-{strategy}-n{n}-1x1")
            for n in (2, 5, 8):
                yield pytest.param(name, strategy, n, PIPELINED,
                                   id=f"{name}-{strategy}-n{n}-3x2")


# -- helpers -----------------------------------------------------------------------------------


def fresh(rng, length, dtype):
    """Random values of both signs, bounded away from zero, so a lost or stale chunk shows."""
    sign = rng.choice([-1, 1], length)
    if np.dtype(dtype).kind == "i":
        return (rng.integers(1, 100, length) * sign).astype(dtype)
    return (rng.uniform(0.5, 4.0, length) * sign).astype(dtype)


def garbage(length, dtype):
    """What an output buffer holds before the call: nothing a correct run could produce."""
    return np.full(length, -12345 if np.dtype(dtype).kind == "i" else np.nan, dtype=dtype)


def tolerance(dtype, n, op):
    """(rtol, atol) for comparing with the float64 reference; copies and max/min are exact."""
    if op in ("copy", "max", "min") or np.dtype(dtype).kind == "i":
        return 0.0, 0.0
    if np.dtype(dtype) == np.float16:
        # up to n - 1 partial sums of magnitude <= 4n, each rounded to half an ulp of 2^-10
        return 0.0, n * 4 * n * 2.0 ** -11
    if np.dtype(dtype) == np.float32:
        return 1e-5, 1e-5 * n
    return 1e-12, 1e-12 * n


def op_of(collective):
    return collective.op.reduce_op if collective.op.is_reduce else "copy"


def run_and_check(collective, strategy, *, chunks=1, lanes=1, dtype="float32", chunk_sizes=None,
                  calls=2, seed=0):
    """Bind, verify, run ``calls`` back-to-back calls on fresh inputs; return the binding."""
    n = collective.nranks
    chunk_sizes = chunk_sizes or {name: CHUNK for name in collective.input.names()}
    bound = Cluster.cpu(n).bind(collective, strategy, chunk_sizes=chunk_sizes, dtype=dtype,
                                chunks=chunks, lanes=lanes, timeout=10.0)
    schedule = bound.schedule
    assert (schedule.strategy, schedule.chunks, schedule.lanes) == (strategy, chunks, lanes)
    report = verify(schedule)
    assert report.ok, str(report)
    sizing = schedule.sizing
    rtol, atol = tolerance(dtype, n, op_of(collective))
    rng = np.random.default_rng(seed)
    previous = None
    for call in range(calls):
        inputs = [fresh(rng, sizing.input_count(r), dtype) for r in range(n)]
        if previous is not None:  # back-to-back calls really see different data
            assert not all(np.array_equal(a, b) for a, b in zip(inputs, previous) if a.size)
        kept = [x.copy() for x in inputs]
        out = None
        if call % 2:  # odd calls write into caller-given buffers full of garbage
            out = [garbage(sizing.output_count(r), dtype) for r in range(n)]
        got = bound(inputs, out=out)
        want = reference(sizing, inputs)
        for r in range(n):
            where = f"{schedule.title()}: call {call}, rank {r}"
            np.testing.assert_array_equal(inputs[r], kept[r], err_msg=f"input changed: {where}")
            assert got[r].dtype == np.dtype(dtype), where
            assert got[r].shape == (sizing.output_count(r),), where
            if out is not None:
                assert got[r] is out[r], where
            np.testing.assert_allclose(got[r].astype(np.float64), want[r], rtol=rtol, atol=atol,
                                       err_msg=where)
        previous = inputs
    return bound


# -- the grid ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name, strategy, n, chunking", list(cases()))
def test_standard_collective_matches_reference(name, strategy, n, chunking):
    chunks, lanes = chunking
    root = n - 1 if name in ("broadcast", "reduce", "gather", "scatter") else 0
    run_and_check(standard(name, n, root=root), strategy, chunks=chunks, lanes=lanes,
                  seed=n * 100 + chunks)


@pytest.mark.parametrize("name", COPYING)
@pytest.mark.parametrize("n", [2, 5])
def test_two_phase_refuses_copy_collectives(name, n):
    with pytest.raises(PlanError, match=r"two-phase .*copy collective"):
        Cluster.cpu(n).bind(standard(name, n), "two-phase", count=n * 4)


def test_grid_covers_every_standard_collective_and_strategy():
    covered = {(p.values[0], p.values[1]) for p in cases()}
    assert {name for name, _ in covered} == set(STANDARD)
    assert {s for _, s in covered} == set(STRATEGIES)
    assert len(covered) == len(REDUCING) * 4 + len(COPYING) * 3


# -- dtypes and reduce ops ---------------------------------------------------------------------

DTYPES = ["float16", "float32", "float64", "int32"]


def dtype_cases():
    for name in STANDARD:
        for strategy in STRATEGIES:
            if strategy != "two-phase" or name in REDUCING:
                for dtype in DTYPES:
                    yield name, strategy, dtype


@pytest.mark.parametrize("name, strategy, dtype", list(dtype_cases()))
def test_dtypes(name, strategy, dtype):
    run_and_check(standard(name, 4, root=2), strategy, chunks=3, lanes=2, dtype=dtype,
                  seed=len(name) + DTYPES.index(dtype))


def all_reduce_op_cases():
    for op in ("sum", "max", "min", "avg"):
        for dtype in DTYPES:
            if dtype == "int32" and op == "avg":
                continue
            for strategy in STRATEGIES:
                yield op, dtype, strategy


@pytest.mark.parametrize("op, dtype, strategy", list(all_reduce_op_cases()))
def test_all_reduce_every_op(op, dtype, strategy):
    run_and_check(standard("all-reduce", 5, op=op), strategy, chunks=2, lanes=2, dtype=dtype,
                  calls=3, seed=7)


@pytest.mark.parametrize("name", ["reduce-scatter", "reduce"])
@pytest.mark.parametrize("op", ["max", "min", "avg"])
def test_other_reductions_every_op(name, op):
    for strategy in STRATEGIES:
        run_and_check(standard(name, 3, root=1, op=op), strategy, dtype="float64", seed=3)


def test_avg_refuses_integers():
    with pytest.raises(SpecError, match="avg needs a floating-point dtype"):
        Cluster.cpu(2).bind(standard("all-reduce", 2, op="avg"), count=4, dtype="int32")


# -- uneven sizes and custom collectives -------------------------------------------------------


def uneven_sizes(collective, seed):
    """Chunk sizes 0..9 with at least one empty chunk and at least one of 7 or more."""
    rng = np.random.default_rng(seed)
    names = list(collective.input.names())
    sizes = {name: int(rng.integers(1, 10)) for name in names}
    sizes[names[1]] = 0
    sizes[names[-1]] = 7
    return sizes


@pytest.mark.parametrize("strategy", ["direct-push", "direct-pull", "ring"])
@pytest.mark.parametrize("n, chunks, lanes", [(2, 1, 1), (5, 3, 2), (8, 2, 3)])
def test_all_to_all_v(strategy, n, chunks, lanes):
    coll = standard("all-to-all", n)
    sizes = uneven_sizes(coll, seed=n)
    bound = run_and_check(coll, strategy, chunks=chunks, lanes=lanes, chunk_sizes=sizes,
                          dtype="float64", calls=3, seed=n)
    sizing = bound.schedule.sizing
    assert len({c for _, c in sizing.chunks}) > 1  # uneven
    assert [sizing.output_count(r) for r in range(n)] == [
        sum(sizes[(j, r)] for j in range(n)) for r in range(n)]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_reduce_scatter_v(strategy):
    coll = standard("reduce-scatter", 5)
    run_and_check(coll, strategy, chunks=2, lanes=2, chunk_sizes=uneven_sizes(coll, seed=11),
                  dtype="float64", seed=11)


def interleaved_all_gather(n):
    """Rank r holds (r, 0), (r, 1); everyone ends with all first halves, then all second."""
    return Collective([[(r, 0), (r, 1)] for r in range(n)],
                      [[(r, k) for k in (0, 1) for r in range(n)]] * n, copy,
                      name="interleaved-all-gather")


def reduce_to_two_roots(n, op="sum"):
    """Everyone holds x; ranks 0 and n - 1 end with the reduction."""
    return Collective([["x"]] * n, [["x"] if r in (0, n - 1) else [] for r in range(n)],
                      reduce(op), name="reduce-to-two")


def permuted_all_gather(n, seed=0):
    """An all-gather where every rank wants the chunks in its own order."""
    rng = np.random.default_rng(seed)
    return Collective([[r] for r in range(n)],
                      [[int(k) for k in rng.permutation(n)] for _ in range(n)], copy,
                      name="permuted-all-gather")


@pytest.mark.parametrize("strategy", ["direct-push", "direct-pull", "ring"])
@pytest.mark.parametrize("n, chunks, lanes", [(2, 1, 1), (3, 3, 2), (6, 1, 1), (7, 2, 2)])
def test_interleaved_all_gather(strategy, n, chunks, lanes):
    coll = interleaved_all_gather(n)
    run_and_check(coll, strategy, chunks=chunks, lanes=lanes, seed=n)
    # the layout really interleaves: rank 1's second half sits in the second half of the output
    assert coll.output[0].index((1, 1)) == n + 1


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("op", ["sum", "max", "avg"])
@pytest.mark.parametrize("n, chunks, lanes", [(2, 1, 1), (4, 3, 2), (7, 2, 1)])
def test_reduce_to_two_roots(strategy, op, n, chunks, lanes):
    run_and_check(reduce_to_two_roots(n, op), strategy, chunks=chunks, lanes=lanes,
                  dtype="float64", seed=n)


@pytest.mark.parametrize("strategy", ["direct-push", "direct-pull", "ring"])
@pytest.mark.parametrize("n, chunks, lanes", [(3, 1, 1), (5, 3, 2), (8, 2, 2)])
def test_permuted_all_gather(strategy, n, chunks, lanes):
    coll = permuted_all_gather(n, seed=n)
    assert any(list(row) != list(range(n)) for row in coll.output)
    run_and_check(coll, strategy, chunks=chunks, lanes=lanes, seed=n)


# -- buffers the caller passes -----------------------------------------------------------------


@pytest.fixture
def all_reduce_2():
    return Cluster.cpu(2).bind(standard("all-reduce", 2), count=4, dtype="float64")


def test_in_place_is_refused(all_reduce_2):
    x = [np.arange(1.0, 5.0), np.arange(5.0, 9.0)]
    kept = [a.copy() for a in x]
    with pytest.raises(ExecutionError, match=r"output of rank 1 shares memory with an input: "
                                             r"in-place collectives are not supported"):
        all_reduce_2(x, out=[np.empty(4), x[1]])
    np.testing.assert_array_equal(x[1], kept[1])


def test_in_place_through_a_view_is_refused(all_reduce_2):
    base = np.arange(1.0, 9.0)
    x = [base[:4], base[4:]]
    with pytest.raises(ExecutionError, match="output of rank 0 shares memory with an input"):
        all_reduce_2(x, out=[base[2:6], np.empty(4)])   # overlaps both inputs partly


def test_in_place_with_a_non_contiguous_input_is_refused(all_reduce_2):
    # reshape(-1) of a Fortran-ordered 2-D array is a copy: the check must see the original
    a = np.asfortranarray(np.arange(1.0, 5.0).reshape(2, 2))
    with pytest.raises(ExecutionError, match="in-place"):
        all_reduce_2([a, np.ones(4)], out=[a, np.empty(4)])


def test_non_contiguous_outputs_are_written(all_reduce_2):
    x = [np.arange(1.0, 5.0), np.full(4, 10.0)]
    strided = np.full(8, np.nan)[::2]
    transposed = np.full((2, 2), np.nan).T
    got = all_reduce_2(x, out=[strided, transposed])
    np.testing.assert_array_equal(strided, [11.0, 12.0, 13.0, 14.0])
    np.testing.assert_array_equal(transposed, [[11.0, 12.0], [13.0, 14.0]])
    assert got[0] is strided and got[1] is transposed


def test_buffers_of_the_wrong_size_or_dtype_are_refused(all_reduce_2):
    x = [np.ones(4), np.ones(4)]
    with pytest.raises(ExecutionError, match="input of rank 1 has 3 elements"):
        all_reduce_2([np.ones(4), np.ones(3)])
    with pytest.raises(ExecutionError, match="input of rank 0 is float32"):
        all_reduce_2([np.ones(4, np.float32), np.ones(4)])
    with pytest.raises(ExecutionError, match="output of rank 1 must hold 4 float64"):
        all_reduce_2(x, out=[np.empty(4), np.empty(5)])
    with pytest.raises(ExecutionError, match="needs 2 outputs, got 1"):
        all_reduce_2(x, out=[np.empty(4)])
    # the refusals above left the binding usable
    np.testing.assert_array_equal(all_reduce_2(x)[1], np.full(4, 2.0))
