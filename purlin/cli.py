"""The ``purlin`` command line: one function per subcommand, registered in a small table.

>>> main(["describe", "all-gather", "--ranks", "2"])
all-gather (copy), 2 ranks
rank | input | output
   0 | 0     | 0 1
   1 | 1     | 0 1
0

A new subcommand is one function: decorate it with :func:`command`, give its arguments as
:func:`arg` entries (or reuse a group such as ``COLLECTIVE_ARGS``), return an exit code.

Every mistake is answered with one line, ``purlin: error: ...``, and exit status 2, never a
traceback (``PURLIN_DEBUG=1`` shows it). Files go under ``outputs/`` unless ``--out`` says
otherwise; a missing folder is created.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from purlin.errors import PurlinError, SpecError
from purlin.snac.planner import LANES_BY
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
WARM_CALLS = 5  # calls before the one `purlin trace --measure` records on GPUs

OUTPUTS = Path("outputs")  # where files go by default (git-ignored in the repository)

COLLECTIVE_ARGS = (
    arg("collective", metavar="COLLECTIVE",
        help="a standard collective (" + ", ".join(STANDARD) + "), a JSON file written from "
             "Collective.to_json, or module:attribute (a Collective, or a function of the rank "
             "count returning one)"),
    arg("-n", "--ranks", type=int, metavar="N",
        help="number of ranks (>= 2); a custom collective's own count when left out"),
    arg("--root", type=int, metavar="R",
        help=f"root rank of {', '.join(ROOTED)} (default 0)"),
    arg("--op", choices=REDUCE_OPS, help=f"reduction of {', '.join(REDUCING)} (default sum)"),
)


def resolve_collective(text: str, ranks: int | None = None, *, root: int | None = None,
                       op: str | None = None) -> Collective:
    """The collective ``text`` names: a standard name (``all-reduce``), a JSON file written
    from :meth:`Collective.to_json` (``qkv.json``), or ``module:attribute`` (``mymod:qkv`` or
    ``path/to/file.py:qkv``): a Collective, or a function of the rank count returning one.
    ``ranks`` must agree with a custom collective's rank count; ``root`` and ``op`` apply to
    the standard collectives only. Raises SpecError, saying what to give instead.

    >>> resolve_collective("all-gather", 2).name
    'all-gather'
    >>> resolve_collective("no-such", 2)
    Traceback (most recent call last):
    purlin.errors.SpecError: unknown collective 'no-such'; the standard ones are all-gather, \
