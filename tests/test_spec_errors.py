"""Every SpecError the spec layer raises, with the key content of its message.

All are PurlinError and SpecError (a ValueError); none is an AssertionError or a stray TypeError.
"""

import re

import numpy as np
import pytest

from purlin.errors import PurlinError, SpecError
from purlin.spec import STANDARD, Collective, Layout, Op, collectives, copy, dtype, reduce
from purlin.spec import reference, standard


def spec_error(*fragments):
    """pytest.raises(SpecError) whose message holds every fragment, literally."""
    return pytest.raises(SpecError, match="(?s)" + "".join(
        f"(?=.*{re.escape(f)})" for f in fragments))


def test_spec_error_is_a_purlin_error_and_a_value_error():
    assert issubclass(SpecError, PurlinError)
    assert issubclass(SpecError, ValueError)
    assert not issubclass(SpecError, AssertionError)


# -- Collective validation -----------------------------------------------------------------------


def test_output_name_with_no_source():
    with spec_error("output name 'c'", "rank 1 position 1", "no source"):
        Collective([["a"], ["b"]], [["a"], ["b", "c"]], copy)


def test_output_name_with_no_source_in_a_reduce():
    with spec_error("output name '(1,2)'", "rank 0 position 0", "no source"):
        Collective([[(0, 1)], [(0, 1)]], [[(1, 2)], []], reduce.sum)


def test_copy_with_two_sources():
    with spec_error("copy needs exactly one source for 'a'", "output rank 1 position 0",
                    "found 2", "rank 0 position 1, rank 2 position 0"):
        Collective([["b", "a"], [], ["a"]], [["b"], ["a"], []], copy)


def test_the_same_layout_is_fine_as_a_reduce():
    coll = Collective([["b", "a"], [], ["a"]], [["b"], ["a"], []], reduce.sum)
    assert coll.sources("a") == ((0, 1), (2, 0))


def test_duplicate_name_in_one_ranks_input():
    with spec_error("input of rank 1 holds 'b' twice", "positions 0 and 2"):
        Collective([["a"], ["b", "c", "b"]], [["a"], ["b"]], reduce.sum)


@pytest.mark.parametrize("root", [-1, 3, 10])
def test_root_outside_the_ranks(root):
    with spec_error(f"root {root} is outside the ranks 0..2"):
        Collective([["x"], [], []], [["x"]] * 3, copy, root=root)


@pytest.mark.parametrize("root", ["1", 1.0, [0], True])
def test_root_that_is_not_a_rank_number(root):
    with spec_error(f"root {root!r}", "outside the ranks 0..2"):
        Collective([["x"], [], []], [["x"]] * 3, copy, root=root)


def test_empty_collective_without_ranks():
    with spec_error("empty collective", "no ranks"):
        Collective([], [], copy)


def test_empty_collective_without_outputs():
    with spec_error("empty collective", "no rank of the 3 has any output chunk"):
        Collective([["a"], ["b"], []], [[], [], []], copy)


def test_mismatched_rank_counts():
    with spec_error("input layout has 2 ranks but output layout has 3"):
        Collective([["a"], ["b"]], [["a"], ["b"], []], copy)


# -- names and layouts ---------------------------------------------------------------------------


@pytest.mark.parametrize("bad, type_name", [
    (1.5, "float"),
    (["a"], "list"),
    (None, "NoneType"),
    ({"a": 1}, "dict"),
    (True, "bool"),
    (frozenset({1}), "frozenset"),
])
def test_bad_chunk_name(bad, type_name):
    with spec_error(f"chunk name {bad!r}", "rank 1 position 2",
                    "must be a str, an int or a tuple", f"not {type_name}"):
        Layout([["a"], ["b", "c", bad]])


def test_bad_name_nested_in_a_tuple():
    with spec_error("chunk name 0.5 at rank 0 position 0", "not float"):
        Layout([[("a", (1, 0.5))]])


def test_bad_name_through_the_collective_constructor():
    with spec_error("chunk name 2.0", "rank 0 position 0"):
        Collective([[2.0]], [[2.0]], copy)


