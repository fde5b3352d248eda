"""Segments: runs of chunk names that travel together.

Names with the same sources and the same holders that sit next to each other, in the same order,
in every buffer where they appear form one segment, so an all-reduce moves one contiguous range
per peer instead of one range per chunk name.

>>> from purlin.spec import collectives
>>> [len(s.names) for s in segments(collectives.all_reduce(4).sized(count=8))]
[4]
>>> [s.names for s in segments(collectives.all_gather(2).sized(count=4))]
[(0,), (1,)]
"""

from __future__ import annotations

from dataclasses import dataclass

from purlin.spec.sizing import Sizing


@dataclass(frozen=True)
class Segment:
    """``count`` elements made of ``names``; ``sources`` maps each source rank to the input
    offset of the segment; ``holders`` maps each holder rank to its output offsets (one per
    occurrence)."""

    names: tuple
    counts: tuple[int, ...]
    sources: tuple[tuple[int, int], ...]
    holders: tuple[tuple[int, tuple[int, ...]], ...]

    @property
    def count(self) -> int:
        return sum(self.counts)

    def names_in(self, start: int, stop: int) -> tuple:
        """Names whose elements overlap ``[start, stop)`` of the segment."""
        out, at = [], 0
        for name, c in zip(self.names, self.counts):
            if at < stop and start < at + c:
                out.append(name)
            at += c
        return tuple(out)


def _pattern(sizing: Sizing, name):
    coll = sizing.collective
    srcs = tuple(sorted(r for r, _ in coll.sources(name)))
    holders = {}
    for r, row in enumerate(coll.output):
        k = sum(1 for n in row if n == name)
        if k:
            holders[r] = k
    return srcs, tuple(sorted(holders.items()))


def _places(sizing: Sizing, name):
    coll = sizing.collective
    srcs = {r: (p, sizing.input_offset(r, p)) for r, p in coll.sources(name)}
    outs = {}
    for r, row in enumerate(coll.output):
        for q, n in enumerate(row):
            if n == name:
                outs.setdefault(r, []).append((q, sizing.output_offset(r, q)))
    return srcs, outs


def segments(sizing: Sizing) -> list[Segment]:
    """Group the output names of a sized collective into maximal contiguous segments."""
    coll = sizing.collective
    order = []
    for row in coll.output:
        for name in row:
            if name not in order:
                order.append(name)
    groups: list[list] = []
    last = None
    for name in order:
        if sizing.chunk_count(name) == 0:
            continue
        pat = _pattern(sizing, name)
        srcs, outs = _places(sizing, name)
        if last is not None and last[0] == pat and _follows(last[1], last[2], srcs, outs):
            groups[-1].append(name)
        else:
            groups.append([name])
        last = (pat, srcs, outs)
    result = []
    for group in groups:
        srcs, outs = _places(sizing, group[0])
        result.append(Segment(
            names=tuple(group),
            counts=tuple(sizing.chunk_count(n) for n in group),
            sources=tuple(sorted((r, off) for r, (_, off) in srcs.items())),
            holders=tuple(sorted((r, tuple(off for _, off in places))
                                 for r, places in outs.items())),
        ))
    return result


def _follows(prev_srcs, prev_outs, srcs, outs) -> bool:
    """True if every placement of the new name sits right after the previous name's."""
    if any(srcs[r][0] != prev_srcs[r][0] + 1 for r in srcs):
        return False
    for r, places in outs.items():
        prev = prev_outs[r]
        if len(prev) != len(places):
            return False
        if any(q != pq + 1 for (q, _), (pq, _) in zip(places, prev)):
            return False
    return True
