"""The one prepared kernel of the sm datapath, behind both of its front doors: a single-process
cluster (:class:`purlin.atom.sm.SmBound`: every rank, a launch per device) and process mode
(``purlin.torch.sm_path.SmPrepared``: this process's rank on its staging slice). Given every
rank's addresses, it lowers the schedule once and builds the launches of the ranks it runs
(ARCHITECTURE.md, "Runtime")."""

from __future__ import annotations

from purlin.atom.sm_kernel import Flags, RankKernel
from purlin.kernels import isa


def error_record(control) -> int:
    """The address of the error record in a rank's control words (after its epoch and done
    counter)."""
    return control.data_ptr() + 2 * 8


class PreparedKernel:
    """``schedule`` lowered with every rank's addresses, and the launches of the ranks in
    ``groups`` ((torch device, ranks) per launch).

    ``bases[(rank, buffer)]``: input, output and scratch addresses (``lowering.lower``);
    ``flags[q]`` / ``slots[q]`` / ``ll[q]``: rank q's flag words, their slots per block (a
    fused protocol) and its LL area as (address, bytes) (:class:`Flags`); ``abort``: the
    group's abort word. Blocks and threads not given are sized to ``gpu``
    (``sm.interpreter_launch``, ``sm.fused_launch``), ``kind`` naming what to shrink in a
    refusal; ``ll_one_block``: LL sized as one block per lane by default. Build the launches
    with :meth:`interpreter_kernels` or :meth:`fused_kernels`."""

    def __init__(self, torch, schedule, *, bases: dict, flags: dict, scratch_bytes,
                 groups, protocol: str, abort: int, gpu, kind: str, timeout: float,
                 slots: dict | None = None, ll: dict | None = None, blocks_per_lane=None,
                 threads=None, fit: bool = False, pdl: bool = False,
                 ll_one_block: bool = True, cache: dict | None = None):
        from purlin.atom.lowering import flag_slots, lower
        from purlin.atom.sm import interpreter_launch, is_fused

        self.torch, self.schedule, self.protocol, self.pdl = torch, schedule, protocol, pdl
        self.groups = [(device, list(ranks)) for device, ranks in groups]
        self.ranks = [r for _, ranks in self.groups for r in ranks]
        self.per_launch = max(len(ranks) for _, ranks in self.groups)
        self.abort, self.gpu, self.kind, self.cache = int(abort), gpu, kind, cache
        self.timeout, self.timeout_ns = timeout, int(timeout * 1e9)
        self.fused = is_fused(protocol)
        n, lanes = schedule.nranks, schedule.lanes
        self.blocks_per_lane, self.threads = 1, threads  # the fused lowering: a block a lane
        if not self.fused:  # sized to fit the device, an explicit request refused if not
            self.blocks_per_lane, self.threads = interpreter_launch(
                schedule, gpu, self.per_launch, ll=ll_one_block and bool(ll),
                blocks_per_lane=blocks_per_lane, threads=threads, fit=fit, kind=kind)
        self.flags = Flags(n, lanes, flag_slots(n, lanes), dict(flags), slots=slots, ll=ll)
        lowered = lower(schedule, bases, self.flags.flags, blocks_per_lane=self.blocks_per_lane,
                        scratch_bytes=scratch_bytes,
                        ll_bases={q: a for q, (a, _) in ll.items()} if ll else None)
        self.lowered = lowered  # (several lanes, fused: a program a lane, fused_lanes)
        # each rank's control words (epoch, done counter, error record): the interpreter's
        # sit in its executor block (interpreter_kernels), the fused kernel's alone
        self.control = {r: torch.zeros(2 + isa.ERR_WIDTH, dtype=torch.int64, device=device)
                        for device, ranks in self.groups for r in ranks} if self.fused else {}
        self.unit = self.ops = None  # the fused programs' item bytes and ops (fused_rows)
        # rank -> its fused programs, one a lane (purlin.atom.fused.FusedProgram)
        self.programs: dict = {}
        self.launches: list[RankKernel] = []
        self.keep: list = []

    def error_at(self, rank: int) -> int:
        """The address of ``rank``'s error record."""
        return error_record(self.control[rank])

    def add(self, kernel: RankKernel) -> RankKernel:
        self.launches.append(kernel)
        self.keep += kernel.keep
        return kernel

    def interpreter_kernels(self, traces=None, trace_rows: int = 0) -> None:
        """The executor per launch over its ranks' blocks (``sm.rank_blob``; ``traces[r]``:
        rank r's trace records, ``trace_rows`` a block), on the tables' kernel."""
        from purlin.atom.sm import rank_blob
        from purlin.kernels.executor import kernel_for

        kernel = kernel_for(t for r in self.ranks for t in self.lowered[r].tables)
        for device, ranks in self.groups:
            blobs = []
            for r in ranks:
                low = self.lowered[r]
                blob, self.control[r] = rank_blob(
                    self.torch, low, device, self.abort, len(low.lane_offsets) - 1,
                    traces[r] if traces else None, trace_rows)
                blobs.append(blob)
            self.keep += blobs
            self.add(RankKernel.interpreter(
                self.torch, device, ranks, blobs, [self.control[r] for r in ranks],
                lanes=self.schedule.lanes, blocks_per_lane=self.blocks_per_lane,
                threads=self.threads, pdl=self.pdl, cache=self.cache, kernel=kernel))

    def fused_kernels(self, unit: int, *, blocks=None, wish=None, threads=None, grid=None,
                      spare_words: int = 0, options=None) -> None:
        """Every launched rank's fused program of :func:`purlin.atom.fused_rows.launch_ops`
        (the same ops on every rank and in every process) of ``unit``-byte items, on
        ``grid`` = (blocks, threads) where given, else sized (``sm.fused_launch``: ``blocks``
        kept or refused, ``wish`` cut to fit); programs packed ``spare_words`` longer than
        the longest. ``options(device, ranks)``: the launcher's kernel and trace options
        (by default the fused kernel its programs need)."""
        from purlin.atom.fused_rows import launch_ops
        from purlin.atom.sm import fused_launch

        self.unit = unit
        self.ops = launch_ops(self.schedule, self.lowered, unit)
        for r in self.ranks:
            self.programs[r] = self.ops.program(r, self.error_at(r), self.abort, self.flags.slot)
        lanes = max(len(self.programs[r]) for r in self.ranks)  # (a program a lane)
        self.blocks_per_lane, self.threads = grid or fused_launch(
            self.gpu, self.ops.items(), self.per_launch, unit, lanes=lanes, blocks=blocks,
            wish=wish, threads=threads, kind=self.kind)
        self.launch_programs(self.programs, options or self._kernel_of, spare_words)

    def _kernel_of(self, device, ranks) -> dict:
        from purlin.atom.fused import kernel_name

        return {"kernel": kernel_name(p.words for r in ranks for p in self.programs[r])}

    def launch_programs(self, programs, options, spare_words: int = 0) -> None:
        """A fused launch per group of ``programs[r]`` (rank r's
        :class:`purlin.atom.fused.FusedProgram` per lane, each a rank slot of the launch) on
        this grid; ``options(device, ranks)``: its launcher's kernel (and trace) options."""
        for device, ranks in self.groups:
            words = [p.words for r in ranks for p in programs[r]]
            kernel = self.add(RankKernel.fused(
                self.torch, device, ranks, words, [self.control[r] for r in ranks],
                blocks=self.blocks_per_lane, threads=self.threads, pdl=self.pdl,
                stride=max(w.size for w in words) + spare_words, cache=self.cache,
                **options(device, ranks)))
            if self.schedule.lanes > 1:  # (an error names its step's lane)
                kernel.step_lanes = {r: [st.lane for st in self.schedule.steps[r]]
                                     for r in ranks}

    def errors(self, sums: dict | None = None, ask: bool = False) -> list:
        """(rank, error code, sentence) of every launched rank that recorded an error
        (synchronize first; :meth:`RankKernel.errors`)."""
        return [e for k in self.launches for e in k.errors(self.flags, self.timeout, sums, ask)]
