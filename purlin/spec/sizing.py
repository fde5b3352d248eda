"""Sizing: a collective plus a message size and dtype gives chunk sizes and buffer offsets.

The message size follows nccl-tests: it is the largest per-rank buffer (input or output) of the
collective. A message size splits into the chunks of that buffer as evenly as it can (the
first ``count % chunks`` get one element more, as NCCL takes any count); uneven chunks of your
own are given per name.

>>> from purlin.spec import collectives
>>> s = collectives.all_gather(4).sized(nbytes=1024, dtype="float32")
>>> s.chunk_count(0), s.output_count(1), s.output_offset(1, 3)
(64, 256, 192)
>>> [c for _, c in collectives.all_reduce(3).sized(10).chunks]
[4, 3, 3]
>>> v = collectives.all_gather(2).sized(chunk_sizes={0: 3, 1: 5})
>>> v.output_count(0), v.output_offset(0, 1)
(8, 3)
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from functools import cached_property
from typing import Callable, Mapping

from purlin.errors import SpecError
from purlin.spec.collective import Collective, _fmt
from purlin.spec.dtypes import DType, dtype as as_dtype
from purlin.spec.layout import Name


@dataclass(frozen=True)
class Sizing:
    """Element counts for every chunk name of a collective, and the offsets they imply."""

    collective: Collective
    dtype: DType
    chunks: tuple[tuple[Name, int], ...]  # (name, elements), in collective order

    @cached_property
    def _count_of(self) -> dict:
        return dict(self.chunks)

    def chunk_count(self, name: Name) -> int:
        """Elements in the chunk called ``name``."""
        return self._count_of[name]

    def _offsets(self, layout) -> list[list[int]]:
        """Per rank, the offset of every position, plus the buffer's total at the end."""
        counts = self._count_of
        table = []
        for row in layout:
            out, at = [], 0
            for name in row:
                out.append(at)
                at += counts[name]
            table.append(out + [at])
        return table

    @cached_property
    def _input_offsets(self) -> list[list[int]]:
        return self._offsets(self.collective.input)

    @cached_property
    def _output_offsets(self) -> list[list[int]]:
        return self._offsets(self.collective.output)

    def input_offset(self, rank: int, pos: int) -> int:
        return self._input_offsets[rank][pos]

    def output_offset(self, rank: int, pos: int) -> int:
        return self._output_offsets[rank][pos]

    def input_count(self, rank: int) -> int:
        return self._input_offsets[rank][-1]

    def output_count(self, rank: int) -> int:
        return self._output_offsets[rank][-1]

    @property
    def message_count(self) -> int:
        """Elements in the largest per-rank buffer (nccl-tests' "size" over the itemsize)."""
        n = self.collective.nranks
        return max(max(self.input_count(r), self.output_count(r)) for r in range(n))

    @property
    def message_bytes(self) -> int:
        return self.message_count * self.dtype.itemsize

    def __repr__(self) -> str:
        counts = {c for _, c in self.chunks}
        per = f"{counts.pop()} each" if len(counts) == 1 else "uneven"
        return (f"Sizing({self.collective.name}, {self.dtype}, {len(self.chunks)} chunks "
                f"of {per}, message {self.message_bytes} B)")


def size(collective: Collective, count: int | None = None, *, nbytes: int | None = None,
         dtype="float32", chunk_sizes: Mapping | Callable | None = None) -> Sizing:
    """Give every chunk of ``collective`` an element count.

    Either ``count`` (elements) or ``nbytes`` sets the message size, split as evenly as it can
    over the chunks of the largest buffer (the first ``count % chunks`` one element more); or ``chunk_sizes`` (a mapping or a function of the name)
    sets each chunk's element count directly, for uneven (all-to-all-v style) collectives.
    """
    dt = as_dtype(dtype)
    if collective.op.reduce_op == "avg" and not dt.is_float:
        raise SpecError(
            f"{collective.name}: reduce with avg needs a floating-point dtype, got {dt}: an "
            "integer average would truncate"
        )
    names = collective.input.names()
    if chunk_sizes is not None:
        if count is not None or nbytes is not None:
            raise SpecError("give either chunk_sizes or a message size (count/nbytes), not both")
        get = chunk_sizes if callable(chunk_sizes) else _lookup(chunk_sizes)
        chunks = []
        for name in names:
            value = get(name)
            if isinstance(value, numbers.Integral) and not isinstance(value, bool):
                value = int(value)  # numpy integers from an array of sizes are fine
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise SpecError(
                    f"chunk {_fmt(name)!r} must have a whole, non-negative element count, "
                    f"got {value!r}"
                )
            chunks.append((name, value))
        return Sizing(collective, dt, tuple(chunks))

    if nbytes is not None:
        if count is not None:
            raise SpecError("give count or nbytes, not both")
        _check_whole(nbytes, "nbytes")
        if nbytes % dt.itemsize:
            raise SpecError(f"{nbytes} bytes is not a whole number of {dt} elements "
                            f"({dt.itemsize} bytes each)")
        count = nbytes // dt.itemsize
    if count is None:
        raise SpecError("a sizing needs count, nbytes or chunk_sizes")
    _check_whole(count, "count")
    if count < 0:
        raise SpecError(f"message size must not be negative, got {count} elements")
    n = collective.nranks
    rows = [(f"input of rank {r}", collective.input[r]) for r in range(n)]
    rows += [(f"output of rank {r}", collective.output[r]) for r in range(n)]
    where, widest = max(rows, key=lambda item: len(item[1]))
    k = len(widest)
    each, extra = divmod(count, k) if k else (0, 0)
    # As NCCL takes any count: the first count % k chunks of the largest buffer get one element
    # more; every other name gets the even share, so no buffer exceeds the message.
    more = set(widest[:extra])
    sizing = Sizing(collective, dt, tuple((name, each + (name in more)) for name in names))
    if sizing.message_count != count:  # a buffer that repeats a name with the extra element
        raise SpecError(
            f"{count} elements do not divide into the {k} chunks of the {where} "
            f"(the largest buffer of {collective.name}) without another buffer growing past "
            f"the message; use a multiple of {k} or give chunk_sizes"
        )
    return sizing


def _lookup(mapping: Mapping):
    def get(name):
        if name not in mapping:
            raise SpecError(f"chunk_sizes gives no size for chunk {_fmt(name)!r}")
        return mapping[name]

    return get


def _check_whole(value, what: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise SpecError(f"{what} must be a whole number, got {value!r}")


def fit_nbytes(collective: Collective, nbytes: int, dtype="float32") -> int:
    """The largest message size <= ``nbytes`` that splits evenly into the collective's chunks
    (at least one element per chunk).

    >>> from purlin.spec import collectives
    >>> fit_nbytes(collectives.all_gather(3), 1000, "float32")
    996
    """
    dt = as_dtype(dtype)
    n = collective.nranks
    widest = max(max(len(collective.input[r]), len(collective.output[r])) for r in range(n))
    count = max(widest, nbytes // dt.itemsize // widest * widest)
    return count * dt.itemsize
