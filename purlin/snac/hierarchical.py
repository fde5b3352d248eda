"""Hierarchical collectives: SNAC inside each node, another library between nodes.

``plan_hierarchical(collective, node_of_rank)`` splits a standard all-reduce, all-gather or
reduce-scatter over several nodes into intra-node and inter-node phases (ARCHITECTURE.md,
"SNAC").

>>> from purlin.spec import collectives
>>> hp = plan_hierarchical(collectives.all_reduce(4), (0, 0, 1, 1))
>>> print(hp.render())
all-reduce (reduce:sum) over 2 nodes x 2 ranks: nodes [0, 1] [2, 3]
  1. intra reduce-scatter (reduce:sum), input -> mid
  2. inter all-reduce (sum) on groups [0, 2] [1, 3], mid -> mid
  3. intra all-gather (copy), mid -> output
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from purlin.errors import PlanError, SpecError
from purlin.spec import collectives
from purlin.spec.collective import Collective
from purlin.spec.sizing import Sizing

SPLITTABLE = ("all-reduce", "all-gather", "reduce-scatter")
BUFFERS = ("input", "mid", "output")


@dataclass(frozen=True)
class Intra:
    """A Purlin collective over the ranks of every node, from buffer ``src`` into ``dst``.

    ``sizes`` says how its chunks are sized from the flat collective's: ``"shard"`` (chunk
    ``k`` is the ``k``-th of ``L`` near-equal parts of the whole message), ``"flat"`` (chunk
    ``(a, i)`` is the flat chunk of the ``i``-th rank of node ``a``) or ``"same"`` (the flat
    collective itself, on a single node).
    """

    collective: Collective
    src: str
    dst: str
    sizes: str
    kind = "intra"


@dataclass(frozen=True)
class Inter:
    """``collective`` ("all-reduce", "all-gather" or "reduce-scatter") with ``op`` on every
    group of ``groups`` (ranks ascending; one group per local index), ``src`` -> ``dst``."""

    collective: str
    op: str
    groups: tuple
    src: str
    dst: str
    kind = "inter"


@dataclass(frozen=True)
class HierarchicalPlan:
    """The phases of a collective over ``nodes`` (each a tuple of ranks, ascending)."""

    collective: Collective
    nodes: tuple
    phases: tuple

    @property
    def nranks(self) -> int:
        return self.collective.nranks

    @property
    def local_size(self) -> int:
        return len(self.nodes[0])

    def node_of(self, rank: int) -> int:
        return next(a for a, ranks in enumerate(self.nodes) if rank in ranks)

    def local_rank(self, rank: int) -> int:
        return self.nodes[self.node_of(rank)].index(rank)

    def flat_sizing(self, count: int | None = None, *, dtype="float32",
                    chunk_sizes=None) -> Sizing:
        """The flat collective sized as :func:`purlin.spec.size` would, but any ``count`` of
        an all-reduce is accepted (its chunks become near-equal, not necessarily equal)."""
        c = self.collective
        if chunk_sizes is None and c.name == "all-reduce" and count is not None:
            chunk_sizes = dict(zip(range(self.nranks), _split(count, self.nranks)))
            count = None
        return c.sized(count, dtype=dtype, chunk_sizes=chunk_sizes)

    def phase_sizing(self, phase: Intra, flat: Sizing) -> Sizing:
        """Chunk sizes of an intra phase, from the flat collective's sizing."""
        if phase.sizes == "same":
            return flat
        if phase.sizes == "shard":
            total = flat.input_count(0)
            parts = dict(zip(range(self.local_size), _split(total, self.local_size)))
            return phase.collective.sized(chunk_sizes=parts, dtype=flat.dtype)
        parts = {(a, i): flat.chunk_count(self.nodes[a][i])
                 for a in range(len(self.nodes)) for i in range(self.local_size)}
        return phase.collective.sized(chunk_sizes=parts, dtype=flat.dtype)

    def buffer_counts(self, flat: Sizing, rank: int) -> dict:
        """Elements of ``input``, ``mid`` and ``output`` on ``rank``."""
        counts = {"input": flat.input_count(rank), "output": flat.output_count(rank), "mid": 0}
        local = self.local_rank(rank)
        for phase in self.phases:
            if isinstance(phase, Intra):
                sz = self.phase_sizing(phase, flat)
                for buf, n in ((phase.src, sz.input_count(local)),
                               (phase.dst, sz.output_count(local))):
                    if buf == "mid":
                        counts["mid"] = max(counts["mid"], n)
        return counts

    def render(self) -> str:
        c = self.collective
        nodes = " ".join(str(list(n)) for n in self.nodes)
        lines = [f"{c.name} ({c.op}) over {len(self.nodes)} nodes x {self.local_size} ranks: "
                 f"nodes {nodes}"]
        for k, p in enumerate(self.phases, 1):
            if isinstance(p, Intra):
                lines.append(f"  {k}. intra {p.collective.name} ({p.collective.op}), "
                             f"{p.src} -> {p.dst}")
            else:
                groups = " ".join(str(list(g)) for g in p.groups)
                lines.append(f"  {k}. inter {p.collective} ({p.op}) on groups {groups}, "
                             f"{p.src} -> {p.dst}")
        return "\n".join(lines)

    __repr__ = render

    def to_json(self) -> dict:
        phases = []
        for p in self.phases:
            if isinstance(p, Intra):
                phases.append({"kind": "intra", "collective": p.collective.to_json(),
                               "src": p.src, "dst": p.dst, "sizes": p.sizes})
            else:
                phases.append({"kind": "inter", "collective": p.collective, "op": p.op,
                               "groups": [list(g) for g in p.groups], "src": p.src,
                               "dst": p.dst})
        return {"collective": self.collective.to_json(),
                "nodes": [list(n) for n in self.nodes], "phases": phases}

    @classmethod
    def from_json(cls, obj) -> "HierarchicalPlan":
        phases = []
        for p in obj["phases"]:
            if p["kind"] == "intra":
                phases.append(Intra(Collective.from_json(p["collective"]), p["src"], p["dst"],
                                    p["sizes"]))
            else:
                phases.append(Inter(p["collective"], p["op"],
                                    tuple(tuple(g) for g in p["groups"]), p["src"], p["dst"]))
        return cls(Collective.from_json(obj["collective"]),
                   tuple(tuple(n) for n in obj["nodes"]), tuple(phases))


