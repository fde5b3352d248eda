"""``purlin bench`` and ``purlin tune`` where there is no GPU: the cpu datapath, the cost
model's table, the candidate list, saved records."""

import json

import pytest

from purlin.bench import commands
from purlin.cli import main, size_list


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(autouse=True)
def no_gpus(monkeypatch):
    monkeypatch.setattr(commands, "gpu_count", lambda: 0)
    monkeypatch.delenv("PURLIN_TUNING", raising=False)


def test_bench_without_gpus_says_so_and_runs_the_cpu_datapath(capsys):
    code, out, err = run(capsys, "bench", "all-reduce", "-b", "64,4KiB", "--no-progress")
    assert code == 0
    assert "no CUDA GPU is visible" in err and "NOT GPU numbers" in err
    assert "NOT GPU numbers" in out
    rows = [ln.split() for ln in out.splitlines() if ln and not ln.startswith("#")]
    assert {r[0] for r in rows} == {"64", "4096"}
    assert all(r[8] == "0" for r in rows)  # #wrong
    assert {"float32"} == {r[2] for r in rows}


def test_bench_datapath_cpu_with_providers_json_and_html(capsys, tmp_path):
    pytest.importorskip("plotly")
    js, html = tmp_path / "r.json", tmp_path / "r.html"
    code, out, err = run(capsys, "bench", "all-gather", "reduce-scatter", "--datapath", "cpu",
                         "-b", "8:32", "-p", "purlin:direct-push,purlin:ring,nccl",
                         "--no-progress", "--json", str(js), "--html", str(html))
    assert code == 0 and err == ""
    data = json.loads(js.read_text())
    assert len(data["records"]) == 2 * 2 * 3  # collectives x providers x sizes 8, 16, 32
    assert any("nccl needs GPUs" in s for s in data["skipped"])
    assert html.stat().st_size > 1000
    code, again, _ = run(capsys, "bench", "--load", str(js))
    assert code == 0 and "# all-gather | purlin:ring" in again


def test_bench_predict_prints_the_models_table(capsys):
    code, out, err = run(capsys, "bench", "all", "--predict", "-b", "8,1MiB,1GiB",
                         "--no-progress")
    assert code == 0 and err == ""
    assert "cost model prediction" in out and "H200-measured" in out
    for coll in ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "broadcast",
                 "reduce"):
        assert f"# {coll} | purlin:auto" in out
    rows = [ln.split() for ln in out.splitlines() if ln.strip().startswith("1073741824")]
    assert rows and all(r[8] == "N/A" and float(r[7]) > 100 for r in rows)


def test_bench_refuses_sm_without_gpus(capsys):
    code, _, err = run(capsys, "bench", "--datapath", "sm", "-b", "64")
    assert code == 1 and "needs GPUs" in err


def test_tune_lists_candidates_without_a_gpu_and_refuses_to_measure(capsys):
    code, out, _ = run(capsys, "tune", "all-reduce", "all-gather", "--list", "-b", "1MiB",
                       "--sms", "16", "--limit", "3")
    assert code == 0 and "SM budget of 16 blocks" in out
    assert "all-reduce" in out and "two-phase" in out
    assert "two-phase" not in next(ln for ln in out.splitlines() if "all-gather" in ln)
    code, _, err = run(capsys, "tune", "-b", "1MiB")
    assert code == 1 and "needs GPUs" in err


def test_size_lists():
    assert size_list("8:1GiB")[-1] == 1 << 30 and len(size_list("8:1GiB")) == 28
    assert size_list("64KiB,1MiB") == [65536, 1 << 20]
    assert size_list(None) is None
