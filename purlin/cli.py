"""The ``purlin`` command line: one function per subcommand, registered in a small table.

>>> main(["describe", "all-gather", "--ranks", "2"])
all-gather (copy), 2 ranks
rank | input | output
   0 | 0     | 0 1
   1 | 1     | 0 1
0

A new subcommand is one function: decorate it with :func:`command`, give its arguments as
:func:`arg` entries (or reuse a group such as ``COLLECTIVE_ARGS``), return an exit code.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from typing import Callable, Sequence

from purlin.errors import PurlinError, SpecError
from purlin.spec.collective import Collective
from purlin.spec.collectives import REDUCING, ROOTED, STANDARD, standard
from purlin.spec.ops import REDUCE_OPS


@dataclass(frozen=True)
class Arg:
    """One ``add_argument`` call, kept as data so argument groups can be shared."""

    flags: tuple[str, ...]
    options: dict


def arg(*flags: str, **options) -> Arg:
    return Arg(flags, options)


@dataclass(frozen=True)
class Command:
    name: str
    run: Callable[[argparse.Namespace], int]
    args: tuple[Arg, ...]

    @property
    def help(self) -> str:
        return (self.run.__doc__ or "").strip().splitlines()[0]


COMMANDS: dict[str, Command] = {}


def command(name: str, *args: Arg):
    """Register ``run(namespace) -> exit code`` as the subcommand ``name``; its docstring's first
    line is the help text."""

    def register(run):
        COMMANDS[name] = Command(name, run, args)
        return run

    return register


# -- shared arguments --------------------------------------------------------------------------
COLLECTIVE_ARGS = (
    arg("collective", help="a standard collective: " + ", ".join(STANDARD)),
    arg("-n", "--ranks", type=int, required=True, metavar="N", help="number of ranks (>= 2)"),
    arg("--root", type=int, metavar="R",
        help=f"root rank of {', '.join(ROOTED)} (default 0)"),
    arg("--op", choices=REDUCE_OPS, help=f"reduction of {', '.join(REDUCING)} (default sum)"),
)


def collective_from(args: argparse.Namespace) -> Collective:
    """Build the collective that COLLECTIVE_ARGS name, refusing options it does not take."""
    key = args.collective.replace("_", "-").lower()
    if key in STANDARD:
        if args.root is not None and key not in ROOTED:
            raise SpecError(f"{key} has no root; --root applies to {', '.join(ROOTED)}")
        if args.op is not None and key not in REDUCING:
            raise SpecError(f"{key} copies and takes no --op; --op applies to "
                            f"{', '.join(REDUCING)}")
    root = 0 if args.root is None else args.root
    return standard(args.collective, args.ranks, root=root, op=args.op or "sum")


# -- subcommands -------------------------------------------------------------------------------
@command("list")
def list_collectives(args: argparse.Namespace) -> int:
    """List the standard collectives."""
    width = max(map(len, STANDARD))
    for name, build in STANDARD.items():
        kind = "reduce" if name in REDUCING else "copy"
        summary = (build.__doc__ or "").strip().splitlines()[0]
        print(f"{name.ljust(width)}  {kind.ljust(6)}  {summary}")
    return 0


@command("describe", *COLLECTIVE_ARGS,
         arg("--json", action="store_true", help="print the collective as JSON"))
def describe(args: argparse.Namespace) -> int:
    """Print which chunks every rank holds before and after a collective."""
    coll = collective_from(args)
    print(json.dumps(coll.to_json()) if args.json else coll.describe())
    return 0


@command("demo", arg("-n", "--ranks", type=int, default=4, metavar="N",
                     help="number of ranks (default 4)"))
def demo(args: argparse.Namespace) -> int:
    """Describe every standard collective."""
    for i, name in enumerate(STANDARD):
        if i:
            print()
        print(standard(name, args.ranks).describe())
    return 0


# -- entry point -------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="purlin",
        description="Purlin: intra-node GPU collectives as layouts, schedules and datapaths.",
    )
    from purlin import __version__

    parser.add_argument("--version", action="version", version=f"purlin {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for cmd in COMMANDS.values():
        p = sub.add_parser(cmd.name, help=cmd.help, description=cmd.help)
        for a in cmd.args:
            p.add_argument(*a.flags, **a.options)
        p.set_defaults(run=cmd.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``purlin`` command; returns the exit status (2 for a usage or Purlin error)."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # argparse has printed usage or help already
        return exc.code if isinstance(exc.code, int) else 2
    try:
        return args.run(args)
    except PurlinError as exc:
        print(f"purlin: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
