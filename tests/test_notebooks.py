"""The notebooks: committed without outputs, and each one runs headless, top to bottom, on the
cpu datapath (nbclient, a fresh kernel, a time limit per cell). The tour runs through
``purlin demo``, which also writes its timelines as a standalone HTML page."""

import json
import math

import pytest

nbformat = pytest.importorskip("nbformat", reason="pip install -e '.[notebook]'")
pytest.importorskip("nbclient", reason="pip install -e '.[notebook]'")
pytest.importorskip("ipykernel", reason="pip install -e '.[notebook]'")

from purlin.bench.metrics import Record, Timing  # noqa: E402
from purlin.cli import main  # noqa: E402
from purlin.notebooks import execute, notebook_paths  # noqa: E402

PATHS = {p.stem: p for p in notebook_paths()}
CELL_TIMEOUT = 120
PLOTLY = "application/vnd.plotly.v1+json"
WIDGET = "application/vnd.jupyter.widget-view+json"


def outputs(nb, kind=None):
    """Every output of every code cell (of mime type ``kind`` if given)."""
    found = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", ())]
    if kind is None:
        return found
    return [o for o in found if kind in o.get("data", {})]


def text_of(nb) -> str:
    parts = []
    for o in outputs(nb):
        parts.append(o.get("text", "") if o.get("output_type") == "stream"
                     else str(o.get("data", {}).get("text/plain", "")))
    return "\n".join(parts)


def test_the_seven_stories_are_there():
    assert list(PATHS) == ["01-tour", "02-custom-collective", "03-timelines", "04-benchmark",
                           "05-your-own-strategy", "06-variable-length-and-fp8",
                           "07-your-own-epilogue"]


@pytest.mark.parametrize("name", list(PATHS))
def test_committed_notebooks_carry_no_outputs(name):
    path = PATHS[name]
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        assert cell.outputs == [], f"{path.name} cell {i} has outputs: clear them before commit"
        assert cell.execution_count is None, f"{path.name} cell {i} has an execution count"
    assert "widgets" not in nb.metadata, f"{path.name} stores widget state: clear it"
    raw = json.loads(path.read_text())
    assert raw["metadata"]["kernelspec"]["name"] == "python3"


@pytest.mark.slow
def test_the_tour_runs_through_purlin_demo(tmp_path, capsys):
    out = tmp_path / "demo"
    assert main(["demo", "--out", str(out), "--timeout", str(CELL_TIMEOUT)]) == 0
    printed = capsys.readouterr().out
    page, executed = out / "demo-timeline.html", out / "demo-tour.ipynb"
    assert f"timeline page:     {page}" in printed
    for heading in ("A tour of Purlin", "2. Plan and verify", "4. Timelines", "5. Explore"):
        assert heading in printed
    assert "running on Cluster.cpu(4 ranks)" in printed
    assert "[plotly figure: predicted (H200)" in printed and "[interactive widget" in printed
    html = page.read_text()
    assert "plotly" in html and "predicted (H200)" in html and "measured (cpu)" in html
    nb = nbformat.read(executed, as_version=4)
    assert len(outputs(nb, PLOTLY)) >= 2 and len(outputs(nb, WIDGET)) == 1
    assert not [o for o in outputs(nb) if o.get("output_type") == "error"]


@pytest.mark.slow
def test_custom_collectives_notebook(tmp_path):
    nb = execute(PATHS["02-custom-collective"], cwd=tmp_path, cpu_only=True,
                 timeout=CELL_TIMEOUT)
    text = text_of(nb)
    assert "qkv all-gather" in text and "reduce to two roots" in text
    assert "uneven all-to-all" in text
    assert "no step ever notifies that flag" in text  # the dropped Notify is caught
    assert "race on" in text and "VerificationError" in text  # so is the missing wait


