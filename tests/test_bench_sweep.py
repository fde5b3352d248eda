"""Sweeps on the cpu datapath and the cost model: records, checks, JSON, tables, figures."""

import json
import math

import pytest

from purlin.bench.sweep import Provider, Results, Sweep, powers_of_two
from purlin.errors import SpecError
from purlin.spec import Collective, collectives


@pytest.fixture(scope="module")
def cpu_results():
    sweep = Sweep(collectives=["all-reduce", "all-gather", "reduce-scatter", "all-to-all",
                               "broadcast", "reduce"],
                  sizes=[64, 4096], dtypes=["float32"], nranks=2, datapath="cpu",
                  providers=["purlin:auto", "purlin:two-phase", "purlin:ring/c2/l2"])
    return sweep.run(progress=False)


def test_cpu_sweep_checks_every_point_and_finds_nothing_wrong(cpu_results):
    recs = cpu_results.records
    # 6 collectives x 2 sizes x (auto, ring) + 3 reducing collectives x 2 sizes x two-phase
    assert len(recs) == 6 * 2 * 2 + 3 * 2
    assert all(r.wrong == 0 and r.ok for r in recs), [r.extra for r in recs if not r.ok]
    assert {r.mode for r in recs} == {"cpu"}
    assert all(r.time_us > 0 and r.busbw_gbs >= 0 for r in recs)
    ring = [r for r in recs if r.provider == "purlin:ring/c2/l2"]
    assert {(r.extra["chunks"], r.extra["lanes"]) for r in ring} == {(2, 2)}
    assert any("two-phase reduces" in s for s in cpu_results.skipped)


def test_cpu_sweep_is_labelled_as_not_gpu_numbers(cpu_results):
    text = cpu_results.table()
    assert "NOT GPU numbers" in text.splitlines()[1]
    assert cpu_results.info["datapath"] == "cpu" and "cpu" in cpu_results.info["hardware"]


def test_json_round_trip(cpu_results, tmp_path):
    path = tmp_path / "sweep.json"
    obj = cpu_results.to_json(path)
    assert set(obj) == {"info", "records", "skipped"}
    assert {"date", "hardware", "torch", "nccl", "commit"} <= set(obj["info"])
    back = Results.load(path)
    assert back.records == cpu_results.records
    assert back.info == json.loads(path.read_text())["info"]
    df = back.to_dataframe()
    assert len(df) == len(back.records) and {"busbw_gbs", "strategy", "wrong"} <= set(df.columns)


def test_nan_times_survive_json(tmp_path):
    res = Sweep(collectives=["all-reduce"], sizes=[64], dtypes=["float32"], nranks=2,
                datapath="cpu", providers=["purlin:auto"]).run(progress=False)
    bad = res.records[0]
    bad.time_us = float("nan")
    bad.extra["error"] = "X: failed"
    path = tmp_path / "r.json"
    res.to_json(path)
    assert "NaN" not in path.read_text()
    back = Results.load(path).records[0]
    assert math.isnan(back.time_us) and not back.ok


def test_predicted_sweep_uses_the_model_and_checks_nothing():
    res = Sweep(collectives=["all-reduce"], sizes=[8, 1 << 20, 1 << 30], nranks=2,
                datapath="model", providers=["purlin:auto", "purlin:direct-push", "nccl"]
                ).run(progress=False)
    assert {r.mode for r in res.records} == {"model"}
    assert all(r.wrong == -1 for r in res.records)
    assert any("nccl needs GPUs" in s for s in res.skipped)
    by = {(r.provider, r.nbytes): r for r in res.records}
    assert by[("purlin:auto", 8)].time_us < by[("purlin:auto", 1 << 30)].time_us
    assert by[("purlin:auto", 1 << 30)].extra["source"].startswith("model")


def test_custom_collectives_run_on_purlin_only():
    swapped = Collective([[0], [1]], [[1, 0], [1, 0]], "copy", name="swapped-gather")
    res = Sweep(collectives=[swapped], sizes=[256], dtypes=["float32"], nranks=2,
                datapath="cpu", providers=["purlin:direct-push"]).run(progress=False)
    assert [r.collective for r in res.records] == ["swapped-gather"]
    assert res.records[0].wrong == 0
    assert Provider.parse("nccl").skip_reason(swapped, "sm").startswith("nccl runs the six")