reduce-scatter, all-reduce, all-to-all, broadcast, reduce, gather, scatter; or give a JSON \
file written from Collective.to_json, or module:attribute
    """
    key = text.replace("_", "-").lower()
    if key in STANDARD:
        if ranks is None:
            raise SpecError(f"{key} needs a rank count: give --ranks N")
        if root is not None and key not in ROOTED:
            raise SpecError(f"{key} has no root; --root applies to {', '.join(ROOTED)}")
        if op is not None and key not in REDUCING:
            raise SpecError(f"{key} copies and takes no --op; --op applies to "
                            f"{', '.join(REDUCING)}")
        return standard(key, ranks, root=0 if root is None else root, op=op or "sum")
    if text.endswith(".json") or (os.path.isfile(text) and ":" not in text):
        coll, what = _collective_from_file(text), text
    elif ":" in text:
        coll, what = _collective_from_attribute(text, ranks), text
    else:
        raise SpecError(f"unknown collective {text!r}; the standard ones are "
                        f"{', '.join(STANDARD)}; or give a JSON file written from "
                        "Collective.to_json, or module:attribute")
    for flag, value in (("--root", root), ("--op", op)):
        if value is not None:
            raise SpecError(f"{flag} applies to the standard collectives; {what} carries its "
                            f"own layouts and op ({coll.op})")
    if ranks is not None and ranks != coll.nranks:
        raise SpecError(f"--ranks {ranks} does not match {what}, a collective of "
                        f"{coll.nranks} ranks; give --ranks {coll.nranks} or leave it out")
    return coll


def _collective_from_file(path: str) -> Collective:
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        raise SpecError(f"no file {path!r}: give a standard collective's name or the path of "
                        "a JSON file written from Collective.to_json") from None
    except OSError as exc:
        raise SpecError(f"cannot read {path!r}: {exc.strerror}") from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SpecError(f"{path} is not JSON ({exc.msg} at line {exc.lineno}); write it with "
                        "json.dump(collective.to_json(), file)") from None
    if not isinstance(obj, dict) or not {"input", "output", "op"} <= set(obj):
        raise SpecError(f"{path} is not a collective written from Collective.to_json: it needs "
                        "the keys 'input', 'output' and 'op'")
    try:
        return Collective.from_json(obj)
    except SpecError as exc:
        raise SpecError(f"{path}: {exc}") from None
    except (TypeError, ValueError, KeyError) as exc:
        raise SpecError(f"{path} does not hold a valid collective: {exc}") from None


def _collective_from_attribute(text: str, ranks: int | None) -> Collective:
    import importlib
    import importlib.util

    module_name, _, attribute = text.rpartition(":")
    if not module_name or not attribute:
        raise SpecError(f"cannot read {text!r}: write module:attribute, e.g. mymodule:qkv")
    try:
        if module_name.endswith(".py"):
            if not os.path.isfile(module_name):
                raise SpecError(f"no file {module_name!r} (named in {text!r})")
            spec = importlib.util.spec_from_file_location(Path(module_name).stem, module_name)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        else:
            if os.getcwd() not in sys.path and "" not in sys.path:
                sys.path.insert(0, os.getcwd())  # as `python -m` would: modules beside you
            module = importlib.import_module(module_name)
    except SpecError:
        raise
    except ImportError as exc:
        raise SpecError(f"cannot import {module_name!r} (named in {text!r}): {exc}; is it on "
                        "PYTHONPATH or in this folder?") from None
    except Exception as exc:
        raise SpecError(f"importing {module_name!r} raised {type(exc).__name__}: {exc}") from None
    if not hasattr(module, attribute):
        raise SpecError(f"module {module_name!r} has no attribute {attribute!r}")
    obj, what = getattr(module, attribute), f"{text} is"
    if not isinstance(obj, Collective) and callable(obj):
        if ranks is None:
            raise SpecError(f"{text} is a function of the rank count: give --ranks N")
        try:
            obj = obj(ranks)
        except PurlinError:
            raise
        except Exception as exc:
            raise SpecError(f"{text}({ranks}) raised {type(exc).__name__}: {exc}") from None
        what = f"{text}({ranks}) returned"
    if not isinstance(obj, Collective):
        raise SpecError(f"{what} a {type(obj).__name__}, not a Collective (or a function "
                        "of the rank count returning one)")
    return obj


def collective_from(args: argparse.Namespace) -> Collective:
    """Build the collective that COLLECTIVE_ARGS name, refusing options it does not take."""
    return resolve_collective(args.collective, args.ranks, root=args.root, op=args.op)


def output_path(path) -> Path:
    """``path`` ready to write: its folder created (and said so) when missing."""
    path = Path(path)
    if path.is_dir():
        raise SpecError(f"{path} is a folder; give a file name, e.g. {path / 'timeline.html'}")
    folder = path.parent
    if not folder.exists():
        folder.mkdir(parents=True)
        print(f"purlin: created folder {folder}")
    return path


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


@command("demo",
         arg("--out", default=str(OUTPUTS), metavar="DIR",
             help="where to write demo-timeline.html and demo-tour.ipynb (default outputs/)"),
         arg("--gpu", action="store_true",
             help="run on the GPUs if there are any (default: the cpu datapath)"),
         arg("--timeout", type=int, default=120, metavar="S",
             help="seconds a notebook cell may take (default 120)"))
def demo(args: argparse.Namespace) -> int:
    """Run the tour notebook headless and write its timelines as a standalone HTML page."""
    from purlin.notebooks import demo as run_tour

    run_tour(args.out, cpu_only=not args.gpu, timeout=args.timeout)
    return 0


PLAN_ARGS = COLLECTIVE_ARGS + (
    arg("-s", "--strategy", default="direct-push",
        help="direct-push, direct-pull, two-phase, ring or auto (default direct-push)"),
    arg("-b", "--bytes", default="64KiB", metavar="SIZE",
        help="message size: the largest per-rank buffer, e.g. 4096, 64KiB, 1MiB (default 64KiB)"),
    arg("--dtype", default="float32", help="element type (default float32)"),
    arg("--chunks", type=int, default=1, help="pieces per transfer (default 1)"),
    arg("--lanes", type=int, default=1, help="parallel lanes per rank (default 1)"),
    arg("--lanes-by", default="piece", choices=LANES_BY,
        help="piece: a piece keeps one lane; stage: a hop at depth d runs in lane d %% lanes "
             "(default piece)"),
)

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2,
          "mib": 1024**2, "g": 1000**3, "gb": 1000**3, "gib": 1024**3}


def parse_size(text: str) -> int:
    """Bytes from text such as ``4096``, ``64KiB``, ``1MiB`` or ``2GB``.

    >>> parse_size("64KiB"), parse_size("1MiB"), parse_size("512")
    (65536, 1048576, 512)
    """
    raw = text.strip().lower().replace(" ", "")
    digits = raw.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = raw[len(digits):]
    if not digits or unit not in _UNITS:
        raise SpecError(f"cannot read size {text!r}; use bytes or a unit: KiB, MiB, GiB, KB, MB")
    try:
        value = float(digits) * _UNITS[unit]
    except ValueError:
        raise SpecError(f"cannot read size {text!r}") from None
    if value != int(value) or value < 0:
        raise SpecError(f"size {text!r} is not a whole, non-negative number of bytes")
    return int(value)


def plan_from(args: argparse.Namespace):
    from purlin.runtime.auto import choose
    from purlin.runtime.cluster import Cluster
    from purlin.snac import plan

    coll = collective_from(args)
    nbytes = parse_size(args.bytes)  # split as evenly as it goes into the collective's chunks
    strategy, chunks, lanes = args.strategy, args.chunks, args.lanes
    if strategy == "auto":
        strategy, chunks, lanes = choose(coll, Cluster.cpu(coll.nranks), nbytes=nbytes,
                                         dtype=args.dtype)
    return plan(coll, strategy, nbytes=nbytes, dtype=args.dtype, chunks=chunks, lanes=lanes,
                lanes_by=args.lanes_by, check=False)


@command("plan", *PLAN_ARGS,
         arg("--json", action="store_true", help="print the schedule as JSON"),
         arg("--ir", action="store_true",
             help="print the exact program (buffers, offsets, flags) instead of the summary"),
         arg("--rank", type=int, action="append", help="show only this rank (repeatable)"))
def plan_command(args: argparse.Namespace) -> int:
    """Plan a collective, print its per-rank schedule and the verification report."""
    from purlin.snac import verify

    schedule = plan_from(args)
    report = verify(schedule)
    if args.json:
        print(json.dumps({"schedule": schedule.to_json(), "verified": report.ok,
                          "problems": report.errors + [r.message for r in report.races]}))
        return 0 if report.ok else 1
    for r in args.rank or ():
        if not 0 <= r < schedule.nranks:
            raise SpecError(f"--rank {r} is outside the ranks 0..{schedule.nranks - 1}")
    print(schedule.render(args.rank) if args.ir else schedule_summary(schedule, args.rank))
    summary = schedule.summary()
    steps = ", ".join(f"{count} {kind.capitalize()}" for kind, count in summary["steps"].items())
    print(f"in all: {steps}; {summary['remote_hops']} remote hops, "
          f"{_bytes(summary['total_link_bytes'])} over links")
    print(fused_line(schedule))
    print(report)
    return 0 if report.ok else 1


def _bytes(n: int) -> str:
    """``1536`` -> ``1.5 KiB``."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.4g} {unit}"
    return f"{n} B"


