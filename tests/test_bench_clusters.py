"""The cluster a measurement runs on, with a fake device count: one GPU runs the sm datapath
on virtual ranks (never the cpu datapath), and the baselines that need one GPU per rank are
skipped with a reason that the table prints and the JSON keeps."""

import json

import pytest

from purlin.atom import sm
from purlin.bench import clusters, commands
from purlin.bench.sweep import Sweep
from purlin.cli import main
from purlin.runtime.cluster import Cluster


@pytest.fixture
def gpus(monkeypatch):
    """Pretend ``n`` CUDA GPUs named NVIDIA H200 are visible; returns a setter."""
    monkeypatch.delenv("PURLIN_TUNING", raising=False)

    def visible(n):
        monkeypatch.setattr(sm, "device_count", lambda: n)
        monkeypatch.setattr(sm, "check_device", lambda device: None)
        monkeypatch.setattr(sm, "local_devices", lambda k=None: tuple(range(k)))
        # a GPU cluster asks for the hardware queues in the environment: keep this process's
        monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32")
        monkeypatch.setattr(clusters, "gpu_names", lambda devs: ["NVIDIA H200"] * len(devs))
    return visible


@pytest.mark.parametrize("count, n, kind", [(0, 4, "cpu"), (1, 4, "virtual"), (1, 2, "virtual"),
                                            (2, 4, "virtual"), (4, 4, "local"),
                                            (8, 4, "local")])
def test_choose_follows_cluster_best(gpus, count, n, kind):
    gpus(count)
    cluster = clusters.choose(n)
    assert cluster.kind == kind and cluster.nranks == n
    assert clusters.choose(n, "cpu").kind == "cpu"


def test_describe_says_datapath_ranks_and_gpus(gpus):
    gpus(1)
    assert clusters.describe(clusters.choose(4)) == \
        "sm datapath, 4 virtual ranks on 1 x NVIDIA H200"
    gpus(2)
    assert clusters.describe(clusters.choose(2)) == "sm datapath, 2 ranks on 2 x NVIDIA H200"
    assert clusters.describe(Cluster.cpu(3)).startswith("cpu datapath, 3 ranks")


def test_baselines_need_one_gpu_per_rank():
    assert clusters.baseline_reason("nccl", 2, 2) is None
    assert clusters.baseline_reason("nccl", 2, 8) is None
    why = clusters.baseline_reason("symm-one-shot", 4, 1)
    assert why == ("symm-one-shot needs one GPU per rank (4 ranks, 1 GPU visible); it is not "
                   "run on virtual ranks")
    assert "no GPU visible" in clusters.baseline_reason("nccl", 2, 0)


def test_sweep_on_virtual_ranks_skips_the_baselines_with_the_reason(gpus):
    gpus(1)
    sweep = Sweep(collectives=["all-reduce", "all-gather"], sizes=[8192], nranks=4,
                  providers=["purlin:auto", "nccl", "symm-one-shot"])
    points, skipped = sweep.points()
    assert {p.provider.name for p in points} == {"purlin:auto"}
    assert ("nccl all-reduce: nccl needs one GPU per rank (4 ranks, 1 GPU visible); it is not "
            "run on virtual ranks") in skipped
    assert any(s.startswith("symm-one-shot all-reduce: symm-one-shot needs one GPU per rank")
               for s in skipped)
    assert sweep._cluster().kind == "virtual"
    gpus(4)
    points, skipped = Sweep(collectives=["all-reduce"], sizes=[8192], nranks=4,
                            providers=["purlin:auto", "nccl"]).points()
    assert {p.provider.name for p in points} == {"purlin:auto", "nccl"} and not skipped


def test_purlin_bench_on_one_gpu_runs_the_sm_datapath_on_virtual_ranks(gpus, monkeypatch,
                                                                        capsys, tmp_path):
    """What `purlin bench all-reduce -n 4` does on one H200: the baselines are never spawned
    (no "invalid device ordinal"), the Purlin points run on the virtual cluster."""
    gpus(1)
    ran = []

    def fake_purlin(self, cluster, point):
        from purlin.bench.metrics import Record, Timing

        ran.append(cluster)
        c = point.collective
        return Record.make(point.provider.name, c.name, c.nranks, point.nbytes, 1,
                           point.dtype, "sum", point.mode, Timing(5.0, 5.0, 5.0, 3), 0)

    def no_baselines(*a, **k):
        raise AssertionError("a baseline was spawned on virtual ranks")

    monkeypatch.setattr(Sweep, "_purlin", fake_purlin)
    monkeypatch.setattr(Sweep, "_baselines", no_baselines)
    js = tmp_path / "r.json"
    code = main(["bench", "all-reduce", "-n", "4", "-b", "8KiB,1MiB", "--no-progress",
                 "--json", str(js)])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "NOT GPU numbers" not in out + err
    assert "sm datapath, 4 virtual ranks on 1 x NVIDIA H200" in err
    assert "# cluster: sm datapath, 4 virtual ranks on 1 x NVIDIA H200" in out
    assert "# skipped: nccl all-reduce: nccl needs one GPU per rank (4 ranks, 1 GPU" in out
    assert ran and all(c.kind == "virtual" and c.nranks == 4 for c in ran)
    data = json.loads(js.read_text())
    assert data["info"]["cluster"] == "sm datapath, 4 virtual ranks on 1 x NVIDIA H200"
    assert any("nccl needs one GPU per rank" in s for s in data["skipped"])
    assert {r["provider"] for r in data["records"]} == {"purlin:auto"}


