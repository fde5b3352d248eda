"""Declared sweeps: collectives x sizes x dtypes x providers, every point checked and timed.

A :class:`Sweep` is data; :meth:`Sweep.run` returns :class:`Results` (records, a DataFrame, an
nccl-tests table, JSON, plotly figures). Providers, datapaths and timing: ARCHITECTURE.md,
"Benchmarks".

>>> sweep = Sweep(collectives=["all-gather"], sizes=[1024, 4096], dtypes=["float32"],
...               providers=["purlin:auto", "purlin:ring"], datapath="cpu", nranks=2)
>>> res = sweep.run(progress=False)
>>> [(r.provider, r.nbytes, r.mode, r.wrong) for r in res.records]  # doctest: +NORMALIZE_WHITESPACE
[('purlin:auto', 1024, 'cpu', 0), ('purlin:auto', 4096, 'cpu', 0),
 ('purlin:ring', 1024, 'cpu', 0), ('purlin:ring', 4096, 'cpu', 0)]
"""

from __future__ import annotations

import json
import math
import os
import platform
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from purlin.bench.metrics import MODE_NOTES, Record, Timing, nccl_table, vs_baseline
from purlin.errors import SpecError
from purlin.spec.collective import Collective

SIX = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "broadcast", "reduce")
BASELINES = ("nccl", "nccl-window", "symm-one-shot", "symm-two-shot")
SWEEP_DATAPATHS = ("sm", "cpu", "model")  # what a sweep measures or predicts on
MODES = ("graph", "eager")
KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


def powers_of_two(lo: int = 8, hi: int = GiB) -> list[int]:
    """Sizes ``lo, 2 lo, ... <= hi`` in bytes (``lo`` rounded up to a power of two).

    >>> powers_of_two(8, 64)
    [8, 16, 32, 64]
    """
    out, size = [], 1 << max(0, (max(lo, 1) - 1).bit_length())
    while size <= hi:
        out.append(size)
        size *= 2
    return out


# -- providers ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Provider:
    """Who runs a point: ``kind`` "purlin" (the sm datapath, with a strategy, or "auto", and
    optional fixed chunks/lanes/blocks per lane), "ce" (the same on the copy-engine datapath,
    reductions on SMs) or one of the baselines.

    >>> Provider.parse("purlin:ring/c4/l8/b2")
    Provider('purlin:ring/c4/l8/b2')
    >>> Provider.parse("ce:direct-push").name
    'ce:direct-push'
    >>> Provider.parse("purlin").name, Provider.parse("nccl").is_baseline
    ('purlin:auto', True)
    """

    kind: str
    strategy: str = "auto"
    chunks: int | None = None
    lanes: int | None = None
    blocks_per_lane: int | None = None
    lanes_by: str | None = None

    @classmethod
    def parse(cls, text) -> "Provider":
        if isinstance(text, Provider):
            return text
        raw = str(text).strip().lower()
        if raw in BASELINES:
            return cls(raw)
        if raw in ("purlin", "ce"):
            return cls(raw)
        kind, sep, rest = raw.partition(":")
        if kind not in ("purlin", "ce") or not sep:
            raise SpecError(f"unknown provider {text!r}: use purlin:auto, purlin:<strategy>"
                            f"[/cN/lN/bN], ce:<strategy> or one of {', '.join(BASELINES)}")
        strategy, *opts = rest.split("/")
        fixed = {}
        for opt in opts:
            if opt == "stage":
                fixed["lanes_by"] = "stage"
                continue
            key = {"c": "chunks", "l": "lanes", "b": "blocks_per_lane"}.get(opt[:1])
            if key is None or not opt[1:].isdigit() or int(opt[1:]) < 1:
                raise SpecError(f"provider {text!r}: options are /cN (chunks), /lN (lanes), "
                                f"/bN (blocks per lane) with N >= 1 and /stage (lanes by "
                                f"stage), got {opt!r}")
            fixed[key] = int(opt[1:])
        if strategy != "auto":
            from purlin.snac.strategies import STRATEGIES

            if strategy not in STRATEGIES:
                raise SpecError(f"provider {text!r}: unknown strategy {strategy!r}; "
                                f"registered: auto, {', '.join(STRATEGIES)}")
        return cls(kind, strategy, **fixed)

    @property
    def is_baseline(self) -> bool:
        return self.kind in BASELINES

    @property
    def name(self) -> str:
        if self.is_baseline:
            return self.kind
        opts = "".join(f"/{k}{v}" for k, v in (("c", self.chunks), ("l", self.lanes),
                                                ("b", self.blocks_per_lane)) if v)
        opts += "/stage" if self.lanes_by == "stage" else ""
        return f"{self.kind}:{self.strategy}{opts}"

    def __repr__(self) -> str:
        return f"Provider({self.name!r})"

    def skip_reason(self, collective: Collective, datapath: str,
                    gpus: int | None = None) -> str | None:
        """Why this provider cannot run ``collective`` here (None: it can); ``gpus``: the
        distinct GPUs the sweep has (None: not checked)."""
        if self.is_baseline:
            if datapath != "sm":
                return f"{self.kind} needs GPUs (datapath {datapath})"
            if gpus is not None:
                from purlin.bench.clusters import baseline_reason

                why = baseline_reason(self.kind, collective.nranks, gpus)
                if why:
                    return why
            if self.kind in ("nccl", "nccl-window") and collective.name not in SIX:
                return f"nccl runs the six standard collectives, not {collective.name}"
            if self.kind.startswith("symm") and (collective.name != "all-reduce"
                                                 or collective.op.reduce_op != "sum"):
                return f"{self.kind} is an all-reduce (sum) only"
            return None
        if self.kind == "ce" and datapath != "sm":
            return f"the ce datapath needs GPUs (datapath {datapath})"
        if self.strategy == "two-phase" and not collective.op.is_reduce:
            return f"two-phase reduces; {collective.name} copies"
        return None


