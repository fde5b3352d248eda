"""bench/: one short script per published table, each importing the installed package and
naming the one command that reproduces it; the GPU session script's stages, dry-run."""

import ast
import shutil
import subprocess
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
SCRIPTS = ("sweep", "allreduce", "ce", "process_mode", "tp_decoder", "inlayer", "timelines",
           "plan_verify", "moe", "all_to_all_v", "versions")
PROBES = ("ce_hang_probe.py", "gpu_floor.py", "gpu_kernels_check.py", "viz_5000_bars.py",
          "gpu_call.sh", "gpu_tune.py", "gpu_wheels.sh")


@pytest.mark.parametrize("name", SCRIPTS)
def test_each_script_imports_the_package_and_says_its_command(name):
    path = BENCH / f"{name}.py"
    text = path.read_text()
    assert "sys.path" not in text, f"{path.name} edits sys.path"
    doc = ast.get_docstring(ast.parse(text))
    assert f"python3 bench/{name}.py" in doc.split("\n\n")[1], \
        f"{path.name}'s docstring does not open with the command that reproduces its table"
    assert "bench/results" not in text


def test_the_probes_are_gone():
    assert not [p for p in PROBES if (BENCH / p).exists()]
    assert not (BENCH / "apps").exists()


def test_output_goes_under_outputs_by_default(tmp_path, monkeypatch):
    from purlin.bench.scripts import OUTPUTS, folder, output

    monkeypatch.chdir(tmp_path)
    assert output(None, "x.json") == OUTPUTS / "x.json" and (tmp_path / "outputs").is_dir()
    assert output(tmp_path / "a" / "b.json", "x.json") == tmp_path / "a" / "b.json"
    assert folder(tmp_path / "f") == tmp_path / "f" and (tmp_path / "f").is_dir()


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_gpu_session_dry_run_bounds_every_one_gpu_stage(tmp_path):
    script = BENCH / "gpu_session.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    out = subprocess.run(["bash", str(script), "--dry-run", "--limit", "500", "one-gpu"],
                         capture_output=True, text=True, cwd=BENCH.parent, timeout=60,
                         env={"PATH": "/usr/bin:/bin", "OUT": str(tmp_path)}).stdout
    stages = [ln.split()[1] for ln in out.splitlines() if ln.startswith("=== ")]
    assert stages == ["env", "imports", "cli1", "notebooks1", "custom", "fusedtrace", "fp8det",
                      "varlen", "epilogues", "vtests"]
    commands = [ln.strip() for ln in out.splitlines() if ln.startswith("  timeout ")]
    assert any("purlin bench all-reduce -n 4 -b 8KiB:1MiB" in c for c in commands)
    assert any("purlin trace all-reduce -n 4" in c and "--measure" in c for c in commands)
    assert any(c.endswith("-m gpu tests > $OUT/gpu_tests_virtual.log") for c in commands)
    assert any("bench/all_to_all_v.py" in c for c in commands)
    assert all(str(tmp_path) in c or "pytest" in c or "purlin run" in c for c in commands)


def _load(name):
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_allreduce_script_on_virtual_ranks_skips_the_baselines(tmp_path, monkeypatch, capsys):
    """bench/allreduce.py's wiring with the GPU parts faked: the tuner's candidates, the eager
    points, the baselines skipped on virtual ranks with the reason, one JSON."""
    import json

    from purlin.bench import clusters, tune
    from purlin.bench.metrics import Record, Timing
    from purlin.bench.sweep import Results, Sweep
    from purlin.runtime.cluster import Cluster

    script = _load("allreduce")
    virtual = Cluster("virtual", 2, (0, 0))
    monkeypatch.setattr(script, "choose", lambda n: virtual)
    monkeypatch.setattr(clusters, "gpu_names", lambda devs: ["NVIDIA H200"] * len(devs))

    def rec(provider, nbytes, mode, us, **extra):
        return Record.make(provider, "all-reduce", 2, nbytes, nbytes // 2, "bfloat16", "sum",
                           mode, Timing(us, us, us, 3), 0, **extra)

    def fake_tune(cluster, names, sizes, dtype, **k):
        assert cluster is virtual and names == ["all-reduce"]
        return tune.TuneResult(None, Results([rec("purlin:direct-push", s, "graph", 4.0,
                                                  strategy="direct-push", chunks=1, lanes=1,
                                                  blocks_per_lane=8) for s in sizes], {}))

    monkeypatch.setattr(script.tune, "tune", fake_tune)
    monkeypatch.setattr(Sweep, "_purlin", lambda self, c, p: rec(p.provider.name, p.nbytes,
                                                                 p.mode, 9.0))
    monkeypatch.setattr(Sweep, "_baselines", lambda *a: pytest.fail("a baseline ran"))
    monkeypatch.setattr("sys.argv", ["allreduce.py", "--out", str(tmp_path)])
    assert script.main() == 0
    out = capsys.readouterr().out
    assert "on the sm datapath, 2 virtual ranks on 1 x NVIDIA H200" in out
    assert "# skipped: nccl all-reduce: nccl needs one GPU per rank (2 ranks, 1 GPU" in out
    data = json.loads((tmp_path / "allreduce.json").read_text())
    assert {(r["provider"], r["mode"]) for r in data["records"]} == {
        ("purlin:direct-push", "graph"), ("purlin:auto", "eager")}
    assert sum("needs one GPU per rank" in s for s in data["skipped"]) == 4  # 3 graph + 1 eager


