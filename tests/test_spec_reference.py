"""reference() against direct numpy formulas, for every standard collective and reduce op."""

import numpy as np
import pytest

from purlin.spec import Collective, Layout, collectives, copy, reduce, reference

NS = [2, 3, 5, 8]
OPS = ["sum", "max", "min", "avg"]
NUMPY_OP = {"sum": np.sum, "max": np.max, "min": np.min, "avg": np.mean}
INPUT_DTYPES = [np.float64, np.float32, np.float16, np.int32]
CHUNK = 3  # elements per chunk


def nonzero(rng, length, dtype=np.float64):
    """Random values of both signs, bounded away from zero (so a lost chunk cannot hide)."""
    if np.issubdtype(dtype, np.integer):
        values = rng.integers(1, 100, length) * rng.choice([-1, 1], length)
    else:
        values = rng.uniform(0.5, 4.0, length) * rng.choice([-1.0, 1.0], length)
    return values.astype(dtype)


def inputs_for(n, per_rank_chunks, seed, dtype=np.float64):
    rng = np.random.default_rng(seed)
    return [nonzero(rng, k * CHUNK, dtype) for k in per_rank_chunks]


def block(x, k):
    """The k-th CHUNK-sized block of a flat array."""
    return np.asarray(x, dtype=np.float64)[k * CHUNK:(k + 1) * CHUNK]


def assert_outputs(got, want):
    assert len(got) == len(want)
    for rank, (g, w) in enumerate(zip(got, want)):
        assert g.dtype == np.float64, f"rank {rank}"
        np.testing.assert_allclose(g, w, rtol=1e-12, atol=0, err_msg=f"rank {rank}")


EMPTY = np.zeros(0)


# -- reducing collectives ------------------------------------------------------------------------


@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("op", OPS)
def test_all_reduce(n, op):
    x = inputs_for(n, [n] * n, seed=n)
    total = NUMPY_OP[op](np.stack(x).astype(np.float64), axis=0)
    assert_outputs(reference(collectives.all_reduce(n, op), x), [total] * n)


@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("op", OPS)
def test_reduce_scatter(n, op):
    x = inputs_for(n, [n] * n, seed=10 + n)
    total = NUMPY_OP[op](np.stack(x), axis=0)
    want = [block(total, r) for r in range(n)]
    assert_outputs(reference(collectives.reduce_scatter(n, op), x), want)


@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("op", OPS)
def test_reduce_every_root(n, op):
    x = inputs_for(n, [1] * n, seed=20 + n)
    total = NUMPY_OP[op](np.stack(x), axis=0)
    for root in range(n):
        want = [total if r == root else EMPTY for r in range(n)]
        assert_outputs(reference(collectives.reduce(n, root, op), x), want)


def test_reduce_ops_on_a_tiny_case_by_hand():
    x = [np.array([1.0, -2.0]), np.array([3.0, 5.0]), np.array([-4.0, 0.5])]
    expected = {
        "sum": [0.0, 3.5],
        "max": [3.0, 5.0],
        "min": [-4.0, -2.0],
        "avg": [0.0, 3.5 / 3],
    }
    for op, want in expected.items():
        out = reference(collectives.reduce(3, root=2, op=op), x)
        assert out[2].tolist() == pytest.approx(want), op
        assert out[0].size == out[1].size == 0


# -- copying collectives -------------------------------------------------------------------------


@pytest.mark.parametrize("n", NS)
def test_all_gather(n):
    x = inputs_for(n, [1] * n, seed=30 + n)
    assert_outputs(reference(collectives.all_gather(n), x), [np.concatenate(x)] * n)


@pytest.mark.parametrize("n", NS)
def test_all_to_all(n):
    x = inputs_for(n, [n] * n, seed=40 + n)
    # rank r receives block r of every rank, in rank order: a transpose of the (src, dst) blocks
    as_blocks = np.stack(x).reshape(n, n, CHUNK)
    want = [as_blocks[:, r, :].ravel() for r in range(n)]
    assert_outputs(reference(collectives.all_to_all(n), x), want)


@pytest.mark.parametrize("n", NS)
def test_broadcast_every_root(n):
    for root in range(n):
        x = [nonzero(np.random.default_rng(root), CHUNK) if r == root else EMPTY
             for r in range(n)]
        assert_outputs(reference(collectives.broadcast(n, root), x), [x[root]] * n)


