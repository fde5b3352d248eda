"""Timeline figures with plotly (imported when a figure is built, never at ``import purlin``).

One row per (rank, lane), rank 0 lane 0 on top; bars coloured by step kind, one plotly trace
per kind (never one per bar) so figures of many thousands of bars stay responsive; the
Notify → wait/consume dependencies as one line trace with None separators and an arrow head
at the released end; hover shows kind, step, op, bytes, names, peer and times. The time axis
is numeric, in µs. A figure always has ``len(KINDS) + 1`` traces, empty or not, so a widget can
replace their data in place.

>>> from purlin.spec import collectives
>>> from purlin.snac import plan
>>> from purlin.trace import predict
>>> t = predict(plan(collectives.all_gather(4), "ring", count=64))
>>> [len(d["x"]) for d in trace_data(t)]    # bars per kind, then 3 points per arrow
[16, 12, 12, 12, 0, 36]
>>> fig = timeline_figure(t)                 # doctest: +SKIP
>>> to_html(fig, "ring.html")                # doctest: +SKIP
"""

from __future__ import annotations

from pathlib import Path

from purlin.trace.events import KINDS, Timeline

KIND_COLORS = {"stage": "#4C78A8", "notify": "#F58518", "wait": "#C9C3BE",
               "consume": "#54A24B", "barrier": "#B279A2"}
FLOW_NAME = "notify → release"
FLOW_COLOR = "rgba(80, 80, 80, 0.55)"
BAR_HEIGHT = 0.8  # of a row
# Figure layout in pixels: each plot is as tall as its rows, its title above it with room for
# two lines (label and schedule), the figure's title above everything.
ROW_PX = 30
MIN_PLOT_PX = 90
HEAD_PX = 64  # the figure's title (two lines where it has a subtitle)
TITLE_PX = 52  # a subplot's two-line title
AXIS_PX = 60  # the time axis and its title under the last plot
MIN_BAR_FRACTION = 0.002  # zero-length steps are drawn this wide (of the span); hover is exact

HOVER = ("<b>%{customdata[0]}</b> %{customdata[9]} · r%{customdata[6]} lane %{customdata[7]}"
         "%{customdata[8]} · step %{customdata[1]}<br>peer %{customdata[4]} · "
         "%{customdata[2]:,} B<br>names %{customdata[3]}<br>"
         "%{customdata[5]}<extra></extra>")


def timeline_figure(timeline: Timeline, *, flows: bool = True, title: str | None = None):
    """A plotly Figure of ``timeline`` (see the module docstring)."""
    import plotly.graph_objects as go

    fig = go.Figure()
    for trace in _traces(timeline, flows=flows):
        fig.add_trace(trace)
    fig.update_layout(**_layout(timeline, title))
    fig.update_yaxes(**_yaxis(timeline))
    fig.update_xaxes(title_text="time (µs)", zeroline=False)
    return fig


def compare_figure(predicted: Timeline, measured: Timeline, *, flows: bool = True,
                   title: str | None = None):
    """Two timelines (predicted above, measured below) on one shared time axis."""
    from plotly.subplots import make_subplots

    plots = [_plot_px(predicted), _plot_px(measured)]
    gap = TITLE_PX + 8  # the lower plot's title sits between the two
    area = sum(plots) + gap
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=gap / area,
                        row_heights=[p / sum(plots) for p in plots],
                        subplot_titles=[_title(predicted), _title(measured)])
    for i, tl in enumerate((predicted, measured), start=1):
        for trace in _traces(tl, flows=flows, legend=(i == 1)):
            fig.add_trace(trace, row=i, col=1)
        fig.update_yaxes(row=i, col=1, **_yaxis(tl))
    for note in fig.layout.annotations:  # subplot titles: left-aligned, clear of the bars
        note.update(x=0, xanchor="left", yshift=6, align="left")
    fig.update_xaxes(title_text="time (µs)", row=2, col=1, zeroline=False)
    fig.update_layout(barmode="overlay", bargap=0, hovermode="closest",
                      height=HEAD_PX + TITLE_PX + area + AXIS_PX,
                      margin=dict(l=70, r=20, t=HEAD_PX + TITLE_PX, b=AXIS_PX),
                      title=_head(title or f"{predicted.label} vs {measured.label}"),
                      legend=dict(orientation="v", yanchor="top", y=1.0, x=1.01))
    return fig


def _plot_px(timeline: Timeline) -> int:
    return max(MIN_PLOT_PX, ROW_PX * max(len(timeline.rows()), 1))


def _head(text: str) -> dict:
    """The figure's title, pinned to the top of the page above every plot title."""
    return dict(text=text, x=0.01, xanchor="left", y=1, yref="container", yanchor="top",
                pad=dict(t=14))