def schedule_summary(schedule, ranks=None) -> str:
    """Per rank, its steps in order: Stage / Notify / Consume, the peer, the chunk names and
    the bytes each moves (``purlin plan``; ``--ir`` prints the exact program instead)."""
    from purlin.snac.ir import Consume, Notify, Stage
    from purlin.spec.collective import _fmt
    from purlin.spec.dtypes import dtype as as_dtype

    item = as_dtype(schedule.dtype).itemsize
    sizing = schedule.sizing
    counts = sorted({c for _, c in sizing.chunks})
    each = (f"{_bytes(counts[0] * item)} each" if len(counts) == 1 else
            " or ".join(f"{c * item} B" for c in counts))
    lines = [schedule.title(),
             f"message {_bytes(sizing.message_bytes)}: {len(sizing.chunks)} chunks of {each}"]
    lanes = schedule.lanes > 1

    def names(step) -> str:
        shown = ", ".join(_fmt(n) for n in step.names[:6]) + (" ..." if len(step.names) > 6
                                                              else "")
        return f"chunk{'s' if len(step.names) > 1 else ''} {shown}" if step.names else ""

    def move(step) -> str:
        nbytes = step.dst.count * item
        peers = sorted({r.rank for r in step.srcs if r.rank != step.rank})
        where = (f"to rank {step.dst.rank}" if step.dst.rank != step.rank else
                 f"from rank {', '.join(map(str, peers))}" if peers else "local")
        what = names(step)
        return f"{step.op} {what + ' ' if what else ''}{_bytes(nbytes)} {where}".rstrip()

    for rank in ranks if ranks is not None else range(schedule.nranks):
        steps = schedule.steps[rank]
        scratch = schedule.scratch[rank] * item * schedule.scratch_copies
        lines.append(f"\nrank {rank}: {len(steps)} steps, scratch {_bytes(scratch)}")
        for i, s in enumerate(steps):
            lane = f"lane {s.lane}  " if lanes else ""
            if isinstance(s, Stage):
                text = f"Stage    {move(s)}"
            elif isinstance(s, Notify):
                text = f"Notify   rank {s.flag.owner} (its flag from here reaches {s.value})"
            else:
                assert isinstance(s, Consume)
                waits = "; ".join(
                    f"rank {w.flag.src}{f' lane {w.flag.lane}' if lanes else ''} >= {w.value}"
                    + ("" if w.call == 0 else f" (call {w.call:+d})") for w in s.waits)
                text = f"Consume  wait for {waits}" if waits else "Consume"
                if s.moves_data:
                    text += f"; then {move(s)}"
            lines.append(f"  {i:3d}  {lane}{text}")
    return "\n".join(lines)


