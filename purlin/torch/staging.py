"""Where prepared collectives live inside the symmetric staging area.

Every prepared (collective, size, dtype) gets a slice of its own -- the same offsets on every
rank -- holding its flags, input, output and scratch, so a schedule's own proof of safe reuse
across back-to-back calls (``verify``) holds whatever other collectives run in between. Slices
are placed first-fit; when the area is full the least recently used slices that are not
pinned (captured in a CUDA graph, or handed out as buffers) are evicted. Every rank makes the
same calls in the same order, so every rank makes the same decisions without talking.

>>> area = Staging(1024)
>>> area.place("a", 512), area.place("b", 256), area.place("c", 512)
(0, 512, None)
>>> area.victims(512)
['a']
>>> area.free("a"); area.place("c", 512)
0
"""

from __future__ import annotations

from collections import OrderedDict

from purlin.runtime.shm import ALIGN, round_up


class Staging:
    """First-fit placement of slices in ``nbytes``, with least-recently-used eviction."""

    def __init__(self, nbytes: int, align: int = ALIGN):
        self.nbytes, self.align = int(nbytes), align
        self.slices: "OrderedDict[object, tuple[int, int]]" = OrderedDict()  # LRU first
        self.pinned: set = set()

    def _fit(self, size: int, taken) -> int | None:
        at = 0
        for off, sz in sorted(taken):
            if off - at >= size:
                return at
            at = max(at, off + sz)
        return at if self.nbytes - at >= size else None

    def place(self, key, size: int) -> int | None:
        """Offset of a new slice for ``key``, or None if it does not fit without evicting."""
        size = round_up(max(size, 1), self.align)
        off = self._fit(size, self.slices.values())
        if off is not None:
            self.slices[key] = (off, size)
        return off

    def touch(self, key) -> None:
        self.slices.move_to_end(key)

    def pin(self, key) -> None:
        self.pinned.add(key)

    def victims(self, size: int) -> list | None:
        """Least recently used unpinned keys whose eviction makes room for ``size`` bytes,
        or None if even evicting all of them would not."""
        size = round_up(max(size, 1), self.align)
        left = dict(self.slices)
        out = []
        for key in list(self.slices):
            if self._fit(size, left.values()) is not None:
                return out
            if key in self.pinned:
                continue
            del left[key]
            out.append(key)
        return out if self._fit(size, left.values()) is not None else None

    def free(self, key) -> None:
        self.slices.pop(key, None)
        self.pinned.discard(key)

    @property
    def used(self) -> int:
        return sum(sz for _, sz in self.slices.values())

    def __repr__(self) -> str:
        return (f"<Staging {self.used}/{self.nbytes} bytes in {len(self.slices)} slice(s), "
                f"{len(self.pinned)} pinned>")
