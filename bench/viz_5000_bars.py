"""How long a timeline figure of >= 5,000 bars takes to build and to write as HTML.

    PYTHONPATH=. python bench/viz_5000_bars.py [--chunks 24] [--out /tmp/bars.html]
                                               [--browser /usr/bin/chromium]

Predicts all-to-all on 8 ranks, direct-push, with many chunks and 2 lanes on H200, builds the
figure (one bar trace per step kind, one line trace for the notify arrows) and writes a
standalone HTML page with plotly.js inline. With ``--browser`` it also opens the page in that
headless Chromium and reports how long plotly.js took to draw the figure.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import tempfile
import time
from pathlib import Path

from purlin.snac import plan
from purlin.spec import collectives
from purlin.trace import predict
from purlin.viz import timeline_figure, to_html

# draws the figure once more from scratch and stamps how long plotly.js took into the page,
# for --browser to read from the dumped DOM
TIMING_JS = """
var t0 = performance.now();
var gd = document.getElementById('{plot_id}');
Plotly.newPlot(gd, gd.data, gd.layout).then(function () {
  var el = document.createElement('pre'); el.id = 'purlin-draw-ms';
  el.textContent = 'draw_ms=' + (performance.now() - t0).toFixed(1);
  document.body.appendChild(el);
});
"""


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunks", type=int, default=24)
    ap.add_argument("--lanes", type=int, default=2)
    ap.add_argument("--out", default=None, help="HTML path (default: a temporary file)")
    ap.add_argument("--browser", default=None, help="headless Chromium to time the drawing")
    args = ap.parse_args(argv)

    t0 = time.perf_counter()
    schedule = plan(collectives.all_to_all(8), "direct-push", count=8 * 1024 * args.chunks,
                    dtype="bfloat16", chunks=args.chunks, lanes=args.lanes)
    t1 = time.perf_counter()
    timeline = predict(schedule, "H200")
    t2 = time.perf_counter()
    fig = timeline_figure(timeline)
    t3 = time.perf_counter()
    out = Path(args.out or tempfile.mkdtemp(prefix="purlin-bench-"))
    if out.suffix != ".html":
        out = out / "viz_5000_bars.html"
    if args.browser:
        fig.write_html(str(out), include_plotlyjs=True, post_script=TIMING_JS)
    else:
        to_html(fig, out)
    t4 = time.perf_counter()
    bars = sum(len(t.x) for t in fig.data if t.type == "bar")
    result = {"bars": bars, "traces": len(fig.data), "flows": len(timeline.flows()),
              "plan_s": t1 - t0, "predict_s": t2 - t1, "build_s": t3 - t2,
              "to_html_s": t4 - t3, "html_bytes": out.stat().st_size, "html": str(out)}
    if args.browser:
        result["draw_ms"] = _draw_ms(args.browser, out)
    print(f"{schedule.title()}")
    print(f"{bars} bars in {result['traces']} traces, {result['flows']} arrows; predicted "
          f"latency {timeline.end_ns / 1e3:.1f} us")
    print(f"plan {result['plan_s']:.3f} s, predict {result['predict_s']:.3f} s, figure build "
          f"{result['build_s']:.3f} s, to_html {result['to_html_s']:.3f} s "
          f"({result['html_bytes'] / 1e6:.1f} MB) -> {out}")
    if "draw_ms" in result:
        print(f"plotly.js redraw in headless Chromium: {result['draw_ms']} ms")
    return result


def _draw_ms(browser: str, page: Path):
    proc = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu",
                           "--dump-dom", page.as_uri()],
                          capture_output=True, text=True, timeout=300)
    found = re.search(r"draw_ms=([0-9.]+)", proc.stdout)
    return float(found.group(1)) if found else None


if __name__ == "__main__":
    main()