def fused_line(schedule) -> str:
    """Whether the sm datapath's fused kernel can run ``schedule`` (protocols "fused" and
    "fused-ll"), or why not."""
    from purlin.atom.fused import fused_problems

    parts = [f"{p}: " + ("yes" if why is None else f"no ({why})")
             for p, why in fused_problems(schedule).items()]
    return "fused kernel (sm): " + "; ".join(parts)


@command("run", *PLAN_ARGS,
         arg("--datapath", choices=("cpu", "sm"), default="cpu",
             help="cpu (numpy, default) or sm (GPUs)"),
         arg("--calls", type=int, default=3, help="back-to-back calls to run (default 3)"),
         arg("--seed", type=int, default=0, help="random seed of the inputs"))
def run_command(args: argparse.Namespace) -> int:
    """Plan, verify and run a collective; check every call against the reference."""
    import time

    import numpy as np

    from purlin.spec.reference import reference

    schedule = plan_from(args)
    from purlin.snac import verify

    verify(schedule, raise_on_error=True)
    from purlin.bench.clusters import choose, describe

    n = schedule.nranks
    cluster = choose(n, args.datapath)
    bound = cluster.bind(schedule.collective, schedule.strategy, sizing=schedule.sizing,
                         chunks=schedule.chunks, lanes=schedule.lanes,
                         lanes_by=schedule.lanes_by)
    sizing = schedule.sizing
    rng = np.random.default_rng(args.seed)
    print(f"{schedule.title()} on the {describe(cluster)}")
    worst = 0.0
    for call in range(args.calls):
        inputs = [_random_input(rng, sizing.input_count(r), schedule.dtype) for r in range(n)]
        t0 = time.perf_counter()
        outputs = bound(inputs)
        took = time.perf_counter() - t0
        expect = reference(sizing, [x.astype(np.float64) for x in inputs])
        err = max((float(np.max(np.abs(np.asarray(_host(o), dtype=np.float64) - e)))
                   if len(e) else 0.0) for o, e in zip(outputs, expect))
        worst = max(worst, err)
        print(f"call {call}: {took * 1e3:8.2f} ms, max |error| vs reference {err:.3g}")
    tol = {"float16": 1e-2, "bfloat16": 5e-2}.get(schedule.dtype, 1e-6)
    ok = worst <= tol * max(1, n)
    print("result: " + ("matches the reference" if ok else f"WRONG (max error {worst:.3g})"))
    return 0 if ok else 1


