"""The schedule IR: Stage, Notify and Consume steps over named buffer regions.

Regions name a buffer of a rank (``input``, ``output`` or ``scratch``) and an element range; no
raw pointers. Flags are counters that only grow: flag ``(owner, src, lane)`` lives in the owner's
memory and only lane ``lane`` of rank ``src`` adds to it, one per Notify. A Wait for value ``v``
with ``call=0`` is satisfied once the flag has grown by ``v`` in this call; ``call=-1`` refers to
the previous call (acknowledgements), and so on.

>>> r = Region(1, "scratch", 0, 8)
>>> r
r1.scratch[0:8]
>>> Region.from_json(r.to_json()) == r
True
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Union

from purlin.spec.collective import Collective, _fmt
from purlin.spec.layout import name_from_json, name_to_json

BUFFERS = ("input", "output", "scratch")


@dataclass(frozen=True, order=True)
class Region:
    """``count`` elements from ``offset`` in ``buffer`` of ``rank``."""

    rank: int
    buffer: str
    offset: int
    count: int

    @property
    def end(self) -> int:
        return self.offset + self.count

    def overlaps(self, other: "Region") -> bool:
        return (self.rank == other.rank and self.buffer == other.buffer
                and self.offset < other.end and other.offset < self.end)

    def __repr__(self) -> str:
        return f"r{self.rank}.{self.buffer}[{self.offset}:{self.end}]"

    def to_json(self):
        return [self.rank, self.buffer, self.offset, self.count]

    @classmethod
    def from_json(cls, obj) -> "Region":
        return cls(*obj)


@dataclass(frozen=True, order=True)
class Flag:
    """A growing counter in ``owner``'s memory that only lane ``lane`` of rank ``src`` adds to."""

    owner: int
    src: int
    lane: int

    def __repr__(self) -> str:
        return f"flag(r{self.owner}<-r{self.src}.l{self.lane})"


@dataclass(frozen=True)
class Wait:
    """Wait until ``flag`` has grown by ``value`` within call ``call`` (0 = this call)."""

    flag: Flag
    value: int
    call: int = 0

    def __repr__(self) -> str:
        when = "" if self.call == 0 else f" of call{self.call:+d}"
        return f"{self.flag}>={self.value}{when}"


@dataclass(frozen=True)
class Stage:
    """The producer ``rank`` moves data: ``op`` over ``srcs`` into ``dst`` (usually a peer's)."""

    rank: int
    lane: int
    op: str
    srcs: tuple[Region, ...]
    dst: Region
    names: tuple = ()
    engine: str = ""
    kind = "stage"

    @property
    def waits(self) -> tuple:
        return ()

    @property
    def moves_data(self) -> bool:
        return True


@dataclass(frozen=True)
class Notify:
    """Rank ``rank`` adds one to ``flag`` (in ``flag.owner``'s memory); ``value`` is the count
    the flag reaches within the call."""

    rank: int
    lane: int
    flag: Flag
    value: int
    kind = "notify"

    @property
    def waits(self) -> tuple:
        return ()

    @property
    def moves_data(self) -> bool:
        return False


@dataclass(frozen=True)
class Consume:
    """Wait for every flag in ``waits``, then (if ``dst``) apply ``op`` over ``srcs`` into ``dst``."""

    rank: int
    lane: int
    waits: tuple[Wait, ...]
    op: str | None = None
    srcs: tuple[Region, ...] = ()
    dst: Region | None = None
    names: tuple = ()
    engine: str = ""
    kind = "consume"

    @property
    def moves_data(self) -> bool:
        return self.dst is not None


Step = Union[Stage, Notify, Consume]


def step_peer(step: Step) -> int | None:
    """The other rank a step talks to, if any (for rendering and traces)."""
    if isinstance(step, Notify):
        return step.flag.owner
    ranks = {r.rank for r in (*step.srcs, *((step.dst,) if step.dst else ()))} - {step.rank}
    if not ranks and step.waits:
        ranks = {w.flag.src for w in step.waits}
    return min(ranks) if ranks else None


def render_step(step: Step) -> str:
    """One line, e.g. ``stage copy r0.input[0:4] -> r1.scratch[0:4]``."""
    names = f"  {{{', '.join(_fmt(n) for n in step.names)}}}" if getattr(step, "names", ()) else ""
    engine = f" [{step.engine}]" if getattr(step, "engine", "") else ""
    if isinstance(step, Notify):
        return f"notify {step.flag} ={step.value}"
    move = ""
    if step.moves_data:
        srcs = " + ".join(map(repr, step.srcs))
        move = f"{step.op} {srcs} -> {step.dst!r}{engine}{names}"
    if isinstance(step, Stage):
        return f"stage {move}"
    waits = ", ".join(map(repr, step.waits))
    return f"consume wait {waits}" + (f"; {move}" if move else "")


# -- JSON -------------------------------------------------------------------------------------
def step_to_json(step: Step) -> dict:
    out = {"kind": step.kind, "rank": step.rank, "lane": step.lane}
    if isinstance(step, Notify):
        out.update(flag=[step.flag.owner, step.flag.src, step.flag.lane], value=step.value)
        return out
    if step.waits:
        out["waits"] = [[w.flag.owner, w.flag.src, w.flag.lane, w.value, w.call]
                        for w in step.waits]
    if step.moves_data:
        out.update(op=step.op, srcs=[r.to_json() for r in step.srcs], dst=step.dst.to_json(),
                   names=[name_to_json(n) for n in step.names])
        if step.engine:
            out["engine"] = step.engine
    return out