@pytest.mark.parametrize("name", ["ce", "timelines", "process_mode", "tp_decoder", "inlayer"])
def test_one_rank_per_gpu_scripts_refuse_in_one_line(name, tmp_path, monkeypatch, capsys):
    from purlin.bench import clusters

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(clusters, "gpu_count", lambda: 1)
    monkeypatch.setattr("sys.argv", [f"{name}.py"])
    script = _load(name)
    assert (script.main() if name in ("ce", "timelines") else script.main([])) == 2
    err = capsys.readouterr().err
    assert err == (f"bench/{name}.py runs one rank per GPU: it needs 2 GPUs and 1 is visible "
                   "(on one GPU, `purlin bench -n 2` measures virtual ranks)\n")
    assert not (tmp_path / "outputs").exists()


def _versions():
    import importlib.util

    spec = importlib.util.spec_from_file_location("versions", BENCH / "versions.py")
    versions = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(versions)
    return versions


def test_versions_summary_compares_the_same_binds(monkeypatch):
    versions = _versions()
    rows = []
    for version, scale in (("before", 1.0), ("now", 1.1)):
        for name in versions.NAMES:
            slow = 2.0 if name == "reduce" and version == "now" else 1.0
            rows.append({"version": version, "ranks": 4, "collective": name, "bytes": 8192,
                         "bind": "auto", "us": 10.0 * scale * slow, "wrong": 0})
            rows.append({"version": version, "ranks": 4, "collective": name, "bytes": 8192,
                         "bind": "direct-push fused", "us": 5.0, "wrong": 0})
    # a wrong result never counts as the best bind
    rows.append({"version": "now", "ranks": 4, "collective": "all_gather", "bytes": 8192,
                 "bind": "direct-push ll", "us": 1.0, "wrong": 3})
    (line,) = versions.summary(rows)
    assert line["best"]["geomean"] == pytest.approx(1.0)
    assert line["auto"]["worst_of"] == "reduce" and line["auto"]["worst"] == pytest.approx(2.2)
    assert line["auto"]["geomean"] == pytest.approx(1.1 * 2 ** (1 / 6))
    assert line["auto"]["compared"] == 6 and line["auto"]["now_missing"] == 0


def test_versions_measures_the_named_custom_cases_and_their_twins():
    versions = _versions()
    standard = list(versions._targets(4, [8192, 65536], []))
    assert [t[0] for t in standard[:2]] == ["all_reduce", "all_reduce"]
    assert len(standard) == 12 and standard[1][3] == {"nbytes": 65536}
    cases = list(versions._targets(4, [8192], ["gqa"]))
    assert [t[0] for t in cases] == [
        "gqa all-gather (custom)", "gqa all-gather (twin)",
        "gqa all-gather, odd pieces (custom)", "gqa all-gather, odd pieces (twin)"]
    custom = cases[2]
    assert set(custom[3]) == {"chunk_sizes"} and custom[4] == versions.CASE_BINDS
    # (the odd pieces are each one element longer than the aligned case's)
    assert all(custom[3]["chunk_sizes"][k] == v + 1
               for k, v in cases[0][3]["chunk_sizes"].items())

    rows = []
    for version, custom_us in (("before", 12.0), ("now", 9.0)):
        for side, us in (("custom", custom_us), ("twin", 8.0)):
            for bind, scale in (("auto", 1.0), ("direct-pull fused", 1.25)):
                rows.append({"version": version, "ranks": 4, "bytes": 8192, "bind": bind,
                             "collective": f"gqa all-gather ({side})", "us": us * scale,
                             "wrong": 0})
    rows.append({"version": "now", "ranks": 4, "bytes": 8192, "bind": "direct-push fused",
                 "collective": "gqa all-gather (custom)", "us": 1.0, "wrong": 5})
    (line,) = versions.summary(rows)
    assert line["best"]["compared"] == 2 and line["best"]["worst"] == pytest.approx(1.0)
    assert line["best"]["geomean"] == pytest.approx(0.75 ** 0.5)
    (case,) = versions.case_lines(rows)
    assert case["case"] == "gqa all-gather"
    assert case["before"]["ratio"] == pytest.approx(1.5)
    assert case["now"] == {"custom": 9.0, "twin": 8.0, "ratio": pytest.approx(9 / 8)}
    assert "1.500 -> 1.125" in versions._case_table([case])


def test_versions_refuses_a_case_word_that_names_no_case(tmp_path, capsys):
    before = tmp_path / "before"
    (before / "purlin").mkdir(parents=True)
    (before / "purlin" / "__init__.py").write_text("")
    with pytest.raises(SystemExit):
        _versions().main(["--before", str(before), "--cases", "gqq"])
    assert "--cases gqq: no case of bench/custom_vs_standard.py holds gqq" in \
        capsys.readouterr().err


def test_versions_rows_say_what_ran_as_far_as_a_version_tells():
    from types import SimpleNamespace

    from purlin import Cluster, collectives

    versions = _versions()
    fused = SimpleNamespace(schedule=SimpleNamespace(strategy="direct-push"), protocol="fused-ll",
                            launches=[SimpleNamespace(launcher=SimpleNamespace(kernel="fused-seg"))],
                            blocks_per_lane=8, threads=128)
    assert versions._how(fused) == "direct-push fused-ll fused-seg b8 t128"
    cpu = Cluster.cpu(2).bind(collectives.all_reduce(2), "two-phase", count=64)
    assert versions._how(cpu) == "two-phase"  # (a bind that names no launch)