# -- progress ----------------------------------------------------------------------------------
class Progress:
    """tqdm when installed, else a counter on stderr; silent when disabled."""

    def __init__(self, total: int, enabled: bool = True, desc: str = "purlin bench"):
        self.total, self.done, self.enabled, self.bar = total, 0, enabled and total > 0, None
        self.desc, self.t0 = desc, time.monotonic()
        if self.enabled:
            try:
                from tqdm.auto import tqdm

                self.bar = tqdm(total=total, desc=desc, file=sys.stderr, leave=False)
            except ImportError:
                pass

    def update(self, k: int = 1, label: str = "") -> None:
        self.done += k
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.update(k)
            if label:
                self.bar.set_postfix_str(label, refresh=False)
            return
        took = time.monotonic() - self.t0
        print(f"\r{self.desc}: {self.done}/{self.total} points, {took:.0f} s  {label[:50]:<50}",
              end="", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.enabled:
            print(file=sys.stderr)


# -- the sweep ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Point:
    collective: Collective
    nbytes: int
    dtype: str
    provider: Provider
    mode: str


@dataclass
class Sweep:
    """Collectives (standard names or :class:`Collective` objects) x sizes (bytes of the
    largest per-rank buffer, as nccl-tests) x dtypes x providers, in one mode on one datapath.

    ``nranks`` defaults to the visible GPUs (or 2); ``cluster`` to ``Cluster.best(nranks)``
    on ``"sm"`` (virtual ranks where there are fewer GPUs than ranks); ``table`` is a tuning table (path or
    TuningTable) for the Purlin configurations; ``time_limit`` (seconds) skips the Purlin
    points still to run when it is reached (baselines run first, then providers in order)."""

    collectives: Sequence = ("all-reduce",)
    sizes: Sequence[int] = field(default_factory=lambda: powers_of_two(8, GiB))
    dtypes: Sequence[str] = ("bfloat16",)
    providers: Sequence = ("purlin:auto", "nccl")
    mode: str = "graph"
    nranks: int | None = None
    datapath: str = "sm"
    op: str = "sum"
    ops: int = 50
    repeats: int = 20
    profile: str = "H200-measured"
    table: object = None
    time_limit: float | None = None
    cluster: object = None

    def __post_init__(self):
        if self.datapath not in SWEEP_DATAPATHS:
            raise SpecError(f"datapath must be one of {', '.join(SWEEP_DATAPATHS)}, got "
                            f"{self.datapath!r}")
        if self.mode not in MODES:
            raise SpecError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if isinstance(self.collectives, (str, Collective)):
            self.collectives = [self.collectives]
        if isinstance(self.dtypes, str):
            self.dtypes = [self.dtypes]
        from purlin.spec.dtypes import dtype

        self.dtypes = [dtype(d).name for d in self.dtypes]
        if isinstance(self.providers, (str, Provider)):
            self.providers = [self.providers]
        self.providers = [Provider.parse(p) for p in self.providers]

    # -- what runs ---------------------------------------------------------------------------
    def ranks(self) -> int:
        if self.nranks is not None:
            return self.nranks
        if self.cluster is not None:
            return self.cluster.nranks
        from purlin.atom.sm import device_count

        return max(2, device_count()) if self.datapath == "sm" else 2

    def gpus(self) -> int:
        """The distinct GPUs the ranks run on (what the baselines need one per rank of)."""
        if self.cluster is not None:
            return len(set(self.cluster.devices))
        from purlin.bench.clusters import gpu_count

        return min(gpu_count(), self.ranks())

    def built(self) -> list[Collective]:
        from purlin.spec.collectives import REDUCING, standard

        n, out = self.ranks(), []
        for c in self.collectives:
            if isinstance(c, Collective):
                if c.nranks != n:
                    raise SpecError(f"{c.name} is declared for {c.nranks} ranks; the sweep "
                                    f"runs {n}")
                out.append(c)
            else:
                key = str(c).replace("_", "-").lower()
                out.append(standard(key, n, op=self.op) if key in REDUCING else standard(key, n))
        return out

    def points(self) -> tuple[list[Point], list[str]]:
        """The points to run (baselines first, then each Purlin provider in turn) and the
        reasons for what is left out."""
        from purlin.spec.sizing import fit_nbytes

        mode = {"sm": self.mode, "cpu": "cpu", "model": "model"}[self.datapath]
        points, skipped = [], []
        gpus = self.gpus() if self.datapath == "sm" else None
        ordered = ([p for p in self.providers if p.is_baseline]
                   + [p for p in self.providers if not p.is_baseline])
        for provider in ordered:
            for coll in self.built():
                why = provider.skip_reason(coll, self.datapath, gpus)
                if why:
                    skipped.append(f"{provider.name} {coll.name}: {why}")
                    continue
                for dt in self.dtypes:
                    if self.datapath == "cpu" and dt == "bfloat16":
                        skipped.append(f"{provider.name} {coll.name} {dt}: the cpu datapath "
                                       "has no bfloat16 (numpy); use float32 or float16")
                        continue
                    seen = set()
                    for size in self.sizes:
                        nbytes = fit_nbytes(coll, int(size), dt)
                        if nbytes not in seen:
                            seen.add(nbytes)
                            points.append(Point(coll, nbytes, dt, provider, mode))
        return points, skipped

    # -- running -----------------------------------------------------------------------------
    def run(self, progress: bool = True, checkpoint=None) -> "Results":
        """Run every point; a point that fails becomes a record with ``extra["error"]``.
        ``checkpoint``: a JSON path rewritten after every Purlin point with the records so far,
        so a point that never returns (a stuck GPU) loses only itself."""
        points, skipped = self.points()
        info = environment(self.datapath, self.ranks())
        info.update(mode=self.mode if self.datapath == "sm" else self.datapath,
                    profile=self.profile if self.datapath == "model" else None)
        bar = Progress(len(points), progress)
        t0 = time.monotonic()
        records: list[Record] = []
        try:
            base = [p for p in points if p.provider.is_baseline]
            if base:
                try:
                    records += self._baselines(base, bar)
                except Exception as exc:  # the Purlin points still run; say why in one line
                    lines = str(exc).strip().splitlines() or [type(exc).__name__]
                    names = ", ".join(sorted({p.provider.name for p in base}))
                    skipped.append(f"{names}: the baseline processes failed: "
                                   f"{lines[-1].strip()[:300]}")
                    bar.update(len(base))
            cluster = self._cluster() if any(not p.provider.is_baseline for p in points) \
                else None
            info["cluster"] = self.where(cluster)
            late = 0
            for p in points:
                if p.provider.is_baseline:
                    continue
                if self.time_limit is not None and time.monotonic() - t0 > self.time_limit:
                    late += 1
                    bar.update(1)
                    continue
                if checkpoint is not None:
                    _checkpoint(checkpoint, records, info, skipped, f"{p.provider.name} "
                                f"{p.collective.name} {p.nbytes} B {p.dtype} {p.mode}")
                records.append(self._purlin(cluster, p))
                bar.update(1, f"{p.provider.name} {p.collective.name} {p.nbytes} B")
            if late:
                skipped.append(f"{late} Purlin point(s) not run: the time limit of "
                               f"{self.time_limit:.0f} s was reached")
        finally:
            bar.close()
        info["seconds"] = round(time.monotonic() - t0, 1)
        if checkpoint is not None:
            _checkpoint(checkpoint, records, info, skipped, None)
        return Results(records, info, skipped)

    def _cluster(self):
        if self.cluster is not None or self.datapath != "sm":
            return self.cluster
        from purlin.bench.clusters import choose

        self.cluster = choose(self.ranks())
        return self.cluster

    def where(self, cluster=None) -> str:
        """Where the Purlin points run, in words (``purlin.bench.clusters.describe``)."""
        from purlin.bench.clusters import describe

        if self.datapath == "model":
            return f"cost model (profile {self.profile}), {self.ranks()} ranks: nothing runs"
        if self.datapath == "cpu":
            from purlin.runtime.cluster import Cluster

            return describe(Cluster.cpu(self.ranks()))
        cluster = cluster or self.cluster
        return describe(cluster) if cluster is not None else f"{self.ranks()} GPU ranks"

    def configure(self, cluster, point: Point):
        """The Purlin configuration of a point: fixed options win, then the tuning table,
        then the model (GPUs and ``model``) or the rules (cpu)."""
        from purlin.runtime.auto import Choice, select

        pr = point.provider
        strategy = None if pr.strategy == "auto" else pr.strategy
        if pr.kind == "ce":
            # the sm tuning table says nothing about copy engines; their measured best
            # (2 x H200): one lane, whole pieces, pulls for copies and two-phase (reductions
            # on sm) for reductions; given chunks or lanes win
            given = bool(pr.chunks or pr.lanes or pr.lanes_by)
            return Choice(strategy or ("two-phase" if point.collective.op.is_reduce
                                       else "direct-pull"), pr.chunks or 1, pr.lanes or 1,
                          pr.blocks_per_lane, "given" if given else "ce default",
                          lanes_by=pr.lanes_by or "piece")
        choice = select(point.collective, cluster, nbytes=point.nbytes, dtype=point.dtype,
                        strategy=strategy, table=self.table,
                        model=True if self.datapath == "model" else None)
        given = bool(pr.chunks or pr.lanes or pr.blocks_per_lane or pr.lanes_by)
        # the table's LL and PDL belong to its configuration: a given one runs without them
        return Choice(choice.strategy, pr.chunks or choice.chunks, pr.lanes or choice.lanes,
                      pr.blocks_per_lane or choice.blocks_per_lane,
                      choice.source if not given else "given",
                      "simple" if given else choice.protocol, choice.pdl and not given,
                      pr.lanes_by or choice.lanes_by)

    def _purlin(self, cluster, p: Point) -> Record:
        from purlin.bench import providers

        try:
            c = self.configure(cluster, p)
            if p.provider.kind == "ce":
                from purlin.bench.ce import time_ce

                rec = time_ce(cluster, p.collective, p.nbytes, p.dtype, c.strategy, c.chunks,
                              c.lanes, c.blocks_per_lane, mode=p.mode, ops=self.ops,
                              repeats=self.repeats, provider=p.provider.name,
                              lanes_by=c.lanes_by)
            elif self.datapath == "sm":
                rec = providers.time_purlin(cluster, p.collective, p.nbytes, p.dtype,
                                            c.strategy, c.chunks, c.lanes, c.blocks_per_lane,
                                            mode=p.mode, ops=self.ops, repeats=self.repeats,
                                            provider=p.provider.name, protocol=c.protocol,
                                            pdl=c.pdl, lanes_by=c.lanes_by,
                                            fallback=c.source != "given")
            elif self.datapath == "cpu":
                rec = providers.time_purlin_cpu(p.collective, p.nbytes, p.dtype, c.strategy,
                                                c.chunks, c.lanes,
                                                calls=min(self.ops, 10),
                                                repeats=min(self.repeats, 5),
                                                provider=p.provider.name,
                                                lanes_by=c.lanes_by)
            else:
                rec = providers.predict_purlin(p.collective, p.nbytes, p.dtype, c.strategy,
                                               c.chunks, c.lanes, c.blocks_per_lane,
                                               profile=self.profile, provider=p.provider.name,
                                               lanes_by=c.lanes_by)
            rec.extra["source"] = c.source
            return rec
        except Exception as exc:  # one failed point must not lose the sweep
            coll = p.collective
            nan = Timing(float("nan"), float("nan"), float("nan"), 0)
            return Record.make(p.provider.name, coll.name, coll.nranks, p.nbytes, 0, p.dtype,
                               coll.op.reduce_op or "none", p.mode, nan, -1,
                               error=f"{type(exc).__name__}: {exc}",
                               traceback=traceback.format_exc(limit=4))

    def _baselines(self, points: list[Point], bar: Progress) -> list[Record]:
        from purlin.bench.torch_dist import run_baselines

        try:
            import torch

            torch.cuda.empty_cache()
        except Exception:
            pass
        plain = [(p.provider.kind, p.collective.name, p.nbytes, p.dtype,
                  p.collective.op.reduce_op or "none", p.mode) for p in points]
        return run_baselines(plain, world=self.ranks(), ops=self.ops, repeats=self.repeats,
                             progress=lambda k: bar.update(k, "baselines"))


def _checkpoint(path, records, info, skipped, running) -> None:
    """Write the records so far (atomically: a reader never sees half a file); ``running``
    names the point under way, None once the sweep has finished."""
    path = Path(path)
    part = Results(list(records), {**info, "running": running} if running else dict(info),
                   list(skipped))
    tmp = path.with_name(path.name + ".tmp")
    part.to_json(tmp)
    tmp.replace(path)


# -- results -----------------------------------------------------------------------------------
@dataclass
class Results:
    """Records of a sweep with the environment they were taken in."""

    records: list[Record]
    info: dict = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)

    def __add__(self, other: "Results") -> "Results":
        return Results(self.records + other.records, {**other.info, **self.info},
                       self.skipped + other.skipped)

    def __len__(self) -> int:
        return len(self.records)

    def __repr__(self) -> str:
        provs = sorted({r.provider for r in self.records})
        return (f"<Results: {len(self.records)} records, providers {', '.join(provs)}; "
                f"{self.info.get('hardware', '?')}>")

    @property
    def wrong(self) -> int:
        """Wrong elements over every checked record."""
        return sum(r.wrong for r in self.records if r.wrong > 0)

    @property
    def errors(self) -> list[Record]:
        return [r for r in self.records if "error" in r.extra]

    # -- data --------------------------------------------------------------------------------
    def to_dataframe(self):
        """One row per record; Purlin's configuration (strategy, chunks, ...) as columns."""
        import pandas as pd

        rows = []
        for r in self.records:
            d = r.to_dict()
            extra = d.pop("extra")
            d.update({k: v for k, v in extra.items() if k != "traceback"})
            rows.append(d)
        return pd.DataFrame(rows)

    def to_json(self, path=None) -> dict:
        """``{"info": {...}, "records": [...], "skipped": [...]}``; written to ``path`` if
        given. NaN times are written as null."""
        obj = {"info": self.info, "records": [_clean(r.to_dict()) for r in self.records],
               "skipped": self.skipped}
        if path is not None:
            Path(path).write_text(json.dumps(obj, indent=1) + "\n")
        return obj

    @classmethod
    def from_json(cls, obj) -> "Results":
        recs = [Record.from_dict({k: (float("nan") if v is None and k.endswith(("_us", "_gbs"))
                                      else v) for k, v in d.items()})
                for d in obj.get("records", [])]
        return cls(recs, obj.get("info", {}), obj.get("skipped", []))

    @classmethod
    def load(cls, path) -> "Results":
        obj = json.loads(Path(path).read_text())
        if not _is_sweep(obj):
            raise SpecError(f"{path} holds no sweep (a JSON object with a 'records' list, as "
                            "Results.to_json writes); another benchmark's JSON? Results."
                            "sweeps_in(folder) lists which files of a folder are sweeps")
        return cls.from_json(obj)

    @classmethod
    def sweeps_in(cls, folder) -> list[tuple[Path, "Results | None"]]:
        """(path, its Results) of every ``*.json`` in ``folder``, in name order; None for a
        file that holds another benchmark's JSON (docs/results keeps both)."""
        out = []
        for path in sorted(Path(folder).glob("*.json")):
            obj = json.loads(path.read_text())
            out.append((path, cls.from_json(obj) if _is_sweep(obj) else None))
        return out

    # -- views -------------------------------------------------------------------------------
    def table(self, file=None) -> str:
        """The nccl-tests-style table, with a banner saying what kind of numbers these are."""
        head = [f"# {self.info.get('hardware', '')}  torch {self.info.get('torch', '?')}  "
                f"nccl {self.info.get('nccl') or '-'}  commit {str(self.info.get('commit'))[:12]}"]
        for mode in sorted({r.mode for r in self.records}):
            if mode in ("cpu", "model"):
                extra = (f" (profile {self.info.get('profile')})" if mode == "model" else "")
                head.append(f"# NOTE: {MODE_NOTES[mode]}{extra}")
        if self.info.get("cluster"):
            head.append(f"# cluster: {self.info['cluster']}")
        text = "\n".join(head + ["#", nccl_table(self.records)])
        if self.skipped:
            text += "\n#\n" + "\n".join(f"# skipped: {s}" for s in self.skipped)
        if file is not None:
            print(text, file=file)
        return text

    def summary(self, baseline: str = "nccl", small: int = 64 * KiB, large: int = 64 * MiB,
                file=None) -> str:
        """Per collective and provider: the geometric mean of ``baseline time / provider time``
        over sizes <= ``small`` and >= ``large`` (> 1: faster than the baseline); "purlin
        (best)" takes the fastest Purlin provider at every size."""
        rows = vs_baseline(self.records, baseline)
        best: dict = {}
        for row in rows:
            if row["provider"].startswith(("purlin", "ce:")):
                key = (row["collective"], row["dtype"], row["mode"], row["nbytes"])
                if key not in best or row["ratio"] > best[key]["ratio"]:
                    best[key] = {**row, "provider": "purlin (best)"}
        rows += list(best.values())
        groups: dict = {}
        for row in rows:
            k = (row["collective"], row["dtype"], row["mode"], row["provider"])
            groups.setdefault(k, []).append(row)
        lines = [f"# speed vs {baseline}: {baseline} time / provider time, geometric mean "
                 f"(> 1: faster than {baseline})",
                 f"{'collective':<15} {'dtype':<9} {'mode':<6} {'provider':<28} "
                 f"{'<=' + _size(small):>10} {'>=' + _size(large):>10}"]
        for (coll, dt, mode, prov), rs in sorted(groups.items()):
            lo = _gmean([r["ratio"] for r in rs if r["nbytes"] <= small])
            hi = _gmean([r["ratio"] for r in rs if r["nbytes"] >= large])
            lines.append(f"{coll:<15} {dt:<9} {mode:<6} {prov:<28} {lo:>10} {hi:>10}")
        if len(lines) == 2:
            lines.append(f"(no {baseline} points to compare with)")
        text = "\n".join(lines)
        if file is not None:
            print(text, file=file)
        return text

    def best(self, baseline: str = "nccl", file=None) -> str:
        """Per collective and size: the fastest correct Purlin record of the graph mode, its
        configuration, and ``baseline`` beside it (ratio > 1: Purlin faster)."""
        from purlin.bench.tune import launch_suffix

        by: dict = {}
        for r in self.records:
            if r.mode != "graph" or not r.ok:
                continue
            slot = by.setdefault((r.collective, r.nbytes, r.dtype), {})
            if r.provider == baseline:
                slot["base"] = r
            elif r.provider.startswith(("purlin", "ce:")) and r.wrong == 0:
                if "best" not in slot or r.time_us < slot["best"].time_us:
                    slot["best"] = r
        lines = [f"{'collective':<15} {'size':>11} {'purlin best':<34} {'us':>9} "
                 f"{baseline + ' us':>9} {'ratio':>6}"]
        for (coll, nbytes, _), slot in sorted(by.items()):
            if "best" not in slot:
                continue
            b, e = slot["best"], slot["best"].extra
            cfg = (f"{b.provider.split(':')[0]}={e.get('strategy')} c{e.get('chunks')} "
                   f"l{e.get('lanes')} b{e.get('blocks_per_lane')}"
                   f"{launch_suffix(e.get('protocol', 'simple'), e.get('pdl'))}")
            base = slot["base"].time_us if "base" in slot else float("nan")
            lines.append(f"{coll:<15} {nbytes:>11} {cfg:<34} {b.time_us:9.2f} {base:9.2f} "
                         f"{base / b.time_us:6.2f}")
        text = "\n".join(lines)
        if file is not None:
            print(text, file=file)
        return text

    def figures(self, baseline: str = "nccl") -> dict:
        """``{"latency", "busbw", "speedup"}`` plotly figures (see :mod:`purlin.bench.figures`)."""
        from purlin.bench.figures import figures

        return figures(self.records, baseline=baseline, title=_title(self.info))

    def write_html(self, path, baseline: str = "nccl", plotlyjs=True) -> Path:
        """All figures in one HTML file (self-contained; ``plotlyjs="cdn"``: small)."""
        from purlin.bench.figures import write_html

        return write_html(self.figures(baseline), path, title=_title(self.info),
                          plotlyjs=plotlyjs)


