"""Strategies are routes, not code paths: each one says how a piece of a segment travels.

A strategy is a function from a :class:`Piece` to the :class:`Node` list of one route,
registered by name with :func:`strategy`; :func:`check_route` refuses a malformed route. How to
write one, what it receives and what is checked: ARCHITECTURE.md, "Add a strategy"; the
built-ins: "SNAC".

>>> from purlin.spec import collectives
>>> from purlin.snac import plan
>>> @strategy("doc-star", replace=True)
... def star(piece):
...     hub = piece.holders[0]
...     leaves = [Node(s, own=piece.input(s)) for s in piece.sources if s != hub]
...     top = Node(hub, own=piece.input(hub), preds=list(range(len(leaves))),
...                outputs=piece.outputs(hub))
...     rest = [Node(h, preds=[len(leaves)], outputs=piece.outputs(h)) for h in piece.holders[1:]]
...     return leaves + [top] + rest
>>> plan(collectives.all_reduce(4), "doc-star", count=8).summary()["remote_hops"]
6
>>> unregister("doc-star")
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Callable

from purlin.errors import PlanError
from purlin.snac.ir import Region
from purlin.snac.routes import INTO_OUTPUT, PULL, SCRATCH, Node
from purlin.snac.segments import Segment
from purlin.spec.collective import Collective, _fmt

INCOMING = (SCRATCH, INTO_OUTPUT, PULL)
RESERVED = ("auto",)   # the runtime's choice among the registered strategies


@dataclass(frozen=True)
class Piece:
    """What a strategy receives: ``count`` elements from ``start`` of one segment.

    ``sources`` are the ranks whose input holds the piece (one for a copy collective, every
    contributor for a reduction), ``holders`` the ranks whose output needs it; ``input(r)`` and
    ``outputs(r)`` give the regions. ``op`` is ``"copy"`` or the reduce op. With
    ``owners=True`` at registration a reducing segment is cut into one part per holder first:
    ``part`` (of ``parts``) numbers it and ``owner`` is the holder it belongs to. ``chunk`` (of
    ``chunks``, ``plan(chunks=)``) numbers the piece within its part. Plans do not depend on
    the cluster: the same route runs on every datapath."""

    collective: Collective
    segment: Segment
    start: int
    count: int
    part: int = 0
    chunk: int = 0
    parts: int = 1
    chunks: int = 1

    @property
    def nranks(self) -> int:
        return self.collective.nranks

    @property
    def op(self) -> str:
        c = self.collective
        return c.op.reduce_op if c.op.is_reduce else "copy"

    @property
    def names(self) -> tuple:
        """The chunk names whose elements the piece carries."""
        return self.segment.names_in(self.start, self.start + self.count)

    @property
    def sources(self) -> tuple[int, ...]:
        return tuple(r for r, _ in self.segment.sources)

    @property
    def holders(self) -> tuple[int, ...]:
        return tuple(r for r, _ in self.segment.holders)

    @property
    def owner(self) -> int:
        """The holder that owns this part (two-phase reduces there, ring ends there)."""
        return self.holders[self.part % len(self.holders)]

    def input(self, rank: int) -> Region:
        """The piece in ``rank``'s input (``rank`` must be a source)."""
        offsets = dict(self.segment.sources)
        if rank not in offsets:
            raise PlanError(f"rank {rank} holds no input of chunk(s) {_names(self.names)}; "
                            f"its sources are ranks {_ranks(self.sources)}")
        return Region(rank, "input", offsets[rank] + self.start, self.count)

    def outputs(self, rank: int) -> list[Region]:
        """The output slots of ``rank`` that hold the piece (empty where it holds none)."""
        return [Region(rank, "output", off + self.start, self.count)
                for off in dict(self.segment.holders).get(rank, ())]


@dataclass(frozen=True)
class Strategy:
    """A registered strategy: ``fn(piece) -> list[Node]`` and how the planner uses it."""

    name: str
    fn: Callable[[Piece], list[Node]]
    owners: bool = False
    check: Callable[[Collective], str | None] | None = None
    builtin: bool = False

    def __call__(self, piece: Piece) -> list[Node]:
        return self.fn(piece)

    def refusal(self, collective: Collective) -> str | None:
        """Why this strategy cannot plan ``collective`` (None: it can)."""
        return self.check(collective) if self.check is not None else None


