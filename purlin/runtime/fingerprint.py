"""A call's fingerprint: what a rank is about to run, so that ranks that disagree can say so.

In process mode every rank must make the same calls in the same order. Each rank writes the
fingerprint of the call it is making -- its index, function, dtype, count, op, root -- where its
peers can read it (beside the flags in shared memory on the CPU; gathered on first use of a
size on GPUs), and :func:`disagreement` turns the ranks' fingerprints into the sentence every
rank's error carries, instead of a timeout that asks whether a live rank is alive.

>>> a = Call(5, "all_reduce", "float32", 64, "sum")
>>> b = Call(5, "all_gather_into_tensor", "float32", 64)
>>> Call.decode(a.encode()) == a
True
>>> print(disagreement([a, a, b, Call(4, "broadcast", "int32", 7, root=0)]))
ranks disagree about call 5: ranks 0 and 1 call all_reduce of 64 float32 (sum); rank 2 calls \
all_gather_into_tensor of 64 float32; rank 3 is still at call 4 (broadcast of 7 int32 from rank \
0) -- every rank must make the same calls in the same order
>>> disagreement([a, a]) is None
True
"""

from __future__ import annotations

from dataclasses import dataclass

FUNCTIONS = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor",
             "all_to_all_single", "broadcast", "reduce", "all_reduce_add_rms_norm", "run",
             "input_buffer", "all_gather", "reduce_scatter")
DTYPES = ("float32", "float64", "float16", "bfloat16", "int32", "int64", "int16", "int8",
          "uint8", "bool", "complex64", "complex128")
OPS = (None, "sum", "max", "min", "avg", "product", "other")
WORDS = 8  # index, function, dtype, count, op, root + 1, fallback, spare


def _code(table, value) -> int:
    return table.index(value) if value in table else len(table)


def _name(table, code: int, unknown: str):
    return table[code] if 0 <= code < len(table) else unknown


@dataclass(frozen=True)
class Call:
    """One rank's call: ``index`` counts the communicator's calls from 1 (0: none yet);
    ``count`` is the function's own size (see :meth:`purlin.torch.Communicator.input_buffer`;
    -1 where the ranks' sizes may differ, as with all-to-all split sizes);
    ``root`` the group rank of broadcast's source or reduce's destination; ``fallback``: it
    runs on torch.distributed."""

    index: int
    function: str
    dtype: str
    count: int
    op: str | None = None
    root: int | None = None
    fallback: bool = False

    def encode(self) -> list[int]:
        return [int(self.index), _code(FUNCTIONS, self.function), _code(DTYPES, self.dtype),
                int(self.count), _code(OPS, self.op), -1 if self.root is None else int(self.root),
                int(self.fallback), 0]

    @classmethod
    def decode(cls, words) -> "Call | None":
        """The call ``words`` encode, or None where no call was written (index 0)."""
        w = [int(x) for x in words]
        if w[0] <= 0:
            return None
        return cls(w[0], _name(FUNCTIONS, w[1], "another function"),
                   _name(DTYPES, w[2], "other-dtype"), w[3], _name(OPS, w[4], "another op"),
                   None if w[5] < 0 else w[5], bool(w[6]))

    def same(self, other: "Call") -> bool:
        """The same call, whatever its index."""
        return self.encode()[1:] == other.encode()[1:]

    def __str__(self) -> str:
        text = (f"{self.function} of {self.count} {self.dtype}" if self.count >= 0 else
                f"{self.function} of {self.dtype} with split sizes")
        if self.op is not None:
            text += f" ({self.op})"
        if self.root is not None:
            text += f" {'from' if self.function == 'broadcast' else 'to'} rank {self.root}"
        return text + (" on torch.distributed" if self.fallback else "")


def _ranks(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return "ranks " + ", ".join(map(str, ranks[:-1])) + f" and {ranks[-1]}"


def disagreement(calls, index: int | None = None) -> str | None:
    """The sentence saying how the ranks' ``calls`` (one :class:`Call` or None per rank)
    differ at call ``index`` (default: the furthest one), or None if every rank that reached
    it makes the same call. Ranks still at an earlier call are named with it."""
    reached = [c.index for c in calls if c is not None]
    if not reached:
        return None
    index = max(reached) if index is None else index
    groups: list[tuple[Call, list[int]]] = []
    behind = []
    for rank, c in enumerate(calls):
        if c is None or c.index < index:
            behind.append((rank, c))
        elif c.index == index:
            for call, ranks in groups:
                if call.same(c):
                    ranks.append(rank)
                    break
            else:
                groups.append((c, [rank]))
    if len(groups) < 2:
        return None
    parts = [f"{_ranks(ranks)} call{'s' if len(ranks) == 1 else ''} {call}"
             for call, ranks in groups]
    parts += [f"rank {rank} " + (f"is still at call {c.index} ({c})" if c is not None
                                 else "has made no call yet") for rank, c in behind]
    return (f"ranks disagree about call {index}: " + "; ".join(parts) +
            " -- every rank must make the same calls in the same order")


def positions(calls, rank: int) -> str:
    """Where the other ranks are, for a timeout message: '' when every rank is at this
    rank's call, else e.g. 'rank 3 is still at call 4 (broadcast of 7 int32 from rank 0)'."""
    mine = calls[rank]
    if mine is None:
        return ""
    parts = []
    for r, c in enumerate(calls):
        if r != rank and (c is None or c.index < mine.index):
            parts.append(f"rank {r} " + (f"is still at call {c.index} ({c})" if c is not None
                                         else "has made no call yet"))
    return "; ".join(parts)
