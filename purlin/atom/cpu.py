"""The cpu datapath: numpy buffers, real flags and real, time-limited waiting.

It is the reference every other datapath is compared with, and the default where there is no
GPU. Flags are integer counters guarded by one condition variable per rank, so a wait sleeps
until a notify arrives instead of spinning.

>>> import numpy as np
>>> mem = CpuMemory(nranks=2, lanes=1)
>>> dst = np.zeros(2); reduce_into(dst, [np.ones(2), np.full(2, 2.0)], "avg", 2)
>>> dst.tolist()
[1.5, 1.5]
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict

import numpy as np

from purlin.errors import CapabilityError, PurlinTimeoutError
from purlin.snac.ir import Flag
from purlin.snac.planner import Capabilities

CAPABILITIES = Capabilities(name="cpu", can_reduce=True)
DTYPES = ("float16", "float32", "float64", "int32", "int64")

_UFUNC = {"sum": np.add, "avg": np.add, "max": np.maximum, "min": np.minimum}


def check_dtype(dtype_name: str) -> None:
    if dtype_name not in DTYPES:
        raise CapabilityError(f"the cpu datapath moves {', '.join(DTYPES)}, not {dtype_name} "
                              "(numpy has no bfloat16; use the sm datapath on a GPU)")


def copy_into(dst: np.ndarray, src: np.ndarray) -> None:
    """Atom copy."""
    np.copyto(dst, src)


def reduce_into(dst: np.ndarray, srcs, op: str, divisor: int = 1) -> None:
    """Atom reduce of k sources into ``dst`` in one pass; float16 accumulates in float32."""
    acc_type = np.float32 if dst.dtype == np.float16 else dst.dtype
    acc = np.array(srcs[0], dtype=acc_type, copy=True)
    ufunc = _UFUNC[op]
    for src in srcs[1:]:
        ufunc(acc, src.astype(acc_type, copy=False), out=acc)
    if op == "avg":
        acc = acc / divisor
    np.copyto(dst, acc, casting="unsafe")


class CpuMemory:
    """Flags of every rank: counters keyed by (src rank, lane), one condition per rank.

    Keyed, not laid out as src * lanes + lane: a flag outside that grid (an unverified
    schedule) is then a counter nobody adds to, which times out, instead of another flag's.
    """

    def __init__(self, nranks: int, lanes: int):
        self.nranks, self.lanes = nranks, lanes
        self.counters = [defaultdict(int) for _ in range(nranks)]
        self.conds = [threading.Condition() for _ in range(nranks)]
        self.abort = threading.Event()

    def _index(self, flag: Flag) -> tuple[int, int]:
        return flag.src, flag.lane

    def notify(self, flag: Flag, amount: int = 1) -> None:
        """Atom notify: add ``amount`` to ``flag`` and wake its owner's waiters."""
        cond = self.conds[flag.owner]
        with cond:
            self.counters[flag.owner][self._index(flag)] += amount
            cond.notify_all()

    def value(self, flag: Flag) -> int:
        return int(self.counters[flag.owner][self._index(flag)])

    def wait(self, flag: Flag, target: int, deadline: float, where: str) -> None:
        """Atom wait: until ``flag`` >= ``target``; raise PurlinTimeoutError at ``deadline``."""
        cond = self.conds[flag.owner]
        counters, i = self.counters[flag.owner], self._index(flag)
        with cond:
            while counters[i] < target:
                left = deadline - time.monotonic()
                if left <= 0 or self.abort.is_set():
                    seen = int(counters[i])
                    why = ("another rank failed first" if self.abort.is_set() and left > 0
                           else "timed out")
                    raise PurlinTimeoutError(
                        f"{where} {why} waiting on {flag} (notified by rank {flag.src} lane "
                        f"{flag.lane}): expected >= {target}, saw {seen}")
                cond.wait(min(left, 0.05))
