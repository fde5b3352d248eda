"""Sizing: message size -> chunk counts, buffer counts and offsets; nbytes vs count."""

import pytest

from purlin.spec import DTYPES, Collective, Sizing, collectives, copy, dtype, size

NS = [2, 3, 4, 8]

# chunks in the largest per-rank buffer (nccl-tests' message size), derived from ARCHITECTURE.md:
# all-gather/gather outputs, reduce-scatter/scatter/all-reduce/all-to-all buffers hold n chunks;
# broadcast and reduce move one chunk.
CHUNKS_IN_MESSAGE = {
    "all-gather": lambda n: n,
    "reduce-scatter": lambda n: n,
    "all-reduce": lambda n: n,
    "all-to-all": lambda n: n,
    "broadcast": lambda n: 1,
    "reduce": lambda n: 1,
    "gather": lambda n: n,
    "scatter": lambda n: n,
}


@pytest.mark.parametrize("name", sorted(CHUNKS_IN_MESSAGE))
@pytest.mark.parametrize("n", NS)
def test_even_chunk_count_is_message_over_chunks_in_largest_buffer(name, n):
    count = 840  # divisible by 1..8
    s = collectives.standard(name, n, root=n - 1).sized(count)
    each = count // CHUNKS_IN_MESSAGE[name](n)
    assert {c for _, c in s.chunks} == {each}
    assert s.message_count == count
    assert s.message_bytes == count * 4  # float32 by default


@pytest.mark.parametrize("n", NS)
def test_all_gather_offsets_and_counts(n):
    s = collectives.all_gather(n).sized(n * 16)
    for r in range(n):
        assert s.input_count(r) == 16
        assert s.input_offset(r, 0) == 0
        assert s.output_count(r) == n * 16
        assert [s.output_offset(r, p) for p in range(n)] == [16 * p for p in range(n)]


@pytest.mark.parametrize("n", NS)
def test_scatter_offsets_and_counts(n):
    root = n // 2
    s = collectives.scatter(n, root=root).sized(n * 5)
    for r in range(n):
        assert s.input_count(r) == (n * 5 if r == root else 0)
        assert s.output_count(r) == 5
        assert s.output_offset(r, 0) == 0
    assert [s.input_offset(root, p) for p in range(n)] == [5 * p for p in range(n)]