def test_bfloat16_on_cpu_is_skipped_with_a_reason():
    res = Sweep(collectives=["all-reduce"], sizes=[64], dtypes=["bf16", "float32"], nranks=2,
                datapath="cpu", providers=["purlin:auto"]).run(progress=False)
    assert [r.dtype for r in res.records] == ["float32"]
    assert any("no bfloat16" in s for s in res.skipped)


def test_time_limit_skips_the_rest_and_says_so():
    res = Sweep(collectives=["all-reduce"], sizes=[64, 128, 256], dtypes=["float32"],
                nranks=2, datapath="cpu", providers=["purlin:auto"], time_limit=0.0
                ).run(progress=False)
    assert res.records == [] and "time limit" in res.skipped[-1]


def test_sizes_that_do_not_split_are_fitted_once():
    res = Sweep(collectives=["all-gather"], sizes=[8, 12, 16], dtypes=["float32"], nranks=3,
                datapath="model", providers=["purlin:auto"]).run(progress=False)
    assert [r.nbytes for r in res.records] == [12]


def test_provider_names_parse_and_refuse():
    assert Provider.parse("purlin:two-phase/c4/l8").name == "purlin:two-phase/c4/l8"
    assert Provider.parse("symm-two-shot").is_baseline
    for bad in ("mpi", "purlin:zigzag", "purlin:ring/x3"):
        with pytest.raises(SpecError):
            Provider.parse(bad)
    assert powers_of_two(8, 1 << 30)[-1] == 1 << 30 and len(powers_of_two(8, 1 << 30)) == 28


def test_sweep_refuses_collectives_of_another_rank_count():
    with pytest.raises(SpecError, match="declared for 4 ranks"):
        Sweep(collectives=[collectives.all_reduce(4)], nranks=2, datapath="cpu").points()


def test_progress_falls_back_to_a_counter(monkeypatch, capsys):
    import builtins

    real_import = builtins.__import__

    def no_tqdm(name, *args, **kwargs):
        if name.startswith("tqdm"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_tqdm)
    Sweep(collectives=["all-reduce"], sizes=[64, 128], dtypes=["float32"], nranks=2,
          datapath="cpu", providers=["purlin:auto"]).run(progress=True)
    err = capsys.readouterr().err
    assert "2/2 points" in err


def test_summary_compares_with_nccl():
    from purlin.bench.metrics import Record, Timing

    def rec(p, n, us):
        return Record.make(p, "all-reduce", 2, n, n // 2, "bfloat16", "sum", "graph",
                           Timing(us, us, us, 1), 0)

    res = Results([rec("nccl", 1024, 10.0), rec("purlin:auto", 1024, 5.0),
                   rec("nccl", 1 << 28, 800.0), rec("purlin:auto", 1 << 28, 1600.0),
                   rec("purlin:ring", 1 << 28, 400.0)])
    lines = res.summary().splitlines()
    auto = next(ln for ln in lines if "purlin:auto" in ln).split()
    best = next(ln for ln in lines if "purlin (best)" in ln).split()
    assert auto[-2:] == ["2.00x", "0.50x"]
    assert best[-2:] == ["2.00x", "2.00x"]


def test_ce_provider_parses_and_is_skipped_without_gpus():
    from purlin.bench.sweep import Provider
    from purlin.spec import collectives

    p = Provider.parse("ce:two-phase/c2")
    assert (p.kind, p.strategy, p.chunks, p.name) == ("ce", "two-phase", 2, "ce:two-phase/c2")
    assert not p.is_baseline
    assert "needs GPUs" in p.skip_reason(collectives.all_gather(2), "cpu")
    assert p.skip_reason(collectives.all_reduce(2), "sm") is None
    assert "reduces" in Provider.parse("ce:two-phase").skip_reason(collectives.all_gather(2),
                                                                    "sm")


def test_the_ce_provider_defaults_to_one_lane_whole_pieces():
    """ce:auto takes the copy engines' own configuration, not the sm datapath's lane-heavy one."""
    from purlin.bench.sweep import Point, Provider, Sweep
    from purlin.spec import standard

    sweep = Sweep(collectives=["all-gather"], sizes=[1 << 20], dtypes=["bfloat16"],
                  providers=["ce:auto"], nranks=2)

    def choice(name, provider):
        point = Point(standard(name, 2), 1 << 20, "bfloat16", Provider.parse(provider), "graph")
        c = sweep.configure(None, point)
        return c.strategy, c.chunks, c.lanes

    assert choice("all-reduce", "ce:auto") == ("two-phase", 1, 1)
    assert choice("all-gather", "ce:auto") == ("direct-pull", 1, 1)
    assert choice("broadcast", "ce:direct-push") == ("direct-push", 1, 1)
    # given chunks or lanes win; the rest stays the ce default, not the sm table's
    assert choice("all-reduce", "ce:two-phase/c4") == ("two-phase", 4, 1)
    assert choice("reduce", "ce:direct-push/c8/l2") == ("direct-push", 8, 2)