def _split(count: int, parts: int) -> list[int]:
    base, extra = divmod(count, parts)
    return [base + (1 if k < extra else 0) for k in range(parts)]


def nodes_of(node_of_rank) -> tuple:
    """Ranks of every node (ascending), nodes in order of their first rank.

    >>> nodes_of(("b", "a", "b", "a"))
    ((0, 2), (1, 3))
    """
    nodes: dict = {}
    for rank, node in enumerate(node_of_rank):
        nodes.setdefault(node, []).append(rank)
    return tuple(tuple(r) for r in nodes.values())


def plan_hierarchical(collective: Collective, node_of_rank) -> HierarchicalPlan:
    """Split ``collective`` over the nodes that ``node_of_rank[r]`` names for every rank r."""
    n = collective.nranks
    node_of_rank = tuple(node_of_rank)
    if len(node_of_rank) != n:
        raise PlanError(f"node_of_rank names a node for {len(node_of_rank)} ranks but "
                        f"{collective.name} has {n}")
    kind = collective.name
    op = collective.op.reduce_op or "copy"
    if kind not in SPLITTABLE or collective != _standard(kind, n, op):
        raise PlanError(f"hierarchical plans split the standard {', '.join(SPLITTABLE)}; "
                        f"{collective.name!r} is not one of them (run it on one node, or across "
                        "nodes on the group's own backend)")
    nodes = nodes_of(node_of_rank)
    sizes = {len(ranks) for ranks in nodes}
    if len(sizes) != 1:
        counts = ", ".join(f"node {node_of_rank[r[0]]!r}: {len(r)}" for r in nodes)
        raise PlanError(f"a hierarchical plan needs the same number of ranks on every node; "
                        f"got {counts}")
    L, M = sizes.pop(), len(nodes)
    if M == 1:
        return HierarchicalPlan(collective, nodes, (Intra(collective, "input", "output",
                                                          "same"),))
    groups = tuple(tuple(sorted(ranks[i] for ranks in nodes)) for i in range(L))
    if L == 1:
        return HierarchicalPlan(collective, nodes, (Inter(kind, op, groups, "input", "output"),))
    # node a's position in group i follows the group's (ascending) rank order
    order = [sorted(range(M), key=lambda a: nodes[a][i]) for i in range(L)]
    flat_names = [(_node(nodes, r), nodes[_node(nodes, r)].index(r)) for r in range(n)]
    per_local = [[(a, i) for a in order[i]] for i in range(L)]
    if kind == "all-reduce":
        phases = (Intra(collectives.reduce_scatter(L, op), "input", "mid", "shard"),
                  Inter("all-reduce", op, groups, "mid", "mid"),
                  Intra(collectives.all_gather(L), "mid", "output", "shard"))
    elif kind == "all-gather":
        gather = Collective(per_local, [flat_names] * L, "copy", name="all-gather into rank order")
        phases = (Inter("all-gather", "copy", groups, "input", "mid"),
                  Intra(gather, "mid", "output", "flat"))
    else:
        scatter = Collective([flat_names] * L, per_local, collective.op,
                             name="reduce-scatter by local rank")
        phases = (Intra(scatter, "input", "mid", "flat"),
                  Inter("reduce-scatter", op, groups, "mid", "output"))
    return HierarchicalPlan(collective, nodes, phases)