def test_purlin_bench_with_one_gpu_per_rank_keeps_nccl(gpus, monkeypatch, capsys):
    gpus(2)
    seen = {}
    monkeypatch.setattr(Sweep, "run", lambda self, progress=True: seen.setdefault("s", self)
                        or None)
    monkeypatch.setattr(commands, "report", lambda *a, **k: 0)
    assert main(["bench", "all-reduce", "-b", "8KiB", "--no-progress"]) == 0
    sweep = seen["s"]
    assert sweep.datapath == "sm" and sweep.cluster.kind == "local"
    assert sweep.cluster.nranks == 2 and [p.name for p in sweep.providers] == ["purlin:auto",
                                                                               "nccl"]
    assert not sweep.points()[1]


def test_purlin_tune_on_one_gpu_uses_virtual_ranks(gpus, monkeypatch, capsys, tmp_path):
    gpus(1)
    from purlin.bench import tune as tuning

    seen = {}

    def fake_tune(cluster, *a, **k):
        seen["cluster"] = cluster
        raise SystemExit(0)

    monkeypatch.setattr(tuning, "tune", fake_tune)
    with pytest.raises(SystemExit):
        main(["tune", "all-reduce", "-n", "4", "-b", "8KiB", "--out", str(tmp_path / "t.json")])
    assert seen["cluster"].kind == "virtual" and seen["cluster"].nranks == 4
    assert "sm datapath, 4 virtual ranks on 1 x NVIDIA H200" in capsys.readouterr().out


def test_purlin_run_sm_on_one_gpu_names_the_virtual_cluster(gpus, monkeypatch, capsys):
    """`purlin run --datapath sm -n 4` on one GPU binds on virtual ranks and says so (the bind
    itself is faked: there is no GPU here)."""
    gpus(1)
    import numpy as np

    from purlin.spec.reference import reference

    def fake_bind(self, collective, strategy="direct-push", *, sizing=None, **k):
        assert self.kind == "virtual"

        def run(inputs):
            return reference(sizing, [np.asarray(x, dtype=np.float64) for x in inputs])
        return run

    monkeypatch.setattr(Cluster, "bind", fake_bind)
    code = main(["run", "all-reduce", "-n", "4", "-b", "8KiB", "--datapath", "sm",
                 "--calls", "1"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "on the sm datapath, 4 virtual ranks on 1 x NVIDIA H200" in out


def test_purlin_trace_names_the_profile_of_its_prediction(capsys, tmp_path):
    pytest.importorskip("plotly")
    out_html = tmp_path / "t.html"
    code = main(["trace", "all-reduce", "-n", "2", "-b", "8KiB", "--profile", "H200-measured",
                 "--out", str(out_html)])
    out = capsys.readouterr().out
    assert code == 0
    assert "predicted by profile H200-measured (measured on 2xH200" in out
    assert "predicted: profile H200-measured" in out_html.read_text()


def test_a_baseline_that_dies_is_one_line_in_the_notes(gpus, monkeypatch):
    """A baseline process that fails (a raw CUDA error in a spawned rank) does not end the
    sweep: its last line goes into the skipped notes and the Purlin points still run."""
    gpus(2)
    from purlin.bench.metrics import Record, Timing

    def dies(self, points, bar):
        raise RuntimeError("\n-- Process 1 terminated with the following error:\nTraceback "
                           "...\ntorch.AcceleratorError: CUDA error: invalid device ordinal")

    monkeypatch.setattr(Sweep, "_baselines", dies)
    monkeypatch.setattr(Sweep, "_purlin", lambda self, c, p: Record.make(
        p.provider.name, "all-reduce", 2, p.nbytes, 1, p.dtype, "sum", p.mode,
        Timing(5.0, 5.0, 5.0, 3), 0))
    res = Sweep(collectives=["all-reduce"], sizes=[8192], nranks=2,
                providers=["purlin:auto", "nccl"]).run(progress=False)
    assert [r.provider for r in res.records] == ["purlin:auto"]
    assert res.skipped == ["nccl: the baseline processes failed: torch.AcceleratorError: CUDA "
                           "error: invalid device ordinal"]
    assert "# skipped: nccl: the baseline processes failed" in res.table()