def test_auto_points_run_with_the_tables_ll_and_pdl():
    """purlin:auto times the table's whole configuration; a given one runs without LL / PDL."""
    from purlin.bench.sweep import Point, Provider, Sweep
    from purlin.runtime.auto import TuningTable
    from purlin.spec import standard

    table = TuningTable("NVIDIA H200", {2: [
        {"collective": "all-reduce", "nbytes": 8192, "dtype": "bfloat16",
         "strategy": "direct-push", "chunks": 1, "lanes": 1, "blocks_per_lane": 1,
         "protocol": "ll", "pdl": True}]})
    sweep = Sweep(collectives=["all-reduce"], sizes=[8192], dtypes=["bfloat16"],
                  providers=["purlin:auto"], nranks=2, table=table)

    def choice(provider):
        point = Point(standard("all-reduce", 2), 8192, "bfloat16", Provider.parse(provider),
                      "graph")
        c = sweep.configure(None, point)
        return c.strategy, c.blocks_per_lane, c.protocol, c.pdl

    assert choice("purlin:auto") == ("direct-push", 1, "ll", True)
    assert choice("purlin:auto/b4") == ("direct-push", 4, "simple", False)


def test_checkpoint_keeps_the_points_before_one_that_never_returns(tmp_path, monkeypatch):
    """A point that hangs (here: raises out of the sweep, as a kill would stop it) leaves the
    earlier records on disk, and the file names the point that was running."""
    from purlin.bench.sweep import Results, Sweep

    sweep = Sweep(collectives=["all-gather"], sizes=[64, 4096, 65536], dtypes=["float32"],
                  providers=["purlin:direct-push"], nranks=2, datapath="cpu")
    real = Sweep._purlin
    calls = []

    def stuck_on_the_third(self, cluster, p):
        calls.append(p.nbytes)
        if len(calls) == 3:
            raise KeyboardInterrupt  # what a stuck point looks like from outside
        return real(self, cluster, p)

    monkeypatch.setattr(Sweep, "_purlin", stuck_on_the_third)
    path = tmp_path / "partial.json"
    with pytest.raises(KeyboardInterrupt):
        sweep.run(progress=False, checkpoint=path)
    part = Results.load(path)
    assert [r.nbytes for r in part.records] == calls[:2] and all(r.wrong == 0
                                                                  for r in part.records)
    assert part.info["running"].startswith("purlin:direct-push all-gather 65536 B")
    monkeypatch.setattr(Sweep, "_purlin", real)
    done = sweep.run(progress=False, checkpoint=path)
    assert len(Results.load(path).records) == len(done.records) == 3
    assert "running" not in Results.load(path).info


def test_commit_names_a_tree_that_differs_from_its_head(monkeypatch):
    """A results file names the commit it ran: PURLIN_COMMIT first, else git's HEAD, marked
    +dirty where tracked files differ from it (a copied tree with a stale .git), else
    "unknown"."""
    import subprocess

    from purlin.bench import sweep

    answers = {}

    def run(cmd, **kw):
        out = answers[cmd[1]]
        if isinstance(out, Exception):
            raise out
        return subprocess.CompletedProcess(cmd, 0, stdout=out, stderr="")

    monkeypatch.delenv("PURLIN_COMMIT", raising=False)
    monkeypatch.setattr(sweep.subprocess, "run", run)
    answers.update({"rev-parse": "abc123\n", "status": ""})
    assert sweep.commit() == "abc123"
    answers["status"] = " M kernels/fused.py\n"
    assert sweep.commit() == "abc123+dirty"
    answers["rev-parse"] = subprocess.CalledProcessError(128, "git")
    assert sweep.commit() == "unknown"
    monkeypatch.setenv("PURLIN_COMMIT", "f00d")
    assert sweep.commit() == "f00d"
