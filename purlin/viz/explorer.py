"""An interactive explorer: pick a collective, strategy, ranks, size, chunks, lanes (by piece
or by stage) and a hardware profile; the predicted timeline and a summary update live.

``explorer()`` returns an ipywidgets ``VBox`` (controls, a plotly ``FigureWidget``, a summary)
with an ``update(**changes)`` method for code and tests. Updates replace the data of the
figure's fixed set of traces inside one ``batch_update``; a collective that cannot be planned
(or sized) shows the reason in the summary instead of raising.

>>> SIZES[0], SIZES[-1]                                                 # the size slider
(('1 KiB', 1024), ('256 MiB', 268435456))
>>> ex = explorer(collective="all-gather", strategy="ring", ranks=4)  # doctest: +SKIP
>>> ex.update(strategy="direct-push")                                  # doctest: +SKIP
>>> ex                                                                 # doctest: +SKIP
"""

from __future__ import annotations

import html
from functools import lru_cache

from purlin.errors import PurlinError, SpecError
from purlin.snac.planner import LANES_BY, plan
from purlin.snac.strategies import STRATEGIES
from purlin.spec.collectives import STANDARD, standard
from purlin.trace.model import predict
from purlin.trace.profiles import PROFILES

SIZES = [(f"{b >> 10} KiB" if b < 1 << 20 else f"{b >> 20} MiB", b)
         for b in (1 << k for k in range(10, 29, 2))]
DTYPES = ("bfloat16", "float16", "float32")
DEFAULTS = dict(collective="all-reduce", strategy="ring", ranks=4, size=1 << 20, chunks=1,
                lanes=1, lanes_by="piece", profile="H200", dtype="bfloat16")


def explorer(**settings):
    """The explorer widget, started with ``settings`` (any of collective, strategy, ranks,
    size in bytes, chunks, lanes, lanes_by, profile, dtype)."""
    return _explorer_class()(**settings)


@lru_cache(maxsize=1)
def _explorer_class():
    import ipywidgets as widgets
    import plotly.graph_objects as go

    from purlin.viz.timeline import _layout, _title, _yaxis, timeline_figure, trace_data

    class Explorer(widgets.VBox):
        """Controls, the predicted timeline and its summary; see :func:`explorer`."""

        def __init__(self, **settings):
            unknown = set(settings) - set(DEFAULTS)
            if unknown:
                raise SpecError(f"explorer() has no setting(s) {', '.join(sorted(unknown))}; "
                                f"it knows {', '.join(DEFAULTS)}")
            s = {**DEFAULTS, **settings}
            style = {"description_width": "70px"}
            self.controls = {
                "collective": widgets.Dropdown(options=list(STANDARD), value=s["collective"],
                                               description="collective", style=style),
                "strategy": widgets.Dropdown(options=list(STRATEGIES), value=s["strategy"],
                                             description="strategy", style=style),
                "ranks": widgets.IntSlider(value=s["ranks"], min=2, max=8,
                                           description="ranks", style=style),
                "size": widgets.SelectionSlider(options=SIZES, value=s["size"],
                                                description="size", style=style),
                "chunks": widgets.IntSlider(value=s["chunks"], min=1, max=16,
                                            description="chunks", style=style),
                "lanes": widgets.IntSlider(value=s["lanes"], min=1, max=8,
                                           description="lanes", style=style),
                "lanes_by": widgets.Dropdown(options=list(LANES_BY), value=s["lanes_by"],
                                             description="lanes by", style=style),
                "profile": widgets.Dropdown(options=list(PROFILES), value=s["profile"],
                                            description="hardware", style=style),
                "dtype": widgets.Dropdown(options=list(DTYPES), value=s["dtype"],
                                          description="dtype", style=style),
            }
            self.summary = widgets.HTML()
            self.timeline = None
            self.schedule = None
            self.error: str | None = None
            self._holding = False
            first = self._compute()
            self.figure = go.FigureWidget(timeline_figure(first) if first is not None
                                          else timeline_figure(_empty()))
            names = list(self.controls)
            rows = [widgets.HBox([self.controls[k] for k in names[:4]]),
                    widgets.HBox([self.controls[k] for k in names[4:]])]
            super().__init__([*rows, self.figure, self.summary])
            self._render()
            for control in self.controls.values():
                control.observe(self._changed, names="value")

        # -- state ---------------------------------------------------------------------------
        @property
        def settings(self) -> dict:
            return {k: c.value for k, c in self.controls.items()}

        def update(self, **changes):
            """Set controls (as a user would) and redraw once; returns the new Timeline, or
            None when the settings cannot be planned (the reason is in ``self.error``)."""
            unknown = set(changes) - set(self.controls)
            if unknown:
                raise SpecError(f"the explorer has no control(s) {', '.join(sorted(unknown))}; "
                                f"it has {', '.join(self.controls)}")
            self._holding = True
            try:
                for k, v in changes.items():
                    self.controls[k].value = v
            finally:
                self._holding = False
            self._compute()
            self._render()
            return self.timeline

        def _changed(self, _change) -> None:
            if not self._holding:
                self._compute()
                self._render()

        def _compute(self):
            s = self.settings
            self.error, self.timeline, self.schedule = None, None, None
            try:
                coll = standard(s["collective"], s["ranks"])
                self.schedule = _plan_near(coll, s)
                self.timeline = predict(self.schedule, s["profile"])
            except PurlinError as exc:
                self.error = f"{type(exc).__name__}: {exc}"
            return self.timeline

        # -- drawing -------------------------------------------------------------------------
        def _render(self) -> None:
            tl = self.timeline if self.timeline is not None else _empty()
            data = trace_data(tl)
            with self.figure.batch_update():
                for trace, d in zip(self.figure.data, data):
                    if "marker_size" in d:
                        trace.update(x=d["x"], y=d["y"], marker_size=d["marker_size"],
                                     showlegend=bool(d["x"]))
                    else:
                        trace.update(showlegend=bool(d["x"]), **d)
                layout = _layout(tl, None)
                self.figure.layout.title.text = (_title(tl) if self.timeline is not None else
                                                 "no schedule: see below")
                self.figure.layout.height = layout["height"]
                self.figure.layout.yaxis.update(**_yaxis(tl))
                self.figure.layout.xaxis.autorange = True
            self.summary.value = _summary_html(self)

    return Explorer


