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
         copies: int = 1, engine_for=None, stage_lanes: int = 0,
         rank_order: bool = False) -> Emitted:
    """Lower routes to steps. ``acks`` holds scratch edge ids whose consumer must acknowledge
    the read before the producer writes the same scratch again ``copies`` calls later.
    ``engine_for(op)`` names the engine of a data step (for datapaths that cannot reduce).
    ``stage_lanes`` > 0: a node at depth d runs in lane d % stage_lanes instead of its
    route's lane (``plan(..., lanes_by="stage")``). A reduce step lists its sources as the
    node's predecessors, then its own input; ``rank_order`` lists them by the rank they come
    from instead (``plan(..., deterministic=True)``)."""
    out = _Emitter(nranks, engine_for, rank_order)
    for route in routes:
        r = _RouteState(route, stage_lanes)
        out.land(r)
        for i in range(len(route.nodes)):
            out.node(r, i, acks)
        out.release_pulls(r)
        out.wait_for_acks(r, copies)
    return out.result()


class _RouteState:
    """One route while it is emitted: its shape, where each edge's data lands, and the notifies
    that announce it (``ready``) or release it (``done``)."""

    def __init__(self, route: Route, stage_lanes: int):
        self.route = route
        self.depth = _depths(route)
        self.succs: list[list[int]] = [[] for _ in route.nodes]
        for i, node in enumerate(route.nodes):
            for p in node.preds:
                self.succs[p].append(i)
        self.lane_of = [self.depth[i] % stage_lanes if stage_lanes else route.lane
                        for i in range(len(route.nodes))]
        self.landing: dict[tuple[int, int], Region] = {}  # edge -> where its value lands
        self.edge_ids: dict[tuple[int, int], int] = {}   # scratch edge -> edge id
        self.ready: dict[tuple[int, int], int] = {}      # edge -> notify id announcing the data
        self.done: dict[tuple[int, int], int] = {}       # pull / ack edge -> reader's notify id
        self.value_at: dict[int, Region] = {}            # node -> region holding its value
        self.contributions = [0] * len(route.nodes)