def _title(info: dict) -> str:
    mode = info.get("mode", "")
    note = " (cpu datapath: not GPU numbers)" if mode == "cpu" else (
        " (cost model prediction)" if mode == "model" else "")
    return f"{info.get('hardware', '')}, {info.get('nranks', '?')} ranks{note}"


def _gmean(values) -> str:
    values = [v for v in values if v > 0 and v == v]
    if not values:
        return "-"
    return f"{math.exp(sum(map(math.log, values)) / len(values)):.2f}x"


def _size(n: int) -> str:
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return f"{n}B"


def _clean(obj):
    if isinstance(obj, float) and obj != obj:
        return None
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return obj


# -- environment -------------------------------------------------------------------------------
def environment(datapath: str = "sm", nranks: int | None = None) -> dict:
    """Date, hardware, software versions and the git commit, for the JSON's ``info``."""
    from purlin import __version__

    info = {"date": time.strftime("%Y-%m-%d %H:%M:%S %z"), "host": platform.node(),
            "datapath": datapath, "nranks": nranks, "purlin": __version__,
            "python": platform.python_version(), "commit": commit(), "torch": None,
            "nccl": None}
    try:
        import torch

        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            info["gpus"] = [torch.cuda.get_device_name(d)
                            for d in range(torch.cuda.device_count())]
            info["cuda"] = torch.version.cuda
            info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception:
        pass
    if datapath == "sm" and info.get("gpus"):
        names = info["gpus"]
        info["hardware"] = f"{len(names)}x {names[0]}"
    else:
        info["hardware"] = f"cpu ({platform.processor() or platform.machine()}, " \
                           f"{os.cpu_count()} cores)"
    for key in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
        if key in os.environ:
            info.setdefault("env", {})[key] = os.environ[key]
    return info


def commit() -> str:
    """The commit being run: ``$PURLIN_COMMIT`` when set, else the checkout's git HEAD, with
    ``+dirty`` where tracked files differ from it (a copied tree may carry a stale ``.git``:
    set ``PURLIN_COMMIT`` there), else "unknown"."""
    if os.environ.get("PURLIN_COMMIT"):
        return os.environ["PURLIN_COMMIT"]

    def git(*args):
        return subprocess.run(["git", *args], capture_output=True, text=True, check=True,
                              cwd=Path(__file__).resolve().parent, timeout=10).stdout.strip()

    try:
        head = git("rev-parse", "HEAD")
        changed = git("status", "--porcelain", "--untracked-files=no")
    except Exception:
        return "unknown"
    return f"{head}+dirty" if changed else head


def _is_sweep(obj) -> bool:
    return isinstance(obj, dict) and isinstance(obj.get("records"), list)
