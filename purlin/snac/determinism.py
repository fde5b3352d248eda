"""check_deterministic(schedule): prove every reduced output element is summed one way.

A schedule is deterministic when every output element of a reduction is computed by ONE
reduce step that reads all n contributions (inputs, or plain copies of them) and lists them in
rank order 0..n-1; the value is then copied, never combined again. A datapath that accumulates
a step's sources in the order given, in a fixed accumulation type, and rounds once then gives
bitwise the same result whatever the strategy, chunking, lanes or arrival order. Strategies
that build a sum hop by hop (ring, recursive doubling, a chain) fail: the partial sums round
on the way, so their result depends on the route.

>>> from purlin.spec import collectives
>>> from purlin.snac import plan
>>> check_deterministic(plan(collectives.all_reduce(3), "direct-push", count=8,
...                          deterministic=True))
[]
>>> print(check_deterministic(plan(collectives.all_reduce(3), "ring", count=8))[0])
... # doctest: +ELLIPSIS
rank 2 step 4 (lane 0 consume, call 0) adds the input of rank(s) 2 to a value already reduced...
"""

from __future__ import annotations

from purlin.snac.ir import Schedule
from purlin.snac.symbolic import Memory
from purlin.snac.verify import _Analysis  # the event order its flags allow

# The built-in strategies whose reductions read every source at once (tests prove each of
# them passes the check for the standard collectives; ring builds its sums hop by hop).
DETERMINISTIC_STRATEGIES = ("direct-push", "direct-pull", "push-pull", "two-phase")


class _Sum:
    """What an interval holds: input elements ``(rank, delta)`` in the order they were added,
    and how many reduce steps made it (0: an input or a copy of one)."""

    __slots__ = ("parts", "hops")

    def __init__(self, parts, hops=0):
        self.parts, self.hops = parts, hops

    def shifted(self, by: int) -> "_Sum":
        return _Sum(tuple((r, d + by) for r, d in self.parts), self.hops)


def check_one_rounding(schedule: Schedule) -> list[str]:
    """The steps of ``schedule`` that reduce a value already reduced (empty: none): where
    every element is summed in one step, a datapath that accumulates a step's sources in a
    wider type rounds each result once (FP8 on the GPUs), whatever the sources' order.

    >>> from purlin.spec import collectives
    >>> from purlin.snac import plan
    >>> check_one_rounding(plan(collectives.all_reduce(3), "direct-push", count=8))
    []
    """
    return check_deterministic(schedule, rank_order=False)


def check_deterministic(schedule: Schedule, rank_order: bool = True) -> list[str]:
    """The problems that keep ``schedule`` from being deterministic (empty: none), each
    naming the rank and step. A copy collective is always deterministic. The schedule is
    run symbolically over one call in an order its flags allow (``verify`` proves the rest:
    that the outputs are right and nothing races)."""
    if not schedule.collective.op.is_reduce:
        return []
    an = _Analysis(schedule, calls=1)
    if not an.static_checks():
        return list(an.errors)
    order = an.happens_before()
    if an.errors:
        return list(an.errors)
    mem = Memory()
    for r in range(schedule.nranks):
        size = an.buf_size[(r, "input")]
        if size:
            mem.write(r, "input", 0, [(0, size, _Sum(((r, 0),)))])
    problems: list[str] = []
    for eid in order:
        info = an.ev_info[eid]
        if info[0] != "step":
            continue
        _, r, i, _call = info
        st = schedule.steps[r][i]
        if not st.moves_data:
            continue
        reads = []
        for src in st.srcs:
            pieces = mem.read(src.rank, src.buffer, src.offset, src.end)
            if any(t is None for _, _, t in pieces):
                return [f"{an.where(r, i, 0)} reads {src!r} before anything wrote it "
                        "(verify(schedule) says more)"]
            reads.append([(a, b, t.shifted(src.offset - st.dst.offset)) for a, b, t in pieces])
        if st.op == "copy":
            out = reads[0]
        else:
            out, problem = _reduce(reads, rank_order)
            if problem:
                problems.append(f"{an.where(r, i, 0)} {problem}")
        mem.write(st.dst.rank, st.dst.buffer, st.dst.offset, out)
    return problems


def _reduce(reads, rank_order: bool = True):
    """The reduction of ``reads`` (one interval list per source) and what breaks the
    property there, if anything (the first such interval)."""
    cuts = sorted({x for pieces in reads for a, b, _ in pieces for x in (a, b)})
    out, problem = [], None
    for a, b in zip(cuts, cuts[1:]):
        terms = [next(t for s0, s1, t in pieces if s0 <= a < s1) for pieces in reads]
        parts = tuple(p for t in terms for p in t.parts)
        if problem is None:
            partial = next((t for t in terms if t.hops or len(t.parts) > 1), None)
            ranks = [t.parts[0][0] for t in terms]
            if partial is not None:
                others = sorted({t.parts[0][0] for t in terms if t is not partial})
                problem = (f"adds the input of rank(s) {', '.join(map(str, others))} to a value "
                           f"already reduced from ranks "
                           f"{', '.join(str(p[0]) for p in partial.parts)} (elements "
                           f"{a}..{b} of its output): the sum is built hop by hop, so its "
                           "rounding depends on the route")
            elif rank_order and ranks != sorted(ranks):
                problem = (f"reduces ranks {', '.join(map(str, ranks))} in that order (elements "
                           f"{a}..{b} of its output), not in rank order")
        out.append((a, b, _Sum(parts, 1)))
    return out, problem