STRATEGIES: dict[str, Strategy] = {}
_listeners: list[Callable[[], None]] = []


def on_change(callback: Callable[[], None]) -> None:
    """Call ``callback()`` whenever a strategy is registered, replaced or removed (caches of
    plans and of ``auto``'s choices are cleared this way)."""
    _listeners.append(callback)


def _changed() -> None:
    for callback in _listeners:
        callback()


def strategy(name: str, *, owners: bool = False,
             check: Callable[[Collective], str | None] | None = None, replace: bool = False):
    """Register ``fn(piece: Piece) -> list[Node]`` as strategy ``name``; returns ``fn``.

    ``owners=True`` cuts each reducing segment into one part per holder before chunking
    (``piece.part`` / ``piece.owner``). ``check(collective)`` returns None when the strategy can
    plan the collective, else a sentence saying why not (``plan`` raises it as a PlanError and
    ``auto`` skips the strategy). A name is registered once: registering it again raises
    PlanError unless it is the same function again (same module and name: a re-run notebook
    cell, not a lambda) or ``replace=True``; built-in strategies are never replaced. Registered
    strategies are candidates wherever ``strategy="auto"`` ranks strategies with the cost model
    (GPUs), and ``purlin tune`` measures them like the built-ins.

    >>> @strategy("direct-push")
    ... def mine(piece):
    ...     return []
    Traceback (most recent call last):
    ...
    purlin.errors.PlanError: strategy 'direct-push' is built in and cannot be replaced; ...
    """
    if not isinstance(name, str) or not name.strip() or name != name.strip():
        raise PlanError("a strategy name is a non-empty string without surrounding spaces, "
                        f"got {name!r}")
    if name in RESERVED:
        raise PlanError(f"strategy name {name!r} is reserved (plan(..., 'auto') lets the "
                        "runtime choose); register yours under another name")
    builtin = _registering_builtins

    def register(fn):
        if not callable(fn):
            raise PlanError(f"strategy {name!r}: @strategy decorates a function "
                            f"fn(piece) -> list[Node], got {fn!r}")
        old = STRATEGIES.get(name)
        if old is not None:
            if old.builtin:
                raise PlanError(f"strategy {name!r} is built in and cannot be replaced; "
                                "register yours under another name")
            # a re-run cell or a reloaded module defines the function anew under its old name
            same = old.fn is fn or (_origin(old.fn) == _origin(fn)
                                    and "<lambda>" not in _origin(fn)[1])
            if not (same or replace):
                raise PlanError(f"strategy {name!r} is already registered (by "
                                f"{'.'.join(_origin(old.fn))}); pick another name, or pass "
                                "replace=True to replace it")
        STRATEGIES[name] = Strategy(name, fn, owners, check, builtin)
        _changed()
        return fn
    return register


def unregister(name: str) -> None:
    """Remove the user strategy ``name`` (built-ins stay)."""
    old = STRATEGIES.get(name)
    if old is None:
        raise PlanError(f"no strategy {name!r} is registered; registered: {', '.join(STRATEGIES)}")
    if old.builtin:
        raise PlanError(f"strategy {name!r} is built in and cannot be removed")
    del STRATEGIES[name]
    _changed()


def _origin(fn) -> tuple[str, str]:
    return (getattr(fn, "__module__", "?"), getattr(fn, "__qualname__", repr(fn)))


def _names(names) -> str:
    return ", ".join(_fmt(n) for n in names)


def _ranks(ranks) -> str:
    return ", ".join(str(r) for r in ranks)


def parts_of(seg: Segment, strategy_name: str) -> int:
    """How many owner parts a strategy cuts a segment into before chunking."""
    if STRATEGIES[strategy_name].owners and len(seg.sources) > 1:
        return max(1, len(seg.holders))
    return 1


def check_strategy(name: str, collective) -> None:
    """Refuse an unknown strategy, or one whose ``check`` refuses ``collective``."""
    if name not in STRATEGIES:
        raise PlanError(f"unknown strategy {name!r}; registered: {', '.join(STRATEGIES)}")
    why = STRATEGIES[name].refusal(collective)
    if why:
        raise PlanError(f"strategy {name!r} cannot plan {collective.name} on "
                        f"{collective.nranks} ranks: {why}")


