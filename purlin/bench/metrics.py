"""nccl-tests' bandwidth conventions and the timing record every provider returns.

>>> bus_factor("all-reduce", 8)
1.75
>>> round(algbw_gbs(1 << 20, 10.0), 1)
104.9
>>> op_counts(1 << 30, ops=50, repeats=20)
(2, 3)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np


def bus_factor(collective: str, n: int) -> float:
    """nccl-tests' busbw = algbw x factor (doc/PERFORMANCE.md of nccl-tests)."""
    if collective == "all-reduce":
        return 2 * (n - 1) / n
    if collective in ("all-gather", "reduce-scatter", "all-to-all"):
        return (n - 1) / n
    return 1.0  # broadcast, reduce, and anything else


def op_counts(nbytes: int, ops: int = 50, repeats: int = 20) -> tuple[int, int]:
    """(ops per graph or eager loop, repeats) for a message of ``nbytes``: as given up to
    4 MiB, then fewer so that one point costs about the same device time at any size (a
    1 GiB all-reduce takes milliseconds per op)."""
    scaled_ops = max(2, min(ops, ops * (4 << 20) // max(nbytes, 1)))
    scaled_repeats = max(3, min(repeats, repeats * (64 << 20) // max(nbytes, 1)))
    return int(scaled_ops), int(min(repeats, scaled_repeats))


def algbw_gbs(nbytes: int, time_us: float) -> float:
    """Algorithm bandwidth in GB/s (1e9 bytes per second) for ``nbytes`` in ``time_us``."""
    return nbytes / (time_us * 1e-6) / 1e9 if time_us > 0 else float("nan")


@dataclass
class Timing:
    """Median time per op with the 20th and 80th percentiles, in microseconds."""

    median_us: float
    p20_us: float
    p80_us: float
    samples: int

    @classmethod
    def of(cls, per_op_us) -> "Timing":
        arr = np.asarray(per_op_us, dtype=float)
        return cls(float(np.median(arr)), float(np.quantile(arr, 0.2)),
                   float(np.quantile(arr, 0.8)), int(arr.size))


@dataclass
class Record:
    """One measured point: a provider running a collective at one size."""

    provider: str
    collective: str
    nranks: int
    nbytes: int
    count: int
    dtype: str
    redop: str
    mode: str              # "graph" (device time per op) or "eager" (host-inclusive)
    time_us: float
    p20_us: float
    p80_us: float
    algbw_gbs: float
    busbw_gbs: float
    wrong: int
    extra: dict = field(default_factory=dict)

    @classmethod
    def make(cls, provider, collective, nranks, nbytes, count, dtype, redop, mode,
             timing: Timing, wrong: int, **extra) -> "Record":
        alg = algbw_gbs(nbytes, timing.median_us)
        return cls(provider, collective, nranks, nbytes, count, dtype, redop, mode,
                   timing.median_us, timing.p20_us, timing.p80_us, alg,
                   alg * bus_factor(collective, nranks), wrong, extra)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Record":
        known = {k: d[k] for k in cls.__dataclass_fields__ if k in d}
        return cls(**known)

    @property
    def root(self) -> int:
        """nccl-tests' root column: the root rank of a rooted collective, else -1."""
        return int(self.extra.get("root", 0 if self.collective in ROOTED else -1))

    @property
    def ok(self) -> bool:
        """Measured (or predicted) without error."""
        return "error" not in self.extra and self.time_us == self.time_us


ROOTED = ("broadcast", "reduce", "gather", "scatter")


def table(records, file=None) -> str:
    """An nccl-tests-style table of records, one line each."""
    head = (f"{'provider':>22} {'collective':>14} {'size(B)':>11} {'count':>10} {'type':>8} "
            f"{'redop':>5} {'mode':>5} {'time(us)':>9} {'algbw':>7} {'busbw':>7} {'#wrong':>6}")
    lines = [head]
    for r in records:
        lines.append(f"{r.provider:>22} {r.collective:>14} {r.nbytes:>11} {r.count:>10} "
                     f"{r.dtype:>8} {r.redop:>5} {r.mode:>5} {r.time_us:>9.2f} "
                     f"{r.algbw_gbs:>7.1f} {r.busbw_gbs:>7.1f} {r.wrong:>6}")
    text = "\n".join(lines)
    if file is not None:
        print(text, file=file)
    return text


MODE_NOTES = {
    "graph": "CUDA-graph replay: device time per op",
    "eager": "eager calls: host-inclusive time per call",
    "cpu": "cpu datapath, numpy and host threads, wall time per call: NOT GPU numbers",
    "model": "cost model prediction, not a measurement",
}


def plan_extra(schedule) -> dict:
    """A record's plan fields (what :func:`config_of` reads): strategy, chunks, lanes, and
    ``lanes_by`` where it is not the default.

    >>> from purlin.snac import plan
    >>> from purlin.spec import collectives
    >>> plan_extra(plan(collectives.all_reduce(2), "ring", count=8, chunks=2, lanes=2,
    ...                 lanes_by="stage"))
    {'strategy': 'ring', 'chunks': 2, 'lanes': 2, 'lanes_by': 'stage'}
    """
    out = {"strategy": schedule.strategy, "chunks": schedule.chunks, "lanes": schedule.lanes}
    if schedule.lanes_by != "piece":
        out["lanes_by"] = schedule.lanes_by
    return out


def config_of(r: Record) -> str:
    """Purlin's configuration of a record as ``strategy cC lL[ stage] bB`` ("" for
    baselines)."""
    e = r.extra
    if "strategy" not in e:
        return ""
    bpl = e.get("blocks_per_lane")
    return (f"{e['strategy']} c{e.get('chunks', 1)} l{e.get('lanes', 1)}"
            + (" stage" if e.get("lanes_by") == "stage" else "") + (f" b{bpl}" if bpl else ""))


def _num(value: float, width: int) -> str:
    if value != value:  # NaN
        return "n/a".rjust(width)
    return f"{value:{width}.2f}" if abs(value) < 1e4 else f"{value:{width}.0f}"


def nccl_table(records, file=None) -> str:
    """nccl-tests' table: one block per (collective, provider, mode, dtype, ranks) with size,
    count, type, redop, root, time, algbw, busbw and #wrong per line (N/A where nothing was
    checked), Purlin's configuration at the end, and the average bus bandwidth.

    >>> rec = Record.make("nccl", "all-reduce", 2, 1 << 20, 1 << 19, "bfloat16", "sum",
    ...                   "graph", Timing(10.0, 9.0, 11.0, 5), 0)
    >>> print(nccl_table([rec]))  # doctest: +NORMALIZE_WHITESPACE
    # all-reduce | nccl | 2 ranks | bfloat16 | graph (CUDA-graph replay: device time per op)
    #       size         count      type   redop    root     time   algbw   busbw  #wrong
    #        (B)    (elements)                               (us)  (GB/s)  (GB/s)
         1048576        524288  bfloat16     sum      -1    10.00  104.86  104.86       0
    # Avg bus bandwidth    : 104.86 GB/s
    """
    groups: dict = {}
    for r in records:
        groups.setdefault((r.collective, r.provider, r.mode, r.dtype, r.nranks), []).append(r)
    blocks = []
    for (coll, provider, mode, dtype, n), rows in groups.items():
        note = MODE_NOTES.get(mode, mode)
        lines = [f"# {coll} | {provider} | {n} ranks | {dtype} | {mode} ({note})",
                 f"#{'size':>11} {'count':>13} {'type':>9} {'redop':>7} {'root':>7} "
                 f"{'time':>8} {'algbw':>7} {'busbw':>7} {'#wrong':>7}",
                 f"#{'(B)':>11} {'(elements)':>13} {'':>9} {'':>7} {'':>7} "
                 f"{'(us)':>8} {'(GB/s)':>7} {'(GB/s)':>7}"]
        bws = []
        for r in sorted(rows, key=lambda r: r.nbytes):
            wrong = "N/A" if r.wrong < 0 or not r.ok else str(r.wrong)
            line = (f"{r.nbytes:>12} {r.count:>13} {r.dtype:>9} {r.redop:>7} {r.root:>7} "
                    f"{_num(r.time_us, 8)} {_num(r.algbw_gbs, 7)} {_num(r.busbw_gbs, 7)} "
                    f"{wrong:>7}")
            cfg = config_of(r)
            if cfg and provider != f"purlin:{cfg}":
                line += f"  {cfg}"
            if "error" in r.extra:
                line += "  error: " + str(r.extra["error"]).strip().splitlines()[-1][:120]
            lines.append(line)
            if r.ok:
                bws.append(r.busbw_gbs)
        if bws:
            lines.append(f"# Avg bus bandwidth    : {sum(bws) / len(bws):.2f} GB/s")
        blocks.append("\n".join(lines))
    text = "\n#\n".join(blocks)
    if file is not None:
        print(text, file=file)
    return text


def vs_baseline(records, baseline: str = "nccl") -> list[dict]:
    """``baseline time / provider time`` (> 1: the provider is faster) for every record that
    has a baseline point of the same collective, ranks, size, dtype and mode.

    >>> t = lambda us: Timing(us, us, us, 1)
    >>> recs = [Record.make(p, "all-reduce", 2, 1024, 512, "bfloat16", "sum", "graph", t(us), 0)
    ...         for p, us in (("nccl", 10.0), ("purlin:auto", 5.0))]
    >>> [(row["provider"], row["ratio"]) for row in vs_baseline(recs)]
    [('purlin:auto', 2.0)]
    """
    base = {(r.collective, r.nranks, r.nbytes, r.dtype, r.mode): r.time_us
            for r in records if r.provider == baseline and r.ok}
    rows = []
    for r in records:
        key = (r.collective, r.nranks, r.nbytes, r.dtype, r.mode)
        if r.provider == baseline or not r.ok or key not in base or not r.time_us > 0:
            continue
        rows.append({"provider": r.provider, "collective": r.collective, "nranks": r.nranks,
                     "nbytes": r.nbytes, "dtype": r.dtype, "mode": r.mode,
                     "ratio": base[key] / r.time_us})
    return rows