@pytest.mark.slow
def test_timelines_notebook_exports_perfetto_and_html(tmp_path):
    nb = execute(PATHS["03-timelines"], cwd=tmp_path, cpu_only=True, timeout=CELL_TIMEOUT)
    assert len(outputs(nb, PLOTLY)) >= 2 and len(outputs(nb, WIDGET)) == 1
    out = tmp_path / "out"
    for stem in ("allreduce-ring-measured", "allreduce-ring-predicted"):
        trace = json.loads((out / f"{stem}.perfetto.json").read_text())
        phases = {e["ph"] for e in trace["traceEvents"]}
        assert {"X", "s", "f", "M"} <= phases
    page = (out / "allreduce-ring-compare.html").read_text()
    assert "plotly" in page and "measured (cpu)" in page
    assert "this machine (cpu datapath)" in text_of(nb)
    # the fused kernel's section: both layouts traced (here on the cpu datapath), and where
    # its tracing overhead is measured
    assert "reversed all-gather" in text_of(nb) and "cpu datapath, " in text_of(nb)
    assert "bench/timelines.py --fused" in text_of(nb)
    assert len(outputs(nb, PLOTLY)) >= 4


@pytest.mark.slow
def test_notebook_05_your_own_strategy(tmp_path):
    nb = execute(PATHS["05-your-own-strategy"], cwd=tmp_path, cpu_only=True,
                 timeout=CELL_TIMEOUT)
    text = text_of(nb)
    assert "recursive-doubling, 1 chunk(s) x 1 lane(s), float32: " in text
    assert "outputs correct, no races, no deadlock" in text          # verified
    assert "cannot plan all-reduce on 3 ranks" in text                # refused by its check
    assert ("strategy 'recursive-doubling-broken'" in text
            and "misses the input of rank(s) 2, 3" in text)           # the dropped hop
    assert "deadlock: rank 0 step 0" in text and "rank 1 step 0" in text
    assert "race on r0.scratch" in text and "VerificationError" in text
    assert "max |purlin - reference| =" in text
    assert "NOT GPU numbers" in text and "fastest predicted per size" in text
    figures = [o["data"][PLOTLY] for o in outputs(nb, PLOTLY)]
    assert len(figures) == 3  # predicted timeline, predicted vs measured, latency
    lines = {t["name"] for t in figures[2]["data"]}
    for source in ("measured (cpu datapath, not GPU numbers)", "predicted (H200-measured)"):
        for provider in ("recursive-doubling", "direct-push", "two-phase", "ring"):
            assert any(name.startswith(f"{source}: purlin:{provider}") for name in lines), \
                (source, provider, sorted(lines))


@pytest.mark.slow
def test_notebook_07_your_own_epilogue(tmp_path):
    nb = execute(PATHS["07-your-own-epilogue"], cwd=tmp_path, cpu_only=True,
                 timeout=CELL_TIMEOUT)
    text = text_of(nb)
    assert not [o for o in outputs(nb) if o.get("output_type") == "error"]
    assert "running on Cluster.cpu(2 ranks)" in text
    for r in range(2):  # the FP8 epilogue against unfused torch
        assert f"rank {r}: residual identical: True" in text
        assert f"rank {r}: bias + GELU max |fused - unfused torch|" in text
        assert f"rank {r}: residual equal to PyTorch's, max |norm - torch|" in text  # rms_norm
    assert "at most 0 step apart" in text or "at most 1 step apart" in text
    assert "fn must take (v, e0) -- the value, then one per extra tensor" in text
    assert "extra 0 is torch.float32, the tensor torch.float16" in text
    assert "stat must return one float or a tuple of 2 floats" in text
    figures = [o["data"][PLOTLY] for o in outputs(nb, PLOTLY)]
    assert len(figures) == 1 and "NOT GPU numbers" in figures[0]["layout"]["title"]["text"]
    names = {t["name"] for t in figures[0]["data"]}
    assert any("add_rms_norm_fp8" in n for n in names) and any("bias_gelu" in n for n in names)
    assert "float8_e4m3fn on the wire" in text and "ranks agree: True" in text  # section 6
    assert "wire='float8_e4m3fn' needs a prologue" in text
    assert "FP8 on the wire vs torch.float16 on the wire" in text and "float8_e5m2" in text


