"""Variable-length collectives on the cpu datapath: every collective x strategy x dtype against
the unpadded reference, counts of zero and at capacity, and bad counts ending in CountError."""

from __future__ import annotations

import numpy as np
import pytest

from purlin import Cluster, Collective
from purlin.errors import CountError, PlanError, SpecError
from purlin.snac.planner import plan
from purlin.spec import collectives
from purlin.spec.dtypes import fp8_decode, fp8_encode
from purlin.spec.varlen import VarLen, all_gather_v, all_to_all_v, reduce_scatter_v

N, CAP, ROW = 3, 5, 2
BUILDERS = {"all-gather-v": all_gather_v, "reduce-scatter-v": reduce_scatter_v,
            "all-to-all-v": all_to_all_v}
STRATEGIES = ("direct-push", "direct-pull", "two-phase", "push-pull", "ring")
DTYPES = ("float16", "float32", "float64", "int32", "int64", "float8_e4m3fn")


def _plans(kind, strategy) -> bool:
    v = BUILDERS[kind](N, CAP, row=ROW)
    try:
        plan(v.collective, strategy, sizing=v.sized("float32"))
    except PlanError:
        return False
    return True


CASES = [(k, s) for k in BUILDERS for s in STRATEGIES if _plans(k, s)]


def test_every_collective_plans_with_several_strategies():
    for kind in BUILDERS:
        assert sum(1 for k, _ in CASES if k == kind) >= 2, kind


def _counts(v: VarLen, rng, style: str):
    if style == "zero":
        return [0] * len(v.names)
    if style == "full":
        return [v.capacity] * len(v.names)
    c = rng.integers(0, v.capacity + 1, len(v.names))
    c[0], c[-1] = 0, v.capacity  # one empty chunk, one full one
    return c.tolist()


def _inputs(v: VarLen, counts, dtype, rng):
    checked = v.counts(counts)
    out = []
    for r in range(v.nranks):
        n = sum(v.input_counts(r, checked)) * v.row
        vals = rng.integers(-3, 4, n).astype(np.float64)
        out.append(vals)
    return out


def _as_dtype(values, dtype):
    if dtype.startswith("float8"):
        return fp8_encode(values, dtype)
    return values.astype(dtype)


def _decoded(x, dtype):
    return fp8_decode(x, dtype).astype(np.float64) if dtype.startswith("float8") else \
        np.asarray(x, dtype=np.float64)