@pytest.mark.parametrize("n", NS)
def test_gather_every_root(n):
    x = inputs_for(n, [1] * n, seed=50 + n)
    for root in range(n):
        want = [np.concatenate(x) if r == root else EMPTY for r in range(n)]
        assert_outputs(reference(collectives.gather(n, root), x), want)


@pytest.mark.parametrize("n", NS)
def test_scatter_every_root(n):
    for root in range(n):
        rng = np.random.default_rng(60 + root)
        x = [nonzero(rng, n * CHUNK) if r == root else EMPTY for r in range(n)]
        want = [block(x[root], r) for r in range(n)]
        assert_outputs(reference(collectives.scatter(n, root), x), want)


# -- input dtypes and shapes ---------------------------------------------------------------------


@pytest.mark.parametrize("dtype", INPUT_DTYPES)
@pytest.mark.parametrize("op", OPS)
def test_inputs_of_any_dtype_are_reduced_in_float64(dtype, op):
    n = 4
    x = inputs_for(n, [n] * n, seed=70, dtype=dtype)
    total = NUMPY_OP[op](np.stack([xi.astype(np.float64) for xi in x]), axis=0)
    assert_outputs(reference(collectives.all_reduce(n, op), x), [total] * n)


def test_avg_of_integers_is_not_truncated():
    out = reference(collectives.all_reduce(2, "avg"), [np.array([1, 2], np.int32),
                                                         np.array([2, 5], np.int32)])
    assert out[0].tolist() == [1.5, 3.5]


def test_multidimensional_inputs_are_flattened():
    x = [np.arange(1.0, 7.0).reshape(2, 3), np.arange(7.0, 13.0).reshape(3, 2)]
    out = reference(collectives.all_gather(2), x)
    assert out[1].tolist() == list(np.arange(1.0, 13.0))


def test_reference_does_not_alias_its_inputs():
    x = [np.array([1.0, 2.0]), np.array([3.0, 4.0])]
    out = reference(collectives.all_gather(2), x)
    out[0][:] = -1.0
    assert x[0].tolist() == [1.0, 2.0] and x[1].tolist() == [3.0, 4.0]


# -- uneven chunks through a Sizing (all-to-all-v) -----------------------------------------------


def a2av_size(src, dst):
    return 1 + (2 * src + 3 * dst) % 4  # 1..4 elements, not symmetric


@pytest.mark.parametrize("n", [2, 3, 5])
def test_all_to_all_v(n):
    coll = collectives.all_to_all(n)
    sizing = coll.sized(chunk_sizes=lambda name: a2av_size(*name))
    rng = np.random.default_rng(n)
    blocks = {(s, d): nonzero(rng, a2av_size(s, d)) for s in range(n) for d in range(n)}
    x = [np.concatenate([blocks[s, d] for d in range(n)]) for s in range(n)]
    want = [np.concatenate([blocks[s, r] for s in range(n)]) for r in range(n)]
    assert_outputs(reference(sizing, x), want)


def test_uneven_reduce_scatter_from_a_mapping():
    coll = collectives.reduce_scatter(3, "max")
    sizes = {0: 1, 1: 4, 2: 2}
    sizing = coll.sized(chunk_sizes=sizes)
    rng = np.random.default_rng(5)
    x = [nonzero(rng, 7) for _ in range(3)]
    total = np.max(np.stack(x), axis=0)
    assert_outputs(reference(sizing, x), [total[0:1], total[1:5], total[5:7]])


def test_uneven_custom_copy_with_a_name_used_twice():
    # rank 1 wants b then a then b again, from chunks of different sizes
    coll = Collective(Layout([["a", "b"], []]), Layout([[], ["b", "a", "b"]]), copy)
    sizing = coll.sized(chunk_sizes={"a": 2, "b": 3})
    x = [np.array([1.0, 2.0, 3.0, 4.0, 5.0]), np.zeros(0)]
    out = reference(sizing, x)
    assert out[1].tolist() == [3.0, 4.0, 5.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert out[0].size == 0


def test_custom_reduce_to_two_roots():
    coll = Collective([["x"]] * 4, [["x"], [], [], ["x"]], reduce.sum, name="reduce-to-two")
    x = [np.full(2, float(r + 1)) for r in range(4)]
    out = reference(coll, x)
    assert out[0].tolist() == out[3].tolist() == [10.0, 10.0]
    assert out[1].size == out[2].size == 0
