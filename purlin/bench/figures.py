"""Sweep figures with plotly (imported when a figure is built): latency and bus bandwidth
versus message size on log-log axes, and the speedup over a baseline (NCCL), one subplot per
collective and one line per provider (a provider keeps its colour across subplots and
figures; one legend entry toggles it everywhere).

>>> from purlin.bench.metrics import Record, Timing
>>> t = lambda us: Timing(us, us, us, 1)
>>> recs = [Record.make(p, "all-reduce", 2, n, n // 2, "bfloat16", "sum", "graph",
...                     t(us * f), 0)
...         for p, f in (("nccl", 1.0), ("purlin:auto", 0.5)) for n, us in ((8, 10), (64, 12))]
>>> [(s["name"], s["x"], s["y"]) for s in series(recs, "time_us")]
[('nccl', [8, 64], [10.0, 12.0]), ('purlin:auto', [8, 64], [5.0, 6.0])]
>>> figs = figures(recs)                     # doctest: +SKIP
>>> write_html(figs, "sweep.html")           # doctest: +SKIP
"""

from __future__ import annotations

import math
from pathlib import Path

from purlin.bench.metrics import config_of, vs_baseline
from purlin.errors import CapabilityError

PALETTE = ("#4C78A8", "#F58518", "#54A24B", "#E45756", "#72B7B2", "#B279A2", "#FF9DA6",
           "#9D755D", "#EECA3B", "#BAB0AC")
KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
METRICS = {"time_us": "time per op (µs)", "busbw_gbs": "bus bandwidth (GB/s)",
           "ratio": "speedup ({base} time / provider time)"}


def _labeler(records):
    """A provider's line name: the provider, plus mode / dtype / ranks where they vary."""
    modes = {r.mode for r in records}
    dtypes = {r.dtype for r in records}
    ranks = {r.nranks for r in records}

    def label(r) -> str:
        parts = [r.provider]
        if len(modes) > 1:
            parts.append(r.mode)
        if len(dtypes) > 1:
            parts.append(r.dtype)
        if len(ranks) > 1:
            parts.append(f"{r.nranks} ranks")
        return " ".join(parts)

    return label


def series(records, metric: str = "time_us") -> list[dict]:
    """Per (collective, line): sizes and values of ``metric``, sorted by size; records that
    failed are left out. Lines are in order of first appearance."""
    label = _labeler(records)
    lines: dict = {}
    for r in records:
        value = getattr(r, metric)
        if not r.ok or not value == value:
            continue
        lines.setdefault((r.collective, label(r)), []).append((r.nbytes, value, r))
    out = []
    for (coll, name), pts in lines.items():
        pts.sort(key=lambda p: p[0])
        out.append({"collective": coll, "name": name, "x": [p[0] for p in pts],
                    "y": [float(p[1]) for p in pts],
                    "hover": [_hover(p[2]) for p in pts]})
    return out


def _hover(r) -> str:
    cfg = config_of(r)
    return (f"{r.provider} · {r.collective} · {r.dtype} · {r.mode}<br>"
            f"{_size(r.nbytes)}: {r.time_us:.2f} µs, busbw {r.busbw_gbs:.1f} GB/s"
            + (f"<br>{cfg}" if cfg else "") + f"<br>#wrong {r.wrong if r.wrong >= 0 else 'N/A'}")


def _size(n: int) -> str:
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= scale:
            v = n / scale
            return f"{v:g} {unit}"
    return f"{n} B"


def _plotly():
    try:
        import plotly.graph_objects as go
        from plotly.subplots import make_subplots
    except ModuleNotFoundError:
        raise CapabilityError("figures need plotly: pip install plotly (the records are "
                              "data: Results.load(path).write_html(...) on a machine that "
                              "has it)") from None
    return go, make_subplots


def colors(records) -> dict:
    """A colour per line name, in order of first appearance over all records, so a provider
    keeps its colour in every figure of the same records."""
    label = _labeler(records)
    names = list(dict.fromkeys(label(r) for r in records))
    return {n: PALETTE[k % len(PALETTE)] for k, n in enumerate(names)}


