"""The sm datapath for :class:`purlin.torch.Communicator`: PyTorch symmetric memory.

The staging area is one ``torch.distributed._symmetric_memory`` allocation per rank,
rendezvoused once at construction (before any graph capture); the handle's ``buffer_ptrs`` give
every peer's address of it. Ranks sharing one GPU (a process each, a gloo group: for tests on
one GPU) map each other's buffers by CUDA IPC instead, which symmetric memory refuses. A prepared collective is a slice of that area: the schedule is
lowered with every rank's addresses (:func:`purlin.atom.lowering.lower`), and only this rank's
table goes to the device, behind a descriptor built like :mod:`purlin.atom.sm` builds it -- or,
with a fused protocol, as this rank's fused program: the one a single-process cluster builds
for the rank, from every rank's ops (:func:`purlin.atom.fused_rows.launch_ops`; flag slots per
block in the slice, call counters kept apart so relocated programs share them). A call copies
the input in, launches this rank's kernel on the current stream and copies the output out --
all asynchronous and capturable. Waits that time out leave an error record that
:meth:`SmPath.check` turns into a :class:`PurlinTimeoutError` after a synchronize.
"""

from __future__ import annotations

import socket
import warnings
from collections import OrderedDict

import torch
import torch.distributed as dist

from purlin.errors import CapabilityError, ExecutionError
from purlin.kernels import isa
from purlin.torch.common import overlap

DTYPES = ("bfloat16", "float16", "float32", "int32")  # float64: in the kernels, untested here
DEFAULT_THREADS = 512


