"""Benchmarks: sweeps of Purlin against NCCL and PyTorch symmetric memory (ARCHITECTURE.md).

Timing returns the same record type everywhere (median and quantiles in microseconds); tables
follow nccl-tests (size, count, type, redop, time, algbw, busbw, #wrong). Nothing here imports
torch, pandas or plotly until a sweep runs or a figure is drawn.

>>> from purlin.bench import Sweep
>>> Sweep(collectives=["all-reduce"], sizes=[1 << 20], datapath="model", nranks=2
...       ).run(progress=False).records[0].mode
'model'
"""

from purlin.bench.metrics import Record, Timing, nccl_table
from purlin.bench.sweep import Provider, Results, Sweep, powers_of_two

__all__ = ["Provider", "Record", "Results", "Sweep", "Timing", "nccl_table", "powers_of_two"]
