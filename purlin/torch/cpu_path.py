"""The cpu datapath for :class:`purlin.torch.Communicator`: shared-memory blocks, one per rank.

The staging area is a :class:`purlin.runtime.shm.ShmArena` (rank 0 creates the blocks, their
names travel through the process group); a prepared collective is a
:class:`purlin.runtime.shm.ShmRun` of this rank, whose input and output regions are wrapped as
CPU tensors. A call runs synchronously and raises on failure, so nothing is copied back after a
timeout.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from purlin.atom.cpu import DTYPES, FP8
from purlin.runtime import shm
from purlin.runtime.shm import HEADER, ShmRun, open_arena


class CpuPrepared:
    """One prepared collective: ``input``/``output`` tensors over this rank's regions."""

    def __init__(self, run: ShmRun):
        self.run = run
        self.schedule = run.schedule
        self.input = torch.from_numpy(run.input)
        self.output = torch.from_numpy(run.output)

    def launch(self) -> None:
        self.run()

    def error(self) -> str | None:
        return self.run.broken

    def release(self) -> None:
        self.input = self.output = None
        self.run = None


class CpuPath:
    """Shared-memory staging for the ranks of ``group`` (all on this host)."""

    name = "cpu"
    dtypes = tuple(d for d in DTYPES if d not in FP8)  # (ShmRun moves FP8 bits; float8
    # tensors are not staged into it yet: they fall back to the process group)

    def __init__(self, group, rank: int, nranks: int, nbytes: int, timeout: float, **_):
        self.group, self.rank, self.nranks, self.timeout = group, rank, nranks, timeout
        self.device = torch.device("cpu")
        root = dist.get_global_rank(group, 0) if group is not dist.group.WORLD else 0

        def share(obj):
            box = [obj]
            dist.broadcast_object_list(box, src=root, group=group)
            return box[0]

        self.arena = open_arena(rank, nranks, HEADER + nbytes, share)

    def prepare(self, schedule, offset: int, lay, blocks_per_lane=None) -> CpuPrepared:
        run = ShmRun(schedule, self.rank, self.arena, lay, base=HEADER + offset,
                     timeout=self.timeout)
        run.zero_flags()
        return CpuPrepared(run)

    def barrier(self) -> None:
        """Every rank got here (calls are synchronous, so their work is done too)."""
        dist.barrier(group=self.group)

    quiesce = barrier

    def announce(self, call) -> None:
        """Write ``call``'s fingerprint beside the flags, where a waiting peer compares it."""
        shm.announce(self.arena, self.rank, call)

    def agree(self, call) -> None:
        """The barrier of a first use: every rank announced the same ``call`` and zeroed its
        flags (:func:`purlin.runtime.shm.agree`; else CallMismatchError on every rank)."""
        shm.agree(self.arena, self.rank, call, self.timeout)

    def check(self, prepared) -> list[str]:
        """Nothing is asynchronous here: a failure was raised by the call itself."""
        return [e for e in (p.error() for p in prepared) if e]

    def forget(self, prepared) -> None:
        prepared.release()

    def close(self) -> None:
        self.arena.close()
