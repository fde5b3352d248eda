"""Variable-length collectives: a collective planned once at a per-chunk *capacity*, run with
the actual counts given per call (ARCHITECTURE.md, "Variable-length collectives").

A :class:`VarLen` wraps a :class:`Collective` whose every chunk may hold from 0 to
``capacity`` rows of ``row`` elements. The planner and verifier see the padded collective
(:meth:`VarLen.sized`: every chunk a fixed *slot*); a call packs the user's buffers -- rows
concatenated by the actual counts, as ``torch.distributed.all_to_all_single`` lays them out --
into the slots and unpacks what arrives. For a copy collective every slot starts with a
16-byte header holding its count, so a receiver learns the counts from the data, never from
the host; a reducing collective's receiver holds the counts of what it reduces already.

>>> import numpy as np
>>> v = all_gather_v(2, capacity=4)
>>> v.counts([1, 3])
(1, 3)
>>> [o.tolist() for o in v.reference([np.array([1.0]), np.array([2.0, 3.0, 4.0])], [1, 3])]
[[1.0, 2.0, 3.0, 4.0], [1.0, 2.0, 3.0, 4.0]]
>>> v.counts([1, 5])  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
purlin.errors.CountError: rank 1 chunk 1: count 5 is over the capacity of 4 rows this ...
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from purlin.errors import CountError, SpecError
from purlin.spec import collectives
from purlin.spec.collective import Collective, _fmt
from purlin.spec.dtypes import dtype as as_dtype
from purlin.spec.sizing import Sizing

HEADER_BYTES = 16  # a slot's count header: an int64, padded so the rows stay 16-byte aligned
SLOT_ALIGN = 16    # every slot is a multiple of this many bytes (headers stay aligned)


@dataclass(frozen=True)
class VarLen:
    """``collective`` with every chunk holding 0..``capacity`` rows of ``row`` elements.

    Counts are given per call, one per chunk name in :attr:`names` order (or as a mapping
    name -> count); see :meth:`counts`. A reducing collective needs every output chunk in the
    same rank's input (its receiver knows the count); copy collectives carry counts in a slot
    header."""

    collective: Collective
    capacity: int
    row: int = 1

    def __post_init__(self):
        if not isinstance(self.collective, Collective):
            raise SpecError(f"VarLen takes a Collective, got {self.collective!r}")
        for what, value in (("capacity", self.capacity), ("row", self.row)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise SpecError(f"{self.name}: {what} must be a whole number >= 1, got "
                                f"{value!r}")
        c = self.collective
        if c.op.is_reduce:
            for rank, row in enumerate(c.output):
                for name in row:
                    if name not in c.input[rank]:
                        raise SpecError(
                            f"{self.name}: rank {rank} reduces chunk {_fmt(name)!r} without "
                            "holding it in its input, so it could not know its count; a "
                            "variable-length reduce needs every output chunk in the same "
                            "rank's input")

    @property
    def name(self) -> str:
        return f"{self.collective.name}-v"

    @property
    def nranks(self) -> int:
        return self.collective.nranks

    @property
    def header(self) -> bool:
        """Whether slots carry their count (copy collectives)."""
        return not self.collective.op.is_reduce

    @cached_property
    def names(self) -> tuple:
        """Chunk names in the order counts are given."""
        return self.collective.input.names()

    @cached_property
    def _index(self) -> dict:
        return {name: i for i, name in enumerate(self.names)}

    def index(self, name) -> int:
        """Where chunk ``name``'s count sits in a flat counts array."""
        return self._index[name]

    # -- slots ------------------------------------------------------------------------------
    def slot(self, dtype) -> tuple[int, int]:
        """(header elements, slot elements) of one padded chunk in ``dtype``: the header, then
        ``capacity * row`` elements, rounded up to a multiple of 16 bytes.

        >>> all_to_all_v(2, capacity=3).slot("bfloat16")
        (8, 16)
        """
        size = as_dtype(dtype).itemsize
        head = HEADER_BYTES // size if self.header else 0
        data = self.capacity * self.row
        per = max(SLOT_ALIGN // size, 1)
        return head, -(-(head + data) // per) * per

    def sized(self, dtype="float32") -> Sizing:
        """The padded collective's sizing: every chunk one slot. Plan and verify this once."""
        _, slot = self.slot(dtype)
        return self.collective.sized(chunk_sizes=lambda _name: slot, dtype=dtype)

    def input_capacity(self, rank: int) -> int:
        """Elements rank ``rank``'s packed input holds at most."""
        return len(self.collective.input[rank]) * self.capacity * self.row

    def output_capacity(self, rank: int) -> int:
        """Elements rank ``rank``'s packed output holds at most."""
        return len(self.collective.output[rank]) * self.capacity * self.row

    # -- counts -----------------------------------------------------------------------------
    def _where(self, name) -> str:
        ranks = sorted({r for r, _ in self.collective.sources(name)})
        who = f"rank {ranks[0]}" if len(ranks) == 1 else \
            ("every rank" if len(ranks) == self.nranks else f"ranks {ranks}")
        return f"{who} chunk {_fmt(name)}"

    def counts(self, counts) -> tuple[int, ...]:
        """``counts`` checked, as a tuple in :attr:`names` order: a mapping name -> rows, or a
        sequence (nested sequences and arrays are flattened row-major: an all-to-all's
        ``counts[r][j]`` is what rank r sends to rank j), or a host tensor. A CountError
        names the rank and chunk of a negative count or one over capacity, or says how many
        counts a wrong-length list should have had."""
        if isinstance(counts, dict):
            missing = [n for n in self.names if n not in counts]
            if missing:
                raise CountError(f"{self.name}: counts give no count for chunk "
                                 f"{_fmt(missing[0])!r} ({self._where(missing[0])})")
            flat = [counts[n] for n in self.names]
        else:
            if hasattr(counts, "detach"):  # a torch tensor: on the host path, read it
                counts = counts.detach().cpu().numpy()
            try:
                flat = np.asarray(counts, dtype=object).reshape(-1).tolist()
            except (TypeError, ValueError):
                raise CountError(f"{self.name}: counts must be a sequence of "
                                 f"{len(self.names)} whole numbers, got {counts!r}") from None
        if len(flat) != len(self.names):
            shown = ", ".join(_fmt(n) for n in self.names[:4])
            more = ", ..." if len(self.names) > 4 else ""
            raise CountError(f"{self.name} on {self.nranks} ranks takes {len(self.names)} "
                             f"counts, one per chunk ({shown}{more}), got {len(flat)}")
        out = []
        for name, value in zip(self.names, flat):
            if isinstance(value, numbers.Integral) and not isinstance(value, bool):
                value = int(value)
            if not isinstance(value, int) or isinstance(value, bool):
                raise CountError(f"{self._where(name)}: count {value!r} is not a whole number "
                                 "of rows")
            if value < 0:
                raise CountError(f"{self._where(name)}: count {value} is negative; counts are "
                                 "rows >= 0")
            if value > self.capacity:
                raise CountError(
                    f"{self._where(name)}: count {value} is over the capacity of "
                    f"{self.capacity} rows this {self.name} was bound with; bind with "
                    f"capacity >= {value}, or send fewer rows")
            out.append(value)
        return tuple(out)

    def input_counts(self, rank: int, counts) -> tuple[int, ...]:
        """Rows per input position of ``rank`` (``counts`` already checked)."""
        return tuple(counts[self._index[n]] for n in self.collective.input[rank])

    def output_counts(self, rank: int, counts) -> tuple[int, ...]:
        """Rows per output position of ``rank``."""
        return tuple(counts[self._index[n]] for n in self.collective.output[rank])

    def check_packed(self, rank: int, packed_len: int, counts) -> None:
        """A CountError unless rank ``rank``'s packed input of ``packed_len`` elements is
        exactly its counts' rows."""
        want = sum(self.input_counts(rank, counts)) * self.row
        if packed_len != want:
            raise CountError(f"input of rank {rank} holds {packed_len} elements; its counts "
                             f"{list(self.input_counts(rank, counts))} x {self.row} elements "
                             f"per row make {want}")

    # -- host pack / unpack -----------------------------------------------------------------
    def pack(self, rank: int, packed: np.ndarray, counts, dtype, out=None) -> np.ndarray:
        """Rank ``rank``'s padded input (one slot per chunk, counts in the headers) from its
        packed input. ``packed`` is a flat numpy array (FP8 as its uint8 bits)."""
        head, slot = self.slot(dtype)
        row = self.collective.input[rank]
        padded = np.zeros(slot * len(row), dtype=packed.dtype) if out is None else out
        at = 0
        for pos, c in enumerate(self.input_counts(rank, counts)):
            base = pos * slot
            if head:
                padded[base: base + head].view(np.uint8)[:8] = \
                    np.array([c], dtype=np.int64).view(np.uint8)
            n = c * self.row
            padded[base + head: base + head + n] = packed[at: at + n]
            at += n
        return padded

    def unpack(self, rank: int, padded: np.ndarray, dtype, counts=None):
        """(packed output, rows per output position) of rank ``rank`` from its padded output:
        counts read from the slot headers, or for a reducing collective from ``counts``."""
        head, slot = self.slot(dtype)
        row = self.collective.output[rank]
        if head:
            got = [int(padded[p * slot: p * slot + head].view(np.uint8)[:8].view(np.int64)[0])
                   for p in range(len(row))]
        else:
            got = list(self.output_counts(rank, counts))
        parts = [padded[p * slot + head: p * slot + head + c * self.row]
                 for p, c in enumerate(got)]
        packed = np.concatenate(parts) if parts else padded[:0].copy()
        return packed, tuple(got)

    def reference(self, inputs, counts) -> list[np.ndarray]:
        """Each rank's packed output in float64, from each rank's packed input and the
        counts (checked), without padding: the oracle the datapaths are tested against."""
        counts = self.counts(counts)
        c = self.collective
        flat = [np.asarray(x, dtype=np.float64).reshape(-1) for x in inputs]
        if len(flat) != c.nranks:
            raise SpecError(f"{self.name} has {c.nranks} ranks but {len(flat)} inputs were "
                            "given")
        for r, x in enumerate(flat):
            self.check_packed(r, x.size, counts)

        def chunk(rank, pos):
            rows = self.input_counts(rank, counts)
            at = sum(rows[:pos]) * self.row
            return flat[rank][at: at + rows[pos] * self.row]

        reducer = {"sum": np.sum, "avg": np.mean, "max": np.max, "min": np.min}
        outputs = []
        for rank, row in enumerate(c.output):
            parts = []
            for name in row:
                srcs = [chunk(r, p) for r, p in c.sources(name)]
                parts.append(reducer[c.op.reduce_op](np.stack(srcs), axis=0)
                             if c.op.is_reduce else srcs[0].copy())
            outputs.append(np.concatenate(parts) if parts else np.zeros(0))
        return outputs

    def describe(self) -> str:
        return (f"{self.name}: {self.collective.describe()}\nevery chunk 0..{self.capacity} "
                f"rows of {self.row} element(s)")

    def __repr__(self) -> str:
        return (f"VarLen({self.collective.name}, {self.nranks} ranks, capacity {self.capacity}"
                f" rows of {self.row})")


def all_gather_v(n: int, capacity: int, row: int = 1) -> VarLen:
    """Rank r holds chunk r of ``counts[r]`` rows; every rank ends with chunks 0..n-1 packed."""
    return VarLen(collectives.all_gather(n), capacity, row)


def reduce_scatter_v(n: int, capacity: int, op="sum", row: int = 1) -> VarLen:
    """Every rank holds chunks 0..n-1 (chunk r of ``counts[r]`` rows on every rank); rank r
    ends with the reduction of chunk r."""
    return VarLen(collectives.reduce_scatter(n, op), capacity, row)


def all_to_all_v(n: int, capacity: int, row: int = 1) -> VarLen:
    """Rank r sends ``counts[r][j]`` rows to rank j; rank j ends with what ranks 0..n-1 sent
    it, packed in rank order (``torch.distributed.all_to_all_single`` with split sizes)."""
    return VarLen(collectives.all_to_all(n), capacity, row)


VARIABLE = {"all-gather-v": all_gather_v, "reduce-scatter-v": reduce_scatter_v,
            "all-to-all-v": all_to_all_v}
