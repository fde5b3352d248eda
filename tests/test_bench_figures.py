"""Sweep figures: log-log axes, one line per provider, the speedup over NCCL."""

import pytest

from purlin.bench.figures import figures, series, write_html
from purlin.bench.metrics import Record, Timing

pytest.importorskip("plotly")


def _records(collectives=("all-reduce",)):
    out = []
    for coll in collectives:
        for p, f in (("nccl", 1.0), ("purlin:auto", 0.5), ("symm-one-shot", 0.8)):
            for n in (1024, 1 << 20, 1 << 28):
                us = f * (5 + n / 300e3)
                out.append(Record.make(p, coll, 2, n, n // 2, "bfloat16", "sum", "graph",
                                       Timing(us, us, us, 3), 0))
    return out


def test_one_trace_per_provider_on_log_log_axes():
    figs = figures(_records())
    assert set(figs) == {"latency", "busbw", "speedup"}
    for key in ("latency", "busbw"):
        fig = figs[key]
        assert [t.name for t in fig.data] == ["nccl", "purlin:auto", "symm-one-shot"]
        assert fig.layout.xaxis.type == "log" and fig.layout.yaxis.type == "log"
    speed = figs["speedup"]
    assert [t.name for t in speed.data] == ["purlin:auto", "symm-one-shot"]
    assert list(speed.data[0].y) == pytest.approx([2.0, 2.0, 2.0])
    color = {t.name: t.line.color for t in figs["latency"].data}
    assert all(t.line.color == color[t.name] for t in speed.data)  # same colour everywhere


def test_subplot_per_collective_and_one_legend_entry_per_provider():
    fig = figures(_records(("all-reduce", "all-gather", "broadcast", "reduce")))["latency"]
    assert len(fig.data) == 4 * 3
    assert sum(bool(t.showlegend) for t in fig.data) == 3
    titles = [a.text for a in fig.layout.annotations]
    assert titles[:4] == ["all-reduce", "all-gather", "broadcast", "reduce"]


def test_failed_points_are_left_out_and_modes_are_named():
    recs = _records()
    nan = float("nan")
    recs.append(Record.make("nccl", "all-reduce", 2, 64, 0, "bfloat16", "sum", "graph",
                            Timing(nan, nan, nan, 0), -1, error="boom"))
    recs.append(Record.make("nccl", "all-reduce", 2, 64, 32, "bfloat16", "sum", "eager",
                            Timing(20.0, 20.0, 20.0, 1), 0))
    lines = series(recs)
    names = [s["name"] for s in lines]
    assert "nccl graph" in names and "nccl eager" in names
    assert 64 not in next(s for s in lines if s["name"] == "nccl graph")["x"]


def test_write_html_embeds_every_figure_once(tmp_path):
    path = write_html(figures(_records()), tmp_path / "sweep.html", title="test sweep")
    text = path.read_text()
    assert text.count("plotly-graph-div") >= 3 and "test sweep" in text
