"""Property-based tests: random valid and invalid custom collectives.

A ``Draft`` is the test's own record of a random collective: which ranks hold each name. Every
expectation below is computed from the draft, never from the Collective under test.
"""

import json
import re
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from purlin.errors import PurlinError, SpecError
from purlin.spec import Collective, Op, copy, reduce, reference

SETTINGS = settings(max_examples=60, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])
REDUCE_OPS = ["sum", "max", "min", "avg"]
NUMPY_OP = {"sum": np.sum, "max": np.max, "min": np.min, "avg": np.mean}

# -- strategies ----------------------------------------------------------------------------------

atoms = st.one_of(st.text("abxyz_<>&| ", max_size=3), st.integers(-3, 40))
chunk_names = st.recursive(
    atoms, lambda inner: st.tuples(inner) | st.tuples(inner, inner), max_leaves=3)


@dataclass
class Draft:
    n: int
    holders: dict  # name -> sorted ranks whose input holds it
    input_rows: list
    output_rows: list
    op: Op
    root: "int | None"
    name: str

    def build(self) -> Collective:
        return Collective(self.input_rows, self.output_rows, self.op, name=self.name,
                          root=self.root)

    def position(self, name, rank):
        return self.input_rows[rank].index(name)

    def widest(self) -> int:
        return max(len(row) for row in self.input_rows + self.output_rows)

    def first_output_place(self, name):
        return next((r, p) for r, row in enumerate(self.output_rows)
                    for p, held in enumerate(row) if held == name)


@st.composite
def drafts(draw, op=None, min_ranks=1, max_ranks=6):
    """A random valid collective: copy gives each name one holder, reduce one or more."""
    n = draw(st.integers(min_ranks, max_ranks))
    names = draw(st.lists(chunk_names, min_size=1, max_size=6, unique=True))
    if op is None:
        op = draw(st.sampled_from([copy] + [reduce(o) for o in REDUCE_OPS]))
    ranks = st.integers(0, n - 1)
    holders = {}
    for name in names:
        if op.is_reduce:
            holders[name] = tuple(sorted(draw(st.lists(ranks, min_size=1, max_size=n,
                                                       unique=True))))
        else:
            holders[name] = (draw(ranks),)
    input_rows = []
    for r in range(n):
        held = [name for name in names if r in holders[name]]
        input_rows.append(list(draw(st.permutations(held))))
    output_rows = [draw(st.lists(st.sampled_from(names), max_size=4)) for _ in range(n)]
    if not any(output_rows):
        output_rows[draw(ranks)].append(draw(st.sampled_from(names)))
    root = draw(st.none() | ranks)
    label = draw(st.text("abc-", min_size=1, max_size=6))
    return Draft(n, holders, input_rows, output_rows, op, root, label)


def chunk_values(draft, seed):
    """Per (name, rank) holding it: a random non-zero chunk; sizes 1..3 vary by name."""
    rng = np.random.default_rng(seed)
    sizes = {name: int(rng.integers(1, 4)) for name in draft.holders}
    values = {}
    for name, ranks in draft.holders.items():
        for r in ranks:
            values[name, r] = rng.uniform(0.5, 4.0, sizes[name]) * rng.choice([-1, 1])
    return sizes, values


def flat_inputs(draft, values):
    return [np.concatenate([values[name, r] for name in row]) if row else np.zeros(0)
            for r, row in enumerate(draft.input_rows)]


def expected_chunk(draft, values, name):
    parts = [values[name, r] for r in draft.holders[name]]
    if draft.op.is_reduce:
        return NUMPY_OP[draft.op.reduce_op](np.stack(parts), axis=0)
    (only,) = parts
    return only


def run_reference(draft, seed):
    sizes, values = chunk_values(draft, seed)
    sizing = draft.build().sized(chunk_sizes=sizes, dtype="float64")
    return sizes, values, reference(sizing, flat_inputs(draft, values))


def permuted(draft, perm):
    """The same collective with old rank r renamed perm[r]."""
    def move(rows):
        out = [None] * draft.n
        for r, row in enumerate(rows):
            out[perm[r]] = list(row)
        return out

    holders = {name: tuple(sorted(perm[r] for r in ranks))
               for name, ranks in draft.holders.items()}
    root = None if draft.root is None else perm[draft.root]
    return Draft(draft.n, holders, move(draft.input_rows), move(draft.output_rows), draft.op,
                 root, draft.name)


# -- valid collectives ---------------------------------------------------------------------------


@SETTINGS
@given(drafts())
def test_random_valid_collectives_build_as_declared(draft):
    coll = draft.build()
    assert coll.nranks == draft.n
    assert [list(row) for row in coll.input] == draft.input_rows
    assert [list(row) for row in coll.output] == draft.output_rows
    assert (coll.op, coll.root, coll.name) == (draft.op, draft.root, draft.name)
    for name, ranks in draft.holders.items():
        assert coll.sources(name) == tuple((r, draft.position(name, r)) for r in ranks)


@SETTINGS
@given(drafts())
def test_describe_and_html_mention_every_rank(draft):
    coll = draft.build()
    text = coll.describe()
    page = coll._repr_html_()
    assert f"{draft.n} ranks" in text.splitlines()[0]
    for r in range(draft.n):
        assert re.search(rf"(?m)^ *{r} \| ", text), f"rank {r} missing from\n{text}"
        assert f"<tr><td>{r}</td>" in page
    assert page.count("<tr>") == draft.n + 1


