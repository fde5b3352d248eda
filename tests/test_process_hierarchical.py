"""Hierarchical plans (purlin.snac.hierarchical), checked without processes: the shape of the
phases, their intra-node schedules verified, and the phases run on numpy equal to the flat
collective's reference for every node layout, op and (odd) size."""

import json

import numpy as np
import pytest

from purlin.errors import PlanError
from purlin.snac.hierarchical import (HierarchicalPlan, Inter, Intra, nodes_of,
                                      plan_hierarchical, simulate, verify_intra)
from purlin.spec import collectives, reference

LAYOUTS = {
    "2x2": (0, 0, 1, 1),
    "2x2-interleaved": (0, 1, 0, 1),
    "2x2-crossed": (0, 1, 1, 0),   # the inter groups list the nodes in different orders
    "2x3": (0, 0, 0, 1, 1, 1),
    "3x2": ("a", "a", "b", "b", "c", "c"),
    "4x1": (0, 1, 2, 3),
    "1x4": (0, 0, 0, 0),
}
KINDS = {"all-reduce": ("sum", "max", "min", "avg"), "all-gather": ("copy",),
         "reduce-scatter": ("sum", "max", "avg")}


def _flat(kind, n, op):
    return collectives.standard(kind, n, op=op if op != "copy" else "sum")


def _inputs(kind, n, count, rng):
    length = {"all-reduce": count, "all-gather": count, "reduce-scatter": count * n}[kind]
    return [rng.integers(-20, 20, size=length).astype(np.float64) for _ in range(n)]


@pytest.mark.parametrize("layout", LAYOUTS, ids=list(LAYOUTS))
@pytest.mark.parametrize("kind", KINDS)
def test_phases_compute_the_flat_collective(layout, kind):
    nodes = LAYOUTS[layout]
    n = len(nodes)
    rng = np.random.default_rng(n)
    for op in KINDS[kind]:
        hp = plan_hierarchical(_flat(kind, n, op), nodes)
        for count in (1, 5, 2 * n + 1):
            xs = _inputs(kind, n, count, rng)
            flat = hp.flat_sizing(count if kind == "all-reduce" else count * n)
            got = simulate(hp, xs, sizing=flat)
            for rank, (g, w) in enumerate(zip(got, reference(flat, xs))):
                np.testing.assert_allclose(g, w, err_msg=f"{kind} {op} rank {rank} n={count}")


@pytest.mark.parametrize("kind", KINDS)
def test_intra_phases_verify(kind):
    for layout in ("2x2", "2x2-crossed", "2x3"):
        nodes = LAYOUTS[layout]
        n = len(nodes)
        hp = plan_hierarchical(_flat(kind, n, KINDS[kind][0]), nodes)
        for strategy in ("direct-push", "ring"):
            reports = verify_intra(hp, count=7 * n, strategy=strategy, chunks=2)
            assert reports and all(r.ok for r in reports), [str(r) for r in reports]


def test_all_reduce_shape_two_nodes_of_two():
    hp = plan_hierarchical(collectives.all_reduce(4, "max"), (0, 0, 1, 1))
    assert hp.nodes == ((0, 1), (2, 3))
    rs, inter, ag = hp.phases
    assert isinstance(rs, Intra) and rs.collective == collectives.reduce_scatter(2, "max")
    assert (rs.src, rs.dst, rs.sizes) == ("input", "mid", "shard")
    assert isinstance(inter, Inter)
    assert (inter.collective, inter.op, inter.groups) == ("all-reduce", "max", ((0, 2), (1, 3)))
    assert ag.collective == collectives.all_gather(2) and (ag.src, ag.dst) == ("mid", "output")
    flat = hp.flat_sizing(11)
    # shards of 11 elements over 2 local ranks: 6 and 5; the mid buffer holds one shard
    assert [hp.buffer_counts(flat, r)["mid"] for r in range(4)] == [6, 5, 6, 5]


def test_all_gather_lands_chunks_in_rank_order_whatever_the_group_order():
    # node 0 = ranks {0, 3}, node 1 = {1, 2}: group of local index 1 is (2, 3): node 1 first
    hp = plan_hierarchical(collectives.all_gather(4), (0, 1, 1, 0))
    inter, intra = hp.phases
    assert inter.groups == ((0, 1), (2, 3))
    assert intra.collective.input[0] == ((0, 0), (1, 0))
    assert intra.collective.input[1] == ((1, 1), (0, 1))
    assert intra.collective.output[0] == ((0, 0), (1, 0), (1, 1), (0, 1))


def test_single_node_and_single_rank_nodes():
    one = plan_hierarchical(collectives.all_reduce(4), (7, 7, 7, 7))
    assert len(one.phases) == 1 and one.phases[0].sizes == "same"
    spread = plan_hierarchical(collectives.reduce_scatter(3), ("x", "y", "z"))
    assert len(spread.phases) == 1 and isinstance(spread.phases[0], Inter)
    assert spread.phases[0].groups == ((0, 1, 2),)


def test_refuses_what_it_cannot_split():
    with pytest.raises(PlanError, match="same number of ranks"):
        plan_hierarchical(collectives.all_reduce(3), (0, 0, 1))
    with pytest.raises(PlanError, match="standard all-reduce"):
        plan_hierarchical(collectives.broadcast(4), (0, 0, 1, 1))
    with pytest.raises(PlanError, match="names a node for 3 ranks"):
        plan_hierarchical(collectives.all_reduce(4), (0, 0, 1))


def test_json_round_trip_and_render():
    hp = plan_hierarchical(collectives.reduce_scatter(6, "min"), LAYOUTS["3x2"])
    again = HierarchicalPlan.from_json(json.loads(json.dumps(hp.to_json())))
    assert again == hp
    text = hp.render()
    assert "3 nodes x 2 ranks" in text and "inter reduce-scatter (min)" in text


def test_nodes_of_orders_by_first_rank():
    assert nodes_of(("n1", "n0", "n1", "n0")) == ((0, 2), (1, 3))