@pytest.mark.parametrize("bad", [5, None, [1, 2]])
def test_layout_that_is_not_a_list_of_lists(bad):
    with spec_error("one list of chunk names per rank", repr(bad)):
        Layout(bad)


# -- ops and dtypes ------------------------------------------------------------------------------


@pytest.mark.parametrize("text, fragment", [
    ("prod", "op must be copy or a reduction (sum, max, min, avg, or 'reduce:<op>'), got 'prod'"),
    ("reduce:prod", "got 'prod'"),
    ("reduce:", "got ''"),
    ("gather", "op must be copy or a reduction (sum, max, min, avg, or 'reduce:<op>'), got "
               "'gather'"),
])
def test_unknown_op(text, fragment):
    with spec_error(fragment):
        Op.parse(text)


def test_copy_takes_no_reduce_op():
    with spec_error("copy takes no reduce op, got 'sum'"):
        Op("copy", "sum")


def test_unknown_op_through_reduce_factory_and_collective():
    with spec_error("got 'mean'"):
        reduce("mean")
    with spec_error("got 'xor'"):
        Collective([["a"]], [["a"]], "reduce:xor")


@pytest.mark.parametrize("name", ["reduce-scatter", "all-reduce", "reduce"])
def test_a_reducing_collective_rejects_copy(name):
    with spec_error("this collective reduces", "got 'copy'"):
        standard(name, 3, op="copy")


@pytest.mark.parametrize("bad", ["float8", "complex64", "", None])
def test_unknown_dtype(bad):
    with spec_error(f"unknown dtype {bad!r}", "float32"):
        dtype(bad)


def test_unknown_dtype_through_sizing():
    with spec_error("unknown dtype 'uint8'"):
        collectives.all_gather(2).sized(4, dtype="uint8")


@pytest.mark.parametrize("dt", ["int32", "int64", "int"])
@pytest.mark.parametrize("name", ["all-reduce", "reduce-scatter", "reduce"])
def test_avg_of_an_integer_dtype(name, dt):
    coll = standard(name, 4, op="avg")
    with spec_error(f"{name}: reduce with avg needs a floating-point dtype",
                    f"got {dtype(dt).name}"):
        coll.sized(16, dtype=dt)


@pytest.mark.parametrize("dt", ["bfloat16", "float16", "float32", "float64"])
def test_avg_of_a_float_dtype_is_fine(dt):
    assert collectives.all_reduce(4, "avg").sized(16, dtype=dt).dtype.name == dt


def test_other_reductions_of_integers_are_fine():
    for op in ("sum", "max", "min"):
        assert collectives.all_reduce(2, op).sized(4, dtype="int32").dtype.name == "int32"


