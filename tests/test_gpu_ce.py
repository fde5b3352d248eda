"""The ce datapath on real GPUs: copy collectives on copy engines, all-reduce on ce+sm, against
the reference over eager calls and CUDA-graph replays; a stuck stream wait times out instead of
hanging. Skipped, with the reason, where no GPU is visible."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from purlin.errors import PurlinTimeoutError
from purlin.snac import Consume, Wait
from purlin.spec import reference, standard

pytestmark = pytest.mark.gpu

CASES = [("all-gather", "direct-push", 1, 1), ("all-gather", "ring", 2, 2),
         ("all-to-all", "direct-push", 1, 1), ("broadcast", "direct-push", 2, 1),
         ("all-reduce", "two-phase", 1, 1), ("all-reduce", "direct-push", 2, 2),
         ("reduce-scatter", "two-phase", 2, 2), ("all-reduce", "direct-pull", 1, 1)]


@pytest.fixture(scope="module")
def torch():
    import torch

    return torch


def _cluster(kind):
    import torch

    from purlin.runtime import Cluster

    if kind == "local":
        if torch.cuda.device_count() < 2:
            pytest.skip(f"needs 2 GPUs, {torch.cuda.device_count()} visible")
        return Cluster.local(2)
    return Cluster.virtual(2)


def _run_and_compare(torch, bound, gen, launch):
    sizing = bound.schedule.sizing
    xs = []
    for r, t in enumerate(bound.inputs):
        x = gen.integers(-50, 50, sizing.input_count(r)).astype(np.float64)
        t[: x.size].copy_(torch.tensor(x, dtype=t.dtype))
        xs.append(x)
    launch()
    bound.check()
    for r, want in enumerate(reference(sizing, xs)):
        got = bound.outputs[r][: sizing.output_count(r)].double().cpu().numpy()
        np.testing.assert_array_equal(got, want)


def _eager_then_graphs(torch, bound, seed, ops):
    """Three eager calls, then two replays of a graph of ``ops`` calls, fresh inputs each."""
    gen = np.random.default_rng(seed)
    for _ in range(3):
        _run_and_compare(torch, bound, gen, bound.launch)
    graphs = bound.capture(ops)
    for _ in range(2):
        _run_and_compare(torch, bound, gen, graphs.replay)


@pytest.mark.parametrize("kind", ["local", "virtual"])
@pytest.mark.parametrize("name,strategy,chunks,lanes", CASES)
def test_ce_datapath_matches_the_reference(torch, kind, name, strategy, chunks, lanes):
    cluster = _cluster(kind)
    bound = cluster.bind(standard(name, 2), strategy, count=4096, dtype="float32",
                         chunks=chunks, lanes=lanes, datapath="ce")
    _eager_then_graphs(torch, bound, seed=0, ops=3)


@pytest.mark.parametrize("kind", ["local", "virtual"])
@pytest.mark.parametrize("name,count", [("all-reduce", 4096), ("all-reduce", (24 << 20) + 6),
                                        ("reduce-scatter", 4096), ("reduce", 4096)])
def test_direct_push_by_stage_on_copy_engines(torch, kind, name, count):
    """Lanes by stage: the copy engines push every chunk in lane 0, the SMs reduce in lane 1
    (``ce.stage_lanes_problem`` lets this layout through)."""
    cluster = _cluster(kind)
    bound = cluster.bind(standard(name, 2), "direct-push", count=count, dtype="float32",
                         chunks=4, lanes=2, lanes_by="stage", datapath="ce")
    assert bound.schedule.lanes_by == "stage"
    _eager_then_graphs(torch, bound, seed=1, ops=4)


@pytest.mark.parametrize("kind", ["local", "virtual"])
@pytest.mark.parametrize("name,count", [("all-reduce", 4096), ("all-reduce", (24 << 20) + 6),
                                        ("all-gather", 4096)])
def test_push_pull_on_both_engines(torch, kind, name, count):
    """push-pull: half of each segment on the copy engines (pushes), half read by the SMs."""
    cluster = _cluster(kind)
    bound = cluster.bind(standard(name, 2), "push-pull", count=count, dtype="float32",
                         chunks=2, lanes=2, datapath="ce")
    _eager_then_graphs(torch, bound, seed=2, ops=4)


def test_a_stream_wait_that_is_never_satisfied_times_out(torch):
    cluster = _cluster("local")
    from purlin.atom.ce import CAPABILITIES
    from purlin.snac import plan

    s = plan(standard("broadcast", 2), "direct-push", count=64, capabilities=CAPABILITIES)
    steps = list(s.steps[1])
    first = steps[0]
    assert isinstance(first, Consume) and first.engine == "ce"
    steps[0] = dataclasses.replace(first, waits=(Wait(first.waits[0].flag, 5),))
    bad = dataclasses.replace(s, steps=(s.steps[0], tuple(steps)))
    from purlin.atom import ce

    bound = ce.bind(cluster, bad, timeout=1.0)
    bound.launch()
    with pytest.raises(PurlinTimeoutError, match=r"rank 1 lane 0 step 0 .*flag\(r1<-r0.l0\)"):
        bound.check()
    with pytest.raises(Exception, match="bind it again"):
        bound.launch()


@pytest.mark.parametrize("name,strategy", [("all-reduce", "two-phase"),
                                           ("all-reduce", "direct-pull")])
def test_a_large_mixed_collective_leaves_an_sm_to_the_add_kernel(torch, name, strategy):
    """64 MiB: the sm part gets its most blocks; on a driver without stream atomic adds it must
    still leave the counter-add kernel an SM (a full GPU of spinning blocks would never finish)."""
    cluster = _cluster("local")
    bound = cluster.bind(standard(name, 2), strategy, nbytes=64 << 20, dtype="float32",
                         datapath="ce")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert bound.atomic_add or bound.blocks_per_lane * bound.schedule.lanes < sms
    gen = np.random.default_rng(1)
    for _ in range(2):
        _run_and_compare(torch, bound, gen, bound.launch)
    graphs = bound.capture(2)
    _run_and_compare(torch, bound, gen, graphs.replay)


def test_bindings_give_their_streams_back(torch):
    """Each binding makes driver streams and events; close() (or garbage collection) destroys
    them, so a loop of bindings does not pile streams onto the device's hardware queues."""
    cluster = _cluster("local")
    gen = np.random.default_rng(2)
    for _ in range(40):
        bound = cluster.bind(standard("all-gather", 2), "direct-pull", count=1024,
                             dtype="float32", datapath="ce")
        _run_and_compare(torch, bound, gen, bound.launch)
        bound.close()
        assert bound.contexts == {}
        with pytest.raises(Exception, match="closed"):
            bound.launch()


