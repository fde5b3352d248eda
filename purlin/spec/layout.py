"""A Layout says, for every rank, which named chunks its buffer holds, in order.

>>> lay = Layout([["a", "b"], ["c"]])
>>> lay.nranks, lay[0], lay.positions("c")
(2, ('a', 'b'), ((1, 0),))
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Iterable, Sequence

from purlin.errors import SpecError

Name = Hashable


def check_name(name, where: str) -> Name:
    """Names are strings, integers or (nested) tuples of them, so a plan can be saved as JSON."""
    if isinstance(name, bool) or not isinstance(name, (str, int, tuple)):
        raise SpecError(
            f"chunk name {name!r} at {where} must be a str, an int or a tuple of them, "
            f"not {type(name).__name__}"
        )
    if isinstance(name, tuple):
        for part in name:
            check_name(part, where)
    return name


def name_to_json(name):
    """Tuples become {"t": [...]} so they survive a JSON round-trip distinct from lists."""
    return {"t": [name_to_json(p) for p in name]} if isinstance(name, tuple) else name


def name_from_json(obj) -> Name:
    return tuple(name_from_json(p) for p in obj["t"]) if isinstance(obj, dict) else obj


@dataclass(frozen=True)
class Layout:
    """Per rank, the ordered chunk names of its buffer. A rank may hold nothing."""

    slots: tuple[tuple[Name, ...], ...]

    def __init__(self, slots: Iterable[Iterable[Name]] | Sequence[Sequence[Name]]):
        if isinstance(slots, Layout):
            slots = slots.slots
        if isinstance(slots, (str, bytes)):
            raise SpecError(f"a Layout is a list with one list of chunk names per rank, got the "
                            f"string {slots!r}")
        try:
            rows_given = list(slots)
        except TypeError:
            raise SpecError("a Layout is a list with one list of chunk names per rank, "
                            f"got {slots!r}") from None
        for rank, row in enumerate(rows_given):
            if isinstance(row, (str, bytes)):
                raise SpecError(f"rank {rank} of the layout is the string {row!r}; give its "
                                f"chunk names as a list, e.g. [{row!r}]")
        slots = rows_given
        try:
            rows = tuple(tuple(row) for row in slots)
        except TypeError:
            raise SpecError(
                "a Layout is a list with one list of chunk names per rank, "
                f"got {slots!r}"
            ) from None
        for rank, row in enumerate(rows):
            for pos, name in enumerate(row):
                check_name(name, f"rank {rank} position {pos}")
        object.__setattr__(self, "slots", rows)

    @property
    def nranks(self) -> int:
        return len(self.slots)

    def __getitem__(self, rank: int) -> tuple[Name, ...]:
        return self.slots[rank]

    def __iter__(self):
        return iter(self.slots)

    def __len__(self) -> int:
        return len(self.slots)

    def names(self) -> tuple[Name, ...]:
        """Every distinct name, in order of first appearance (rank by rank)."""
        seen = {}
        for row in self.slots:
            for name in row:
                seen.setdefault(name, None)
        return tuple(seen)

    def positions(self, name: Name) -> tuple[tuple[int, int], ...]:
        """All (rank, position) pairs that hold ``name``."""
        return tuple(
            (rank, pos)
            for rank, row in enumerate(self.slots)
            for pos, held in enumerate(row)
            if held == name
        )

    def to_json(self):
        return [[name_to_json(n) for n in row] for row in self.slots]

    @classmethod
    def from_json(cls, obj) -> "Layout":
        return cls([[name_from_json(n) for n in row] for row in obj])

    def __repr__(self) -> str:
        return f"Layout({[list(row) for row in self.slots]!r})"