def _node(nodes, rank: int) -> int:
    return next(a for a, ranks in enumerate(nodes) if rank in ranks)


def _standard(kind: str, n: int, op: str) -> Collective:
    try:
        return collectives.standard(kind, n, op=op if op != "copy" else "sum")
    except SpecError:
        return None


def verify_intra(hp: HierarchicalPlan, count: int | None = None, *, dtype="float32",
                 chunk_sizes=None, strategy: str = "direct-push", **plan_options) -> list:
    """Plan every intra phase for a message of ``count`` elements and verify it; returns
    the :class:`purlin.snac.Report` of each.

    >>> from purlin.spec import collectives
    >>> hp = plan_hierarchical(collectives.all_reduce(4), (0, 0, 1, 1))
    >>> [r.ok for r in verify_intra(hp, count=10)]
    [True, True]
    """
    from purlin.snac.planner import plan
    from purlin.snac.verify import verify

    flat = hp.flat_sizing(count, dtype=dtype, chunk_sizes=chunk_sizes)
    reports = []
    for phase in hp.phases:
        if isinstance(phase, Intra):
            sched = plan(phase.collective, strategy, sizing=hp.phase_sizing(phase, flat),
                         check=False, **plan_options)
            reports.append(verify(sched))
    return reports


_REDUCE = {"sum": np.sum, "avg": np.mean, "max": np.max, "min": np.min}


def simulate(hp: HierarchicalPlan, inputs, *, sizing: Sizing | None = None) -> list:
    """Every rank's output of ``hp`` on ``inputs`` (float64 numpy), phase by phase: intra
    phases through :func:`purlin.spec.reference`, inter phases with numpy."""
    from purlin.spec.reference import reference

    flat = sizing or hp.flat_sizing(
        len(np.ravel(inputs[0])) if hp.collective.name != "all-gather"
        else len(np.ravel(inputs[0])) * hp.nranks)
    buf = {"input": [np.asarray(x, dtype=np.float64).ravel() for x in inputs],
           "mid": [None] * hp.nranks, "output": [None] * hp.nranks}
    for phase in hp.phases:
        if isinstance(phase, Intra):
            sz = hp.phase_sizing(phase, flat)
            for ranks in hp.nodes:
                outs = reference(sz, [buf[phase.src][r] for r in ranks])
                for r, out in zip(ranks, outs):
                    buf[phase.dst][r] = out
            continue
        for group in phase.groups:
            parts = [buf[phase.src][r] for r in group]
            if phase.collective == "all-gather":
                results = [np.concatenate(parts)] * len(group)
            else:
                total = _REDUCE[phase.op](np.stack(parts), axis=0)
                results = ([total] * len(group) if phase.collective == "all-reduce"
                           else np.split(total, len(group)))
            for r, out in zip(group, results):
                buf[phase.dst][r] = np.array(out)
    return buf["output"]
