"""The explorer widget: live updates, a fixed trace count, plan errors as text."""

import pytest

pytest.importorskip("plotly", reason="plotly is needed for the explorer: pip install 'plotly>=6'")
pytest.importorskip("ipywidgets", reason="ipywidgets is needed for the explorer")
pytest.importorskip("anywidget", reason="plotly's FigureWidget needs anywidget")

from purlin.errors import SpecError  # noqa: E402
from purlin.trace import KINDS  # noqa: E402
from purlin.viz import explorer  # noqa: E402


@pytest.fixture
def ex():
    return explorer(collective="all-reduce", strategy="direct-push", ranks=4, size=1 << 16)


def _data(ex):
    return [(tuple(t.x), tuple(t.y)) for t in ex.figure.data]


def test_explorer_is_a_vbox_with_controls_figure_and_summary(ex):
    import ipywidgets as widgets
    import plotly.graph_objects as go

    assert isinstance(ex, widgets.VBox) and isinstance(ex.figure, go.FigureWidget)
    assert ex.figure in ex.children and ex.summary in ex.children
    assert set(ex.controls) == {"collective", "strategy", "ranks", "size", "chunks", "lanes",
                                "lanes_by", "profile", "dtype"}
    assert "predicted latency" in ex.summary.value and "bytes on links" in ex.summary.value
    assert len(ex.figure.data) == len(KINDS) + 1


def test_strategy_change_changes_the_figure_data(ex):
    before = _data(ex)
    timeline = ex.update(strategy="ring")
    assert timeline is ex.timeline and ex.schedule.strategy == "ring"
    assert _data(ex) != before and len(ex.figure.data) == len(KINDS) + 1
    stage = ex.figure.data[0]
    assert len(stage.x) == len(timeline.where(kind="stage"))


def test_every_control_updates_and_widget_events_redraw(ex):
    for change in (dict(ranks=8), dict(chunks=3), dict(lanes=2), dict(lanes_by="stage"),
                   dict(profile="A100"),
                   dict(size=1 << 20), dict(collective="all-to-all"), dict(dtype="float32")):
        before = (ex.figure.layout.title.text, _data(ex))
        ex.update(**change)
        assert ex.error is None, ex.error
        assert (ex.figure.layout.title.text, _data(ex)) != before, change
    before = _data(ex)
    ex.controls["strategy"].value = "direct-pull"  # as a user would
    assert _data(ex) != before and ex.schedule.strategy == "direct-pull"


def test_plan_errors_show_as_text_and_clear_the_figure(ex):
    assert ex.update(collective="all-gather", strategy="two-phase") is None
    assert "two-phase" in ex.summary.value and "cannot plan" in ex.summary.value
    assert all(len(t.x) == 0 for t in ex.figure.data)
    assert len(ex.figure.data) == len(KINDS) + 1
    assert ex.update(strategy="ring") is not None and "cannot plan" not in ex.summary.value


def test_sizes_that_ranks_do_not_divide_split_as_evenly_as_they_can(ex):
    t = ex.update(ranks=3, size=1 << 20)
    assert t is not None and ex.schedule.collective.nranks == 3
    assert ex.schedule.sizing.message_bytes == 1 << 20
    assert "1,048,576 B;" in ex.summary.value and "rounded" not in ex.summary.value


def test_unknown_settings_are_refused(ex):
    with pytest.raises(SpecError, match="no control"):
        ex.update(colour="red")
    with pytest.raises(SpecError, match="no setting"):
        explorer(colour="red")
