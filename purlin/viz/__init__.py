"""Figures and widgets for timelines (ARCHITECTURE.md). plotly and ipywidgets are imported when a
figure or widget is built, so ``import purlin.viz`` works without them."""

from purlin.viz.explorer import explorer
from purlin.viz.timeline import compare_figure, timeline_figure, to_html

__all__ = ["compare_figure", "explorer", "timeline_figure", "to_html"]