def to_html(fig, path, *, include_plotlyjs=True) -> Path:
    """Write ``fig`` as a standalone HTML page; plotly.js is inlined (works offline) unless
    ``include_plotlyjs="cdn"``."""
    path = Path(path)
    fig.write_html(str(path), include_plotlyjs=include_plotlyjs, full_html=True)
    return path


# -- building blocks (the explorer reuses them to update traces in place) ---------------------


def trace_data(timeline: Timeline, *, flows: bool = True) -> list[dict]:
    """Per trace (one per kind in KINDS, then the flows), the data properties to set:
    ``x``/``base``/``y``/``width``/``customdata`` for bars, ``x``/``y``/``marker_size`` for
    the flow lines."""
    rows = {row: i for i, row in enumerate(timeline.rows())}
    blocks = 1 + max((e.block for e in timeline.events), default=0)
    thickness = BAR_HEIGHT / blocks
    span_us = max(timeline.end_ns - min(timeline.start_ns, 0.0), 1.0) / 1e3
    min_us = span_us * MIN_BAR_FRACTION

    def y_of(e) -> float:
        return rows[e.row] - BAR_HEIGHT / 2 + (e.block + 0.5) * thickness

    per_kind = {k: {"x": [], "base": [], "y": [], "customdata": []} for k in KINDS}
    for e in timeline.events:
        d = per_kind.setdefault(e.kind, {"x": [], "base": [], "y": [], "customdata": []})
        d["x"].append(max(e.duration_ns / 1e3, min_us))
        d["base"].append(e.start_ns / 1e3)
        d["y"].append(y_of(e))
        d["customdata"].append(_hover(e))
    out = []
    for k in KINDS:
        d = per_kind[k]
        d["width"] = [thickness] * len(d["x"])
        out.append(d)
    x, y, size = [], [], []
    if flows:
        for notify, released in timeline.flows():
            x += [notify.end_ns / 1e3, released.end_ns / 1e3, None]
            y += [y_of(notify), y_of(released), None]
            size += [0, 9, 0]
    out.append({"x": x, "y": y, "marker_size": size})
    return out


def _hover(e) -> list:
    from purlin.spec.collective import _fmt

    names = ", ".join(_fmt(n) for n in e.names[:8]) + (" …" if len(e.names) > 8 else "")
    times = (f"{e.start_ns / 1e3:.3f} → {e.end_ns / 1e3:.3f} µs "
             f"({e.duration_ns / 1e3:.3f} µs)")
    return [e.kind, e.step, e.bytes, names or "–", "–" if e.peer is None else e.peer, times,
            e.rank, e.lane, f" block {e.block}" if e.block else "", e.op]


def _traces(timeline: Timeline, *, flows: bool = True, legend: bool = True) -> list:
    import plotly.graph_objects as go

    data = trace_data(timeline, flows=flows)
    traces = []
    for kind, d in zip(KINDS, data):
        traces.append(go.Bar(orientation="h", name=kind, legendgroup=kind,
                             showlegend=legend and bool(d["x"]), marker_color=KIND_COLORS[kind],
                             marker_line_width=0, hovertemplate=HOVER, **d))
    d = data[-1]
    traces.append(go.Scatter(name=FLOW_NAME, legendgroup="flows", mode="lines+markers",
                             x=d["x"], y=d["y"], hoverinfo="skip",
                             showlegend=legend and bool(d["x"]),
                             line=dict(color=FLOW_COLOR, width=1),
                             marker=dict(symbol="arrow", angleref="previous",
                                         size=d["marker_size"], color=FLOW_COLOR)))
    return traces


def _title(timeline: Timeline) -> str:
    what = timeline.schedule.title() if timeline.schedule is not None else ""
    return (f"{timeline.label}: {timeline.end_ns / 1e3:.2f} µs" +
            (f"<br><sup>{what}</sup>" if what else ""))


def _layout(timeline: Timeline, title) -> dict:
    top = TITLE_PX + 36  # a two-line title, then the legend in one row above the plot
    return dict(barmode="overlay", bargap=0, hovermode="closest",
                title=_head(title or _title(timeline)),
                height=top + _plot_px(timeline) + AXIS_PX,
                margin=dict(l=70, r=20, t=top, b=AXIS_PX),
                legend=dict(orientation="h", yanchor="bottom", y=1.0, x=0))


def _yaxis(timeline: Timeline) -> dict:
    rows = timeline.rows()
    return dict(tickmode="array", tickvals=list(range(len(rows))),
                ticktext=[f"r{r} l{lane}" for r, lane in rows],
                range=[len(rows) - 0.5, -0.5], showgrid=False, zeroline=False)