def _recorded(folder):
    """A results file as a GPU run writes it: NCCL and Purlin, one failed point, one eager."""
    def rec(provider, nbytes, us, mode="graph", wrong=0, **extra):
        return Record.make(provider, "all-reduce", 2, nbytes, nbytes // 2, "bfloat16", "sum",
                           mode, Timing(us, us * 0.9, us * 1.1, 20), wrong, **extra).to_dict()

    records = [rec("nccl", 8192, 9.8), rec("nccl", 1 << 20, 16.7),
               rec("purlin:two-phase", 8192, 6.0, strategy="two-phase", chunks=1),
               rec("purlin:two-phase", 8192, 5.0, strategy="two-phase", chunks=2),
               rec("purlin:two-phase", 1 << 20, 19.4, strategy="two-phase"),
               rec("nccl", 8192, 450.0, mode="eager"),
               rec("symm-one-shot", 8192, math.nan, wrong=-1, error="Traceback: no symm")]
    folder.mkdir()
    (folder / "h200x2.json").write_text(json.dumps(
        {"info": {"hardware": "2x NVIDIA H200", "torch": "2.11", "nccl": "2.28.9",
                  "date": "2026-11-30"}, "records": records}))
    # (docs/results also keeps other benchmarks' JSON: a list, an object without records)
    (folder / "blocks.json").write_text(json.dumps([{"case": "x", "us": 1.0}]))
    (folder / "custom.json").write_text(json.dumps({"info": {}, "rows": []}))
    return folder


@pytest.mark.slow
@pytest.mark.parametrize("results", ["none", "recorded"])
def test_benchmark_notebook(tmp_path, results):
    folder = tmp_path / "results"
    if results == "recorded":
        _recorded(folder)
    nb = execute(PATHS["04-benchmark"], cwd=tmp_path, cpu_only=True, timeout=CELL_TIMEOUT,
                 env={"PURLIN_BENCH_RESULTS": str(folder)})
    text = text_of(nb)
    assert "NOT GPU numbers" in text and "cost model prediction" in text  # labelled numbers
    figures = [o["data"][PLOTLY] for o in outputs(nb, PLOTLY)]
    lines = {t["name"] for f in figures for t in f["data"]}

    def has(prefix):
        return any(name.startswith(prefix) for name in lines)

    assert has("measured: purlin:auto") and has("predicted (H200-measured): purlin:two-phase")
    if results == "none":
        assert "No recorded results" in text and "no speed-up to show" in text
        assert len(figures) == 2 and not has("recorded")
    else:
        assert "h200x2.json: 2x NVIDIA H200" in text and "speed-up against recorded: nccl" in text
        assert "2 other JSON file(s) there hold other benchmarks" in text
        assert len(figures) == 3  # latency, bus bandwidth, speed-up over NCCL
        assert has("recorded: nccl") and has("recorded: purlin:two-phase")
        assert not has("recorded: symm-one-shot")  # the failed point is left out
        latency = next(t for t in figures[0]["data"]
                       if t["name"].startswith("recorded: purlin:two-phase"))
        assert _values(latency["y"]) == [5.0, 19.4]  # the best of two configurations at 8 KiB


def _values(y):
    """plotly JSON may hold a list or a typed array ({"dtype", "bdata"})."""
    if isinstance(y, dict):
        import base64

        import numpy as np

        return np.frombuffer(base64.b64decode(y["bdata"]), dtype=y["dtype"]).tolist()
    return list(y)


@pytest.mark.slow
def test_notebook_06_variable_length_and_fp8(tmp_path):
    nb = execute(PATHS["06-variable-length-and-fp8"], cwd=tmp_path, cpu_only=True,
                 timeout=CELL_TIMEOUT)
    assert not [o for o in outputs(nb) if o.get("output_type") == "error"]
    text = text_of(nb)
    assert "running on Cluster.cpu(4 ranks)" in text
    assert text.count("equal to the reference") == 4 and "WRONG" not in text
    assert "count 9 is over the capacity of 8 rows" in text
    assert "count -1 is negative" in text and "takes 16 counts" in text
    assert text.count("-> same") == 4
    assert "FP8 all-to-all-v: bit-exact" in text
    figures = [o["data"][PLOTLY] for o in outputs(nb, PLOTLY)]
    assert len(figures) == 1
    names = {t["name"] for t in figures[0]["data"]}
    assert names == {f"{k}, {d}, cpu" for k in ("all_to_all_v", "all_to_all (capacity)")
                     for d in ("float32", "float8_e4m3fn")}
    assert "not GPU numbers" in figures[0]["layout"]["title"]["text"]