@pytest.mark.parametrize("kind,strategy", CASES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("style", ["mixed", "zero", "full"])
def test_cpu_matches_reference(kind, strategy, dtype, style):
    rng = np.random.default_rng(hash((kind, strategy, dtype, style)) % 2**32)
    v = BUILDERS[kind](N, CAP, row=ROW)
    bound = Cluster.cpu(N).bind(v, strategy, dtype=dtype)
    counts = _counts(v, rng, style)
    values = _inputs(v, counts, dtype, rng)
    outs = bound([_as_dtype(x, dtype) for x in values], counts)
    want = v.reference(values, counts)
    for r in range(N):
        got = _decoded(outs[r], dtype)
        assert got.shape == want[r].shape, (r, got.shape, want[r].shape)
        np.testing.assert_array_equal(got, want[r])
        if style == "zero":
            assert got.size == 0


def test_all_to_all_v_counts_are_torch_split_sizes():
    v = all_to_all_v(2, capacity=4)
    bound = Cluster.cpu(2).bind(v, dtype="float32")
    ins = [np.array([1, 2, 3], np.float32), np.array([4, 5, 6, 7], np.float32)]
    outs = bound(ins, [[1, 2], [4, 0]])  # rank 0 sends 1 to itself, 2 to rank 1
    assert outs[0].tolist() == [1, 4, 5, 6, 7]
    assert outs[1].tolist() == [2, 3]


def test_torch_tensors_in_give_tensors_out():
    torch = pytest.importorskip("torch")
    v = all_gather_v(2, capacity=3, row=2)
    bound = Cluster.cpu(2).bind(v, dtype="float32")
    outs = bound([torch.ones(2, 2), torch.zeros(0, 2)], torch.tensor([2, 0]))
    assert isinstance(outs[1], torch.Tensor) and outs[1].tolist() == [1.0] * 4


def test_launch_returns_capacity_buffers_and_counts():
    torch = pytest.importorskip("torch")
    v = all_to_all_v(2, capacity=3)
    bound = Cluster.cpu(2).bind(v, dtype="float32")
    # inputs of a fixed size (a graph's buffers): only the counts' rows are read
    ins = [torch.arange(6.0), torch.arange(10.0, 16.0)]
    outs, got = bound.launch(ins, torch.tensor([2, 1, 0, 3]))
    assert [o.numel() for o in outs] == [6, 6]
    assert got[0].tolist() == [2, 0] and got[1].tolist() == [1, 3]
    assert outs[0][:2].tolist() == [0.0, 1.0]
    assert outs[1][:4].tolist() == [2.0, 10.0, 11.0, 12.0]


@pytest.mark.parametrize("counts,match", [
    ([1, -1, 0, 0], r"rank 0 chunk \(0,1\): count -1 is negative"),
    ([1, 0, 6, 0], r"rank 1 chunk \(1,0\): count 6 is over the capacity of 5 rows"),
    ([1, 0, 0], r"takes 4 counts, one per chunk \(\(0,0\), \(0,1\), \(1,0\), \(1,1\)\), got 3"),
    ([1, 0, 0, 0, 0], r"takes 4 counts.*got 5"),
    ([1.5, 0, 0, 0], r"count 1.5 is not a whole number"),
])
def test_bad_counts_are_refused(counts, match):
    v = all_to_all_v(2, capacity=5)
    bound = Cluster.cpu(2).bind(v, dtype="float32")
    with pytest.raises(CountError, match=match):
        bound([np.zeros(1, np.float32), np.zeros(0, np.float32)], counts)


def test_reduce_scatter_v_bad_count_names_every_rank():
    v = reduce_scatter_v(3, capacity=2)
    with pytest.raises(CountError, match=r"every rank chunk 1: count 3 is over the capacity"):
        v.counts([0, 3, 0])


def test_packed_input_of_the_wrong_length_is_refused():
    v = all_gather_v(2, capacity=4)
    bound = Cluster.cpu(2).bind(v, dtype="float32")
    with pytest.raises(CountError, match=r"input of rank 1 holds 3 elements; its counts \[2\]"):
        bound([np.zeros(1, np.float32), np.zeros(3, np.float32)], [1, 2])


def test_counts_by_name():
    v = all_to_all_v(2, capacity=2)
    assert v.counts({(0, 0): 1, (0, 1): 2, (1, 0): 0, (1, 1): 2}) == (1, 2, 0, 2)
    with pytest.raises(CountError, match=r"no count for chunk \(1, 1\)|no count for chunk"):
        v.counts({(0, 0): 1})


def test_spec_refusals():
    with pytest.raises(SpecError, match="capacity must be a whole number >= 1"):
        all_gather_v(2, capacity=0)
    # a rank reducing a chunk it does not hold could not know its count
    with pytest.raises(SpecError, match="without holding it in its input"):
        VarLen(Collective([["x"], ["x"], []], [[], [], ["x"]], "sum"), 4)
    assert VarLen(collectives.reduce(3, root=0), 4).nranks == 3


def test_plan_is_the_padded_collective():
    v = all_to_all_v(4, capacity=7)
    head, slot = v.slot("float32")
    assert (head, slot) == (4, 12)  # a 16-byte header, 7 rows, rounded to 16 bytes
    sizing = v.sized("float32")
    assert {c for _, c in sizing.chunks} == {slot}
    # reductions carry no header: the receiver holds the counts
    assert reduce_scatter_v(2, 4).slot("float32") == (0, 4)


def test_auto_strategy_binds_at_capacity():
    v = all_to_all_v(4, capacity=16, row=8)
    bound = Cluster.cpu(4).bind(v, "auto", dtype="float32")
    counts = [[16, 0, 3, 1]] * 4
    ins = [np.arange(20 * 8, dtype=np.float32) + 1000 * r for r in range(4)]
    want = v.reference(ins, counts)
    assert all(np.array_equal(o, w) for o, w in zip(bound(ins, counts), want))


def test_moe_example_on_the_cpu_datapath():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / "moe.py"
    spec = importlib.util.spec_from_file_location("bench_moe", path)
    moe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(moe)
    row = moe.run(ranks=2, tokens=16, hidden=16, ffn=32, experts=4, k=2, datapath="cpu",
                  repeats=1, log=None)
    assert row["status"] == "ok" and row["max_abs_error"] < 1e-4, row
    assert sum(row["rows_per_rank_received"]) == 2 * 16 * 2  # every (token, expert) row


def test_a_varlen_takes_no_message_size():
    with pytest.raises(SpecError, match=r"all-gather-v is sized by its capacity \(4 rows of 1\)"):
        Cluster.cpu(2).bind(all_gather_v(2, 4), count=8)
