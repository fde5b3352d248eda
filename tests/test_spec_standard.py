"""The eight standard collectives against hand-derived layouts (ARCHITECTURE.md, "Spec" table).

Expectations are written out here: literal tables for n = 3, and for n = 2..8 per-rank formulas
phrased in terms of "who holds what" rather than by calling the constructors again.
"""

import pytest

from purlin.spec import STANDARD, Collective, collectives, copy, reduce, standard

NS = range(2, 9)
ROOTED_CASES = [(n, root) for n in NS for root in range(n)]


def rows(layout):
    return [list(row) for row in layout]


# -- literal tables for n = 3 ------------------------------------------------------------------

N3_TABLES = {
    "all-gather": ([[0], [1], [2]], [[0, 1, 2], [0, 1, 2], [0, 1, 2]]),
    "reduce-scatter": ([[0, 1, 2], [0, 1, 2], [0, 1, 2]], [[0], [1], [2]]),
    "all-reduce": ([[0, 1, 2], [0, 1, 2], [0, 1, 2]], [[0, 1, 2], [0, 1, 2], [0, 1, 2]]),
    "all-to-all": (
        [[(0, 0), (0, 1), (0, 2)], [(1, 0), (1, 1), (1, 2)], [(2, 0), (2, 1), (2, 2)]],
        [[(0, 0), (1, 0), (2, 0)], [(0, 1), (1, 1), (2, 1)], [(0, 2), (1, 2), (2, 2)]],
    ),
    # rooted ones with root = 1
    "broadcast": ([[], ["x"], []], [["x"], ["x"], ["x"]]),
    "reduce": ([["x"], ["x"], ["x"]], [[], ["x"], []]),
    "gather": ([[0], [1], [2]], [[], [0, 1, 2], []]),
    "scatter": ([[], [0, 1, 2], []], [[0], [1], [2]]),
}


@pytest.mark.parametrize("name", sorted(N3_TABLES))
def test_n3_layouts_match_the_design_table(name):
    want_in, want_out = N3_TABLES[name]
    coll = standard(name, 3, root=1)
    assert rows(coll.input) == want_in
    assert rows(coll.output) == want_out
    assert coll.name == name
    assert coll.nranks == 3


def test_every_standard_collective_has_a_table():
    assert set(N3_TABLES) == set(STANDARD)


# -- n = 2..8 ------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", NS)
def test_all_gather(n):
    coll = collectives.all_gather(n)
    assert coll.op == copy
    for r in range(n):
        assert coll.input[r] == (r,)
        assert coll.output[r] == tuple(k for k in range(n))
    # chunk k comes from rank k alone, position 0
    for k in range(n):
        assert coll.sources(k) == ((k, 0),)


@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("op", ["sum", "max", "min", "avg"])
def test_reduce_scatter(n, op):
    coll = collectives.reduce_scatter(n, op=op)
    assert coll.op == reduce(op)
    for r in range(n):
        assert len(coll.input[r]) == n and set(coll.input[r]) == set(range(n))
        assert list(coll.input[r]) == sorted(coll.input[r])
        assert coll.output[r] == (r,)
    # chunk k is the reduction of position k of every rank
    for k in range(n):
        assert coll.sources(k) == tuple((r, k) for r in range(n))


@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("op", ["sum", "max", "min", "avg"])
def test_all_reduce(n, op):
    coll = collectives.all_reduce(n, op=op)
    assert coll.op == reduce(op)
    everything = tuple(sorted(range(n)))
    for r in range(n):
        assert coll.input[r] == everything
        assert coll.output[r] == everything
    for k in range(n):
        assert coll.sources(k) == tuple((r, k) for r in range(n))


@pytest.mark.parametrize("n", NS)
def test_all_to_all(n):
    coll = collectives.all_to_all(n)
    assert coll.op == copy
    for r in range(n):
        # rank r sends (r, d) to every destination d, in destination order ...
        assert [src for src, _ in coll.input[r]] == [r] * n
        assert [dst for _, dst in coll.input[r]] == list(range(n))
        # ... and receives (s, r) from every source s, in source order
        assert [src for src, _ in coll.output[r]] == list(range(n))
        assert [dst for _, dst in coll.output[r]] == [r] * n
    # the block (s, d) lives at rank s, position d
    for s in range(n):
        for d in range(n):
            assert coll.sources((s, d)) == ((s, d),)


@pytest.mark.parametrize("n, root", ROOTED_CASES)
def test_broadcast(n, root):
    coll = collectives.broadcast(n, root=root)
    assert (coll.op, coll.root) == (copy, root)
    for r in range(n):
        assert coll.input[r] == (("x",) if r == root else ())
        assert coll.output[r] == ("x",)
    assert coll.sources("x") == ((root, 0),)


@pytest.mark.parametrize("n, root", ROOTED_CASES)
def test_reduce(n, root):
    coll = collectives.reduce(n, root=root, op="max")
    assert (coll.op, coll.root) == (reduce.max, root)
    for r in range(n):
        assert coll.input[r] == ("x",)
        assert coll.output[r] == (("x",) if r == root else ())
    assert coll.sources("x") == tuple((r, 0) for r in range(n))


@pytest.mark.parametrize("n, root", ROOTED_CASES)
def test_gather(n, root):
    coll = collectives.gather(n, root=root)
    assert (coll.op, coll.root) == (copy, root)
    for r in range(n):
        assert coll.input[r] == (r,)
        assert len(coll.output[r]) == (n if r == root else 0)
    assert list(coll.output[root]) == sorted(range(n))
    for k in range(n):
        assert coll.sources(k) == ((k, 0),)


@pytest.mark.parametrize("n, root", ROOTED_CASES)
def test_scatter(n, root):
    coll = collectives.scatter(n, root=root)
    assert (coll.op, coll.root) == (copy, root)
    for r in range(n):
        assert len(coll.input[r]) == (n if r == root else 0)
        assert coll.output[r] == (r,)
    assert list(coll.input[root]) == sorted(range(n))
    for k in range(n):
        assert coll.sources(k) == ((root, k),)


# -- standard() lookup ---------------------------------------------------------------------------


@pytest.mark.parametrize("spelling, canonical", [
    ("all-gather", "all-gather"),
    ("all_gather", "all-gather"),
    ("All_Reduce", "all-reduce"),
    ("REDUCE-SCATTER", "reduce-scatter"),
    ("all_to_all", "all-to-all"),
])
def test_standard_accepts_spellings(spelling, canonical):
    assert standard(spelling, 4).name == canonical


@pytest.mark.parametrize("name", sorted(STANDARD))
def test_standard_equals_the_direct_constructor(name):
    kwargs = {}
    if name in ("broadcast", "reduce", "gather", "scatter"):
        kwargs["root"] = 2
    if name in ("reduce-scatter", "all-reduce", "reduce"):
        kwargs["op"] = "min"
    built = standard(name, 5, **kwargs)
    assert built == STANDARD[name](5, **kwargs)
    assert isinstance(built, Collective)
    assert built.root == kwargs.get("root")


def test_standard_ignores_root_and_op_where_they_do_not_apply():
    assert standard("all-gather", 4, root=3, op="max") == collectives.all_gather(4)
    assert standard("broadcast", 4, root=3, op="max").root == 3
    assert standard("all-reduce", 4, root=3, op="max").op == reduce.max


def test_output_names_in_first_appearance_order():
    assert collectives.gather(4, root=2).output.names() == (0, 1, 2, 3)
    assert collectives.all_to_all(2).output.names() == ((0, 0), (1, 0), (0, 1), (1, 1))
    assert collectives.reduce(3, root=1).output.names() == ("x",)
