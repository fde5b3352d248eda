"""bench/peers.py and purlin.bench.peers on the CPU: the plan and its skip reasons (dry run),
the ratio to the best peer and the tables on fake timings, FlashInfer's stripped wheel, the
NCCL window's sizes, and the GPU session's stage."""

import ast
import base64
import doctest
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from purlin.bench import peers
from purlin.bench.metrics import Record, Timing

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "peers.py"
KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
NO_GPU = peers.Environment(0, None, None, None, "flashinfer is not installed here", None)


def _run(*args, timeout=240):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=timeout, env=env)


def _load_script():
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_peers", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_module_doctests_pass():
    assert doctest.testmod(peers).failed == 0


def test_the_script_says_its_command_and_leaves_sys_path_alone():
    text = SCRIPT.read_text()
    doc = ast.get_docstring(ast.parse(text))
    assert "python3 bench/peers.py" in doc.split("\n\n")[1]
    assert "sys.path" not in text


def test_dry_run_prints_the_whole_plan_and_what_is_skipped_here():
    out = _run("--dry-run")
    assert out.returncode == 0, out.stderr
    assert "Traceback" not in out.stdout + out.stderr
    text = out.stdout
    assert "# the plan on 2 GPUs with every peer present" in text
    for coll in peers.SIX:
        for peer in ("nccl", "nccl-window", "purlin:auto", "purlin-process"):
            assert re.search(rf"^{re.escape(peer)}\s+{coll}\s+14 sizes: 8 B \.\. 1 GiB$", text,
                             re.M), (peer, coll)
    for peer in ("symm-one-shot", "symm-two-shot"):
        assert re.search(rf"^{peer}\s+all-reduce\s+14 sizes", text, re.M)
        assert not re.search(rf"^{peer}\s+all-gather", text, re.M)
    assert re.search(r"^flashinfer-oneshot\s+all-reduce\s+12 sizes: 64 B \.\. 256 MiB$", text,
                     re.M)
    assert re.search(r"^flashinfer-twoshot\s+all-reduce\s+8 sizes: 32 KiB \.\. 256 MiB$",
                     text, re.M)
    assert "flashinfer-twoshot all-reduce 1 GiB: FlashInfer runs up to 256 MiB here" in text
    assert re.search(r"^ce:auto\s+all-gather\s+3 sizes: 64 MiB \.\. 1 GiB$", text, re.M)
    assert not re.search(r"^purlin:two-phase\s+all-gather", text, re.M)
    assert "10000 per size" in text
    assert "1x4096, 8x4096, 32x4096, 64x4096, 1x8192, 8x8192, 32x8192, 64x8192" in text
    # what this machine lacks, one line per peer with every reason
    env = peers.probe()
    here = [ln for ln in text.splitlines() if ln.startswith("# skipped here: ")]
    if env.missing("gpus") is not None:
        assert any(ln.startswith("# skipped here: nccl: needs 2 GPUs") for ln in here)
        assert any(ln.startswith("# skipped here: purlin:auto: needs 2 GPUs") for ln in here)
        assert any("graph replays: needs 2 GPUs" in ln for ln in here)
    if env.flashinfer:
        assert any(ln.startswith("# skipped here: flashinfer-oneshot:") and env.flashinfer in ln
                   for ln in here)


def test_the_whole_run_is_estimated_under_nine_minutes():
    text = _run("--dry-run").stdout
    total = int(re.search(r"estimate on 2 x H200: .*; total (\d+) s", text).group(1))
    assert 300 < total <= 540
    quick = _run("--dry-run", "--quick").stdout
    assert re.search(r"^nccl\s+all-reduce\s+4 sizes: 8 B \.\. 64 MiB$", quick, re.M)
    assert int(re.search(r"total (\d+) s", quick).group(1)) < total


def test_without_gpus_the_run_writes_its_skip_lines_not_a_traceback(tmp_path, capsys):
    if peers.probe().gpus >= 2:
        pytest.skip("this machine has 2 GPUs: the run would measure")
    script = _load_script()
    rc = script.main(["--quick", "--out", str(tmp_path)])
    assert rc == 2
    out = capsys.readouterr().out
    assert "Traceback" not in out and "nothing measured: needs 2 GPUs" in out
    saved = json.loads((tmp_path / "peers.json").read_text())
    assert saved["records"] == [] and any("nccl: needs 2 GPUs" in s for s in saved["skipped"])


