"""Strategies are routes, not code paths: each one says how a piece of a segment travels.

Registered by name; ``STRATEGIES[name](segment, start, count, part, nranks=n)`` returns the
nodes of one route (in topological order) for ``count`` elements of a segment from ``start``;
the planner wraps them into Routes.

* ``direct-push``: every holder gets every source straight; sources write into the holder's
  scratch, the holder reduces or copies into its output (one shot).
* ``direct-pull``: the same graph, but the holder reads the sources' inputs in place.
* ``two-phase``: reduce-scatter to one owner per part, then all-gather from the owners.
* ``ring``: the value walks the ranks in ring order, accumulating, then circulates to holders.
* ``push-pull``: the first half of every segment travels as direct-push, the second as
  direct-pull. On the ce datapath the pushes are copy-engine copies and the pulls SM reads, so
  both engines carry bytes over NVLink at once (use chunks = lanes: one half per lane). On
  2 x H200 that was slower than either engine alone.
"""

from __future__ import annotations

from typing import Callable

from purlin.errors import PlanError
from purlin.snac.ir import Region
from purlin.snac.routes import INTO_OUTPUT, PULL, SCRATCH, Node
from purlin.snac.segments import Segment

STRATEGIES: dict[str, Callable] = {}


def strategy(name: str):
    def register(fn):
        STRATEGIES[name] = fn
        return fn
    return register


def _own(seg: Segment, rank: int, start: int, count: int) -> Region:
    return Region(rank, "input", dict(seg.sources)[rank] + start, count)


def _outs(seg: Segment, rank: int, start: int, count: int) -> list[Region]:
    return [Region(rank, "output", off + start, count) for off in dict(seg.holders)[rank]]


def parts_of(seg: Segment, strategy_name: str) -> int:
    """How many owner parts a strategy cuts a segment into before chunking."""
    if strategy_name in ("two-phase", "ring") and len(seg.sources) > 1:
        return max(1, len(seg.holders))
    return 1


def owner_of(seg: Segment, part: int) -> int:
    holders = [r for r, _ in seg.holders]
    return holders[part % len(holders)]


def _direct(seg: Segment, start: int, count: int, part: int, incoming: str) -> list[Node]:
    nodes: list[Node] = []
    src_node = {}
    for s, _ in seg.sources:
        if any(h != s for h, _ in seg.holders):
            src_node[s] = len(nodes)
            nodes.append(Node(s, own=_own(seg, s, start, count)))
    for h, _ in seg.holders:
        preds = [i for s, i in src_node.items() if s != h]
        own = _own(seg, h, start, count) if h in dict(seg.sources) else None
        nodes.append(Node(h, own=own, preds=preds, outputs=_outs(seg, h, start, count),
                          incoming=incoming))
    return nodes


@strategy("direct-push")
def direct_push(seg: Segment, start: int, count: int, part: int, nranks: int = 0) -> list[Node]:
    return _direct(seg, start, count, part, SCRATCH)


@strategy("direct-pull")
def direct_pull(seg: Segment, start: int, count: int, part: int, nranks: int = 0) -> list[Node]:
    return _direct(seg, start, count, part, PULL)


@strategy("two-phase")
def two_phase(seg: Segment, start: int, count: int, part: int, nranks: int = 0) -> list[Node]:
    sources = dict(seg.sources)
    if len(sources) == 1:
        return _direct(seg, start, count, part, SCRATCH)
    owner = owner_of(seg, part)
    nodes = [Node(s, own=_own(seg, s, start, count)) for s in sources if s != owner]
    nodes.append(Node(owner, own=_own(seg, owner, start, count) if owner in sources else None,
                      preds=list(range(len(nodes))), outputs=_outs(seg, owner, start, count)))
    top = len(nodes) - 1
    for h, _ in seg.holders:
        if h != owner:
            nodes.append(Node(h, preds=[top], outputs=_outs(seg, h, start, count),
                              incoming=INTO_OUTPUT if h in sources else SCRATCH))
    return nodes


@strategy("push-pull")
def push_pull(seg: Segment, start: int, count: int, part: int, nranks: int = 0) -> list[Node]:
    first_half = 2 * start < seg.count
    return _direct(seg, start, count, part, SCRATCH if first_half else PULL)


def _ring_after(first: int, ranks, n: int) -> list[int]:
    """``ranks`` in ring order starting just after ``first``."""
    return sorted(ranks, key=lambda r: (r - first - 1) % n)


@strategy("ring")
def ring(seg: Segment, start: int, count: int, part: int, nranks: int = 0) -> list[Node]:
    n = nranks or 1 + max(max(r for r, _ in seg.sources), max(r for r, _ in seg.holders))
    sources = dict(seg.sources)
    holders = dict(seg.holders)
    nodes: list[Node] = []
    if len(sources) == 1:
        (head,) = sources
    else:
        head = owner_of(seg, part)
        # accumulate around the ring, ending at the owner
        for r in _ring_after(head, [s for s in sources if s != head], n):
            nodes.append(Node(r, own=_own(seg, r, start, count),
                              preds=[len(nodes) - 1] if nodes else []))
    preds = [len(nodes) - 1] if nodes else []
    nodes.append(Node(head, own=_own(seg, head, start, count) if head in sources else None,
                      preds=preds,
                      outputs=_outs(seg, head, start, count) if head in holders else []))
    for h in _ring_after(head, [h for h in holders if h != head], n):
        receive = INTO_OUTPUT if len(sources) > 1 and h in sources else SCRATCH
        nodes.append(Node(h, preds=[len(nodes) - 1], outputs=_outs(seg, h, start, count),
                          incoming=receive))
    return nodes


def check_strategy(name: str, collective) -> None:
    if name not in STRATEGIES:
        raise PlanError(f"unknown strategy {name!r}; registered: {', '.join(STRATEGIES)}")
    if name == "two-phase" and not collective.op.is_reduce:
        raise PlanError(f"two-phase reduces to an owner per part; {collective.name} is a copy "
                        "collective: use direct-push, direct-pull or ring")