class SmPrepared:
    """One prepared collective on this rank: a :class:`purlin.atom.prepared.PreparedKernel`
    (``core``) of this rank on its slice of the staging area, its region views, and the
    relocated and epilogue programs of its calls. ``protocol``: "simple" / "ll" run the
    interpreter, "fused" / "fused-ll" the fused kernel (the communicator has checked that it
    can run the schedule)."""

    SPARE_WORDS = isa.OP_WIDTH + isa.SOURCE_WIDTH  # a program ending with an epilogue's more

    # (what the prepared kernel holds, under the names relocation and epilogues read)
    all_lowered = property(lambda self: self.core.lowered)
    lowered = property(lambda self: self.core.lowered[self.path.rank])
    flags = property(lambda self: self.core.flags)
    abort_ptr = property(lambda self: self.core.abort)
    control = property(lambda self: self.core.control[self.path.rank])
    unit = property(lambda self: self.core.unit)
    ops = property(lambda self: self.core.ops)
    kernel = property(lambda self: self.core.launches[0])
    blocks_per_lane = property(lambda self: self.core.blocks_per_lane)
    threads = property(lambda self: self.core.threads)
    timeout_ns = property(lambda self: self.core.timeout_ns)

    def __init__(self, path: "SmPath", schedule, offset: int, lay, blocks_per_lane, threads,
                 protocol: str = "simple", pdl: bool = False, row_bytes: int | None = None,
                 epilogue_grid: str | int | None = None, epilogue_kernel: str = "auto"):
        from purlin.atom.lowering import local_buffers
        from purlin.atom.prepared import PreparedKernel
        from purlin.atom.sm import is_fused

        self.path, self.schedule, self.offset, self.layout = path, schedule, offset, lay
        self.protocol, self.pdl = protocol, pdl
        self.fused = is_fused(protocol)
        rank, n = path.rank, schedule.nranks
        sizing = schedule.sizing
        ptrs = path.ptrs
        self.core = PreparedKernel(
            torch, schedule, bases={(q, b): ptrs[q] + offset + lay.offset(q, b)
                                    for q in range(n) for b in ("input", "output", "scratch")},
            flags={q: ptrs[q] + offset + lay.flags for q in range(n)},
            slots={q: ptrs[q] + offset + lay.block_flags for q in range(n)}
            if lay.block_flags else None,  # (LL areas: every peer's, as the puts target them)
            ll={q: (ptrs[q] + offset + lay.offset(q, "ll"), lay.ll_bytes[q]) for q in range(n)}
            if lay.has_ll else None,
            scratch_bytes=dict(enumerate(lay.scratch_bytes)), groups=[(path.device, [rank])],
            protocol=protocol, abort=ptrs[0] + offset + lay.abort,  # rank 0's: the group's
            gpu=path.gpu, kind="process", timeout=path.timeout, blocks_per_lane=blocks_per_lane,
            threads=threads, pdl=pdl and self.fused,  # (the interpreter launches plainly)
            ll_one_block=False, cache=path._launchers)  # (LL: the size's default blocks)
        self.local = local_buffers(schedule, rank)
        self._moved: OrderedDict = OrderedDict()  # (input at, output at) -> relocated block
        self._pinned: set = set()
        self._refused: dict = {}  # keys the fused kernel cannot run relocated: why
        self.sums = None  # the epilogue's row sums (purlin.atom.fused.Epilogue), on demand
        self.program_words = None  # the fused programs' length
        self.programs = None  # this rank's fused programs, one a lane
        self.epilogue_kernel = epilogue_kernel  # "fused": the built-in on the NORM op everywhere
        self.norm_kernel = None  # what the last epilogue program made runs on (plans())
        tdt = getattr(torch, schedule.dtype)
        if self.fused:
            self._fused_kernel(tdt.itemsize, blocks_per_lane, row_bytes, epilogue_grid)
        else:
            self.core.interpreter_kernels()
        self.input = path.view(offset + lay.offset(rank, "input"), sizing.input_count(rank), tdt)
        self.output = path.view(offset + lay.offset(rank, "output"), sizing.output_count(rank),
                                tdt)

    def _fused_kernel(self, itemsize: int, blocks_per_lane, row_bytes, epilogue_grid) -> None:
        """This rank's fused program and launch: the program a single-process cluster runs
        for the rank (from every rank's tables, lowered with every rank's addresses), on the
        grid every rank launches -- or, with ``row_bytes``, the grid ``epilogue_grid`` asks
        for an RMSNorm epilogue over rows that long ("rows": blocks owning whole rows,
        16-byte items, where there is one; threads: blocks of that many, one item each)."""
        from purlin.atom.fused import fuse_problem, row_grid, threads_grid
        from purlin.atom.sm_kernel import fused_unit_or_refuse

        core, rank = self.core, self.path.rank
        # (the communicator checked the plan: a refusal is a bug, said on every rank)
        unit = fused_unit_or_refuse(core.lowered, self.protocol,
                                    f"{self.schedule.title()} here")
        nbytes, rows = self.schedule.sizing.output_count(rank) * itemsize, None
        if row_bytes and epilogue_grid == "rows":
            rows = row_grid(nbytes, row_bytes, self.path.sms)
            if rows and fuse_problem(core.lowered, 16) is None:
                unit = 16
            else:
                rows = None
        elif row_bytes and epilogue_grid:
            rows = threads_grid(nbytes, unit, epilogue_grid, self.path.sms)
        core.fused_kernels(unit, blocks=blocks_per_lane, grid=rows,
                           spare_words=self.SPARE_WORDS)
        self.programs = core.programs[rank]  # (one a lane, each a rank slot of the launch)
        self.program_words = max(p.words.size for p in self.programs) + self.SPARE_WORDS

    def launch(self, src: torch.Tensor | None = None, dst: torch.Tensor | None = None,
               capturing: bool = False, norm: tuple | None = None) -> None:
        """Launch this rank's kernel. With ``src`` / ``dst`` (tensors :meth:`movable` said
        the kernel may use in place of the staging regions) it reads its input from ``src``
        and writes its output into ``dst``: no copy in or out. Each pair of addresses gets a
        relocated copy of the table or fused program (kept; the ones used in a graph capture
        for ever). ``norm``: (residual, weight, eps) of an epilogue :meth:`norm_problem`
        accepted -- the program ends with it."""
        desc = launcher = None
        if src is not None or dst is not None or norm is not None:
            desc, launcher = self._relocated(src, dst, capturing, norm)
        self.kernel.launch(torch.cuda.current_stream(self.path.device).cuda_stream,
                           self.timeout_ns, desc, launcher)

    def _program(self, moves=None, epilogue=None):
        """This rank's fused programs on the device (one a lane, packed at the launch's
        stride), and the :class:`purlin.atom.fused.FusedProgram` list they hold: the rank's
        programs of ``self.ops`` (``purlin.atom.fused_rows.launch_ops``), of its table
        relocated by ``moves``
        (``lowering.relocate``) where given; with ``epilogue`` (a
        :class:`purlin.atom.fused.Epilogue` to end with), the rank's own ops and the NORM op,
        as a single-process cluster builds a program ending with an epilogue
        (``purlin.atom.sm_epilogue.launch_epilogue``)."""
        from purlin.atom.fused import program
        from purlin.atom.lowering import relocate
        from purlin.atom.prepared import error_record
        from purlin.atom.sm_kernel import pack

        error = error_record(self.control)
        if epilogue is None:
            progs = self.ops.program(self.path.rank, error, self.abort_ptr, self.flags.slot,
                                     moves)
        else:  # (one lane: epilogue_problem refuses more)
            low = relocate(self.lowered, moves) if moves else self.lowered
            progs = [program(low, error=error, abort=self.abort_ptr,
                             flag_slot=self.flags.slot, unit=self.unit, epilogue=epilogue,
                             threads=self.threads)]
        # the launch reads stride_words words of a program: every program of this collective
        # (relocated: as long; with an epilogue: one op and one source entry more) is that
        # long, padded
        if self.program_words is None:
            self.program_words = max(p.words.size for p in progs) + self.SPARE_WORDS
        # (a program ending with an epilogue is written from the rank's own ops, which may
        # take more words than self.ops', and a user epilogue's extra words may run past it:
        # its launcher reads more, _grid_launcher)
        table, _, _ = pack(torch, self.path.device, [p.words for p in progs],
                           self.program_words, False)
        return table, progs

    def _epilogue_kernel(self, moves, words: torch.Tensor, dst, norm):
        """(why not, program, launcher) for the program ``words`` that this rank's table,
        relocated by ``moves``, ends with the epilogue ``norm`` in: the one-shot kernel built
        for the epilogue where it runs the program (a user epilogue runs nowhere else; the
        built-in (residual, weight, eps) runs there as the user epilogue ``rms_norm``, unless
        ``epilogue_kernel`` is "fused"), else the fused kernel with the NORM op."""
        from purlin.atom.epilogue import rms_norm
        from purlin.atom.fused import oneshot_problem
        from purlin.atom.sm_kernel import one_shot_kernel

        user = hasattr(norm, "form")
        if not user and (self.epilogue_kernel == "fused"
                         or oneshot_problem(words.cpu().numpy())):
            self.norm_kernel = "fused-norm"
            return None, words, self._grid_launcher("fused-norm", words.numel())
        if not user:  # (its program also holds the addresses the generic kernel reads)
            norm = rms_norm(*norm)
            words, _ = self._program(moves, self._epilogue(dst, norm))
        name, why = one_shot_kernel(norm, self.output, words.cpu().numpy())
        if why:
            return (f"a user epilogue runs on the one-shot kernel, which cannot run it: {why}",
                    None, None)
        self.norm_kernel = "generic"
        return None, words, self._grid_launcher(name, words.numel())

    def _grid_launcher(self, kernel: str, words: int = 0):
        """A launcher of fused ``kernel`` ("fused", "fused-copy", "fused-norm" or an
        epilogue's one-shot kernel) on this collective's grid, reading programs of this
        collective's length or of ``words`` where longer (a user epilogue's extras: a block
        loads its program's first words into shared memory, and reads them there)."""
        from purlin.atom.sm_kernel import launcher

        return launcher(self.path._launchers, device=self.path.device.index,
                        nranks_in_launch=1, nlanes=1, blocks_per_lane=self.blocks_per_lane,
                        threads=self.threads, kernel=kernel,
                        stride_words=max(self.program_words, int(words)), pdl=self.pdl)

    MAX_MOVED = 128  # relocated tables kept outside graph captures (least recently used go)

    def movable(self, src: torch.Tensor | None, dst: torch.Tensor | None,
                capturing: bool = False) -> tuple[bool, bool]:
        """(use ``src`` as the input, use ``dst`` as the output): where no peer touches that
        buffer of this rank (``lowering.local_buffers``), the tensor is contiguous, as large,
        and as aligned within 16 bytes as the staging region (the lowering's barrier choices
        depend on alignment). When ``src`` and ``dst`` overlap (in place) only the output
        moves: the input is then copied in first and read from staging. Inside a graph
        capture only a pair an eager call already used can move (a new relocated table
        cannot be written while capturing)."""
        def fits(t, region, buffer):
            return (t is not None and buffer in self.local and region is not None
                    and t.is_contiguous() and t.numel() == region.numel()
                    and t.dtype == region.dtype and t.device == region.device
                    and t.data_ptr() % 16 == region.data_ptr() % 16)

        move_in = fits(src, self.input, "input")
        move_out = fits(dst, self.output, "output")
        if move_in and move_out and overlap(src, dst):
            move_in = False
        if not (move_in or move_out):
            return False, False
        src, dst = src if move_in else None, dst if move_out else None
        if capturing and self._key(src, dst) not in self._moved:
            return False, False
        if self.fused and not capturing and self._relocated(src, dst, capturing) is None:
            return False, False  # the fused kernel cannot run the relocated rows
        return move_in, move_out

    def norm_problem(self, src, dst, norm: tuple, capturing: bool = False) -> str | None:
        """Why this rank's kernel cannot end with the epilogue ``norm`` = (residual, weight,
        eps) when it reads ``src`` / writes ``dst`` (as :meth:`launch`), or None -- it then
        has the program (made here, outside a graph capture)."""
        if not self.fused:
            return f"the size runs on the interpreter (protocol {self.protocol!r})"
        if capturing and self._key(src, dst, norm) not in self._moved:
            return ("first call with these tensors inside a CUDA graph capture (call it once "
                    "eagerly before capturing)")
        if self._relocated(src, dst, capturing, norm) is None:
            return self._refused.get(self._key(src, dst, norm)) or "refused"
        return None

    def epilogues(self) -> int:
        """How many programs ending with an epilogue this collective holds."""
        return sum(len(key) > 2 for key in self._moved)

    @staticmethod
    def _key(src, dst, norm=None) -> tuple:
        key = (src.data_ptr() if src is not None else 0,
               dst.data_ptr() if dst is not None else 0)
        if norm is not None and hasattr(norm, "key"):  # a user epilogue (purlin.Epilogue)
            key += norm.key()
        elif norm is not None:
            residual, weight, eps = norm
            key += (residual.data_ptr(), weight.data_ptr(), weight.numel(), float(eps))
        return key

    def _epilogue(self, dst, norm):
        """The :class:`purlin.atom.fused.Epilogue` for ``norm`` over ``dst`` (else the
        staging output), its row sums area made on first use."""
        from purlin.atom.fused import Epilogue, row_sums_bytes

        nbytes = self.output.numel() * self.output.element_size()
        words = row_sums_bytes(nbytes, self.unit, self.threads) // 8
        if self.sums is None or self.sums.numel() < words:
            self.sums = torch.zeros(words, dtype=torch.int64, device=self.path.device)
        target = (dst if dst is not None else self.output).data_ptr()
        if hasattr(norm, "record"):  # a user epilogue, on rows of its hidden
            return norm.record(target, self.sums.data_ptr(),
                               norm.check(self.output, norm.hidden)["hidden"])
        residual, weight, eps = norm
        return Epilogue(target, residual.data_ptr(), weight.data_ptr(), self.sums.data_ptr(),
                        weight.numel(), float(eps))

    def _relocated(self, src, dst, capturing: bool, norm=None) -> tuple | None:
        """(device address, launcher or None: the collective's) of the table (or fused
        program) that reads ``src`` / writes ``dst`` (and ends with the epilogue ``norm``);
        None where the fused kernel cannot run it."""
        from purlin.atom.fused import epilogue_problem, fuse_problem
        from purlin.atom.lowering import relocate
        from purlin.atom.sm import rank_blob

        key = self._key(src, dst, norm)
        if key in self._refused:
            return None
        found = self._moved.get(key)
        if found is None:
            launcher, moves = None, {}
            for t, region in ((src, self.input), (dst, self.output)):
                if t is not None:
                    nbytes = region.numel() * region.element_size()
                    moves[(region.data_ptr(), nbytes)] = t.data_ptr()
            low = relocate(self.lowered, moves)
            if self.fused:  # the same call counters: one epoch
                everyone = list(self.all_lowered)
                everyone[self.path.rank] = low
                # the tables themselves were checked when prepared: only moved ones again
                problem = fuse_problem(everyone, self.unit) if moves else None
                epilogue = self._epilogue(dst, norm) if norm is not None else None
                if problem is None and epilogue is not None:
                    problem = epilogue_problem(low, epilogue, self.unit, self.threads)
                if problem:
                    self._refused[key] = problem
                    return None
                found, _ = self._program(moves, epilogue)
                if epilogue is not None:  # (never while capturing: a new key is refused then)
                    why, found, launcher = self._epilogue_kernel(moves, found, dst, norm)
                    if why:
                        self._refused[key] = why
                        return None
            else:  # the relocated block counts calls in this one's control words: one epoch
                found, _ = rank_blob(torch, low, self.path.device, self.abort_ptr,
                                     self.schedule.lanes, control=self.control.data_ptr())
            run = launcher or self.kernel.launcher
            # (a program's words past what the launch reads of it: garbage)
            if self.fused and found.numel() > run.head_words * run.nranks_in_launch:
                raise ExecutionError(f"rank {self.path.rank}: fused programs of "
                                     f"{found.numel()} words under a launcher reading "
                                     f"{run.head_words * run.nranks_in_launch} (a bug: "
                                     "please report it)")
            found = self._moved[key] = (found, launcher)
            if len(self._moved) > self.MAX_MOVED + len(self._pinned):
                # a launch still queued may read the oldest table: let it finish (rare)
                torch.cuda.synchronize(self.path.device)
                while len(self._moved) > self.MAX_MOVED + len(self._pinned):
                    old = next(k for k in self._moved if k not in self._pinned)
                    del self._moved[old]
        self._moved.move_to_end(key)
        if capturing:
            self._pinned.add(key)  # the graph keeps this block's address
        return found[0].data_ptr(), found[1]

    def error(self) -> str | None:
        """The error this rank's executor recorded, as a sentence (call after a synchronize)."""
        sums = {} if self.sums is None else {
            self.path.rank: (self.sums.data_ptr(), self.sums.numel() * 8)}
        found = self.core.errors(sums, ask=True)
        return found[0][2] if found else None

    def release(self) -> None:
        self._keep = ()
        self.input = self.output = None
        self._moved.clear()