def step_from_json(obj: dict) -> Step:
    rank, lane = obj["rank"], obj["lane"]
    if obj["kind"] == "notify":
        return Notify(rank, lane, Flag(*obj["flag"]), obj["value"])
    data = {}
    if "dst" in obj:
        data = dict(op=obj["op"], srcs=tuple(Region.from_json(r) for r in obj["srcs"]),
                    dst=Region.from_json(obj["dst"]),
                    names=tuple(name_from_json(n) for n in obj.get("names", ())),
                    engine=obj.get("engine", ""))
    if obj["kind"] == "stage":
        return Stage(rank, lane, **data)
    waits = tuple(Wait(Flag(o, s, l), v, c) for o, s, l, v, c in obj.get("waits", ()))
    return Consume(rank, lane, waits, **data)


@dataclass(frozen=True)
class Schedule:
    """A verified plan: per rank, steps in program order (each lane keeps its own order).

    ``scratch[r]`` is the scratch elements rank r needs for one call; with ``scratch_copies``
    = 2 the calls alternate between two such areas (call e uses copy e % 2).
    """

    collective: Collective
    dtype: str
    chunk_counts: tuple[tuple, ...]  # (name, elements) as in the Sizing
    strategy: str
    chunks: int
    lanes: int
    steps: tuple[tuple[Step, ...], ...]
    scratch: tuple[int, ...]
    scratch_copies: int = 1
    meta: tuple = field(default=(), compare=False)
    lanes_by: str = "piece"     # how pieces map to lanes (planner.plan)

    @property
    def nranks(self) -> int:
        return len(self.steps)

    @property
    def sizing(self):
        return self.collective.sized(chunk_sizes=dict(self.chunk_counts), dtype=self.dtype)

    def lane_steps(self, rank: int, lane: int) -> tuple[Step, ...]:
        return tuple(s for s in self.steps[rank] if s.lane == lane)

    def divisor(self, step) -> int:
        """For an ``avg`` step: how many inputs the average is over (its names' sources)."""
        return len(self.collective.sources(step.names[0])) if step.names else 1

    def flags(self) -> dict[Flag, int]:
        """Every flag and how much it grows per call."""
        grow: dict[Flag, int] = {}
        for rank_steps in self.steps:
            for s in rank_steps:
                if isinstance(s, Notify):
                    grow[s.flag] = grow.get(s.flag, 0) + 1
        return grow

    # -- rendering --------------------------------------------------------------------------
    def render(self, ranks=None) -> str:
        """The per-rank program, one line per step."""
        lines = [self.title()]
        for rank in ranks if ranks is not None else range(self.nranks):
            lines.append(f"rank {rank}  (scratch {self.scratch[rank]} elements"
                         f"{' x2' if self.scratch_copies == 2 else ''})")
            for i, s in enumerate(self.steps[rank]):
                lines.append(f"  {i:3d} l{s.lane} {render_step(s)}")
        return "\n".join(lines)

    def title(self) -> str:
        c = self.collective
        by = " by stage" if self.lanes_by == "stage" else ""
        return (f"{c.name} ({c.op}) on {c.nranks} ranks, {self.strategy}, {self.chunks} "
                f"chunk(s) x {self.lanes} lane(s){by}, {self.dtype}")

    def summary(self) -> dict:
        """Counts: steps by kind, remote hops, bytes on each directed link (src, dst)."""
        from purlin.spec.dtypes import dtype as as_dtype

        item = as_dtype(self.dtype).itemsize
        kinds: dict[str, int] = {}
        links: dict[tuple[int, int], int] = {}
        hops = 0
        for rank_steps in self.steps:
            for s in rank_steps:
                kinds[s.kind] = kinds.get(s.kind, 0) + 1
                if not s.moves_data:
                    continue
                # data crosses a link into the rank running the step (remote reads) and out of
                # it (a remote write): a push that reduces local sources sends one result
                moves = [(src.rank, s.rank, src.count) for src in s.srcs]
                moves.append((s.rank, s.dst.rank, s.dst.count))
                for a, b, count in moves:
                    if a != b:
                        links[(a, b)] = links.get((a, b), 0) + count * item
                        hops += 1
        return {"steps": kinds, "remote_hops": hops, "link_bytes": links,
                "total_link_bytes": sum(links.values())}

    def __repr__(self) -> str:
        s = self.summary()
        return (f"<Schedule {self.title()}: {sum(s['steps'].values())} steps, "
                f"{s['remote_hops']} remote hops>")

    def _repr_html_(self) -> str:
        import html

        return f"<pre>{html.escape(self.render())}</pre>"

    # -- JSON -------------------------------------------------------------------------------
    def to_json(self) -> dict:
        return {
            "collective": self.collective.to_json(),
            "dtype": self.dtype,
            "chunk_counts": [[name_to_json(n), c] for n, c in self.chunk_counts],
            "strategy": self.strategy,
            "chunks": self.chunks,
            "lanes": self.lanes,
            "lanes_by": self.lanes_by,
            "scratch": list(self.scratch),
            "scratch_copies": self.scratch_copies,
            "steps": [[step_to_json(s) for s in rank_steps] for rank_steps in self.steps],
        }

    def dumps(self, **kw) -> str:
        return json.dumps(self.to_json(), **kw)

    @classmethod
    def from_json(cls, obj) -> "Schedule":
        if isinstance(obj, str):
            obj = json.loads(obj)
        return cls(
            collective=Collective.from_json(obj["collective"]),
            dtype=obj["dtype"],
            chunk_counts=tuple((name_from_json(n), c) for n, c in obj["chunk_counts"]),
            strategy=obj["strategy"],
            chunks=obj["chunks"],
            lanes=obj["lanes"],
            steps=tuple(tuple(step_from_json(s) for s in r) for r in obj["steps"]),
            scratch=tuple(obj["scratch"]),
            scratch_copies=obj["scratch_copies"],
            lanes_by=obj.get("lanes_by", "piece"),
        )