def route_nodes(name: str, piece: Piece) -> list[Node]:
    """Call strategy ``name`` on ``piece`` and return its checked route (see check_route)."""
    try:
        nodes = STRATEGIES[name](piece)
    except PlanError as exc:
        if str(exc).startswith(f"strategy {name!r}"):
            raise
        raise PlanError(f"strategy {name!r}: {exc}") from None
    return check_route(name, piece, nodes)


def check_route(name: str, piece: Piece, nodes) -> list[Node]:
    """Refuse a malformed route of strategy ``name`` for ``piece`` with a PlanError naming the
    node, rank and output slot: ranks outside the cluster, predecessors not listed earlier, an
    ``own`` region that is not the rank's input of the piece, outputs that are not the piece's
    output slots on that rank, a slot written twice or never, a node that leads nowhere, and a
    value that misses a source or counts one twice (a reduction) or combines two values (a
    copy). Returns the nodes as a list."""
    def fail(what: str):
        raise PlanError(f"strategy {name!r}, {piece.collective.name} piece of chunk(s) "
                        f"{_names(piece.names)} (elements {piece.start}..."
                        f"{piece.start + piece.count}): {what}")

    if not isinstance(nodes, (list, tuple)) or not nodes:
        fail(f"a strategy returns a non-empty list of Node, got {nodes!r}")
    nodes = list(nodes)
    n = piece.nranks
    sources = set(piece.sources)
    reduce = piece.op != "copy"
    has_succ = [False] * len(nodes)
    value: list[Counter] = []   # node -> how often each source's input reached it
    written: dict[Region, int] = {}
    for i, node in enumerate(nodes):
        if not isinstance(node, Node):
            fail(f"node {i} is a {type(node).__name__}, not a Node")
        r = node.rank
        if not isinstance(r, int) or isinstance(r, bool) or not 0 <= r < n:
            fail(f"node {i} is on rank {r!r}, which is not a rank of this {n}-rank collective")
        at = f"node {i} (rank {r})"
        if node.incoming not in INCOMING:
            fail(f"{at} has incoming={node.incoming!r}; use SCRATCH, INTO_OUTPUT or PULL")
        got = Counter()
        for p in node.preds:
            if not isinstance(p, int) or isinstance(p, bool) or not 0 <= p < i:
                fail(f"{at} lists predecessor {p!r}, which is not an earlier node (routes list "
                     f"nodes in topological order, predecessors by index)")
            has_succ[p] = True
            got += value[p]
        if node.own is not None:
            if r not in sources:
                fail(f"{at} reads own input {node.own!r}, but rank {r} holds no input of this "
                     f"piece; its sources are ranks {_ranks(piece.sources)}")
            if node.own != piece.input(r):
                fail(f"{at} reads {node.own!r}; rank {r}'s input of this piece is "
                     f"{piece.input(r)!r} (use piece.input({r}))")
            got[r] += 1
        combined = len(node.preds) + (node.own is not None)
        if combined == 0:
            fail(f"{at} has neither predecessors nor its own input: it has nothing to send")
        if not reduce and combined > 1:
            fail(f"{at} combines {combined} values, but {piece.collective.name} copies: each "
                 "node forwards one value")
        if node.incoming == INTO_OUTPUT and (len(node.preds) != 1 or not node.outputs):
            fail(f"{at} receives INTO_OUTPUT, which needs exactly one predecessor and an output "
                 f"(it has {len(node.preds)} predecessor(s), {len(node.outputs)} output(s))")
        slots = piece.outputs(r)
        for region in node.outputs:
            if region not in slots:
                where = (", ".join(map(repr, slots)) if slots
                         else f"none: rank {r} does not hold chunk(s) {_names(piece.names)}")
                fail(f"{at} writes {region!r}, which is not an output slot of this piece on rank "
                     f"{r} (its slots there: {where}; use piece.outputs({r}))")
            if region in written:
                fail(f"output slot {region!r} is written by node {written[region]} and node {i}; "
                     "each slot is written once")
            written[region] = i
            _check_value(fail, reduce, piece, region, at, got)
        value.append(got)
    for h in piece.holders:
        for region in piece.outputs(h):
            if region not in written:
                fail(f"rank {h}'s output slot {region!r} is never written: the route does not "
                     f"reach its destination (a node on rank {h} with outputs=piece.outputs({h}))")
    for i, node in enumerate(nodes):
        if not has_succ[i] and not node.outputs:
            fail(f"node {i} (rank {node.rank}) leads nowhere: it has no outputs and no node lists "
                 "it as predecessor")
    return nodes


