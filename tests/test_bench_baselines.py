"""The torch.distributed baseline harness on the host: two gloo processes run the six
collectives eagerly and check every result (the GPU run uses NCCL and CUDA graphs)."""

import pytest

pytest.importorskip("torch")

from purlin.bench.torch_dist import run_baselines  # noqa: E402

SIX = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "broadcast", "reduce")


@pytest.mark.slow
def test_gloo_baselines_check_every_collective():
    points = [("nccl", c, 256, "float32", "sum" if c in ("all-reduce", "reduce-scatter",
                                                         "reduce") else "none", "eager")
              for c in SIX]
    points.append(("nccl", "all-reduce", 256, "float32", "max", "eager"))
    points.append(("nccl", "all-reduce", 256, "float32", "sum", "graph"))  # no graphs on cpu
    done = []
    recs = run_baselines(points, world=2, repeats=2, eager_calls=3, device="cpu",
                         progress=done.append)
    assert sum(done) == len(points)
    by = {(r.collective, r.redop, r.mode): r for r in recs}
    for c in SIX:
        r = next(r for r in recs if r.collective == c and r.mode == "eager")
        assert r.ok and r.wrong == 0, (c, r.extra)
        assert r.count == 64 and r.nbytes == 256
        assert r.time_us > 0
    assert by[("all-reduce", "max", "eager")].wrong == 0
    graph = by[("all-reduce", "sum", "graph")]
    assert not graph.ok and "graph mode needs GPUs" in graph.extra["error"]