def test_the_plan_on_two_gpus():
    p = peers.plan(list(peers.SIX), list(peers.SIZES), peers.Environment.complete(2))
    assert len(p.sizes("nccl", "all-gather")) == 14
    assert p.sizes("purlin:ring", "all-reduce") == list(peers.SIZES[::2]) + [GiB]
    assert p.sizes("purlin:two-phase", "all-gather") == []
    assert p.sizes("ce:auto", "broadcast") == [64 * MiB, 256 * MiB, GiB]
    assert p.sizes("symm-one-shot", "all-reduce") == list(peers.SIZES)
    assert p.sizes("flashinfer-twoshot", "all-reduce")[0] == 32 * KiB
    assert GiB not in p.sizes("flashinfer-oneshot", "all-reduce")
    assert all(s.startswith("flashinfer-") for s in p.skipped)
    assert len(p.norm_shapes) == 8 and len(p.tp_configs) == 8 and p.replays == 10000


def test_what_is_missing_becomes_one_line_per_peer():
    env = peers.Environment(2, None, "no window here", None, "no flashinfer here", None)
    p = peers.plan(["all-reduce"], [8 * KiB], env)
    assert "nccl-window: no window here" in p.skipped
    assert "flashinfer-oneshot: no flashinfer here" in p.skipped
    assert any(s.startswith("flashinfer-fused") and "no flashinfer here" in s for s in p.skipped)
    assert not p.of("nccl-window", "flashinfer-oneshot", "flashinfer-twoshot")
    assert p.of("nccl") and p.norm_shapes  # the rest still runs
    p = peers.plan(["all-reduce"], [8 * KiB], NO_GPU)
    assert not p.points and not p.norm_shapes and not p.tp_configs and p.replays == 0
    assert "purlin:auto: needs 2 GPUs, one per rank, and 0 are visible" in p.skipped


def _rec(provider, us, nbytes=8 * KiB, coll="all-reduce", wrong=0, **extra):
    t = Timing(us, us, us, 5)
    return Record.make(provider, coll, 2, nbytes, nbytes // 2, "bfloat16", "sum", "graph", t,
                       wrong, **extra)


def _fake():
    nan = float("nan")
    return [_rec("nccl", 12.0), _rec("nccl-window", 6.0), _rec("symm-one-shot", 7.5),
            _rec("flashinfer-oneshot", 2.5), _rec("purlin:auto", 3.0), _rec("purlin:ring", 2.0),
            _rec("purlin-process", 5.0),
            _rec("nccl", 80.0, 16 * MiB), _rec("purlin:auto", 58.0, 16 * MiB),
            _rec("symm-two-shot", 50.0, 16 * MiB, wrong=3),  # wrong: never the best peer
            Record.make("flashinfer-twoshot", "all-reduce", 2, 16 * MiB, 0, "bfloat16", "sum",
                        "graph", Timing(nan, nan, nan, 0), -1, error="Boom\nRuntimeError: x"),
            _rec("nccl", 10.0, 8 * KiB, "all-gather"), _rec("purlin:auto", 4.0, 8 * KiB,
                                                              "all-gather")]


def test_the_ratio_to_the_best_peer_per_size():
    rows = {(r["collective"], r["nbytes"]): r for r in peers.ratios(_fake())}
    small = rows[("all-reduce", 8 * KiB)]
    assert small["best_peer"] == "flashinfer-oneshot" and small["purlin"] == "purlin:ring"
    assert small["ratio"] == pytest.approx(1.25) and small["ratio_process"] == pytest.approx(0.5)
    big = rows[("all-reduce", 16 * MiB)]
    assert big["best_peer"] == "nccl" and big["ratio"] == pytest.approx(80 / 58, abs=1e-3)
    assert big["ratio_process"] is None
    assert rows[("all-gather", 8 * KiB)]["ratio"] == pytest.approx(2.5)
    best = {(r.collective, r.nbytes): r for r in peers.best_peer_records(_fake())}
    assert best[("all-reduce", 16 * MiB)].extra["peer"] == "nccl"
    assert best[("all-reduce", 8 * KiB)].time_us == 2.5