def _check_value(fail, reduce, piece, region, at, got: Counter) -> None:
    want = set(piece.sources)
    missing = sorted(want - set(got))
    twice = sorted(s for s, k in got.items() if k > 1)
    if missing:
        fail(f"rank {region.rank}'s output slot {region!r}, written by {at}, misses the input of "
             f"rank(s) {_ranks(missing)}" + (": a reduction needs every source once"
                                              if reduce else ""))
    if twice:
        fail(f"rank {region.rank}'s output slot {region!r}, written by {at}, counts the input of "
             f"rank(s) {_ranks(twice)} more than once")


# -- the built-in strategies -------------------------------------------------------------------
_registering_builtins = True


def _direct(piece: Piece, incoming: str) -> list[Node]:
    nodes: list[Node] = []
    src_node = {}
    for s in piece.sources:
        if any(h != s for h in piece.holders):
            src_node[s] = len(nodes)
            nodes.append(Node(s, own=piece.input(s)))
    for h in piece.holders:
        preds = [i for s, i in src_node.items() if s != h]
        own = piece.input(h) if h in piece.sources else None
        nodes.append(Node(h, own=own, preds=preds, outputs=piece.outputs(h), incoming=incoming))
    return nodes


@strategy("direct-push")
def direct_push(piece: Piece) -> list[Node]:
    return _direct(piece, SCRATCH)


@strategy("direct-pull")
def direct_pull(piece: Piece) -> list[Node]:
    return _direct(piece, PULL)


def _reduces_only(collective) -> str | None:
    if collective.op.is_reduce:
        return None
    return ("two-phase reduces to an owner per part and this is a copy collective: use "
            "direct-push, direct-pull or ring")


@strategy("two-phase", owners=True, check=_reduces_only)
def two_phase(piece: Piece) -> list[Node]:
    sources = piece.sources
    if len(sources) == 1:
        return _direct(piece, SCRATCH)
    owner = piece.owner
    nodes = [Node(s, own=piece.input(s)) for s in sources if s != owner]
    nodes.append(Node(owner, own=piece.input(owner) if owner in sources else None,
                      preds=list(range(len(nodes))), outputs=piece.outputs(owner)))
    top = len(nodes) - 1
    for h in piece.holders:
        if h != owner:
            nodes.append(Node(h, preds=[top], outputs=piece.outputs(h),
                              incoming=INTO_OUTPUT if h in sources else SCRATCH))
    return nodes


@strategy("push-pull")
def push_pull(piece: Piece) -> list[Node]:
    first_half = 2 * piece.start < piece.segment.count
    return _direct(piece, SCRATCH if first_half else PULL)


def _ring_after(first: int, ranks, n: int) -> list[int]:
    """``ranks`` in ring order starting just after ``first``."""
    return sorted(ranks, key=lambda r: (r - first - 1) % n)


@strategy("ring", owners=True)
def ring(piece: Piece) -> list[Node]:
    n = piece.nranks
    sources, holders = piece.sources, piece.holders
    nodes: list[Node] = []
    if len(sources) == 1:
        (head,) = sources
    else:
        head = piece.owner
        # accumulate around the ring, ending at the owner
        for r in _ring_after(head, [s for s in sources if s != head], n):
            nodes.append(Node(r, own=piece.input(r), preds=[len(nodes) - 1] if nodes else []))
    preds = [len(nodes) - 1] if nodes else []
    nodes.append(Node(head, own=piece.input(head) if head in sources else None, preds=preds,
                      outputs=piece.outputs(head)))
    for h in _ring_after(head, [h for h in holders if h != head], n):
        receive = INTO_OUTPUT if len(sources) > 1 and h in sources else SCRATCH
        nodes.append(Node(h, preds=[len(nodes) - 1], outputs=piece.outputs(h), incoming=receive))
    return nodes


_registering_builtins = False