# -- sizes ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("n, count", [(4, 10), (3, 7), (8, 12)])
def test_size_that_does_not_divide_splits_as_evenly_as_it_can(n, count):
    s = collectives.all_gather(n).sized(count)
    assert s.output_count(0) == count
    assert sorted({c for _, c in s.chunks}) == sorted({count // n, count // n + 1})


def test_size_that_would_grow_a_buffer_past_the_message_names_the_widest_input():
    coll = Collective([["a", "b"], ["c"]], [["a", "a"], ["b", "c"]], "copy")
    with spec_error("3 elements do not divide into the 2 chunks of the input of rank 0",
                    "give chunk_sizes"):
        coll.sized(3)


def test_nbytes_that_is_not_whole_elements():
    with spec_error("10 bytes is not a whole number of float32 elements", "4 bytes each"):
        collectives.all_gather(2).sized(nbytes=10)


@pytest.mark.parametrize("kwargs, fragment", [
    ({"count": 10.0}, "count must be a whole number, got 10.0"),
    ({"count": "8"}, "count must be a whole number, got '8'"),
    ({"nbytes": 16.0}, "nbytes must be a whole number, got 16.0"),
    ({"count": -4}, "must not be negative, got -4"),
    ({}, "needs count, nbytes or chunk_sizes"),
    ({"count": 4, "nbytes": 16}, "count or nbytes, not both"),
    ({"count": 4, "chunk_sizes": {0: 1, 1: 1}}, "either chunk_sizes or a message size"),
    ({"chunk_sizes": {0: 1}}, "chunk_sizes gives no size for chunk '1'"),
    ({"chunk_sizes": {0: 1, 1: -1}}, "chunk '1' must have a whole, non-negative"),
    ({"chunk_sizes": {0: 1.5, 1: 1}}, "chunk '0' must have a whole, non-negative"),
    ({"chunk_sizes": lambda name: True}, "got True"),
])
def test_bad_sizing_arguments(kwargs, fragment):
    with spec_error(fragment):
        collectives.all_gather(2).sized(**kwargs)


def test_reference_with_the_wrong_number_of_inputs():
    with spec_error("all-gather has 3 ranks but 2 inputs were given"):
        reference(collectives.all_gather(3), [np.ones(2), np.ones(2)])


def test_reference_input_that_does_not_divide_into_its_chunks():
    with spec_error("input of rank 1 has 5 elements", "do not divide into its 2 chunks"):
        reference(collectives.all_reduce(2), [np.ones(4), np.ones(5)])


def test_reference_uneven_inputs_need_a_sizing():
    with spec_error("input of rank 1 has chunks of 3 elements, other ranks 2",
                    "pass a Sizing"):
        reference(collectives.all_gather(2), [np.ones(2), np.ones(3)])


def test_reference_input_that_disagrees_with_the_sizing():
    sizing = collectives.all_gather(2).sized(chunk_sizes={0: 2, 1: 3})
    with spec_error("input of rank 1 has 2 elements, the sizing says 3"):
        reference(sizing, [np.ones(2), np.ones(2)])


def test_reference_rank_without_input_chunks_given_data():
    with spec_error("input of rank 0 has 3 elements, the sizing says 0"):
        reference(collectives.broadcast(2, root=1), [np.ones(3), np.ones(3)])


# -- standard() ----------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", ["all-sum", "allgather", "", 5, None])
def test_unknown_standard_collective(bad):
    with spec_error(f"unknown collective {bad!r}", "all-gather, reduce-scatter"):
        standard(bad, 4)


@pytest.mark.parametrize("name", sorted(STANDARD))
@pytest.mark.parametrize("n", [1, 0, -2, 2.0, "4", True])
def test_standard_needs_at_least_two_ranks(name, n):
    with spec_error(f"needs n >= 2 ranks, got {n!r}"):
        standard(name, n)


@pytest.mark.parametrize("name", ["broadcast", "reduce", "gather", "scatter"])
@pytest.mark.parametrize("root", [-1, 4, "0", 1.0])
def test_standard_root_outside_the_ranks(name, root):
    with spec_error(f"root {root!r} is outside the ranks 0..3"):
        standard(name, 4, root=root)


def test_no_spec_error_is_an_assertion_even_under_python_O():
    # errors are raised explicitly, so they survive `python -O`; spot-check a few code paths
    import subprocess
    import sys

    code = (
        "from purlin.spec import Collective, copy\n"
        "from purlin.errors import SpecError\n"
        "try:\n"
        "    Collective([['a'], ['a']], [['a'], []], copy)\n"
        "except SpecError as e:\n"
        "    print('ok', e)\n"
    )
    done = subprocess.run([sys.executable, "-O", "-c", code], capture_output=True, text=True,
                          cwd=str(__import__("pathlib").Path(__file__).parents[1]))
    assert done.stdout.startswith("ok copy needs exactly one source"), done.stderr


def test_a_string_is_not_a_row_of_names():
    with spec_error("rank 1 of the layout is the string 'ab'"):
        Layout([["x"], "ab"])
    with spec_error("got the string 'ab'"):
        Layout("ab")


def test_numpy_scalar_types_and_integer_sizes_are_accepted():
    assert dtype(np.float32).name == "float32" and dtype(np.int32).name == "int32"
    sizes = np.array([3, 5], dtype=np.int64)
    s = collectives.all_gather(2).sized(chunk_sizes={0: sizes[0], 1: sizes[1]})
    assert s.output_count(0) == 8 and isinstance(s.chunk_count(1), int)