def test_a_dropped_binding_is_freed_at_once(torch):
    """Nothing in a binding refers back to it, so dropping it frees its streams right away,
    not whenever the cyclic garbage collector runs (bindings piling up streams onto the
    hardware queues was one suspect of the hang below)."""
    import gc
    import weakref

    cluster = _cluster("local")
    gc.disable()
    try:
        bound = cluster.bind(standard("all-reduce", 2), "two-phase", count=4096,
                             dtype="float32", datapath="ce")
        ref = weakref.ref(bound)
        del bound
        assert ref() is None
    finally:
        gc.enable()


def test_a_copy_collective_after_a_mixed_one_under_graphs(torch):
    """The sequence that hung on 2 x H200: a ce+sm all-reduce replayed in CUDA graphs, then a
    copy-engine all-gather bound and replayed in graphs in the same process."""
    cluster = _cluster("local")
    gen = np.random.default_rng(3)
    for name, strategy in [("all-reduce", "two-phase"), ("all-gather", "direct-pull"),
                           ("broadcast", "direct-pull")]:
        bound = cluster.bind(standard(name, 2), strategy, nbytes=1 << 20, dtype="bfloat16",
                             datapath="ce")
        _run_and_compare(torch, bound, gen, bound.launch)
        graphs = bound.capture(4)
        for _ in range(3):
            _run_and_compare(torch, bound, gen, graphs.replay)


def test_a_long_graph_starts_on_both_gpus(torch):
    """A 50-call all-gather graph hung at its first replay on 2 x H200: the second GPU's graph
    did not start while the first one's waited for it. capture() now launches every graph
    once with its waits released before handing it out."""
    cluster = _cluster("local")
    gen = np.random.default_rng(4)
    bound = cluster.bind(standard("all-gather", 2), "direct-pull", nbytes=1 << 20,
                         dtype="bfloat16", datapath="ce")
    _run_and_compare(torch, bound, gen, bound.launch)
    graphs = bound.capture(50)
    for _ in range(3):
        _run_and_compare(torch, bound, gen, graphs.replay)
    _run_and_compare(torch, bound, gen, bound.launch)
