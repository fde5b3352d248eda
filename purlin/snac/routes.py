"""Routes and their lowering to Stage / Notify / Consume steps.

A strategy describes, for every piece of data, a small DAG of nodes (a Route): each node is a
rank that combines what its predecessors sent with, optionally, its own input, and writes the
result into its outputs and towards its successors. ``emit`` turns routes into steps: a
predecessor stages into the node's scratch (or straight into its output, or the node pulls from
the predecessor's input) and notifies; the node consumes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from purlin.errors import PlanError
from purlin.snac.ir import Consume, Flag, Notify, Region, Stage, Wait

SCRATCH, INTO_OUTPUT, PULL = "scratch", "output", "pull"


@dataclass
class Node:
    """One rank's part in a route. ``incoming`` says how predecessors hand data over."""

    rank: int
    own: Region | None = None
    preds: list[int] = field(default_factory=list)
    outputs: list[Region] = field(default_factory=list)
    incoming: str = SCRATCH


@dataclass
class Route:
    """The DAG of nodes that moves one piece (``count`` elements) of a segment."""

    nodes: list[Node]
    count: int
    op: str                 # "copy" or the collective's reduce op
    contributions: int      # inputs in a complete value (avg divides by it)
    names: tuple
    lane: int
    seq: int                # position of the piece within its lane (pipelining)

    def add(self, node: Node) -> int:
        self.nodes.append(node)
        return len(self.nodes) - 1


@dataclass
class _PendingWait:
    notify: int             # id of the Notify step (in emit's numbering)
    call: int = 0


@dataclass
class Emitted:
    """Steps per rank in program order (Waits still pending), scratch sizes and, per scratch
    edge, the regions involved (used by the planner to add acknowledgements)."""

    steps: list[list]
    scratch: list[int]
    edges: dict = field(default_factory=dict)  # edge id -> (producer rank, scratch Region)


def _depths(route: Route) -> list[int]:
    depth = [0] * len(route.nodes)
    for i, node in enumerate(route.nodes):  # nodes are listed after their predecessors
        for p in node.preds:
            if p >= i:
                raise PlanError(f"route node {i} on rank {node.rank} lists a later node {p} as "
                                "predecessor; routes must list nodes in topological order")
            depth[i] = max(depth[i], depth[p] + 1)
    return depth