def test_one_table_per_collective_with_every_peer_beside_purlin():
    ran, lines = peers.failures_as_skips(_fake())
    assert lines == ["flashinfer-twoshot all-reduce 16 MiB: RuntimeError: x"]
    text = peers.tables(ran, lines)
    blocks = text.split("\n#\n")
    assert blocks[0].startswith("# all-reduce:") and blocks[1].startswith("# all-gather:")
    head = blocks[0].splitlines()[1].split()
    assert head[:5] == ["size", "auto", "ring", "process", "nccl"]
    assert {"nccl-win", "symm-1shot", "symm-2shot", "fi-1shot"} <= set(head)
    row = next(ln for ln in blocks[0].splitlines() if ln.strip().startswith("8 KiB"))
    assert row.split()[-3:] == ["fi-1shot", "1.25x", "0.50x"]
    row16 = next(ln for ln in blocks[0].splitlines() if ln.strip().startswith("16 MiB"))
    assert "50.00*" in row16 and row16.split()[-3:] == ["nccl", "1.38x", "-"]
    assert text.endswith("# skipped: flashinfer-twoshot all-reduce 16 MiB: RuntimeError: x")


def test_the_norm_and_decoder_tables():
    script = _load_script()
    norm = script.norm_table([
        {"rows": 1, "hidden": 4096, "purlin-epilogue_us": 5.0, "flashinfer-oneshot_us": 6.0,
         "purlin+torch_us": 10.0, "nccl+torch_us": 12.0, "purlin-epilogue_wrong": (0, 0),
         "flashinfer-oneshot_wrong": (0, 0)},
        {"rows": 64, "hidden": 8192, "error": "Boom"}])
    line = next(ln for ln in norm.splitlines() if ln.strip().startswith("1x4096"))
    assert "1.20x" in line and "2.40x" in line
    assert "64x8192 failed: Boom" in norm
    tp = script.tp_table([{"hidden": 4096, "batch": 1, "nccl_us": 4600.0,
                           "purlin-epi_us": 3900.0, "flashinfer_us": 4000.0,
                           "none-fn_us": 3800.0, "purlin-epi_vs_nccl": 1.18,
                           "flashinfer_vs_nccl": 1.15, "purlin-epi_vs_flashinfer": 1.03,
                           "none-fn_vs_nccl": 1.21, "agree": True}])
    assert tp.splitlines()[-1].split()[-5:] == ["1.18x", "1.15x", "1.03x", "1.21x", "yes"]


def test_the_nccl_window_holds_the_largest_point():
    points = [("nccl-window", "all-gather", 1 * GiB, "bfloat16", "none", "graph"),
              ("nccl-window", "reduce-scatter", 256 * MiB, "bfloat16", "sum", "graph"),
              ("nccl", "all-to-all", 4 * GiB, "bfloat16", "none", "graph")]
    assert peers.NcclWindow.needs(points, 2) == (512 * MiB, 1 * GiB)  # all-gather: in, out


def test_nccl_window_is_a_baseline_provider():
    from purlin.bench.sweep import Provider
    from purlin.spec import Collective

    p = Provider.parse("nccl-window")
    assert p.is_baseline and p.name == "nccl-window"
    custom = Collective([["a"], ["b"]], [["b"], ["a"]], "copy", name="swap")
    assert "six standard collectives" in p.skip_reason(custom, "sm", gpus=2)