@command("trace", *PLAN_ARGS,
         arg("--out", default=str(OUTPUTS / "timeline.html"), metavar="HTML",
             help="HTML file of the figure (default outputs/timeline.html)"),
         arg("--perfetto", metavar="JSON", help="also write a Chrome/Perfetto trace here"),
         arg("--profile", help="hardware profile of the prediction (default: H200; for "
                                "--measure on one GPU's virtual ranks, H200-virtual)"),
         arg("--measure", action="store_true",
             help="also run it (GPUs where present, else the cpu datapath) and draw the "
                  "measured timeline under the predicted one"),
         arg("--protocol", default="auto", choices=("auto", "simple", "ll", "fused", "fused-ll"),
             help="on GPUs, the sm protocol measured: auto (default) traces the fast path (the "
                  "fused kernel where it runs the plan, fused-ll up to 256 KiB), else the "
                  "interpreter"))
def trace_command(args: argparse.Namespace) -> int:
    """Draw the predicted (and optionally measured) SNAC timeline of a collective."""
    import numpy as np

    from purlin.bench.clusters import choose, describe
    from purlin.runtime.auto import VIRTUAL_PROFILE
    from purlin.snac import verify
    from purlin.trace import from_cpu, from_sm, predict, to_perfetto
    from purlin.trace.profiles import get_profile
    from purlin.viz import compare_figure, timeline_figure, to_html

    import plotly.graph_objects  # noqa: F401 - the figure needs it: say so before writing anything
    schedule = plan_from(args)
    verify(schedule, raise_on_error=True)
    out = output_path(args.out)
    perfetto = output_path(args.perfetto) if args.perfetto else None
    cluster = choose(schedule.nranks) if args.measure else None
    virtual = cluster is not None and cluster.kind == "virtual"
    profile = get_profile(args.profile or (VIRTUAL_PROFILE if virtual else "H200"))
    predicted = predict(schedule, profile, label=f"predicted (profile {profile.name})")
    shown, fig = predicted, None
    if args.measure:
        options = {} if cluster.kind == "cpu" else {"trace_rows": 256}
        if cluster.kind != "cpu" and args.protocol != "auto":
            options["protocol"] = args.protocol
        bound = cluster.bind(schedule.collective, schedule.strategy, sizing=schedule.sizing,
                             chunks=schedule.chunks, lanes=schedule.lanes,
                             lanes_by=schedule.lanes_by, **options)
        rng = np.random.default_rng(0)
        inputs = [_random_input(rng, schedule.sizing.input_count(r), schedule.dtype)
                  for r in range(schedule.nranks)]
        if cluster.kind == "cpu":
            bound(inputs, trace=True)
            shown = from_cpu(bound)
        else:
            from purlin.atom.sm import clock_pair
            from purlin.trace import measure_clocks

            for _ in range(WARM_CALLS):  # the traced call is the last: no first-call costs
                bound(inputs)
            # the GPUs' clocks drift by microseconds per second: align them right after
            clocks = measure_clocks(clock_pair, sorted(set(cluster.devices)))
            shown = from_sm(bound, clocks)
        where = describe(cluster)
        if getattr(bound, "kernel", None):  # which kernel the timeline is of
            where += f", {bound.kernel}"
        fig = compare_figure(predicted, shown, title=f"{schedule.title()}<br><sup>predicted: "
                             f"profile {profile.name}; measured: {where}</sup>")
        print(f"measured on the {where}: {shown.duration_ns / 1e3:.2f} µs")
    print(f"predicted by profile {profile.name} ({profile.source or 'no source'}): "
          f"{predicted.end_ns / 1e3:.2f} µs, launch included")
    if virtual and profile.topology != "gpu":
        print(f"note: profile {profile.name} models one GPU per rank over links; these "
              f"{cluster.nranks} virtual ranks share one GPU's memory, so the two need not "
              f"agree (--profile {VIRTUAL_PROFILE} models that, or a profile JSON fitted by "
              "purlin.trace.calibrate)")
    fig = fig or timeline_figure(predicted, title=f"{schedule.title()}<br><sup>predicted: "
                                                  f"profile {profile.name}</sup>")
    print(f"wrote {to_html(fig, out).resolve()}")
    if perfetto is not None:
        to_perfetto(shown, perfetto)
        print(f"wrote {perfetto.resolve()} (open in ui.perfetto.dev or chrome://tracing)")
    return 0


