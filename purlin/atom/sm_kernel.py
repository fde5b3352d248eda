"""One launch of the sm datapath's kernels, for the ranks it runs: what the prepared kernel
(:class:`purlin.atom.prepared.PreparedKernel`) of single-process clusters and process mode
builds its launches from.

:class:`Flags` says where every rank's flags, their slots per block (the fused kernel) and LL
areas are: the fused programs' ``flag_slot``, and the names an error record's addresses get.
:class:`RankKernel` is one launch: its ranks' control words (epoch, done counter, error
record), their executor blocks or fused programs at one address, call counters and launcher;
it launches, and :func:`describe` turns an error record into a sentence.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from purlin.errors import CapabilityError
from purlin.kernels import isa


@dataclass(frozen=True)
class Flags:
    """Where every rank's flags are: ``flags[q]``, the address of rank q's ``count`` int64
    flag words (``nranks * lanes`` peer flags, then lane barriers); ``slots[q]``, that of
    their ``isa.F_MAX_BLOCKS`` slots each (the fused kernel; None without); ``ll[q]``, the
    (address, bytes) of rank q's LL area (None without).

    >>> f = Flags(2, 1, 3, {0: 1000, 1: 2000}, slots={0: 5000, 1: 9000}, ll={1: (7000, 64)})
    >>> f.name(2008), f.name(1016), f.name(40)
    ('flag(r1<-r1.l0)', 'lane barrier 0 of rank 0', 'flag at 0x28')
    >>> f.slot(2008) == 9000 + 8 * isa.F_MAX_BLOCKS, f.ll_rank(7008), f.ll_rank(1000)
    (True, 1, None)
    """

    nranks: int
    lanes: int
    count: int
    flags: dict
    slots: dict | None = None
    ll: dict | None = None

    def locate(self, address: int) -> tuple[int, int]:
        """(rank, index) of the flag word at ``address``; (-1, -1) where it is none."""
        for q, base in self.flags.items():
            if base <= address < base + 8 * self.count:
                return q, (address - base) // 8
        return -1, -1

    def slot(self, address: int) -> int:
        """The address of block 0's slot of the flag at ``address`` (block b's is ``8 * b``
        further): what :func:`purlin.atom.fused.program` takes as ``flag_slot``."""
        q, i = self.locate(address)
        if q < 0 or self.slots is None:
            raise CapabilityError(f"0x{address:x} is no flag with a slot per block")
        return self.slots[q] + i * isa.F_MAX_BLOCKS * 8

    def ll_rank(self, address: int) -> int | None:
        """The rank whose LL area holds ``address`` (None: no LL address)."""
        for q, (base, nbytes) in (self.ll or {}).items():
            if base <= address < base + nbytes:
                return q
        return None

    def name(self, address: int) -> str:
        q, i = self.locate(address)
        if q < 0:
            return f"flag at 0x{address:x}"
        if i < self.nranks * self.lanes:
            return f"flag(r{q}<-r{i // self.lanes}.l{i % self.lanes})"
        return f"lane barrier {i - self.nranks * self.lanes} of rank {q}"


def describe(record, rank: int, flags: Flags, timeout: float, adds: int = 1,
             sums: tuple | None = None, ask: bool = False) -> str | None:
    """The sentence of rank ``rank``'s error record (``isa.ERR_WIDTH`` words), or None where
    it recorded nothing. ``adds``: what one notify adds to a flag (the interpreter's blocks
    per lane; 1 on the fused kernel: a slot per block); ``sums``: (address, bytes) of an
    epilogue's row sums; ``ask``: a timeout waiting on a peer asks whether it is alive (one
    process per rank).

    >>> f = Flags(2, 1, 3, {0: 1000, 1: 2000})
    >>> rec = [0] * isa.ERR_WIDTH
    >>> rec[isa.E_CODE], rec[isa.E_STEP], rec[isa.E_PEER], rec[isa.E_FLAG] = \\
    ...     isa.ERR_TIMEOUT, 4, 1, 1008
    >>> rec[isa.E_EXPECTED], rec[isa.E_SEEN] = 2, 1
    >>> describe(rec, 0, f, 2.0, adds=2)
    'rank 0 step 4 (lane 0, block 0) timed out after 2 s waiting on flag(r0<-r1.l0) from rank 1: \
expected >= 2 (1 notifies x 2 blocks), saw 1'
    """
    rec = [int(x) for x in record]
    code, flag = rec[isa.E_CODE], rec[isa.E_FLAG]
    if code == isa.ERR_NONE:
        return None
    expected, seen, peer = rec[isa.E_EXPECTED], rec[isa.E_SEEN], rec[isa.E_PEER]
    where = (f"rank {rank} step {rec[isa.E_STEP]} (lane {rec[isa.E_LANE]}, block "
             f"{rec[isa.E_BLOCK]})")
    if sums is not None and 0 <= flag - sums[0] < sums[1]:
        return (f"rank {rank} block {rec[isa.E_BLOCK]} gave up after {timeout:.3g} s waiting "
                f"for row sum slot {(flag - sums[0]) // 16} of the RMSNorm epilogue (tag "
                f"{expected} expected, saw {seen}): another block of this rank did not finish "
                "its part of the all-reduce")
    ll = flags.ll_rank(flag)
    if code == isa.ERR_ABORTED:
        what = "its LL data" if ll is not None else flags.name(flag)
        return (f"{where} gave up waiting on {what} from rank {peer}: another rank timed out "
                "first (its own error names the rank it waited for)")
    alive = f" — is rank {peer} alive?" if ask else ""
    if ll is not None:
        return (f"{where} timed out after {timeout:.3g} s waiting for the LL data rank {peer} "
                f"sends into r{ll}'s LL area: expected tag {expected}, saw {seen}{alive}")
    return (f"{where} timed out after {timeout:.3g} s waiting on {flags.name(flag)} from rank "
            f"{peer}: expected >= {expected} ({expected // max(adds, 1)} notifies x {adds} "
            f"blocks), saw {seen}{alive}")


class RankKernel:
    """One launch: ``launcher`` run on ``desc`` (the executor descriptors or fused programs
    of ``ranks``, at one address) with the call counters at ``counters`` (0: the
    interpreter's, in its control words); ``control[k]``: rank ``ranks[k]``'s control words
    (epoch, done counter, then the error record); ``keep``: the tensors behind the
    addresses; ``adds``: what one notify adds to a flag (the interpreter's blocks per lane; 1
    on the fused kernel, a slot per block); ``step_lanes[r]``: the lane of each of rank r's
    steps, where the record's lane is not the step's (a fused program a lane records 0)."""

    def __init__(self, device: int, ranks, launcher, desc: int, counters: int, control,
                 keep=(), adds: int = 1):
        self.device, self.ranks, self.launcher = int(device), list(ranks), launcher
        self.desc, self.counters, self.control = int(desc), int(counters), list(control)
        self.keep, self.adds = [t for t in keep if t is not None], int(adds)
        self.step_lanes: dict = {}

    @classmethod
    def interpreter(cls, torch, device, ranks, blobs, control, *, lanes: int,
                    blocks_per_lane: int, threads: int, pdl: bool = False, cache=None,
                    kernel: str = "executor"):
        """The executor over ``ranks`` on ``device`` (a torch device), their blocks ``blobs``
        (:func:`purlin.atom.sm.rank_blob`): a lone rank launches on its block and prefetches
        it; several share a launch through a table of their descriptors. ``kernel``:
        ``purlin.kernels.executor.kernel_for`` their tables."""
        from purlin.atom.lowering import HEAD_WORDS

        if len(ranks) == 1:
            table, head = blobs[0], HEAD_WORDS
        else:
            table, head = torch.stack([b[:isa.DESC_WIDTH] for b in blobs]).contiguous(), 0
        run = launcher(cache, device=device.index, nranks_in_launch=len(ranks), nlanes=lanes,
                       blocks_per_lane=blocks_per_lane, threads=threads, head_words=head,
                       pdl=pdl, kernel=kernel)
        return cls(device.index, ranks, run, table.data_ptr(), 0, control, keep=[table],
                   adds=blocks_per_lane)

    @classmethod
    def fused(cls, torch, device, ranks, programs, control, *, blocks: int, threads: int,
              pdl: bool = False, kernel: str = "fused", stride: int = 0, cache=None,
              **trace):
        """``kernel`` (the fused kernel, with the NORM op, an epilogue's one-shot kernel, a
        traced one with ``trace``'s Launcher options) over ``ranks`` on ``device``: their
        programs (word arrays, one a lane: each a rank slot of the launch) packed at one
        stride of at least ``stride`` words, ``blocks`` blocks of ``threads`` each per slot."""
        table, stride, counters = pack(torch, device, programs, stride)
        run = launcher(cache, device=device.index, nranks_in_launch=len(programs), nlanes=1,
                       blocks_per_lane=blocks, threads=threads, pdl=pdl, kernel=kernel,
                       stride_words=stride, **trace)
        return cls(device.index, ranks, run, table.data_ptr(), counters.data_ptr(), control,
                   keep=[table, counters])

    def launch(self, stream: int, timeout_ns: int, desc: int | None = None,
               launcher=None) -> None:
        """One call on ``stream``; ``desc`` / ``launcher``: another program of the same ranks
        (a relocated one, or one ending with an epilogue), counting calls here too."""
        (launcher or self.launcher)(self.desc if desc is None else desc, stream, timeout_ns,
                                    self.counters)

    def records(self) -> list[tuple[int, np.ndarray]]:
        """(rank, error record) of each rank of the launch (synchronize first), its lane the
        step's (``step_lanes``)."""
        out = []
        for r, c in zip(self.ranks, self.control):
            rec = c[2:].cpu().numpy().copy()
            lanes = self.step_lanes.get(r, ())
            if 0 <= rec[isa.E_STEP] < len(lanes):
                rec[isa.E_LANE] = lanes[rec[isa.E_STEP]]
            out.append((r, rec))
        return out

    def errors(self, flags: Flags, timeout: float, sums=None, ask: bool = False) -> list:
        """(rank, error code, sentence) of each rank of the launch that recorded an error
        (synchronize first; :func:`describe`); ``sums``: rank -> (address, bytes) of its
        epilogue's row sums."""
        return [(r, int(rec[isa.E_CODE]),
                 describe(rec, r, flags, timeout, self.adds, (sums or {}).get(r), ask))
                for r, rec in self.records() if rec[isa.E_CODE] != isa.ERR_NONE]

    def __repr__(self) -> str:
        return f"RankKernel(device={self.device}, ranks={self.ranks}, {self.launcher!r})"


def launcher(cache=None, **config):
    """A :class:`purlin.kernels.launch.Launcher` of ``config`` (its arguments), made once per
    configuration in the dict ``cache`` where one is given."""
    from purlin.kernels.launch import Launcher

    if cache is None:
        return Launcher(**config)
    key = tuple(sorted(config.items()))
    if key not in cache:
        cache[key] = Launcher(**config)
    return cache[key]


def pack(torch, device, programs, stride: int = 0, counted: bool = True):
    """``programs`` (int64 word arrays, one per rank of a launch) at one stride of at least
    ``stride`` words, zero-padded, on ``device``: (the table, the stride, its call counters:
    ``isa.F_MAX_BLOCKS`` zeroed words per rank; None unless ``counted``)."""
    stride = max([stride] + [p.size for p in programs])
    words = np.zeros(stride * len(programs), dtype=np.int64)
    for k, p in enumerate(programs):
        words[k * stride: k * stride + p.size] = p
    table = torch.from_numpy(words).to(device)
    counters = torch.zeros(len(programs) * isa.F_MAX_BLOCKS, dtype=torch.int64,
                           device=device) if counted else None
    return table, stride, counters


def one_shot_kernel(epilogue, out, words) -> tuple[str | None, str | None]:
    """(the name of the one-shot kernel :mod:`purlin.kernels.epilogue` builds for user
    ``epilogue`` after ``out``'s all-reduce, None) where it runs the fused program ``words``
    (:func:`purlin.atom.fused.oneshot_problem`); else (None, why it cannot)."""
    from purlin.atom.fused import oneshot_problem
    from purlin.kernels.epilogue import kernel_name

    why = oneshot_problem(np.asarray(words))
    if why:
        return None, why
    return kernel_name(epilogue.form(out, epilogue.hidden)), None


def fused_unit_or_refuse(lowered, protocol: str, title: str) -> int:
    """The unit of the fused programs of ``lowered`` (:func:`purlin.atom.fused.fused_unit`),
    or CapabilityError saying why ``protocol`` cannot run the schedule ``title``."""
    from purlin.atom.fused import fused_unit

    unit, problem = fused_unit(lowered, protocol)
    if problem:
        raise CapabilityError(f"protocol={protocol!r} cannot run {title}: {problem}")
    return unit
