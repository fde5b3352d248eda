"""The standard collectives as declarations (ARCHITECTURE.md, "Spec"), for any n >= 2.

>>> all_reduce(2).output
Layout([[0, 1], [0, 1]])
>>> all_to_all(2).output[1]
((0, 1), (1, 1))
>>> standard("broadcast", 3, root=2).input
Layout([[], [], ['x']])
>>> sorted(STANDARD)[:3]
['all-gather', 'all-reduce', 'all-to-all']
"""

from __future__ import annotations

from purlin.errors import SpecError
from purlin.spec.collective import Collective
from purlin.spec.ops import Op, copy


def _check(n: int, root: int | None = None) -> None:
    if not isinstance(n, int) or isinstance(n, bool) or n < 2:
        raise SpecError(f"a standard collective needs n >= 2 ranks, got {n!r}")
    if root is not None and (not isinstance(root, int) or not 0 <= root < n):
        raise SpecError(f"root {root!r} is outside the ranks 0..{n - 1}")


def _reduce_op(op) -> Op:
    parsed = Op.parse(op)
    if not parsed.is_reduce:
        raise SpecError(f"this collective reduces; op must be sum, max, min or avg, got {op!r}")
    return parsed


def all_gather(n: int) -> Collective:
    """Rank r holds chunk r; every rank ends with chunks 0..n-1."""
    _check(n)
    return Collective([[r] for r in range(n)], [list(range(n))] * n, copy, name="all-gather")


def reduce_scatter(n: int, op="sum") -> Collective:
    """Every rank holds chunks 0..n-1; rank r ends with the reduction of chunk r."""
    _check(n)
    return Collective([list(range(n))] * n, [[r] for r in range(n)], _reduce_op(op),
                      name="reduce-scatter")


def all_reduce(n: int, op="sum") -> Collective:
    """Every rank holds chunks 0..n-1 and ends with the reduction of each."""
    _check(n)
    return Collective([list(range(n))] * n, [list(range(n))] * n, _reduce_op(op),
                      name="all-reduce")


def all_to_all(n: int) -> Collective:
    """Rank r holds (r, 0..n-1); rank r ends with (0..n-1, r)."""
    _check(n)
    return Collective([[(r, j) for j in range(n)] for r in range(n)],
                      [[(j, r) for j in range(n)] for r in range(n)], copy, name="all-to-all")


def broadcast(n: int, root: int = 0) -> Collective:
    """The root holds x; every rank ends with x."""
    _check(n, root)
    return Collective([["x"] if r == root else [] for r in range(n)], [["x"]] * n, copy,
                      name="broadcast", root=root)


def reduce(n: int, root: int = 0, op="sum") -> Collective:
    """Every rank holds x; the root ends with the reduction of all of them."""
    _check(n, root)
    return Collective([["x"]] * n, [["x"] if r == root else [] for r in range(n)],
                      _reduce_op(op), name="reduce", root=root)


def gather(n: int, root: int = 0) -> Collective:
    """Rank r holds chunk r; the root ends with chunks 0..n-1."""
    _check(n, root)
    return Collective([[r] for r in range(n)],
                      [list(range(n)) if r == root else [] for r in range(n)], copy,
                      name="gather", root=root)


def scatter(n: int, root: int = 0) -> Collective:
    """The root holds chunks 0..n-1; rank r ends with chunk r."""
    _check(n, root)
    return Collective([list(range(n)) if r == root else [] for r in range(n)],
                      [[r] for r in range(n)], copy, name="scatter", root=root)


STANDARD = {
    "all-gather": all_gather,
    "reduce-scatter": reduce_scatter,
    "all-reduce": all_reduce,
    "all-to-all": all_to_all,
    "broadcast": broadcast,
    "reduce": reduce,
    "gather": gather,
    "scatter": scatter,
}
ROOTED = ("broadcast", "reduce", "gather", "scatter")
REDUCING = ("reduce-scatter", "all-reduce", "reduce")


def standard(name: str, n: int, *, root: int = 0, op="sum") -> Collective:
    """Build a standard collective by its name (``"all-reduce"``, ``"all_gather"``, ...)."""
    key = name.replace("_", "-").lower() if isinstance(name, str) else None
    if key not in STANDARD:
        raise SpecError(f"unknown collective {name!r}; the standard ones are "
                        f"{', '.join(STANDARD)}")
    kwargs = {}
    if key in ROOTED:
        kwargs["root"] = root
    if key in REDUCING:
        kwargs["op"] = op
    return STANDARD[key](n, **kwargs)
