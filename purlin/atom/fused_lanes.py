"""Several lanes on the fused kernel: each (rank, lane) a program of its own.

The interpreter runs a lane on blocks of its own, beside the rank's other lanes; the fused
kernel does the same: :func:`lane_slots` cuts every rank's table into one-lane tables, one
per lane, and a launch runs each as a rank slot of its own (``kernels/fused.py``: slot s
reads program s, on blocks ``s * blocks_per_rank ...``), every slot on the same grid. Block b
of every slot then takes the same items of every row, so the fused kernel's argument holds
across lanes as across ranks: two rows that cover the same bytes give item i to block b on
both sides, and block b's flag slot orders them (a lane's flags are its own: one per source
rank and lane, ``lowering.flag_slots``). What orders rows of two lanes is what the plan
orders them with (SNAC verifies lanes running side by side), and every rule of
``purlin.atom.fused.fuse_problem`` is judged on the slots as on ranks. A rank's lanes share
its error record (first writer wins) and are launched together, so a rank's next call
starts after all of them ended.

>>> from purlin.atom.host import HostBuffers
>>> from purlin.snac import plan
>>> from purlin.spec import collectives
>>> s = plan(collectives.all_reduce(2), "ring", count=64, chunks=2, lanes=2)
>>> [(low.rank, len(low.lane_offsets) - 1) for low in lane_slots(HostBuffers(s).lower())]
[(0, 1), (0, 1), (1, 1), (1, 1)]
"""

from __future__ import annotations

import dataclasses

import numpy as np

from purlin.atom.lowering import LoweredRank

__all__ = ["lane_slots", "slot_lanes"]


def lane_slots(lowered: list[LoweredRank]) -> list[LoweredRank]:
    """Each rank's lanes as one-lane tables of their own, rank by rank, lanes in order; a
    lane with no rows left out (a rank keeps one); one-lane ranks as they are."""
    if all(len(low.lane_offsets) == 2 for low in lowered):
        return list(lowered)
    return [slot for low in lowered for _, slot in _slots(low)]


def slot_lanes(low: LoweredRank) -> list[int]:
    """The lane each of rank ``low``'s slots (:func:`lane_slots`) runs, in slot order."""
    return [lane for lane, _ in _slots(low)]


def _slots(low: LoweredRank) -> list[tuple[int, LoweredRank]]:
    bounds = [int(x) for x in low.lane_offsets]
    if len(bounds) == 2:
        return [(0, low)]
    out = []
    for lane, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        if b > a:
            out.append((lane, dataclasses.replace(
                low, tables=[t[a:b] for t in low.tables],
                lane_offsets=np.array([0, b - a], dtype=np.int64))))
    if not out:
        out.append((0, dataclasses.replace(
            low, tables=[t[:0] for t in low.tables],
            lane_offsets=np.array([0, 0], dtype=np.int64))))
    return out
