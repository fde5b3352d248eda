"""plan(): a pure function from a collective, a strategy and chunking to a verified Schedule.

>>> from purlin.spec import collectives
>>> s = plan(collectives.all_gather(4), "direct-push", nbytes=4096)
>>> s.summary()["remote_hops"]
12
>>> plan(collectives.all_reduce(4), "ring", count=64, chunks=2).strategy
'ring'
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from purlin.errors import PlanError, SpecError
from purlin.snac.determinism import DETERMINISTIC_STRATEGIES, check_deterministic
from purlin.snac.ir import Schedule
from purlin.snac.routes import Route, emit
from purlin.snac.segments import segments
from purlin.snac import strategies
from purlin.snac.strategies import Piece, check_strategy, parts_of, route_nodes
from purlin.snac.verify import verify
from purlin.spec.collective import Collective
from purlin.spec.sizing import Sizing


@dataclass(frozen=True)
class Capabilities:
    """What a datapath can do; the planner places reductions on ``reduce_engine`` when
    ``can_reduce`` is False (copy engines feeding an SM reduction)."""

    name: str = "cpu"
    can_reduce: bool = True
    reduce_engine: str = ""


DEFAULT_COUNT_PER_CHUNK = 256
LANES_BY = ("piece", "stage")


def plan(collective: Collective, strategy: str = "direct-push", *, count: int | None = None,
         nbytes: int | None = None, dtype="float32", chunk_sizes=None,
         sizing: Sizing | None = None, chunks: int = 1, lanes: int = 1,
         lanes_by: str = "piece", capabilities: Capabilities | None = None,
         check: bool = True, deterministic: bool = False) -> Schedule:
    """Plan ``collective`` with ``strategy`` and verify the result (unless ``check=False``).

    The size is given as ``count`` elements or ``nbytes`` of the largest per-rank buffer, or
    per chunk with ``chunk_sizes``, or as a ready ``sizing``; with none of them every chunk gets
    256 elements. ``chunks`` splits every transfer into that many pieces so hops pipeline;
    ``lanes`` spreads the pieces over that many parallel workers per rank: with
    ``lanes_by="piece"`` every piece keeps one lane from its first hop to its last (the
    collective's pieces, segment by segment, go round-robin); with ``lanes_by="stage"`` a
    piece's hop at depth d runs in lane d % lanes, so each lane does one kind of work for
    every piece in turn (on a datapath whose lane is a single in-order queue, such as copy
    engines, piece k+1's transfer then runs beside piece k's reduction instead of after it;
    on 2 x H200 that pipelined but did not beat the SMs).

    >>> from purlin.spec import collectives
    >>> s = plan(collectives.all_reduce(2), "two-phase", count=64, chunks=2, lanes=3,
    ...          lanes_by="stage")
    >>> sorted({(st.lane, st.kind) for st in s.steps[0]})  # doctest: +NORMALIZE_WHITESPACE
    [(0, 'notify'), (0, 'stage'), (1, 'consume'), (1, 'notify'), (1, 'stage'), (2, 'consume')]

    ``deterministic=True`` lists every reduce step's sources in rank order and proves, with
    :func:`~purlin.snac.determinism.check_deterministic` (even with ``check=False``), that each
    reduced output element comes from one step reading all its contributions; a strategy that
    sums hop by hop (ring on 3+ ranks) is refused with a PlanError.
    """
    if sizing is None:
        if count is None and nbytes is None and chunk_sizes is None:
            chunk_sizes = {n: DEFAULT_COUNT_PER_CHUNK for n in collective.input.names()}
        sizing = collective.sized(count, nbytes=nbytes, dtype=dtype, chunk_sizes=chunk_sizes)
    elif sizing.collective != collective:
        raise PlanError("the sizing given belongs to another collective")
    for label, value in (("chunks", chunks), ("lanes", lanes)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise PlanError(f"{label} must be a whole number >= 1, got {value!r}")
    if lanes_by not in LANES_BY:
        raise PlanError(f"lanes_by must be one of {', '.join(LANES_BY)}, got {lanes_by!r}")
    if not isinstance(deterministic, bool):
        raise PlanError(f"deterministic must be True or False, got {deterministic!r}")
    return _plan(sizing, strategy, chunks, lanes, lanes_by, capabilities or Capabilities(),
                 check, deterministic)


@lru_cache(maxsize=256)
def _plan(sizing: Sizing, strategy: str, chunks: int, lanes: int, lanes_by: str,
          caps: Capabilities, check: bool, deterministic: bool = False) -> Schedule:
    coll = sizing.collective
    check_strategy(strategy, coll)
    routes = build_routes(sizing, strategy, chunks, lanes)
    engine_for = None
    if not caps.can_reduce:
        if not caps.reduce_engine:
            if coll.op.is_reduce:
                raise PlanError(f"datapath {caps.name!r} cannot reduce and names no engine to "
                                f"place the reductions of {coll.name} on")
        else:
            engine_for = lambda op: caps.name if op == "copy" else caps.reduce_engine  # noqa
    shape = (strategy, chunks, lanes, lanes_by)
    schedule, report = _safe_schedule(sizing, shape, routes, engine_for, deterministic)
    if check:
        (report or verify(schedule)).raise_if_failed()
    if deterministic:
        _require_deterministic(schedule)
    return schedule


def _require_deterministic(schedule: Schedule) -> None:
    problems = check_deterministic(schedule)
    if problems:
        n = schedule.nranks
        raise PlanError(
            f"strategy {schedule.strategy!r} cannot plan {schedule.collective.name} with "
            f"deterministic=True: {problems[0]}. Deterministic mode needs every output element "
            f"reduced by one step that reads all {n} contributions in rank order; of the "
            f"built-in strategies {', '.join(DETERMINISTIC_STRATEGIES)} do that")


strategies.on_change(_plan.cache_clear)  # a re-registered name must not keep old plans


def split(count: int, parts: int, align: int = 1) -> list[tuple[int, int]]:
    """``count`` elements as ``parts`` near-equal (start, count) pieces, empty ones dropped;
    with ``align``, where every piece can have ``align`` elements, every piece but the last
    a whole number of them (the last takes the rest), so every piece starts where the first
    does modulo ``align`` -- the same pieces as without it wherever those all start aligned.

    >>> split(10, 3)
    [(0, 4), (4, 3), (7, 3)]
    >>> split(33, 4), split(33, 4, align=8)
    ([(0, 9), (9, 8), (17, 8), (25, 8)], [(0, 8), (8, 8), (16, 8), (24, 9)])
    >>> split(10, 3, align=8)
    [(0, 4), (4, 3), (7, 3)]
    """
    if count // align < parts:  # (fewer pieces than asked would change the plan's shape)
        align = 1
    whole, rest = divmod(count, align)
    base, extra = divmod(whole, parts)
    out, at = [], 0
    for k in range(parts):
        c = (base + (1 if k < extra else 0)) * align + (rest if k == parts - 1 else 0)
        if c:
            out.append((at, c))
        at += c
    return out


def part_align(sizing) -> int:
    """Elements in 16 bytes of ``sizing``'s dtype: owner parts and chunks are cut there, so a
    message a few elements past a whole size starts every part on the 16-byte items the
    fused kernel moves (and takes the plan measured for the whole size)."""
    return max(1, 16 // sizing.dtype.itemsize)


def build_routes(sizing: Sizing, strategy: str, chunks: int, lanes: int) -> list[Route]:
    coll = sizing.collective
    op = coll.op.reduce_op if coll.op.is_reduce else "copy"
    routes = []
    for seg in segments(sizing):
        align = part_align(sizing)
        parts = split(seg.count, parts_of(seg, strategy), align)
        for part, (pstart, pcount) in enumerate(parts):
            pieces = split(pcount, chunks, align)
            for k, (start, count) in enumerate(pieces):
                start += pstart
                nodes = route_nodes(strategy, Piece(coll, seg, start, count, part, k,
                                                    len(parts), len(pieces)))
                # (round-robin over every piece of the collective, not of each segment:
                # a layout of several segments, one piece each, spreads over the lanes)
                routes.append(Route(nodes, count, op, len(seg.sources),
                                    seg.names_in(start, start + count),
                                    lane=len(routes) % lanes, seq=k))
    if not routes:
        raise SpecError(f"{coll.name} moves no data: every chunk has 0 elements")
    return routes


def _schedule(sizing, shape, emitted, copies) -> Schedule:
    strategy, chunks, lanes, lanes_by = shape
    return Schedule(
        collective=sizing.collective, dtype=sizing.dtype.name, chunk_counts=sizing.chunks,
        strategy=strategy, chunks=chunks, lanes=lanes, lanes_by=lanes_by,
        steps=tuple(tuple(r) for r in emitted.steps), scratch=tuple(emitted.scratch),
        scratch_copies=copies)


def _safe_schedule(sizing, shape, routes, engine_for, rank_order=False):
    """Make scratch reuse across back-to-back calls safe at the least cost: a single scratch
    area if the schedule's own waits already order the reuse, else two alternating areas,
    else two areas plus acknowledgements for exactly the edges that still race. Returns the
    schedule and its verification report (None where the final schedule is not verified yet)."""
    n = sizing.collective.nranks
    by_stage = shape[2] if shape[3] == "stage" else 0
    for copies in (1, 2):
        emitted = emit(routes, n, copies=copies, engine_for=engine_for, stage_lanes=by_stage,
                       rank_order=rank_order)
        schedule = _schedule(sizing, shape, emitted, copies)
        report = verify(schedule, max_races=None)
        if report.ok or not _scratch_races(report):
            return schedule, report
    acks = frozenset(_racing_edges(report, emitted, schedule))
    emitted = emit(routes, n, acks=acks, copies=2, engine_for=engine_for, stage_lanes=by_stage,
                   rank_order=rank_order)
    return _schedule(sizing, shape, emitted, 2), None


def _scratch_races(report) -> bool:
    return bool(report.races) and all(r.region.buffer == "scratch" for r in report.races) \
        and not report.errors


def _racing_edges(report, emitted, schedule) -> set[int]:
    """Scratch edges whose landing region overlaps a race."""
    racing = set()
    for eid, (_producer, landing) in emitted.edges.items():
        size = schedule.scratch[landing.rank]
        for race in report.races:
            reg = race.region
            off = reg.offset % size if size else reg.offset
            if reg.rank == landing.rank and off < landing.end and landing.offset < off + reg.count:
                racing.add(eid)
    return racing
