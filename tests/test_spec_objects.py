"""Layout, Op, DType and Collective as values: equality, hashing, rendering, JSON."""

import json
from dataclasses import FrozenInstanceError

import pytest

from purlin.spec import STANDARD, Collective, Layout, Op, collectives, copy, dtype, reduce
from purlin.spec import standard


def json_round_trip(coll):
    return Collective.from_json(json.loads(json.dumps(coll.to_json())))


# -- Layout --------------------------------------------------------------------------------------


def test_layout_rows_become_tuples():
    lay = Layout([["a", 1], [], [("t", 2)]])
    assert lay.slots == (("a", 1), (), (("t", 2),))
    assert lay.nranks == len(lay) == 3
    assert list(lay) == [("a", 1), (), (("t", 2),)]
    assert lay[1] == ()


def test_layout_names_and_positions():
    lay = Layout([["b", "a"], ["a", "c"], ["b"]])
    assert lay.names() == ("b", "a", "c")
    assert lay.positions("a") == ((0, 1), (1, 0))
    assert lay.positions("b") == ((0, 0), (2, 0))
    assert lay.positions("missing") == ()


def test_layout_equality_hash_and_copy():
    a = Layout([[0, 1], [2]])
    assert a == Layout(((0, 1), (2,)))
    assert a == Layout(a)
    assert hash(a) == hash(Layout([[0, 1], [2]]))
    assert a != Layout([[1, 0], [2]])
    with pytest.raises(FrozenInstanceError):
        a.slots = ()


def test_names_of_different_types_are_different():
    lay = Layout([[1, "1", (1,)]])
    assert lay.names() == (1, "1", (1,))


def test_layout_json_keeps_tuples_apart_from_lists():
    lay = Layout([[("a", (0, 1)), "a", 3], []])
    text = json.dumps(lay.to_json())
    assert Layout.from_json(json.loads(text)) == lay


def test_layout_repr():
    assert repr(Layout([["a"], []])) == "Layout([['a'], []])"


# -- Op ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text, want", [
    ("copy", copy),
    ("reduce", reduce.sum),
    ("sum", reduce.sum),
    ("max", reduce.max),
    ("reduce:min", reduce.min),
    ("reduce:avg", reduce.avg),
])
def test_op_parse(text, want):
    assert Op.parse(text) == want
    assert Op.parse(want) is want


@pytest.mark.parametrize("op", ["sum", "max", "min", "avg"])
def test_reduce_factory_and_str(op):
    assert reduce(op) == getattr(reduce, op) == Op("reduce", op)
    assert str(reduce(op)) == f"reduce:{op}"
    assert Op.parse(str(reduce(op))) == reduce(op)
    assert reduce(op).is_reduce and not copy.is_reduce


# -- DType ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("alias, name, itemsize, is_float", [
    ("bf16", "bfloat16", 2, True),
    ("half", "float16", 2, True),
    ("fp32", "float32", 4, True),
    ("double", "float64", 8, True),
    ("int", "int32", 4, False),
    ("int64", "int64", 8, False),
    ("torch.bfloat16", "bfloat16", 2, True),
])
def test_dtype_aliases(alias, name, itemsize, is_float):
    d = dtype(alias)
    assert (d.name, d.itemsize, d.is_float) == (name, itemsize, is_float)
    assert dtype(d) is d


def test_dtype_from_numpy():
    np = pytest.importorskip("numpy")
    assert dtype(np.dtype("float16")).name == "float16"
    assert dtype("bfloat16").numpy() == np.dtype("float32")
    assert dtype("int64").numpy() == np.dtype("int64")


# -- Collective ----------------------------------------------------------------------------------


def test_collective_normalises_its_fields():
    coll = Collective([["a"], ["b"]], [["b"], ["a"]], "copy", name="swap")
    assert isinstance(coll.input, Layout) and isinstance(coll.output, Layout)
    assert coll.op == copy
    assert coll.sources("a") == ((0, 0),) and coll.sources("nope") == ()
    with pytest.raises(FrozenInstanceError):
        coll.name = "other"


def test_collective_equality_and_hash():
    a = collectives.all_reduce(4, "max")
    b = Collective([[0, 1, 2, 3]] * 4, [[0, 1, 2, 3]] * 4, reduce.max, name="all-reduce")
    assert a == b and hash(a) == hash(b)
    assert a != collectives.all_reduce(4, "min")
    assert a != Collective(a.input, a.output, a.op, name="other")


def test_describe_matches_the_docstring_format():
    assert collectives.broadcast(3, root=1).describe() == "\n".join([
        "broadcast (copy), 3 ranks",
        "rank | input | output",
        "   0 | -     | x",
        "   1 | x     | x",
        "   2 | -     | x",
    ])


def test_describe_formats_tuple_names():
    text = collectives.all_to_all(2).describe()
    assert "   1 | (1,0) (1,1) | (0,1) (1,1)" in text.splitlines()
    assert repr(collectives.all_to_all(2)) == text


def test_html_escapes_names():
    coll = Collective([["<a>"], []], [["<a>"], ["<a>"]], copy, name="x&y")
    page = coll._repr_html_()
    assert "<b>x&amp;y (copy), 2 ranks</b>" in page
    assert "<code>&lt;a&gt;</code>" in page and "<a>" not in page
    assert page.count("<tr>") == 3  # header + 2 ranks


@pytest.mark.parametrize("name", sorted(STANDARD))
def test_standard_collectives_survive_json(name):
    coll = standard(name, 5, root=3, op="avg")
    back = json_round_trip(coll)
    assert back == coll
    assert back.root == coll.root
    assert back.describe() == coll.describe()


def test_json_shape():
    obj = collectives.all_to_all(2).to_json()
    assert obj == {
        "name": "all-to-all",
        "op": "copy",
        "root": None,
        "input": [[{"t": [0, 0]}, {"t": [0, 1]}], [{"t": [1, 0]}, {"t": [1, 1]}]],
        "output": [[{"t": [0, 0]}, {"t": [1, 0]}], [{"t": [0, 1]}, {"t": [1, 1]}]],
    }


def test_from_json_validates():
    obj = collectives.all_gather(2).to_json()
    obj["input"][1] = []
    with pytest.raises(ValueError, match="output name '1' at rank 0 position 1 has no source"):
        Collective.from_json(obj)
