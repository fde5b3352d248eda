"""The operation of a collective: ``copy`` or ``reduce`` with sum, max, min or avg.

>>> copy
copy
>>> reduce.sum
reduce:sum
>>> reduce("max") == reduce.max
True
"""

from __future__ import annotations

from dataclasses import dataclass

from purlin.errors import SpecError

REDUCE_OPS = ("sum", "max", "min", "avg")


@dataclass(frozen=True)
class Op:
    """``kind`` is "copy" or "reduce"; ``reduce_op`` is one of REDUCE_OPS for a reduce."""

    kind: str
    reduce_op: str | None = None

    def __post_init__(self):
        if self.kind == "copy" and self.reduce_op is not None:
            raise SpecError(f"copy takes no reduce op, got {self.reduce_op!r}")
        if self.kind == "reduce" and self.reduce_op not in REDUCE_OPS:
            raise SpecError(
                f"reduce op must be one of {', '.join(REDUCE_OPS)}, got {self.reduce_op!r}"
            )
        if self.kind not in ("copy", "reduce"):
            raise SpecError(f"op must be copy or a reduction ({', '.join(REDUCE_OPS)}, or "
                            f"'reduce:<op>'), got {self.kind!r}")

    @property
    def is_reduce(self) -> bool:
        return self.kind == "reduce"

    def __str__(self) -> str:
        return self.kind if self.reduce_op is None else f"reduce:{self.reduce_op}"

    __repr__ = __str__

    @classmethod
    def parse(cls, text: "str | Op") -> "Op":
        """Read "copy", "sum", "reduce", "reduce:max" and the like.

        >>> Op.parse("reduce:avg")
        reduce:avg
        """
        if isinstance(text, Op):
            return text
        text = str(text)
        if text == "copy":
            return copy
        if text == "reduce":
            return Op("reduce", "sum")
        kind, _, red = text.partition(":")
        if kind == "reduce":
            return Op("reduce", red)
        return Op("reduce", text) if text in REDUCE_OPS else Op(text)


class _ReduceFactory:
    """``reduce("sum")`` or ``reduce.sum``: both give the same Op."""

    sum = Op("reduce", "sum")
    max = Op("reduce", "max")
    min = Op("reduce", "min")
    avg = Op("reduce", "avg")

    def __call__(self, op: str = "sum") -> Op:
        return Op("reduce", op)

    def __repr__(self) -> str:
        return "reduce"


copy = Op("copy")
reduce = _ReduceFactory()