class SmPath:
    """Symmetric staging memory on this rank's GPU for the ranks of ``group``."""

    name = "sm"
    dtypes = DTYPES

    def __init__(self, group, rank: int, nranks: int, nbytes: int, timeout: float, *,
                 device=None, blocks_per_lane=None, threads: int = DEFAULT_THREADS, **_):
        if not torch.cuda.is_available():
            raise CapabilityError("the sm datapath needs a CUDA GPU; none is visible here "
                                  "(use datapath='cpu')")
        import torch.distributed._symmetric_memory as symm_mem

        self.group, self.rank, self.nranks, self.timeout = group, rank, nranks, timeout
        self.device = torch.device("cuda", torch.cuda.current_device()) if device is None \
            else torch.device(device)
        self.blocks_per_lane, self.threads = blocks_per_lane, threads
        from purlin.atom.sm import gpu_of

        self.gpu = gpu_of(torch, self.device.index)  # what launches are sized for
        self.sms = self.gpu.sms
        self.handle, self._peer_bufs = None, []
        if _share_a_gpu(group, self.device):
            self.buf, self.ptrs, self._peer_bufs = _ipc_rendezvous(group, rank, nbytes,
                                                                   self.device)
        else:
            self.buf = symm_mem.empty(int(nbytes), dtype=torch.uint8, device=self.device)
            enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
            if enable is not None:  # needed before PyTorch 2.9, a deprecated no-op after
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    enable(group.group_name)
            self.handle = symm_mem.rendezvous(self.buf, group.group_name)
            # buffer_ptrs point at the tensor on newer PyTorch, at its allocation on older
            # ones: peers hold the tensor at the same offset either way
            shift = self.buf.data_ptr() - int(self.handle.buffer_ptrs[rank])
            self.ptrs = [int(p) + shift for p in self.handle.buffer_ptrs]
        self._launchers: dict = {}
        self.prepared: list[SmPrepared] = []

    def view(self, offset: int, count: int, dtype) -> torch.Tensor:
        item = torch.empty((), dtype=dtype).element_size()
        return self.buf[offset: offset + count * item].view(dtype)

    def prepare(self, schedule, offset: int, lay, blocks_per_lane=None, *,
                protocol: str = "simple", pdl: bool = False,
                row_bytes: int | None = None, epilogue_grid=None,
                epilogue_kernel: str = "auto") -> SmPrepared:
        """Lower ``schedule`` at ``offset`` of the area and zero this rank's flags there (the
        caller then waits for every rank). Blocks per lane: the communicator's setting, else
        ``blocks_per_lane`` (a tuning table's), else the datapath's default for the size (the
        fused kernel's: :func:`purlin.atom.fused.grid`). ``protocol`` / ``pdl``: as
        :class:`SmPrepared` (a fused protocol needs a layout with ``block_flags``);
        ``row_bytes``: an all-reduce for the RMSNorm epilogue over rows that long, on
        ``epilogue_grid`` with ``epilogue_kernel`` (see :class:`purlin.torch.Communicator`)."""
        p = SmPrepared(self, schedule, offset, lay, self.blocks_per_lane or blocks_per_lane,
                       self.threads, protocol=protocol, pdl=pdl, row_bytes=row_bytes,
                       epilogue_grid=epilogue_grid, epilogue_kernel=epilogue_kernel)
        self.buf[offset: offset + lay.control_end].zero_()  # flags, abort, slots per block
        if lay.has_ll:  # tags restart at 1: no unit left by an earlier tenant may match
            at = offset + lay.offset(self.rank, "ll")
            self.buf[at: at + lay.ll_bytes[self.rank]].zero_()
        self.prepared.append(p)
        return p

    def barrier(self) -> None:
        """Every rank's work issued so far has finished (synchronize, all-reduce, synchronize)."""
        torch.cuda.synchronize(self.device)
        token = torch.zeros(1, device=self.device)
        dist.all_reduce(token, group=self.group)
        torch.cuda.synchronize(self.device)

    quiesce = barrier

    def announce(self, call) -> None:
        """Nothing to write: the GPU path compares calls on first use only (:meth:`agree`)."""

    def agree(self, call) -> None:
        """:meth:`barrier` that also gathers every rank's fingerprint of ``call``
        (:mod:`purlin.runtime.fingerprint`): CallMismatchError on every rank naming what each
        called when they differ."""
        from purlin.errors import CallMismatchError
        from purlin.runtime.fingerprint import WORDS, Call, disagreement
        from purlin.torch.common import gather_into

        torch.cuda.synchronize(self.device)
        mine = torch.tensor(call.encode(), dtype=torch.int64, device=self.device)
        every = torch.empty(self.nranks * WORDS, dtype=torch.int64, device=self.device)
        gather_into(every, mine, group=self.group)
        seen = [Call.decode(w) for w in every.view(self.nranks, WORDS).tolist()]  # synchronizes
        why = disagreement(seen, call.index)
        if why:
            raise CallMismatchError(f"rank {self.rank}: {why}")

    def check(self, prepared) -> list[str]:
        """Synchronize and return the errors recorded by any of ``prepared``."""
        torch.cuda.synchronize(self.device)
        errors = [e for e in (p.error() for p in prepared) if e]
        return errors

    def forget(self, prepared: SmPrepared) -> None:
        if prepared in self.prepared:
            self.prepared.remove(prepared)
        prepared.release()

    def close(self) -> None:
        self.prepared = []
        self._launchers = {}
        self._peer_bufs = []


def _share_a_gpu(group, device) -> bool:
    """Do two ranks of ``group`` run on the same GPU (one GPU, a process per rank)? PyTorch's
    symmetric memory refuses such a group; :func:`_ipc_rendezvous` maps it instead."""
    mine = (socket.gethostname(), str(torch.cuda.get_device_properties(device).uuid))
    every = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, mine, group=group)
    return len(set(every)) < len(every)


def _ipc_rendezvous(group, rank: int, nbytes: int, device):
    """This rank's staging buffer and every rank's address of its peers' (CUDA IPC through
    the group: ``torch.multiprocessing``'s sharing of CUDA tensors between processes). For
    ranks sharing one GPU; each peer's mapping is kept until the path closes."""
    from torch.multiprocessing.reductions import reduce_tensor

    buf = torch.zeros(int(nbytes), dtype=torch.uint8, device=device)
    torch.cuda.synchronize(device)
    rebuild, args = reduce_tensor(buf)
    every = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, args, group=group)
    peers = [buf if r == rank else rebuild(*a) for r, a in enumerate(every)]
    dist.barrier(group=group)  # every rank holds its peers' mappings before any is used
    return buf, [int(p.data_ptr()) for p in peers], peers