def _empty():
    from purlin.trace.events import Timeline

    return Timeline((), None, "")


def _plan_near(coll, s):
    """Plan at the chosen size, or the nearest smaller one the ranks divide evenly."""
    options = dict(dtype=s["dtype"], chunks=s["chunks"], lanes=s["lanes"],
                   lanes_by=s["lanes_by"])
    try:
        return plan(coll, s["strategy"], nbytes=s["size"], **options)
    except SpecError:
        from purlin.spec.dtypes import dtype as as_dtype

        count = s["size"] // as_dtype(s["dtype"]).itemsize
        count -= count % coll.nranks
        return plan(coll, s["strategy"], count=max(count, coll.nranks), **options)


def _summary_html(ex) -> str:
    if ex.error is not None:
        return (f"<div style='color:#b00020'><b>cannot plan this:</b> "
                f"{html.escape(ex.error)}</div>")
    s, tl = ex.schedule, ex.timeline
    summary = s.summary()
    links = summary["link_bytes"]
    latency_us = tl.end_ns / 1e3
    message = s.sizing.message_bytes
    busiest = max(links.items(), key=lambda kv: kv[1]) if links else None
    rows = [
        ("schedule", html.escape(s.title())),
        ("verify", "ok: outputs, races and deadlocks checked by plan()"),
        ("predicted latency", f"{latency_us:.3f} µs"),
        ("message", f"{message:,} B" + (f" (rounded from {ex.settings['size']:,} B so "
                                         f"{s.nranks} ranks divide it)"
                                         if message != ex.settings["size"] else "")
         + f"; algorithm bandwidth {message / max(tl.end_ns, 1e-9):.1f} GB/s"),
        ("steps", ", ".join(f"{v} {k}" for k, v in summary["steps"].items())),
        ("bytes on links", f"{summary['total_link_bytes']:,} B over {len(links)} directed "
                           "links" + (f"; busiest r{busiest[0][0]}→r{busiest[0][1]} "
                                      f"{busiest[1]:,} B" if busiest else "")),
    ]
    cells = "".join(f"<tr><td style='padding-right:1em'><b>{k}</b></td><td>{v}</td></tr>"
                    for k, v in rows)
    return f"<table>{cells}</table>"