@pytest.mark.parametrize("dt", sorted(DTYPES))
@pytest.mark.parametrize("nbytes", [0, 64, 1 << 20])
def test_nbytes_is_count_times_itemsize(dt, nbytes):
    coll = collectives.all_reduce(4, "max")
    itemsize = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8,
                "int32": 4, "int64": 8, "float8_e4m3fn": 1, "float8_e5m2": 1}[dt]
    by_bytes = coll.sized(nbytes=nbytes, dtype=dt)
    by_count = coll.sized(nbytes // itemsize, dtype=dt)
    assert by_bytes == by_count
    assert by_bytes.message_bytes == nbytes
    assert by_bytes.message_count == nbytes // itemsize
    assert by_bytes.dtype == dtype(dt)


def test_module_size_function_equals_the_method():
    coll = collectives.gather(3, root=1)
    assert size(coll, 12, dtype="fp16") == coll.sized(12, dtype="float16")


def test_zero_count_gives_empty_chunks():
    s = collectives.all_to_all(3).sized(0)
    assert [c for _, c in s.chunks] == [0] * 9
    assert s.message_bytes == 0


def test_all_to_all_v_offsets():
    n = 3
    sizes = {(s, d): 10 * s + d + 1 for s in range(n) for d in range(n)}
    v = collectives.all_to_all(n).sized(chunk_sizes=sizes, dtype="int64")
    assert len({c for _, c in v.chunks}) > 1
    for s in range(n):
        # rank s's send buffer: (s,0), (s,1), (s,2) back to back
        assert v.input_count(s) == sum(sizes[s, d] for d in range(n))
        assert [v.input_offset(s, d) for d in range(n)] == [
            sum(sizes[s, e] for e in range(d)) for d in range(n)]
    for r in range(n):
        # rank r's receive buffer: (0,r), (1,r), (2,r) back to back
        assert v.output_count(r) == sum(sizes[s, r] for s in range(n))
        assert [v.output_offset(r, s) for s in range(n)] == [
            sum(sizes[t, r] for t in range(s)) for s in range(n)]
    biggest = max(max(v.input_count(r), v.output_count(r)) for r in range(n))
    assert v.message_count == biggest == 66  # rank 2 sends 21 + 22 + 23
    assert v.message_bytes == biggest * 8


def test_chunk_sizes_as_a_function_and_as_a_mapping_agree():
    coll = collectives.all_gather(4)
    f = coll.sized(chunk_sizes=lambda k: k + 1)
    m = coll.sized(chunk_sizes={0: 1, 1: 2, 2: 3, 3: 4})
    assert f == m
    assert f.chunk_count(2) == 3
    assert f.output_offset(0, 3) == 1 + 2 + 3


def test_chunk_sizes_cover_input_names_that_no_output_uses():
    coll = Collective([["a", "spare"], []], [[], ["a"]], copy)
    s = coll.sized(chunk_sizes={"a": 2, "spare": 5})
    assert s.input_count(0) == 7 and s.output_count(1) == 2
    assert s.message_count == 7


def test_custom_collective_message_uses_the_widest_buffer():
    # rank 1 ends with three chunks: the widest buffer, so 12 elements -> 4 per chunk
    coll = Collective([["a"], ["b", "c"]], [["a"], ["c", "b", "a"]], copy)
    s = coll.sized(12)
    assert {c for _, c in s.chunks} == {4}
    assert s.output_count(1) == 12 and s.input_count(1) == 8


def test_repr_states_the_sizes():
    assert repr(collectives.all_gather(4).sized(nbytes=1024)) == (
        "Sizing(all-gather, float32, 4 chunks of 64 each, message 1024 B)")
    assert "uneven" in repr(collectives.all_gather(2).sized(chunk_sizes={0: 1, 1: 2}))


def test_sizing_is_frozen():
    s = collectives.all_gather(2).sized(4)
    assert isinstance(s, Sizing)
    with pytest.raises(AttributeError):
        s.dtype = dtype("int32")


# -- sizes that do not divide: as even as it can, the first count % k chunks one more ------------


@pytest.mark.parametrize("name", sorted(CHUNKS_IN_MESSAGE))
@pytest.mark.parametrize("n", [2, 3, 5, 8])
@pytest.mark.parametrize("count", [1, 7, 10, 841])
def test_any_count_splits_as_evenly_as_it_can(name, n, count):
    coll = collectives.standard(name, n, root=n - 1)
    s = coll.sized(count)
    assert s.message_count == count  # the largest buffer is the message, as with even counts
    k = CHUNKS_IN_MESSAGE[name](n)
    counts = [c for _, c in s.chunks]
    assert max(counts) - min(counts) <= 1
    widest = max(list(coll.input) + list(coll.output), key=len)
    assert [s.chunk_count(x) for x in widest] == (
        [count // k + 1] * (count % k) + [count // k] * (k - count % k))


def test_the_issue_example_plans_a_72_rank_all_reduce_of_1_mib():
    s = collectives.all_reduce(72).sized(nbytes=1 << 20)
    assert [s.chunk_count(i) for i in (0, 63, 64, 71)] == [3641, 3641, 3640, 3640]  # 262144 = 72 * 3640 + 64
    assert s.message_bytes == 1 << 20
    assert all(s.input_count(r) == s.output_count(r) == 1 << 18 for r in range(72))


def test_uneven_split_offsets_follow_the_counts():
    s = collectives.all_gather(3).sized(10)
    assert [s.chunk_count(r) for r in range(3)] == [4, 3, 3]
    assert [s.output_offset(0, p) for p in range(3)] == [0, 4, 7]
    assert [s.input_count(r) for r in range(3)] == [4, 3, 3]


def test_explicit_chunk_sizes_are_kept_as_given():
    s = collectives.all_gather(3).sized(chunk_sizes={0: 1, 1: 5, 2: 2})
    assert [c for _, c in s.chunks] == [1, 5, 2]


def test_a_repeated_output_name_that_would_outgrow_the_message_is_refused():
    from purlin.errors import SpecError

    coll = Collective([["a", "b"], ["c"]], [["a", "a"], ["b", "c"]], copy)
    with pytest.raises(SpecError, match="3 elements do not divide into the 2 chunks"):
        coll.sized(3)
    assert coll.sized(4).message_count == 4


# -- the cpu datapath computes uneven splits right ----------------------------------------------


@pytest.mark.parametrize("name, n, count, strategy, chunks", [
    ("all-gather", 3, 10, "ring", 2),
    ("all-gather", 3, 10, "direct-pull", 1),
    ("reduce-scatter", 4, 10, "two-phase", 2),
    ("all-to-all", 3, 10, "direct-push", 1),
    ("all-reduce", 5, 13, "ring", 2),
    pytest.param("all-reduce", 72, 725, "two-phase", 1, marks=pytest.mark.slow),
])
def test_uneven_splits_run_right_on_the_cpu_datapath(name, n, count, strategy, chunks):
    import numpy as np

    from purlin import Cluster, reference

    coll = collectives.standard(name, n)
    sizing = coll.sized(count)
    assert len({c for _, c in sizing.chunks}) > 1  # the split is uneven
    bound = Cluster.cpu(n).bind(coll, strategy, count=count, chunks=chunks, timeout=120)
    rng = np.random.default_rng(n)
    inputs = [rng.standard_normal(sizing.input_count(r)).astype("float32") for r in range(n)]
    outputs = bound(inputs)
    for got, want in zip(outputs, reference(sizing, inputs)):
        assert np.allclose(got, want, atol=1e-4)


@pytest.mark.parametrize("ll", [False, True], ids=["simple", "ll"])
@pytest.mark.parametrize("name, strategy", [
    ("all-gather", "ring"), ("all-gather", "direct-pull"), ("reduce-scatter", "two-phase"),
    ("all-reduce", "ring"), ("all-reduce", "direct-push"), ("all-to-all", "direct-push"),
    ("scatter", "ring"), ("reduce", "two-phase"),
])
@pytest.mark.parametrize("count", [2, 7, 97])  # fewer elements than chunks, odd, prime
def test_uneven_splits_run_right_in_the_gpu_tables(name, strategy, count, ll):
    """The sm datapath's lowered instruction tables, run by the host interpreter, with chunks
    of unequal (and zero) length, pipelined over two pieces and two lanes."""
    import numpy as np

    from purlin.atom.host import HostBuffers, run_calls
    from purlin.snac import plan
    from purlin.spec import reference

    coll = collectives.standard(name, 4, root=3)
    schedule = plan(coll, strategy, count=count, chunks=2, lanes=2)
    bufs = HostBuffers(schedule, ll=ll)
    rng = np.random.default_rng(count)
    xs = [[rng.integers(-40, 40, schedule.sizing.input_count(r)).astype(np.float64)
           for r in range(4)] for _ in range(2)]
    outs = run_calls(bufs.lower(), bufs, xs)
    for call in range(2):
        for r, want in enumerate(reference(schedule.sizing, xs[call])):
            np.testing.assert_array_equal(outs[call][r], want, err_msg=f"call {call} rank {r}")
