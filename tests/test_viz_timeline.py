"""Timeline figures: one trace per kind, bars and flow lines as expected, numeric µs axis,
standalone HTML."""

import numpy as np
import pytest

pytest.importorskip("plotly", reason="plotly is needed for figures: pip install 'plotly>=6'")

from purlin.runtime import run  # noqa: E402
from purlin.snac import plan  # noqa: E402
from purlin.spec import collectives  # noqa: E402
from purlin.trace import KINDS, from_cpu, predict  # noqa: E402
from purlin.trace.events import Event, Timeline  # noqa: E402
from purlin.viz import compare_figure, timeline_figure, to_html  # noqa: E402
from purlin.viz.timeline import FLOW_NAME  # noqa: E402


@pytest.fixture(scope="module")
def predicted():
    s = plan(collectives.all_reduce(4), "ring", count=256, chunks=2, lanes=2, dtype="float64")
    return predict(s, "H200")


def test_one_trace_per_kind_plus_the_flows(predicted):
    fig = timeline_figure(predicted)
    assert [t.name for t in fig.data] == [*KINDS, FLOW_NAME]
    for kind, trace in zip(KINDS, fig.data):
        events = predicted.where(kind=kind).events
        assert trace.type == "bar" and trace.orientation == "h"
        assert len(trace.x) == len(trace.base) == len(trace.y) == len(events)
        assert list(trace.base) == pytest.approx([e.start_ns / 1e3 for e in events])
        for bar, e in zip(trace.customdata, events):
            assert bar[0] == e.kind and bar[1] == e.step and bar[2] == e.bytes
    assert len(fig.data[-1].x) == 3 * len(predicted.flows())  # (notify, released, None)
    assert fig.data[-1].x[2::3] == (None,) * len(predicted.flows())


def test_rows_hover_and_axis(predicted):
    fig = timeline_figure(predicted)
    rows = predicted.rows()
    assert list(fig.layout.yaxis.ticktext) == [f"r{r} l{lane}" for r, lane in rows]
    assert fig.layout.yaxis.range[0] > fig.layout.yaxis.range[1]  # rank 0 on top
    assert fig.layout.xaxis.title.text == "time (µs)" and fig.layout.xaxis.type in (None, "-",
                                                                                       "linear")
    assert all(isinstance(x, float) for x in fig.data[0].base)
    tmpl = fig.data[0].hovertemplate
    assert "customdata[2]" in tmpl and "names" in tmpl and "peer" in tmpl and "µs" not in tmpl
    assert "µs" in fig.data[0].customdata[0][5]
    assert fig.layout.barmode == "overlay"


def test_zero_length_steps_stay_visible_but_hover_exact():
    t = Timeline((Event(0, 0, "notify", 0, 100.0, 100.0), Event(0, 0, "stage", 1, 100.0,
                                                                  10_100.0)))
    fig = timeline_figure(t)
    notify = fig.data[KINDS.index("notify")]
    assert notify.x[0] > 0 and "0.000 µs)" in notify.customdata[0][5]


def test_blocks_split_a_row():
    t = Timeline(tuple(Event(0, 0, "stage", 0, 0.0, 10.0, block=b) for b in range(4)))
    ys = sorted(timeline_figure(t).data[0].y)
    assert len(set(ys)) == 4 and ys[0] > -0.5 and ys[-1] < 0.5


def test_compare_figure_shares_the_time_axis(predicted):
    s = predicted.schedule
    inputs = [np.arange(s.sizing.input_count(r), dtype=np.float64) for r in range(4)]
    res = run(s.collective, inputs, strategy="ring", chunks=2, lanes=2, sizing=s.sizing,
              trace=True)
    measured = from_cpu(res.trace, res.schedule)
    fig = compare_figure(predicted, measured)
    assert len(fig.data) == 2 * (len(KINDS) + 1)
    assert fig.layout.xaxis.matches == "x2" or fig.layout.xaxis2.matches == "x"
    assert {t.yaxis for t in fig.data} == {"y", "y2"}
    assert sum(bool(t.showlegend) for t in fig.data[len(KINDS) + 1:]) == 0
    assert "predicted (H200)" in fig.layout.annotations[0].text


def test_to_html_inlines_plotly_js(predicted, tmp_path):
    fig = timeline_figure(predicted)
    path = to_html(fig, tmp_path / "t.html")
    text = path.read_text()
    assert path.stat().st_size > 1_000_000 and "<script src=\"https://cdn.plot.ly" not in text
    small = to_html(fig, tmp_path / "c.html", include_plotlyjs="cdn")
    assert small.stat().st_size < 1_000_000


def test_compare_figure_gives_each_plot_its_rows_and_its_title_room(predicted):
    from purlin.viz.timeline import MIN_PLOT_PX, ROW_PX, TITLE_PX

    measured = predict(plan(collectives.all_reduce(2), "direct-push", count=8))
    fig = compare_figure(predicted, measured, title="both")
    layout = fig.layout
    area = layout.height - layout.margin.t - layout.margin.b
    (lo1, hi1), (lo2, hi2) = layout.yaxis.domain, layout.yaxis2.domain
    assert (hi1 - lo1) * area == pytest.approx(ROW_PX * len(predicted.rows()))
    assert (hi2 - lo2) * area == pytest.approx(MIN_PLOT_PX)  # two rows get the minimum
    assert hi1 == 1.0 and lo2 == 0.0
    assert (lo1 - hi2) * area >= TITLE_PX, "the lower title fits between the plots"
    assert layout.margin.t >= TITLE_PX + 40, "the upper title fits under the figure's title"
    titles = layout.annotations
    assert [t.y for t in titles] == [hi1, hi2]
    assert all(t.yanchor == "bottom" and t.yshift > 0 for t in titles), "titles sit above"
    assert layout.title.yref == "container" and layout.title.y == 1
