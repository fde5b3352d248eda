"""nccl-tests' bandwidth conventions and the timing record every provider returns.

>>> bus_factor("all-reduce", 8)
1.75
>>> round(algbw_gbs(1 << 20, 10.0), 1)
104.9
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