class _Emitter:
    """Steps of every rank as they are placed, with their sort keys, and the scratch, notify
    and edge bookkeeping ``emit`` needs."""

    def __init__(self, nranks: int, engine_for, rank_order: bool = False):
        self.nranks, self.engine_for, self.rank_order = nranks, engine_for, rank_order
        self.scratch = [0] * nranks
        self.items: list = []      # (rank, lane, key, order, step-or-("notify", id))
        self.notifies: list = []   # (rank, lane, owner) per Notify id
        self.edges: dict = {}      # edge id -> (producer rank, scratch Region)
        self.writer: dict = {}     # (rank, destination Region) -> index in items

    def place(self, rank, lane, key, step) -> None:
        if getattr(step, "dst", None) is not None:
            self.writer[(rank, step.dst)] = len(self.items)
        self.items.append((rank, lane, key, len(self.items), step))

    def notify(self, rank, lane, key, owner) -> int:
        self.notifies.append((rank, lane, owner))
        nid = len(self.notifies) - 1
        self.place(rank, lane, key, ("notify", nid))
        return nid

    def data(self, rank, lane, key, waits, op, srcs, dst, names) -> None:
        self.place(rank, lane, key, _data(rank, lane, waits, op, srcs, dst, names,
                                          self.engine_for))

    def land(self, r: _RouteState) -> None:
        """Where each predecessor's value lands on its successor: its output, or new scratch."""
        route = r.route
        for i, node in enumerate(route.nodes):
            for p in node.preds:
                if node.incoming == INTO_OUTPUT:
                    if len(node.preds) != 1 or not node.outputs:
                        raise PlanError("a node that receives straight into its output needs "
                                        "exactly one predecessor and an output")
                    r.landing[(p, i)] = node.outputs[0]
                elif node.incoming == SCRATCH:
                    region = Region(node.rank, "scratch", self.scratch[node.rank], route.count)
                    self.scratch[node.rank] += route.count
                    r.landing[(p, i)] = region
                    r.edge_ids[(p, i)] = len(self.edges)
                    self.edges[len(self.edges)] = (route.nodes[p].rank, region)

    def node(self, r: _RouteState, i: int, acks: frozenset) -> None:
        """Node ``i``'s steps: wait for its inputs, copy or reduce them into its targets,
        announce the result to its successors, release what it read."""
        route, node = r.route, r.route.nodes[i]
        key, lane, rank = route.seq + r.depth[i], r.lane_of[i], node.rank
        inputs, waits = [], []  # inputs: (rank the value comes from, region)
        for p in node.preds:
            r.contributions[i] += r.contributions[p]
            inputs.append((route.nodes[p].rank,
                           r.value_at[p] if node.incoming == PULL else r.landing[(p, i)]))
            waits.append(_PendingWait(r.ready[(p, i)]))
        if node.own is not None:
            inputs.append((rank, node.own))
            r.contributions[i] += 1
        if self.rank_order:
            inputs.sort(key=lambda x: x[0])  # stable: a rank's own input stays one source
        inputs = [region for _, region in inputs]
        if not inputs:
            raise PlanError(f"route node on rank {rank} has neither predecessors nor input")
        # a value that travels on and stays local is written here first, then sent from here:
        # local successors before remote ones, so no rank copies its own partial back
        succs = sorted(r.succs[i], key=lambda s: route.nodes[s].rank != rank)
        targets = list(node.outputs) + [r.landing[(i, s)] for s in succs
                                        if route.nodes[s].incoming != PULL]
        if len(inputs) == 1:
            r.value_at[i] = self._copy(rank, lane, key, waits, inputs[0], targets, route.names)
        else:
            op = _reduce_step_op(route, r.contributions[i])
            r.value_at[i] = self._reduce(rank, lane, key, waits, op, inputs, targets,
                                         route.names)
        for s in r.succs[i]:  # tell successors their data is ready (pull: that it may be read)
            r.ready[(i, s)] = self.notify(rank, lane, key, route.nodes[s].rank)
        for p in node.preds:  # after reading: release pull producers and acked scratch edges
            if node.incoming == PULL or r.edge_ids.get((p, i)) in acks:
                r.done[(p, i)] = self.notify(rank, lane, key, route.nodes[p].rank)

    def _copy(self, rank, lane, key, waits, source, targets, names) -> Region:
        """Copy ``source`` to every target but itself (the first copy waits); just wait if
        nothing moves. Returns where the node's value is."""
        moves = [t for t in targets if t != source]
        if not moves and waits:
            self.place(rank, lane, key, Consume(rank, lane, tuple(waits)))
        for j, t in enumerate(moves):
            self.data(rank, lane, key, tuple(waits) if j == 0 else (), "copy", (source,), t,
                      names)
        return source

    def _reduce(self, rank, lane, key, waits, op, inputs, targets, names) -> Region:
        """Reduce ``inputs`` into the first target, then copy it to the others."""
        if not targets:
            raise PlanError(f"route node on rank {rank} reduces but has nowhere to put "
                            "the result")
        first = targets[0]
        self.data(rank, lane, key, tuple(waits), op, tuple(inputs), first, names)
        for t in targets[1:]:
            self.data(rank, lane, key, (), "copy", (first,), t, names)
        return first

    def release_pulls(self, r: _RouteState) -> None:
        """Producers of pull edges wait until every reader is done before their call ends."""
        for (p, i), nid in r.done.items():
            if r.route.nodes[i].incoming == PULL:
                prank, plane = r.route.nodes[p].rank, r.lane_of[p]
                self.place(prank, plane, 1 << 30, Consume(prank, plane, (_PendingWait(nid),)))

    def wait_for_acks(self, r: _RouteState, copies: int) -> None:
        """Acked edges: the producer's write waits for the ack of an earlier call."""
        for (p, i), nid in r.done.items():
            if r.route.nodes[i].incoming != PULL:
                _add_ack(self.items, self.writer, r.route.nodes[p].rank, r.landing[(p, i)],
                         _PendingWait(nid, call=-copies))

    def result(self) -> Emitted:
        """Steps per rank, in (key, placement) order, with their notifies numbered."""
        items = sorted(self.items, key=lambda it: (it[0], it[2], it[3]))
        steps: list[list] = [[] for _ in range(self.nranks)]
        for rank, _lane, _key, _order, step in items:
            steps[rank].append(step)
        return Emitted(_resolve(steps, self.notifies), self.scratch, self.edges)


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
