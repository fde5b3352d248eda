"""Symbolic memory for verification: what every element range of a buffer holds.

A Term says an interval holds ``op`` over input elements ``input_s[x + delta]`` of call ``e``
(one contribution per source); Memory keeps, per (rank, buffer), a sorted interval map of Terms
(None where nothing was written), so verification costs do not grow with message sizes.

>>> m = Memory()
>>> m.write(0, "scratch", 0, [(0, 8, Term(((1, 0, 0),)))])
>>> [(a, b, t.contribs if t else None) for a, b, t in m.read(0, "scratch", 4, 12)]
[(0, 4, ((1, 0, 0),)), (4, 8, None)]
"""

from __future__ import annotations

from bisect import bisect_right


class Term:
    """Symbolic content of an interval: content[x] = op over input_s[x + delta] of call e."""

    __slots__ = ("contribs", "op", "divided")

    def __init__(self, contribs, op=None, divided=False):
        self.contribs = contribs      # sorted tuple of (src rank, delta, call)
        self.op = op
        self.divided = divided

    def shifted(self, by: int) -> "Term":
        return Term(tuple((r, d + by, c) for r, d, c in self.contribs), self.op, self.divided)

    def key(self):
        return (self.contribs, self.op, self.divided)


class Memory:
    """Interval map per (rank, buffer): sorted starts, ends and terms (None = no data)."""

    def __init__(self):
        self.maps: dict = {}

    def read(self, rank, buf, start, stop):
        starts, ends, terms = self.maps.get((rank, buf), ([], [], []))
        out = []
        at = start
        i = max(0, bisect_right(starts, start) - 1)
        while at < stop:
            if i < len(starts) and starts[i] <= at < ends[i]:
                end = min(ends[i], stop)
                out.append((at - start, end - start, terms[i]))
                at = end
                i += 1
            else:
                nxt = starts[i] if i < len(starts) and starts[i] > at else stop
                nxt = min(nxt, stop)
                if nxt <= at:
                    i += 1
                    continue
                out.append((at - start, nxt - start, None))
                at = nxt
        return out

    def write(self, rank, buf, start, pieces):
        """``pieces`` = [(rel_start, rel_stop, term)] covering the region from ``start``."""
        starts, ends, terms = self.maps.setdefault((rank, buf), ([], [], []))
        stop = start + pieces[-1][1]
        # cut out [start, stop)
        keep_s, keep_e, keep_t = [], [], []
        lo = max(0, bisect_right(starts, start) - 1)
        hi = bisect_right(starts, stop)
        for k in range(lo, hi):
            s, e, t = starts[k], ends[k], terms[k]
            if e <= start or s >= stop:
                keep_s.append(s), keep_e.append(e), keep_t.append(t)
                continue
            if s < start:
                keep_s.append(s), keep_e.append(start), keep_t.append(t)
            if e > stop:
                keep_s.append(stop), keep_e.append(e), keep_t.append(t.shifted(0) if t else t)
        new = [(start + a, start + b, t) for a, b, t in pieces]
        merged = sorted(list(zip(keep_s, keep_e, keep_t)) + new, key=lambda x: x[0])
        starts[lo:hi] = [m[0] for m in merged]
        ends[lo:hi] = [m[1] for m in merged]
        terms[lo:hi] = [m[2] for m in merged]