@SETTINGS
@given(drafts())
def test_json_round_trip_gives_an_equal_collective(draft):
    coll = draft.build()
    back = Collective.from_json(json.loads(json.dumps(coll.to_json())))
    assert back == coll
    assert back.root == coll.root
    assert back.to_json() == coll.to_json()
    for name in draft.holders:
        assert back.sources(name) == coll.sources(name)


@SETTINGS
@given(drafts(op=copy), st.integers(0, 2**32 - 1))
def test_copy_output_chunk_is_exactly_its_single_source(draft, seed):
    sizes, values, out = run_reference(draft, seed)
    for r, row in enumerate(draft.output_rows):
        at = 0
        for name in row:
            (holder,) = draft.holders[name]
            np.testing.assert_array_equal(out[r][at:at + sizes[name]], values[name, holder])
            at += sizes[name]
        assert at == len(out[r])


@SETTINGS
@given(drafts(op=reduce.sum), st.integers(0, 2**32 - 1))
def test_reduce_sum_is_the_sum_of_all_same_named_inputs(draft, seed):
    sizes, values, out = run_reference(draft, seed)
    for r, row in enumerate(draft.output_rows):
        want = [sum(values[name, h] for h in draft.holders[name]) for name in row]
        np.testing.assert_allclose(out[r], np.concatenate(want) if want else np.zeros(0),
                                   rtol=1e-12)


@SETTINGS
@given(drafts(), st.integers(0, 2**32 - 1))
def test_reference_matches_the_draft_for_every_op(draft, seed):
    sizes, values, out = run_reference(draft, seed)
    for r, row in enumerate(draft.output_rows):
        want = [expected_chunk(draft, values, name) for name in row]
        np.testing.assert_allclose(out[r], np.concatenate(want) if want else np.zeros(0),
                                   rtol=1e-12)


@SETTINGS
@given(drafts(), st.data())
def test_permuting_ranks_permutes_the_outputs(draft, data):
    perm = data.draw(st.permutations(range(draft.n)))
    seed = data.draw(st.integers(0, 2**32 - 1))
    sizes, values, out = run_reference(draft, seed)

    moved = permuted(draft, perm)
    moved_values = {(name, perm[r]): v for (name, r), v in values.items()}
    sizing = moved.build().sized(chunk_sizes=sizes, dtype="float64")
    moved_out = reference(sizing, flat_inputs(moved, moved_values))

    assert moved.build().root == (None if draft.root is None else perm[draft.root])
    for r in range(draft.n):
        np.testing.assert_allclose(moved_out[perm[r]], out[r], rtol=1e-12)


@SETTINGS
@given(drafts(), st.integers(1, 5))
def test_even_sizes_that_divide_give_that_message(draft, k):
    count = draft.widest() * k
    sizing = draft.build().sized(count)
    assert sizing.message_count == count
    assert {c for _, c in sizing.chunks} == {k}


# -- invalid collectives -------------------------------------------------------------------------


@SETTINGS
@given(drafts(), st.data())
def test_dropping_a_source_is_an_error_naming_rank_and_position(draft, data):
    used = [name for row in draft.output_rows for name in row]
    dropped = data.draw(st.sampled_from(used))
    rows = [[name for name in row if name != dropped] for row in draft.input_rows]
    rank, pos = draft.first_output_place(dropped)
    with pytest.raises(SpecError, match=rf"at rank {rank} position {pos} has no source"):
        Collective(rows, draft.output_rows, draft.op)


@SETTINGS
@given(drafts(op=copy, min_ranks=2), st.data())
def test_a_second_copy_source_is_an_error_listing_both(draft, data):
    used = [name for row in draft.output_rows for name in row]
    twice = data.draw(st.sampled_from(used))
    (holder,) = draft.holders[twice]
    other = data.draw(st.sampled_from([r for r in range(draft.n) if r != holder]))
    rows = [list(row) for row in draft.input_rows]
    rows[other].insert(data.draw(st.integers(0, len(rows[other]))), twice)

    places = sorted([(holder, rows[holder].index(twice)), (other, rows[other].index(twice))])
    where = ", ".join(f"rank {r} position {p}" for r, p in places)
    rank, pos = draft.first_output_place(twice)
    with pytest.raises(SpecError) as info:
        Collective(rows, draft.output_rows, copy)
    message = str(info.value)
    assert "copy needs exactly one source" in message
    assert f"(output rank {rank} position {pos}), found 2: {where}" in message
    # the same declaration is a valid reduce
    assert Collective(rows, draft.output_rows, reduce.sum).sources(twice) == tuple(places)


@SETTINGS
@given(drafts(op=reduce.avg), st.sampled_from(["int32", "int64"]),
       st.sampled_from(["float16", "bfloat16", "float32", "float64"]))
def test_avg_needs_a_float_dtype(draft, int_dtype, float_dtype):
    coll = draft.build()
    count = draft.widest() * 2
    with pytest.raises(PurlinError, match=f"avg needs a floating-point dtype, got {int_dtype}"):
        coll.sized(count, dtype=int_dtype)
    assert coll.sized(count, dtype=float_dtype).dtype.name == float_dtype


@SETTINGS
@given(drafts(), st.integers(0, 4), st.data())
def test_sizes_that_do_not_divide_split_as_evenly_as_they_can(draft, k, data):
    widest = draft.widest()
    assume(widest >= 2)
    count = widest * k + data.draw(st.integers(1, widest - 1))
    try:
        sizing = draft.build().sized(count)
    except SpecError as exc:  # only where a repeated output name would outgrow the message
        assert str(exc).startswith(f"{count} elements do not divide into the {widest} ")
        return
    assert sizing.message_count == count
    counts = {c for _, c in sizing.chunks}
    assert counts <= {count // widest, count // widest + 1}