def _wheel(path: Path) -> Path:
    files = {
        "flashinfer/__init__.py": b"from .attention import everything\n",
        "flashinfer/version.py": b"__version__ = '0.7.4'\n",
        "flashinfer/utils.py": b"x = 1\n",
        "flashinfer/comm/__init__.py": b"",
        "flashinfer/comm/trtllm_ar.py": b"y = 2\n",
        "flashinfer/jit/core.py": b"z = 3\n",
        "flashinfer/attention/big.py": b"w = 4\n" * 1000,
        "flashinfer/data/csrc/trtllm_allreduce.cu":
            b'#include "flashinfer/comm/a.cuh"\n#include <cuda_runtime.h>\n',
        "flashinfer/data/include/flashinfer/comm/a.cuh": b'#include "b.h"\n#include <vector>\n',
        "flashinfer/data/include/flashinfer/comm/b.h":
            b'  #  include <cutlass/numeric_types.h>\n',
        "flashinfer/data/cutlass/include/cutlass/numeric_types.h": b"// cutlass\n",
        "flashinfer/data/cutlass/include/cutlass/gemm.h": b"// not needed\n",
        "flashinfer/data/cccl/libcudacxx/include/cuda/std/atomic": b"// reached from CUDA's\n",
        "flashinfer/data/csrc/attention.cu": b'#include "flashinfer/attention.cuh"\n',
        "flashinfer/data/include/flashinfer/attention.cuh": b"// not needed\n",
        "flashinfer_python-0.7.4.dist-info/METADATA": b"Name: flashinfer-python\n",
        "flashinfer_python-0.7.4.dist-info/RECORD": b"stale\n",
    }
    with zipfile.ZipFile(path, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
    return path


def test_strip_flashinfer_keeps_the_all_reduce_kernels_and_their_headers(tmp_path):
    src = _wheel(tmp_path / "flashinfer_python-0.7.4-py3-none-any.whl")
    out = peers.strip_flashinfer(src, tmp_path / "out")
    assert out.name == src.name and out.parent == tmp_path / "out"
    z = zipfile.ZipFile(out)
    names = set(z.namelist())
    assert {"flashinfer/version.py", "flashinfer/utils.py", "flashinfer/comm/trtllm_ar.py",
            "flashinfer/jit/core.py", "flashinfer/data/csrc/trtllm_allreduce.cu",
            "flashinfer/data/include/flashinfer/comm/a.cuh",
            "flashinfer/data/include/flashinfer/comm/b.h",
            "flashinfer/data/cutlass/include/cutlass/numeric_types.h",
            "flashinfer/data/cccl/libcudacxx/include/cuda/std/atomic",
            "flashinfer_python-0.7.4.dist-info/METADATA"} <= names
    assert not {"flashinfer/attention/big.py", "flashinfer/data/csrc/attention.cu",
                "flashinfer/data/include/flashinfer/attention.cuh",
                "flashinfer/data/cutlass/include/cutlass/gemm.h"} & names
    init = z.read("flashinfer/__init__.py")
    assert b"attention" not in init and b"__version__" in init
    record = z.read("flashinfer_python-0.7.4.dist-info/RECORD").decode().splitlines()
    assert record[-1] == "flashinfer_python-0.7.4.dist-info/RECORD,,"
    for line in record[:-1]:
        name, digest, size = line.rsplit(",", 2)
        data = z.read(name)
        want = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        assert digest == f"sha256={want}" and int(size) == len(data)
    assert len(record) - 1 == len(names) - 1  # every file but RECORD itself


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_the_gpu_session_has_a_peers_stage(tmp_path):
    out = subprocess.run(["bash", str(ROOT / "bench" / "gpu_session.sh"), "--dry-run", "env",
                          "peers"], capture_output=True, text=True, cwd=ROOT, timeout=60,
                         env={"PATH": "/usr/bin:/bin", "OUT": str(tmp_path)}).stdout
    assert [ln.split()[1] for ln in out.splitlines() if ln.startswith("=== ")] == ["env",
                                                                                    "peers"]
    assert f"timeout 570 python3 bench/peers.py --out {tmp_path}/peers" in out
    wheels = (ROOT / "bench" / "wheels.sh").read_text()
    assert "--peers" in wheels and "strip_flashinfer" in wheels
    assert subprocess.run(["bash", "-n", str(ROOT / "bench" / "wheels.sh")]).returncode == 0


@pytest.mark.slow
def test_without_a_window_the_nccl_window_points_say_why_and_nccl_still_runs():
    pytest.importorskip("torch")
    from purlin.bench.torch_dist import run_baselines

    points = [("nccl-window", "all-reduce", 256, "float32", "sum", "eager"),
              ("nccl", "all-reduce", 256, "float32", "sum", "eager")]
    window, nccl = run_baselines(points, world=2, repeats=2, eager_calls=3, device="cpu")
    assert nccl.ok and nccl.wrong == 0
    assert not window.ok and "no NCCL window" in window.extra["error"]
    ran, lines = peers.failures_as_skips([window, nccl])
    assert ran == [nccl] and len(lines) == 1
    assert lines[0].startswith("nccl-window all-reduce 256 B: RuntimeError: no NCCL window")


def test_the_run_put_together_on_fake_phases(tmp_path, monkeypatch, capsys):
    """main()'s phases with the GPU work faked: every provider's records reach one table per
    collective, the ratios, the JSON and the figure; failures become skip lines."""
    import purlin.bench.torch_dist as torch_dist
    import purlin.torch.testing as testing
    from purlin.bench.sweep import Results

    script = _load_script()
    monkeypatch.setattr(script.peers, "probe", lambda: peers.Environment.complete(2))
    marker = tmp_path / "marker"
    marker.write_text("ok")

    class Done:
        def poll(self):
            return 0

    monkeypatch.setattr(script, "start_flashinfer_build", lambda out: (Done(), str(marker)))
    asked = {}

    def baselines(points, **kw):
        asked["baselines"] = points
        return [_rec(p[0], 10.0 if p[0] == "nccl" else 8.0, p[2], p[1]) for p in points]

    monkeypatch.setattr(torch_dist, "run_baselines", baselines)
    monkeypatch.setattr(script, "run_single_process", lambda plan, args, deadline: Results(
        [_rec(p.peer, 4.0, p.nbytes, p.collective) for p in plan.points
         if peers.BY_NAME[p.peer].mode == "single"], {}, ["ce:auto: a note"]))

    def processes(fn, n, opts, **kw):
        if fn.__name__ == "process_worker":
            asked["process"] = opts
            recs = [_rec("purlin-process", 5.0, nb, c).to_dict()
                    for c, nb in opts["process_points"]]
            recs += [_rec(p, 6.0, nb).to_dict() for p, nb in opts["flashinfer_points"]]
            recs[0] = script._failed("purlin-process", "all-reduce", 8, 4, "fell back: x")
            value = {"records": recs, "skipped": [], "replays": [
                {"nbytes": nb, "replays": opts["replays"], "wrong": 0} for nb in (8192,)],
                "norm": [{"rows": 1, "hidden": 4096, "purlin-epilogue_us": 5.0,
                          "nccl+torch_us": 9.0, "flashinfer-oneshot_us": 6.0}]}
        else:
            asked["tp"] = opts
            value = {"rows": [{"hidden": 4096, "batch": 1, "nccl_us": 10.0, "agree": True}],
                     "skipped": ["flashinfer in the TP=2 decoder: a reason"]}
        return [("ok", value), ("ok", None)]

    monkeypatch.setattr(testing, "run_processes", processes)
    rc = script.main(["--quick", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert {p[0] for p in asked["baselines"]} == {"nccl", "nccl-window", "symm-one-shot",
                                                  "symm-two-shot"}
    assert asked["process"]["replays"] == 1000 and asked["process"]["flashinfer"]
    assert asked["tp"]["configs"] == [(4096, 1), (4096, 8)] and asked["tp"]["layers"] == 8
    assert "# all-reduce: bf16 us per op" in out and "# reduce: bf16 us per op" in out
    assert "# skipped: purlin-process all-reduce 8 B: fell back: x" in out
    assert "# skipped: flashinfer in the TP=2 decoder: a reason" in out
    assert "# replays 8 KiB: 0 wrong in 1000" in out
    saved = json.loads((tmp_path / "peers.json").read_text())
    ratio = {(r["collective"], r["nbytes"]): r for r in saved["ratios"]}
    assert ratio[("all-gather", 8 * KiB)]["best_peer"] == "nccl-window"
    assert ratio[("all-gather", 8 * KiB)]["ratio"] == pytest.approx(2.0)
    assert saved["norm"][0]["rows"] == 1 and saved["tp_decoder"][0]["agree"]
    assert saved["flashinfer_build"] == "ok"
    assert (tmp_path / "peers.html").exists()