def _figure(lines: list[dict], ytitle: str, title: str, logy: bool = True, hline=None,
            palette: dict | None = None):
    go, make_subplots = _plotly()

    collectives = list(dict.fromkeys(s["collective"] for s in lines)) or [""]
    cols = min(3, len(collectives))
    rows = math.ceil(len(collectives) / cols)
    fig = make_subplots(rows=rows, cols=cols, subplot_titles=collectives,
                        horizontal_spacing=0.07, vertical_spacing=0.1)
    names = list(dict.fromkeys(s["name"] for s in lines))
    shown = set()
    for s in lines:
        k = collectives.index(s["collective"])
        color = (palette or {}).get(s["name"], PALETTE[names.index(s["name"]) % len(PALETTE)])
        fig.add_trace(go.Scatter(x=s["x"], y=s["y"], name=s["name"], mode="lines+markers",
                                 legendgroup=s["name"], showlegend=s["name"] not in shown,
                                 line={"color": color}, marker={"size": 5},
                                 hovertext=s["hover"], hoverinfo="text"),
                      row=k // cols + 1, col=k % cols + 1)
        shown.add(s["name"])
    sizes = sorted({x for s in lines for x in s["x"]})
    ticks = _ticks(sizes)
    fig.update_xaxes(type="log", tickvals=ticks, ticktext=[_size(t) for t in ticks])
    fig.update_xaxes(title_text="message size", row=rows)
    fig.update_yaxes(type="log" if logy else "linear", title_text=ytitle,
                     **({"dtick": "D2"} if logy else {}))
    if hline is not None:
        for k in range(len(collectives)):
            fig.add_hline(y=hline, line_dash="dot", line_color="gray",
                          row=k // cols + 1, col=k % cols + 1)
    fig.update_layout(title=title, height=340 * rows + 80, template="plotly_white",
                      legend={"title": "provider"}, hovermode="closest")
    return fig


def _ticks(sizes: list[int]) -> list[int]:
    if len(sizes) <= 10:
        return sizes
    lo, hi = int(math.log2(sizes[0])), int(math.log2(sizes[-1])) + 1
    step = max(1, math.ceil((hi - lo) / 10))
    return [1 << e for e in range(lo, hi + 1, step) if (1 << e) <= sizes[-1] * 1.01]


def latency_figure(records, title: str = ""):
    """Time per op versus size, log-log, one line per provider."""
    return _figure(series(records, "time_us"), METRICS["time_us"],
                   f"latency{' · ' + title if title else ''}", palette=colors(records))


def busbw_figure(records, title: str = ""):
    """nccl-tests' bus bandwidth versus size, log-log, one line per provider."""
    return _figure(series(records, "busbw_gbs"), METRICS["busbw_gbs"],
                   f"bus bandwidth{' · ' + title if title else ''}", palette=colors(records))


def speedup_figure(records, baseline: str = "nccl", title: str = ""):
    """``baseline time / provider time`` versus size (above 1: faster than the baseline)."""
    label = _labeler(records)
    by_key = {(r.provider, r.collective, r.nranks, r.nbytes, r.dtype, r.mode): r
              for r in records}
    lines: dict = {}
    for row in vs_baseline(records, baseline):
        r = by_key[(row["provider"], row["collective"], row["nranks"], row["nbytes"],
                    row["dtype"], row["mode"])]
        lines.setdefault((r.collective, label(r)), []).append((r.nbytes, row["ratio"], r))
    out = []
    for (coll, name), pts in lines.items():
        pts.sort(key=lambda p: p[0])
        out.append({"collective": coll, "name": name, "x": [p[0] for p in pts],
                    "y": [p[1] for p in pts],
                    "hover": [f"{_hover(p[2])}<br>{p[1]:.2f}x vs {baseline}" for p in pts]})
    return _figure(out, METRICS["ratio"].format(base=baseline),
                   f"speedup vs {baseline}{' · ' + title if title else ''}", hline=1.0,
                   palette=colors(records))


def figures(records, baseline: str = "nccl", title: str = "") -> dict:
    """``{"latency": fig, "busbw": fig, "speedup": fig}`` (speedup is empty of lines when no
    record has a ``baseline`` point to compare with)."""
    return {"latency": latency_figure(records, title),
            "busbw": busbw_figure(records, title),
            "speedup": speedup_figure(records, baseline, title)}


def write_html(figs: dict, path, title: str = "Purlin sweep", plotlyjs=True) -> Path:
    """All figures into one HTML page: plotly.js embedded once (works offline), or loaded
    from its CDN with ``plotlyjs="cdn"`` (a small file, e.g. for documentation)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    parts = []
    for k, fig in enumerate(figs.values()):
        parts.append(fig.to_html(full_html=False, include_plotlyjs=plotlyjs if k == 0 else False))
    html = (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{title}</title></head>"
            f"<body style='font-family:sans-serif'><h2>{title}</h2>" + "\n".join(parts)
            + "</body></html>")
    path.write_text(html, encoding="utf-8")
    return path
