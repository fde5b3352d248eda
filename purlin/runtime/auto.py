"""strategy="auto": pick strategy, chunks and lanes for a collective, size and rank count.

A tuning table measured on the hardware (``purlin tune`` writes it, JSON next to the package or
at ``$PURLIN_TUNING``) wins; without one, a simple model decides: one-shot direct push for small
messages (latency-bound: one hop), two-phase for large reductions (each byte crosses a link
once per phase instead of n-1 times), and more pieces and lanes as messages grow.

>>> from purlin.spec import collectives
>>> from purlin.runtime import Cluster
>>> choose(collectives.all_reduce(2), Cluster.cpu(2), nbytes=8192)
('direct-push', 1, 1)
>>> choose(collectives.all_reduce(8), Cluster.cpu(8), nbytes=256 << 20)
('two-phase', 8, 16)
"""

from __future__ import annotations

import json
import os
from pathlib import Path

SMALL = 256 << 10
TUNING_FILE = Path(__file__).with_name("tuning.json")


def _table() -> list[dict]:
    path = Path(os.environ.get("PURLIN_TUNING", TUNING_FILE))
    if not path.exists():
        return []
    return json.loads(path.read_text()).get("entries", [])


def choose(collective, cluster, *, count=None, nbytes=None, dtype="float32",
           chunk_sizes=None) -> tuple[str, int, int]:
    """(strategy, chunks, lanes) for this collective on this cluster."""
    sizing = collective.sized(count, nbytes=nbytes, dtype=dtype, chunk_sizes=chunk_sizes)
    size = sizing.message_bytes
    best = None
    for entry in _table():
        if (entry["collective"] == collective.name and entry["nranks"] == collective.nranks
                and entry.get("datapath", "sm") == cluster.datapath):
            if best is None or abs(entry["nbytes"] - size) < abs(best["nbytes"] - size):
                best = entry
    if best is not None:
        return best["strategy"], best["chunks"], best["lanes"]
    if size <= SMALL:
        return "direct-push", 1, 1
    lanes = min(16, max(1, size // (1 << 20)))
    chunks = min(8, max(1, size // (4 << 20)))
    if collective.op.is_reduce and collective.name != "reduce":
        return "two-phase", chunks, lanes
    return "direct-push", chunks, lanes