def _random_input(rng, count, dtype):
    import numpy as np

    if dtype.startswith("int"):
        return rng.integers(-100, 100, size=count).astype(dtype)
    host = "float32" if dtype == "bfloat16" else dtype
    return (rng.standard_normal(count) + 0.5).astype(host)


def _host(x):
    return x.float().cpu().numpy() if hasattr(x, "cpu") else x


def size_list(text: str | None) -> list[int] | None:
    """Sizes from ``8:1GiB`` (powers of two from 8 B to 1 GiB) or ``8,64KiB,1MiB``.

    >>> size_list("8:64"), size_list("1KiB,4096")
    ([8, 16, 32, 64], [1024, 4096])
    """
    if not text:
        return None
    from purlin.bench.sweep import powers_of_two

    if ":" in text:
        lo, hi = text.split(":", 1)
        return powers_of_two(parse_size(lo), parse_size(hi))
    return [parse_size(t) for t in text.split(",") if t.strip()]


BENCH_COMMON = (
    arg("-n", "--ranks", type=int, metavar="N", help="ranks (default: the visible GPUs)"),
    arg("-b", "--sizes", metavar="SIZES",
        help="8:1GiB (powers of two) or a list 8,64KiB,1MiB"),
    arg("--time-limit", type=float, metavar="S", help="stop starting new points after S s"),
    arg("--no-progress", action="store_true", help="no progress bar"),
)


@command("bench",
         arg("collectives", nargs="*", metavar="COLLECTIVE",
             help="standard collectives, or 'all' for the six nccl-tests ones "
                  "(default all-reduce)"),
         *BENCH_COMMON,
         arg("--dtype", help="dtypes, comma-separated (default bfloat16; cpu: float32)"),
         arg("-p", "--providers",
             help="comma-separated: purlin:auto, purlin:<strategy>[/cN/lN/bN], nccl, "
                  "symm-one-shot, symm-two-shot (default purlin:auto,nccl on GPUs)"),
         arg("--mode", choices=("graph", "eager"), default="graph",
             help="graph: device time per op over CUDA-graph replays (default); eager: "
                  "host-inclusive time per call"),
         arg("--datapath", choices=("sm", "cpu"),
             help="sm (GPUs; the default where there are some) or cpu (numpy: not GPU "
                  "numbers)"),
         arg("--predict", action="store_true", help="print the cost model's predicted table"),
         arg("--profile", default="H200-measured", help="cost model profile for --predict"),
         arg("--op", choices=REDUCE_OPS, help="reduction of reducing collectives (sum)"),
         arg("--ops", type=int, default=50, help="ops per graph / eager loop (default 50)"),
         arg("--repeats", type=int, default=20, help="timed repeats (default 20)"),
         arg("--tuning", metavar="PATH", help="tuning table for purlin:auto and strategies"),
         arg("--json", metavar="PATH", help="write the records as JSON"),
         arg("--html", metavar="PATH", help="write the figures as one HTML page"),
         arg("--load", metavar="PATH", help="show saved records (JSON) instead of running"))
