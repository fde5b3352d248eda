"""Timelines (ARCHITECTURE.md): one event record for predicted and measured runs, the cost model
that predicts them, hardware profiles and their calibration, and Perfetto export.

Nothing here imports plotly or pandas; ``Timeline.to_dataframe`` imports pandas when called.

>>> from purlin.spec import collectives
>>> from purlin.snac import plan
>>> t = predict(plan(collectives.all_reduce(4), "ring", nbytes=1 << 20), "H200")
>>> t.label, t.check()
('predicted (H200)', [])
"""

from purlin.trace.calibrate import calibrate
from purlin.trace.events import KINDS, Event, Timeline
from purlin.trace.measured import (ClockOffset, Clocks, align_clocks, from_cpu, from_sm,
                                   from_sm_records, measure_clocks, offset_from_samples,
                                   ping_pong)
from purlin.trace.model import predict, predict_latency
from purlin.trace.perfetto import to_perfetto
from purlin.trace.profiles import PROFILES, Profile, get_profile

__all__ = [
    "KINDS", "PROFILES", "ClockOffset", "Clocks", "Event", "Profile", "Timeline",
    "align_clocks", "calibrate", "from_cpu", "from_sm", "from_sm_records", "get_profile",
    "measure_clocks", "offset_from_samples", "ping_pong", "predict", "predict_latency",
    "to_perfetto",
]