def emit(routes: list[Route], nranks: int, acks: frozenset = frozenset(),
         copies: int = 1, engine_for=None, stage_lanes: int = 0) -> Emitted:
    """Lower routes to steps. ``acks`` holds scratch edge ids whose consumer must acknowledge
    the read before the producer writes the same scratch again ``copies`` calls later.
    ``engine_for(op)`` names the engine of a data step (for datapaths that cannot reduce).
    ``stage_lanes`` > 0: a node at depth d runs in lane d % stage_lanes instead of its
    route's lane (``plan(..., lanes_by="stage")``)."""
    scratch = [0] * nranks
    items = []          # (rank, lane, key, order, step-or-callable)
    notifies = []       # pending Notify records: [rank, lane, owner]
    edges = {}
    order = 0

    writer = {}         # (rank, destination Region) -> index in items

    def place(rank, lane, key, step):
        nonlocal order
        if getattr(step, "dst", None) is not None:
            writer[(rank, step.dst)] = len(items)
        items.append((rank, lane, key, order, step))
        order += 1

    def notify(rank, lane, key, owner) -> int:
        notifies.append((rank, lane, owner))
        nid = len(notifies) - 1
        place(rank, lane, key, ("notify", nid))
        return nid

    edge_id = 0
    for route in routes:
        depth = _depths(route)
        succs = [[] for _ in route.nodes]
        for i, node in enumerate(route.nodes):
            for p in node.preds:
                succs[p].append(i)
        # where each predecessor's value lands on its successor: edge -> Region
        landing: dict[tuple[int, int], Region] = {}
        edge_ids: dict[tuple[int, int], int] = {}
        for i, node in enumerate(route.nodes):
            for p in node.preds:
                if node.incoming == INTO_OUTPUT:
                    if len(node.preds) != 1 or not node.outputs:
                        raise PlanError("a node that receives straight into its output needs "
                                        "exactly one predecessor and an output")
                    landing[(p, i)] = node.outputs[0]
                elif node.incoming == SCRATCH:
                    landing[(p, i)] = Region(node.rank, "scratch", scratch[node.rank],
                                             route.count)
                    scratch[node.rank] += route.count
                    edge_ids[(p, i)] = edge_id
                    edges[edge_id] = (route.nodes[p].rank, landing[(p, i)])
                    edge_id += 1
        ready: dict[tuple[int, int], int] = {}   # edge -> notify id announcing the data
        done: dict[tuple[int, int], int] = {}    # pull edge / ack edge -> notify id from reader
        value_at: dict[int, Region] = {}        # node -> region holding its value
        contributions = [0] * len(route.nodes)

        lane_of = [depth[i] % stage_lanes if stage_lanes else route.lane
                   for i in range(len(route.nodes))]
        for i, node in enumerate(route.nodes):
            key = route.seq + depth[i]
            lane, rank = lane_of[i], node.rank
            # what the node combines
            inputs: list[Region] = []
            waits: list[_PendingWait] = []
            for p in node.preds:
                contributions[i] += contributions[p]
                if node.incoming == PULL:
                    inputs.append(value_at[p])
                    waits.append(_PendingWait(ready[(p, i)]))
                else:
                    inputs.append(landing[(p, i)])
                    waits.append(_PendingWait(ready[(p, i)]))
            if node.own is not None:
                inputs.append(node.own)
                contributions[i] += 1
            if not inputs:
                raise PlanError(f"route node on rank {rank} has neither predecessors nor input")
            targets = list(node.outputs)
            for s in succs[i]:
                if route.nodes[s].incoming != PULL:
                    targets.append(landing[(i, s)])
            is_copy = len(inputs) == 1
            op = "copy" if is_copy else _reduce_step_op(route, contributions[i])
            names = route.names
            first_waits = waits
            if is_copy:
                source = inputs[0]
                value_at[i] = source
                moves = [t for t in targets if t != source]
                if not moves and first_waits:
                    place(rank, lane, key, Consume(rank, lane, tuple(first_waits)))
                for j, t in enumerate(moves):
                    w = tuple(first_waits) if j == 0 else ()
                    place(rank, lane, key, _data(rank, lane, w, "copy", (source,), t, names,
                                                 engine_for))
            else:
                if not targets:
                    raise PlanError(f"route node on rank {rank} reduces but has nowhere to put "
                                    "the result")
                first = targets[0]
                value_at[i] = first
                place(rank, lane, key, _data(rank, lane, tuple(first_waits), op, tuple(inputs),
                                             first, names, engine_for))
                for t in targets[1:]:
                    place(rank, lane, key, _data(rank, lane, (), "copy", (first,), t, names,
                                                 engine_for))
            # tell successors their data is ready (pull: that our input may be read)
            for s in succs[i]:
                ready[(i, s)] = notify(rank, lane, key, route.nodes[s].rank)
            # after reading: pull readers release the producer; acked scratch edges likewise
            for p in node.preds:
                e = (p, i)
                if node.incoming == PULL or edge_ids.get(e) in acks:
                    done[e] = notify(rank, lane, key, route.nodes[p].rank)
        # producers of pull edges wait until every reader is done before their call ends
        for (p, i), nid in done.items():
            if route.nodes[i].incoming == PULL:
                prank, plane = route.nodes[p].rank, lane_of[p]
                place(prank, plane, 1 << 30, Consume(prank, plane, (_PendingWait(nid),)))
        # acked edges: the producer's write waits for the ack of an earlier call; patch it in
        for (p, i), nid in done.items():
            if route.nodes[i].incoming != PULL:
                _add_ack(items, writer, route.nodes[p].rank, landing[(p, i)],
                         _PendingWait(nid, call=-copies))

    items.sort(key=lambda it: (it[0], it[2], it[3]))
    steps: list[list] = [[] for _ in range(nranks)]
    for rank, lane, _key, _order, step in items:
        steps[rank].append(step)
    return Emitted(_resolve(steps, notifies), scratch, edges)


def _add_ack(items, writer, rank, region, wait) -> None:
    """Prepend ``wait`` to the step of ``rank`` that writes ``region``."""
    k = writer.get((rank, region))
    if k is None:
        raise PlanError(f"no step of rank {rank} writes {region!r} to attach an "
                        "acknowledgement to")
    r, lane, key, order, step = items[k]
    waits = (wait,) + tuple(step.waits)
    items[k] = (r, lane, key, order, Consume(rank, lane, waits, step.op, step.srcs, step.dst,
                                             step.names, step.engine))


def _reduce_step_op(route: Route, contributions: int) -> str:
    if route.op == "avg":
        return "avg" if contributions == route.contributions else "sum"
    return route.op


def _data(rank, lane, waits, op, srcs, dst, names, engine_for):
    engine = engine_for(op) if engine_for else ""
    if waits:
        return Consume(rank, lane, tuple(waits), op, tuple(srcs), dst, names, engine)
    return Stage(rank, lane, op, tuple(srcs), dst, names, engine)


def _resolve(steps, notifies) -> list[list]:
    """Number each flag's notifies in lane program order and turn pending waits into Waits."""
    counts: dict[Flag, int] = {}
    value_of: dict[int, tuple[Flag, int]] = {}
    for rank_steps in steps:
        for step in rank_steps:
            if isinstance(step, tuple):
                _, nid = step
                src, lane, owner = notifies[nid]
                flag = Flag(owner, src, lane)
                counts[flag] = counts.get(flag, 0) + 1
                value_of[nid] = (flag, counts[flag])
    out = []
    for rank_steps in steps:
        row = []
        for step in rank_steps:
            if isinstance(step, tuple):
                flag, value = value_of[step[1]]
                row.append(Notify(notifies[step[1]][0], notifies[step[1]][1], flag, value))
                continue
            if isinstance(step, Consume) and step.waits:
                waits = tuple(Wait(*value_of[w.notify], call=w.call) for w in step.waits)
                step = Consume(step.rank, step.lane, waits, step.op, step.srcs, step.dst,
                               step.names, step.engine)
            row.append(step)
        out.append(row)
    return out