def bench_command(args: argparse.Namespace) -> int:
    """Sweep collectives over sizes: Purlin vs NCCL, nccl-tests-style table, JSON, figures."""
    from purlin.bench import commands

    args.collectives = bench_collectives(args.collectives, args)
    return commands.bench(args, size_list(args.sizes))


def bench_collectives(texts, args: argparse.Namespace) -> list:
    """``purlin bench``'s collectives: standard names (and ``all``) as given, custom ones
    through :func:`resolve_collective`; a custom collective's rank count becomes ``--ranks``
    when none was given."""
    out = []
    for text in texts:
        if text.lower() == "all" or text.replace("_", "-").lower() in STANDARD:
            out.append(text)
            continue
        coll = resolve_collective(text, args.ranks)
        args.ranks = coll.nranks
        out.append(coll)
    return out


@command("tune",
         arg("collectives", nargs="*", metavar="COLLECTIVE",
             help="standard collectives or 'all' (default all six)"),
         *BENCH_COMMON,
         arg("--dtype", default="bfloat16", help="element type (default bfloat16)"),
         arg("--limit", type=int, default=8, help="candidates per strategy (default 8)"),
         arg("--threads", type=int, default=512, help="threads per block (default 512)"),
         arg("--out", metavar="PATH", help="tuning table to write (default: where "
                                            "strategy='auto' looks for this GPU)"),
         arg("--replace", action="store_true", help="overwrite the table instead of merging"),
         arg("--json", metavar="PATH", help="also write every timed candidate as JSON"),
         arg("--list", action="store_true", help="print the candidates only (no GPU needed)"),
         arg("--sms", type=int, default=132, help="SMs per GPU for --list (default 132)"))
def tune_command(args: argparse.Namespace) -> int:
    """Time candidate configurations on the GPUs and write the tuning table auto reads."""
    from purlin.bench import commands

    return commands.tune(args, size_list(args.sizes))


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
    """Run the ``purlin`` command; returns the exit status: 2 for a usage or Purlin error, each
    answered with one line (``PURLIN_DEBUG=1`` raises instead, with the traceback)."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # argparse has printed usage or help already
        return exc.code if isinstance(exc.code, int) else 2
    debug = os.environ.get("PURLIN_DEBUG", "") not in ("", "0")
    try:
        return args.run(args)
    except KeyboardInterrupt:
        print("purlin: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `purlin plan ... | head`: the reader has seen enough
        sys.stderr.close()
        return 0
    except Exception as exc:
        if debug:
            raise
        print(f"purlin: error: {error_line(exc)}", file=sys.stderr)
        return 2 if isinstance(exc, (PurlinError, OSError, ModuleNotFoundError)) else 1


def error_line(exc: BaseException) -> str:
    """One line for ``exc``: a PurlinError's message, an OSError's file and reason, anything
    else with its type and a pointer to ``PURLIN_DEBUG=1``."""
    if isinstance(exc, PurlinError):
        text = str(exc)
    elif isinstance(exc, OSError) and exc.filename is not None:
        text = f"cannot write or read {exc.filename}: {exc.strerror or exc}"
    elif isinstance(exc, ModuleNotFoundError) and exc.name:
        package = exc.name.partition(".")[0]
        text = (f"this command needs the {package} package, which is not installed: "
                f"pip install -e '.[notebook]' (or pip install {package})")
    else:
        text = (f"unexpected {type(exc).__name__}: {exc} (a bug: PURLIN_DEBUG=1 shows the "
                "traceback)")
    first, _, rest = text.strip().partition("\n")
    return first + (" (PURLIN_DEBUG=1 shows the rest)" if rest.strip() else "")


if __name__ == "__main__":
    sys.exit(main())
