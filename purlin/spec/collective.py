"""A Collective is an input Layout, an output Layout and an Op, validated when built.

* copy: every name in the output has exactly one source in the input.
* reduce: the output chunk named ``x`` is the reduction of all input chunks named ``x``.

>>> from purlin.spec import Layout, copy
>>> swap = Collective(Layout([["a"], ["b"]]), Layout([["b"], ["a"]]), copy, name="swap")
>>> swap.sources("a")
((0, 0),)
>>> print(swap.describe())
swap (copy), 2 ranks
rank | input | output
   0 | a     | b
   1 | b     | a
"""

from __future__ import annotations

import html
from dataclasses import dataclass, field
from functools import cached_property

from purlin.errors import SpecError
from purlin.spec.layout import Layout, Name
from purlin.spec.ops import Op


@dataclass(frozen=True)
class Collective:
    """What a collective computes. Build it directly for a custom collective, or use
    :mod:`purlin.spec.collectives` for the standard ones."""

    input: Layout
    output: Layout
    op: Op
    name: str = "custom"
    root: int | None = field(default=None, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "input", Layout(self.input))
        object.__setattr__(self, "output", Layout(self.output))
        object.__setattr__(self, "op", Op.parse(self.op))
        _validate(self)

    @property
    def nranks(self) -> int:
        return self.input.nranks

    @cached_property
    def _sources(self) -> dict:
        found: dict = {}
        for rank, row in enumerate(self.input):
            for pos, name in enumerate(row):
                found.setdefault(name, []).append((rank, pos))
        return {name: tuple(v) for name, v in found.items()}

    def sources(self, name: Name) -> tuple[tuple[int, int], ...]:
        """The (rank, position) input chunks that make the output chunk ``name``."""
        return self._sources.get(name, ())

    def sized(self, count: int | None = None, *, nbytes: int | None = None, dtype="float32",
              chunk_sizes=None):
        """Bind element counts: see :func:`purlin.spec.sizing.size`."""
        from purlin.spec.sizing import size

        return size(self, count, nbytes=nbytes, dtype=dtype, chunk_sizes=chunk_sizes)

    # -- rendering -------------------------------------------------------------------------
    def _rows(self) -> list[tuple[str, str, str]]:
        def cell(row):
            return " ".join(_fmt(n) for n in row) if row else "-"

        return [(str(r), cell(self.input[r]), cell(self.output[r])) for r in range(self.nranks)]

    def title(self) -> str:
        return f"{self.name} ({self.op}), {self.nranks} ranks"

    def describe(self) -> str:
        """A small table: rank, its input names, its output names."""
        rows = [("rank", "input", "output")] + self._rows()
        w = [max(len(r[i]) for r in rows) for i in range(3)]
        lines = [self.title()]
        for i, (a, b, c) in enumerate(rows):
            a = a.rjust(w[0]) if i else a.ljust(w[0])
            lines.append(f"{a} | {b.ljust(w[1])} | {c}".rstrip())
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        head = "<tr><th>rank</th><th>input</th><th>output</th></tr>"
        body = "".join(
            f"<tr><td>{html.escape(a)}</td><td><code>{html.escape(b)}</code></td>"
            f"<td><code>{html.escape(c)}</code></td></tr>"
            for a, b, c in self._rows()
        )
        return (f"<div><b>{html.escape(self.title())}</b><table>{head}{body}</table></div>")

    def __repr__(self) -> str:
        return self.describe()

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "op": str(self.op),
            "root": self.root,
            "input": self.input.to_json(),
            "output": self.output.to_json(),
        }

    @classmethod
    def from_json(cls, obj) -> "Collective":
        return cls(Layout.from_json(obj["input"]), Layout.from_json(obj["output"]),
                   Op.parse(obj["op"]), name=obj.get("name", "custom"), root=obj.get("root"))


def _fmt(name: Name) -> str:
    if isinstance(name, tuple):
        return "(" + ",".join(_fmt(p) for p in name) + ")"
    return str(name)


def _validate(c: Collective) -> None:
    if c.input.nranks != c.output.nranks:
        raise SpecError(
            f"input layout has {c.input.nranks} ranks but output layout has {c.output.nranks}; "
            "both must list every rank (an empty list for a rank that holds nothing)"
        )
    if c.nranks == 0:
        raise SpecError("an empty collective: the layouts list no ranks")
    if not any(c.output):
        raise SpecError(f"an empty collective: no rank of the {c.nranks} has any output chunk")
    if c.root is not None and (not isinstance(c.root, int) or isinstance(c.root, bool)
                               or not 0 <= c.root < c.nranks):
        raise SpecError(f"root {c.root!r} is outside the ranks 0..{c.nranks - 1}")
    for rank, row in enumerate(c.input):
        seen: dict = {}
        for pos, name in enumerate(row):
            if name in seen:
                raise SpecError(
                    f"input of rank {rank} holds {_fmt(name)!r} twice (positions {seen[name]} "
                    f"and {pos}); a rank holds each input name once"
                )
            seen[name] = pos
    for rank, row in enumerate(c.output):
        for pos, name in enumerate(row):
            found = c.sources(name)
            if not found:
                raise SpecError(
                    f"output name {_fmt(name)!r} at rank {rank} position {pos} has no source "
                    "in the input"
                )
            if c.op.kind == "copy" and len(found) > 1:
                where = ", ".join(f"rank {r} position {p}" for r, p in found)
                raise SpecError(
                    f"copy needs exactly one source for {_fmt(name)!r} (output rank {rank} "
                    f"position {pos}), found {len(found)}: {where}"
                )
