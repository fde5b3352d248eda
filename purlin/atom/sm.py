"""The sm datapath: Numba CUDA executor kernels over NVLink, driven from PyTorch tensors.

Binding a schedule allocates everything once (input, output and scratch buffers, flags, control
words, instruction tables, launchers); a call only launches one executor per device (one for
all ranks of a virtual cluster). Buffers are PyTorch tensors, launches go on PyTorch's current
stream, so a bound collective can be captured in a ``torch.cuda.CUDAGraph``: flags only grow,
and replays need no reset.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from purlin.atom.sm_kernel import fused_unit_or_refuse
from purlin.errors import CapabilityError, ExecutionError, PurlinTimeoutError
from purlin.kernels import isa
from purlin.snac.planner import Capabilities

CAPABILITIES = Capabilities(name="sm", can_reduce=True)
RUNS_ON = ("local", "virtual")  # cluster kinds (purlin.atom's registry)
TORCH_DTYPES = ("bfloat16", "float16", "float32", "int32", "float8_e4m3fn", "float8_e5m2")


def _torch():
    try:
        import torch
    except ModuleNotFoundError:
        raise CapabilityError("the sm datapath needs PyTorch with CUDA: pip install torch") \
            from None
    if not torch.cuda.is_available():
        raise CapabilityError("the sm datapath needs a CUDA GPU; none is visible here "
                              "(use Cluster.cpu(n) for the cpu datapath)")
    return torch


def check_dtype(name: str, datapath: str = "sm", moves=TORCH_DTYPES) -> None:
    """Raise CapabilityError unless ``datapath`` moves dtype ``name`` (no GPU needed).

    >>> check_dtype("float64")
    Traceback (most recent call last):
    purlin.errors.CapabilityError: the sm datapath moves bfloat16, float16, float32, int32, \
float8_e4m3fn, float8_e5m2, not float64
    """
    if name not in moves:
        raise CapabilityError(f"the {datapath} datapath moves {', '.join(moves)}, not {name}")


def check_fp8_reduction(schedule, datapath: str = "sm") -> None:
    """Raise CapabilityError unless an FP8 reduction of ``schedule`` rounds once: the GPU
    kernels keep FP8 in FP8 buffers, so every element must be reduced by one step over all
    its contributions (a sum built hop by hop -- ring, recursive doubling -- would round at
    every hop). Other dtypes and copy collectives pass."""
    if not (schedule.dtype.startswith("float8") and schedule.collective.op.is_reduce):
        return
    from purlin.snac.determinism import check_one_rounding

    problems = check_one_rounding(schedule)
    if problems:
        raise CapabilityError(
            f"the {datapath} datapath reduces FP8 in one rounding only, and "
            f"{schedule.title()} builds its sums hop by hop: {problems[0]}; use a strategy "
            "that sums every element in one step (direct-push, direct-pull, push-pull, "
            "two-phase, or strategy='auto'), or the cpu datapath, whose scratch holds float32")


def device_count() -> int:
    try:
        import torch
    except ModuleNotFoundError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def enable_peer_access(devices) -> None:
    """Enable peer access between every pair of ``devices``, both ways, through Numba's
    context API (a kernel touching peer memory without it kills the CUDA context; PyTorch's
    own copies do not enable it for kernels)."""
    from numba import cuda
    from numba.cuda.cudadrv.driver import CudaAPIError

    contexts = {}
    for d in devices:
        with cuda.gpus[d]:
            contexts[d] = cuda.current_context()
    for a in devices:
        for b in devices:
            if a == b:
                continue
            with cuda.gpus[a]:
                if not contexts[a].can_access_peer(b):
                    raise CapabilityError(f"GPU {a} cannot access GPU {b} directly (no "
                                          "NVLink/P2P); the sm datapath needs peer access")
                try:
                    contexts[a].enable_peer_access(contexts[b].handle)
                except CudaAPIError as exc:
                    if int(exc.code) != 704:  # CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED
                        raise CapabilityError(f"enabling peer access from GPU {a} to GPU {b} "
                                              f"failed: {exc}") from None


def local_devices(n=None) -> tuple[int, ...]:
    """The first ``n`` visible GPUs (all of them by default), peer access enabled both ways."""
    torch = _torch()
    count = torch.cuda.device_count()
    n = count if n is None else n
    if n > count:
        raise CapabilityError(f"Cluster.local({n}) needs {n} GPUs; {count} are visible")
    devices = tuple(range(n))
    enable_peer_access(devices)
    return devices


def check_device(device) -> None:
    """Raise CapabilityError unless GPU ``device`` is visible."""
    torch = _torch()
    if device >= torch.cuda.device_count():
        raise CapabilityError(f"GPU {device} is not visible ({torch.cuda.device_count()} GPUs)")


PROTOCOLS = ("simple", "ll", "fused", "fused-ll")  # overrides; not naming one is the fast path


def is_fused(protocol: str) -> bool:
    """Does ``protocol`` run the fused kernel? ("fused", "fused-ll"; "simple" and "ll" run the
    interpreter.)"""
    return protocol in ("fused", "fused-ll")


LL_MAX_BYTES = 256 << 10  # where LL can pay: it doubles the bytes on the wire
FUSED_MAX_BYTES = 16 << 20  # where the fused kernel is tried (tuning candidates)


def fast_protocol(schedule) -> str:
    """The protocol a bind runs ``schedule`` with when none is named: the fused kernel where
    it runs the plan (on LL transfers up to :data:`LL_MAX_BYTES`, else 16-byte items), else
    the interpreter (LL up to that size where the lowering sends pairs so, else "simple").

    >>> from purlin.snac import plan
    >>> from purlin.spec import collectives
    >>> fast_protocol(plan(collectives.all_reduce(4), "direct-push", nbytes=8192))
    'fused-ll'
    >>> fast_protocol(plan(collectives.all_reduce(4), "direct-push", nbytes=1 << 20))
    'fused'
    >>> fast_protocol(plan(collectives.all_reduce(4), "ring", nbytes=1 << 20, chunks=4, lanes=2))
    'fused'

    (A plan of several lanes runs a program a lane, side by side: ``purlin.atom.fused_lanes``.)
    """
    from purlin.atom.fused import fused_problems
    from purlin.atom.lowering import ll_transfers

    small = schedule.sizing.message_bytes <= LL_MAX_BYTES
    problems = fused_problems(schedule)
    for protocol in ("fused-ll", "fused") if small else ("fused",):
        if problems[protocol] is None:
            return protocol
    return "ll" if small and ll_transfers(schedule) else "simple"


def bind(cluster, schedule, *, timeout: float = 5.0, blocks_per_lane: int | None = None,
         threads: int | None = None, trace_rows: int = 0, protocol: str | None = None,
         pdl: bool | None = None, fallback: bool = False, fit: bool = False, epilogue=None):
    """Bind ``schedule`` on the sm datapath. ``protocol="ll"`` sends each Stage + Notify pair
    that ``purlin.atom.lowering.ll_transfers`` finds safe as LL units (flags inside the data:
    no release fence, no separate flag hop; twice the bytes on the wire), by default with one
    block per lane. ``protocol="fused"`` runs a one-lane schedule on the fused kernel
    (:mod:`purlin.kernels.fused`) instead of the interpreter: every thread moves the same
    16-byte items of every row on every rank and each flag has a slot per block, so a block
    waits only for the same block of its peers and nothing needs a lane barrier;
    ``"fused-ll"`` does that with the LL transfers (read in place: no scratch round trip; a
    thread takes one 8-byte LL unit at a time, or half of one where every row is a 4-byte
    multiple but not an 8-byte one).
    ``blocks_per_lane`` is then the blocks of each rank (by default about one item per thread,
    :func:`purlin.atom.fused.grid`); a schedule the fused kernel cannot run is refused with
    the reason (:func:`purlin.atom.fused.fused_unit`) -- or, with ``fallback=True`` (what
    ``strategy="auto"`` asks for: a tuning table's choice for a nearby size), run by the
    interpreter with the same signalling ("ll" or "simple") and its default blocks.
    ``pdl=True`` (sm_90+) launches with programmatic dependent launch, overlapping each call's
    launch with the end of the kernel before it.

    Blocks and threads not given are sized to the device (:func:`size_launch`): every block
    of a launch (all ranks of a virtual cluster share one) is resident at once. An explicit
    ``blocks_per_lane`` or ``threads`` that cannot fit is refused with what would; with
    ``fit=True`` (``strategy="auto"``: a tuning table's blocks, measured on another cluster)
    ``blocks_per_lane`` is only a wish, cut down to what fits.

    ``epilogue`` (an all-reduce): a :class:`purlin.atom.epilogue.Epilogue` per rank (or one
    for all) run on the sums -- inside the one-shot kernel where it runs (asked for with
    ``"fused-ll"``, else tried at an LL size), otherwise by the epilogue kernel after the
    all-reduce's own launch on ``protocol`` (:func:`purlin.atom.sm_epilogue.bind_epilogue`);
    ``kernel`` on the result says which.

    ``protocol`` not given: the fast path, :func:`fast_protocol` (the fused kernel where it
    runs the plan, else the interpreter; with PDL on the fused kernel where the GPU has it),
    falling back to the interpreter where the fused bind refuses a launch no one asked for.
    Name a protocol to compare paths (``PROTOCOLS``); ``pdl`` not given is then off."""
    if protocol is not None and protocol not in PROTOCOLS:
        raise CapabilityError(f"protocol must be one of {', '.join(PROTOCOLS)} (or none: the "
                              f"fast path), got {protocol!r}")
    if protocol is None and epilogue is None:
        protocol = fast_protocol(schedule)
        fallback = fallback or (blocks_per_lane is None and threads is None)
        if pdl is None:
            pdl = is_fused(protocol) and _has_pdl(cluster)
    pdl = pdl if epilogue is not None else bool(pdl)
    options = dict(timeout=timeout, trace_rows=trace_rows, pdl=pdl, fit=fit)
    if epilogue is not None:  # (it binds the all-reduce here again, without the epilogue)
        from purlin.atom.sm_epilogue import bind_epilogue

        return bind_epilogue(cluster, schedule, protocol=protocol, fallback=fallback,
                             epilogue=epilogue, blocks_per_lane=blocks_per_lane,
                             threads=threads, **options)
    try:
        return SmBound(cluster, schedule, blocks_per_lane=blocks_per_lane, threads=threads,
                       protocol=protocol, **options)
    except CapabilityError:
        if not (fallback and is_fused(protocol)):
            raise
    return SmBound(cluster, schedule, blocks_per_lane=None, threads=None,
                   protocol="ll" if protocol == "fused-ll" else "simple", **options)


def _has_pdl(cluster) -> bool:
    """Do all of ``cluster``'s GPUs launch with programmatic dependent launch (sm_90+)? (No
    GPU visible: no; the bind then says what is missing.)"""
    try:
        torch = _torch()
    except CapabilityError:
        return False
    return all(torch.cuda.get_device_capability(d) >= (9, 0) for d in set(cluster.devices))


def default_blocks_per_lane(message_bytes: int, lanes: int, sms: int = 132) -> int:
    """About 16 KiB of the message per block (a block pushes ~20 GB/s over NVLink), within
    one block per SM for the whole launch; one block for small messages (what
    :func:`size_launch` asks for before fitting it to the device)."""
    want = max(1, min(sms // max(lanes, 1), message_bytes // (16 * 1024)))
    return int(want)


THREAD_CHOICES = (512, 256, 128, 64, 32)  # an interpreter block's threads, preferred first


@dataclass(frozen=True)
class Gpu:
    """What launch sizing needs of a device: its index, SM count and the registers per thread
    the kernel is counted with (None: the launch bound's limit). Tests pass a made-up one.

    >>> Gpu(0, 132).resident(512), Gpu(0, 132).resident(128)
    (132, 528)
    """

    index: int
    sms: int
    registers: int | None = None

    def resident(self, threads: int) -> int:
        from purlin.kernels.occupancy import resident_blocks

        return resident_blocks(self.sms, threads, self.registers)


def gpu_of(torch, device: int) -> Gpu:
    return Gpu(int(device), torch.cuda.get_device_properties(device).multi_processor_count)


def size_launch(gpu: Gpu, *, lanes: int, ranks: int, want: int, blocks_per_lane=None,
                threads=None, kind: str = "local") -> tuple[int, int]:
    """(blocks per lane, threads) of a launch of ``ranks`` ranks of ``lanes`` lanes on
    ``gpu`` that all fit at once. ``blocks_per_lane`` / ``threads``: what the caller asked
    for, kept or refused with what would fit; otherwise ``want`` blocks per lane (the size's
    default, or a tuning table's) on the most threads (of :data:`THREAD_CHOICES`) at which
    every lane gets a block, as many of ``want`` as fit.

    >>> size_launch(Gpu(0, 132), lanes=1, ranks=4, want=64)
    (33, 512)
    >>> size_launch(Gpu(0, 132), lanes=64, ranks=8, want=1)
    (1, 128)
    >>> size_launch(Gpu(0, 132), lanes=1, ranks=4, want=1, blocks_per_lane=64)
    Traceback (most recent call last):
    purlin.errors.CapabilityError: 256 blocks of 512 threads (4 rank(s) x 1 lane(s) x 64 blocks \
per lane) cannot all be resident on GPU 0 (132 SMs, 1 such block each): at most 33 blocks per \
lane fit: pass blocks_per_lane<=33, or threads<=256
    """
    lanes, ranks = max(1, int(lanes)), max(1, int(ranks))
    choices = (int(threads),) if threads else THREAD_CHOICES
    if blocks_per_lane is not None:
        bpl, t = int(blocks_per_lane), choices[0]
        if bpl * lanes * ranks <= gpu.resident(t):
            return bpl, t
        raise CapabilityError(_overflow(gpu, lanes, ranks, bpl, t, kind))
    for t in choices:
        most = gpu.resident(t) // ranks // lanes
        if most >= 1:
            return max(1, min(int(want), most)), t
    raise CapabilityError(_overflow(gpu, lanes, ranks, 1, choices[-1], kind))


def interpreter_launch(schedule, gpu: Gpu, ranks: int, *, ll: bool = False,
                       blocks_per_lane=None, threads=None, fit: bool = False,
                       kind: str = "local") -> tuple[int, int]:
    """(blocks per lane, threads) of the interpreter running ``schedule`` with ``ranks`` of
    its ranks in one launch on ``gpu``: :func:`size_launch` wishing for the size's default
    (one block per lane with LL, the 8 KiB optimum on 2 x H200), or ``blocks_per_lane`` --
    a wish with ``fit``, else a request kept or refused."""
    wish = blocks_per_lane if fit else None
    want = wish or (1 if ll else default_blocks_per_lane(schedule.sizing.message_bytes,
                                                        schedule.lanes, gpu.sms))
    return size_launch(gpu, lanes=schedule.lanes, ranks=ranks, want=want,
                       blocks_per_lane=None if fit else blocks_per_lane, threads=threads,
                       kind=kind)


def fit_blocks(gpu: Gpu, blocks: int, threads: int, ranks: int, kind: str = "local",
               what: str = "blocks_per_lane", lanes: int = 1) -> None:
    """Refuse a fused launch of ``blocks`` blocks per lane of ``ranks`` ranks of ``lanes``
    programs each that cannot all be resident."""
    if blocks * ranks * lanes > gpu.resident(threads):
        raise CapabilityError(_overflow(gpu, lanes, ranks, blocks, threads, kind, what))


def fused_launch(gpu: Gpu, items: int, ranks: int, unit: int = 16, *, lanes: int = 1,
                 blocks=None, wish=None, threads=None,
                 kind: str = "local") -> tuple[int, int]:
    """(blocks per lane, threads) of a fused launch of ``ranks`` ranks of ``lanes`` programs
    each (``purlin.atom.fused_lanes``) of ``items`` items of ``unit`` bytes:
    :func:`purlin.atom.fused.grid`'s for the size where nothing is asked, ``wish`` cut to
    what fits, ``blocks`` kept or refused with what would fit.

    >>> fused_launch(Gpu(0, 132), 1 << 16, 4), fused_launch(Gpu(0, 132), 1 << 20, 4, wish=132)
    ((32, 512), (33, 512))
    """
    from purlin.atom.fused import grid, round_blocks

    slots = ranks * lanes
    default_blocks, default_threads = grid(items, slots, gpu.sms, unit)
    threads = int(threads or default_threads)
    if blocks is not None:
        blocks = int(blocks)
        if blocks > isa.F_MAX_BLOCKS:
            raise CapabilityError(f"the fused kernel runs at most {isa.F_MAX_BLOCKS} blocks per "
                                  f"rank, got blocks_per_lane={blocks}")
        fit_blocks(gpu, blocks, threads, ranks, kind, lanes=lanes)
        return blocks, threads
    most = min(isa.F_MAX_BLOCKS, gpu.resident(threads) // slots)
    if most < 1:
        fit_blocks(gpu, 1, threads, ranks, kind, lanes=lanes)
    chosen = max(1, min(int(wish or default_blocks), most))
    return round_blocks(items, chosen, threads, most), threads  # (an odd size's last item)


def _overflow(gpu: Gpu, lanes, ranks, bpl, threads, kind, what="blocks_per_lane") -> str:
    """The refusal of a launch that does not fit, naming what would."""
    resident = gpu.resident(threads)
    most, per_sm = resident // ranks // lanes, resident // gpu.sms
    head = (f"{bpl * lanes * ranks} blocks of {threads} threads ({ranks} rank(s) x {lanes} "
            f"lane(s) x {bpl} blocks per lane) cannot all be resident on GPU {gpu.index} "
            f"({gpu.sms} SMs, {per_sm} such block{'s' if per_sm != 1 else ''} each): ")
    if most >= 1:
        fits = f"at most {most} blocks per lane fit: pass {what}<={most}"
        if lanes > 1 and resident // ranks // bpl >= 1:
            fits += f" or lanes<={resident // ranks // bpl}"
    else:
        fits = f"not even one block per lane fits: plan with lanes<={resident // ranks}"
    smaller = [t for t in THREAD_CHOICES if t < threads
               and bpl * lanes * ranks <= gpu.resident(t)]
    if smaller:
        fits += f", or threads<={smaller[0]}"
    if kind == "virtual":
        fits += ", or fewer virtual ranks"
    return head + fits


class SmBound:
    """A schedule bound to GPUs. ``inputs[r]``/``outputs[r]`` are the rank's tensors; write the
    inputs in place and call :meth:`launch` (no copies), or call the object with tensors.
    Its launches are those of a :class:`purlin.atom.prepared.PreparedKernel` (``core``) over
    the buffers allocated here."""

    def __init__(self, cluster, schedule, *, timeout, blocks_per_lane, threads, trace_rows,
                 protocol="simple", pdl=False, fit=False, epilogue=None):
        from purlin.atom.lowering import flag_slots, ll_transfers, scratch_layout
        from purlin.atom.prepared import PreparedKernel

        check_dtype(schedule.dtype)
        check_fp8_reduction(schedule)
        torch = _torch()
        self.cluster, self.schedule, self.timeout = cluster, schedule, timeout
        self.torch = torch
        n, lanes = schedule.nranks, schedule.lanes
        fused = is_fused(protocol)
        # (judged on the aligned scratch slots allocate_buffers makes room for)
        ll = protocol in ("ll", "fused-ll") and \
            len(ll_transfers(schedule, scratch_layout(schedule))) > 0
        devs = cluster.devices
        self.devices = devs
        groups: dict[int, list[int]] = {}
        for r, d in enumerate(devs):
            groups.setdefault(d, []).append(r)
        self.protocol = protocol
        self.inputs, self.outputs, self.scratch, self.flags, bases, self._scratch_bytes = \
            allocate_buffers(torch, schedule, devs, flag_slots(n, lanes), ll=ll)
        self.abort = torch.zeros(1, dtype=torch.int64, device=torch.device("cuda", devs[0]))
        # the fused kernel's flag slots, one per block of every flag (zeroed)
        self.block_flags = [torch.zeros(f.numel() * isa.F_MAX_BLOCKS, dtype=torch.int64,
                                        device=f.device) for f in self.flags] if fused else None
        self.core = PreparedKernel(
            torch, schedule, bases=bases, flags={r: f.data_ptr() for r, f in enumerate(self.flags)},
            slots={r: b.data_ptr() for r, b in enumerate(self.block_flags)} if fused else None,
            ll={r: (bases[(r, "ll")], self.scratch[r].data_ptr() + self.scratch[r].numel()
                    - bases[(r, "ll")]) for r in range(n)} if ll else None,
            scratch_bytes=self._scratch_bytes,
            groups=[(torch.device("cuda", d), ranks) for d, ranks in groups.items()],
            protocol=protocol, abort=self.abort.data_ptr(), gpu=gpu_of(torch, devs[0]),
            kind=cluster.kind, timeout=timeout, blocks_per_lane=blocks_per_lane,
            threads=threads, fit=fit, pdl=pdl)
        self.trace_rows = trace_rows
        self.traces = [None] * n  # the interpreter's records per rank (the fused kernel's:
        self._fused_traces = []   # per launch, _fused_trace_buffer)
        self.kernel = "interpreter"  # what runs a call (and a traced call)
        # the fused kernel's block b waits only for block b of its peers (trace.flows reads it)
        self.block_matched = fused
        wish, asked = (blocks_per_lane, None) if fit else (None, blocks_per_lane)
        if epilogue is not None:
            from purlin.atom.sm_epilogue import launch_epilogue

            self.kernel = f"{protocol} kernel with epilogue"
            launch_epilogue(self, asked, wish, threads, epilogue)
        elif fused:
            self.kernel = f"{protocol} kernel"
            # LL transfers go one 8-byte unit per thread (twice the threads polling at once,
            # as the hand-written LL floor kernel does), or half of one where rows are 4-byte
            # multiples; flags and plain copies 16 bytes
            unit = fused_unit_or_refuse(self.core.lowered, protocol, schedule.title())
            self.core.fused_kernels(unit, blocks=asked, wish=wish, threads=threads,
                                    options=self._fused_trace_buffer)
        else:
            if trace_rows:
                self.traces = [torch.zeros(lanes * self.blocks_per_lane * trace_rows
                                           * isa.TRACE_WIDTH, dtype=torch.int64,
                                           device=torch.device("cuda", d)) for d in devs]
            self.core.interpreter_kernels(self.traces, trace_rows)
        self._keep = self.core.keep
        self.launches = list(self.core.launches)  # (an epilogue kernel after: sm_epilogue)
        self.calls = 0
        torch.cuda.synchronize()

    # (what the prepared kernel holds, under the names callers and traces read)
    lowered = property(lambda self: self.core.lowered)
    flag_map = property(lambda self: self.core.flags)
    control = property(lambda self: self.core.control)
    gpu = property(lambda self: self.core.gpu)
    pdl = property(lambda self: self.core.pdl)
    blocks_per_lane = property(lambda self: self.core.blocks_per_lane)
    threads = property(lambda self: self.core.threads)
    timeout_ns = property(lambda self: self.core.timeout_ns)

    def _fused_trace_buffer(self, device, ranks) -> dict:
        """With ``trace_rows``: the traced fused kernel's Launcher options and its records for
        the ranks of one launch (every op of every block: ``trace_rows`` only switches it
        on), kept in ``self._fused_traces``; without, the untraced kernel."""
        from purlin.atom.fused import kernel_name

        progs = [p for r in ranks for p in self.core.programs[r]]  # (a slot each)
        # (the kernel compiled with what the programs need; traced, its twin runs the same ops)
        kernel = kernel_name((p.words for p in progs), traced=bool(self.trace_rows))
        if not self.trace_rows:
            return {"kernel": kernel}
        ops = max(p.ops for p in progs)
        buffer = self.torch.zeros(len(progs) * self.blocks_per_lane * ops * isa.TRACE_WIDTH,
                                  dtype=self.torch.int64, device=device)
        self._fused_traces.append((ranks, buffer, progs))
        return dict(kernel=kernel, trace=buffer.data_ptr(), trace_rows=ops)

    def _read_fused_trace(self):
        """The traced fused kernel's records per rank, as the interpreter's (table row, block,
        start, end): int64[blocks, table rows, 4], a lane's blocks after the lane before's
        (:mod:`purlin.atom.fused_trace`)."""
        from purlin.atom.fused_trace import lane_records

        out = [None] * self.schedule.nranks
        for ranks, buffer, progs in self._fused_traces:
            records = buffer.cpu().numpy().reshape(len(progs), self.blocks_per_lane, -1,
                                                   isa.TRACE_WIDTH)
            k = 0  # (rank r's slots: its programs, one a lane)
            for r in ranks:
                lanes = len(self.core.programs[r])
                out[r] = lane_records(self.lowered[r], self.core.programs[r],
                                      records[k:k + lanes])
                k += lanes
        return out

    # -- running -----------------------------------------------------------------------------
    def launch(self, streams=None) -> None:
        """Launch one call on every device (asynchronous; on each device's current stream, or
        on ``streams[device]`` given as raw stream handles)."""
        torch = self.torch
        for k in self.launches:
            d = k.device
            k.launch(streams[d] if streams else torch.cuda.current_stream(d).cuda_stream,
                     self.timeout_ns)
        self.calls += 1

    def capture(self, ops: int = 1) -> "GraphSet":
        """Capture ``ops`` back-to-back calls into one CUDA graph per device; replaying the set
        runs them again (flags keep growing, so nothing needs resetting)."""
        torch = self.torch
        graphs = []
        self.synchronize()
        for d in dict.fromkeys(k.device for k in self.launches):
            mine = [k for k in self.launches if k.device == d]  # in call order
            with torch.cuda.device(d):
                graph = torch.cuda.CUDAGraph()
                # a capture stream of this device: torch's default capture stream is shared by
                # all graphs of the process and belongs to whichever device made it first
                capture_stream = torch.cuda.Stream(device=d)
                with torch.cuda.graph(graph, stream=capture_stream):
                    stream = capture_stream.cuda_stream
                    for _ in range(ops):
                        for k in mine:
                            k.launch(stream, self.timeout_ns)
            graphs.append((d, graph))
        return GraphSet(self, graphs, ops)

    def synchronize(self) -> None:
        for d in sorted(set(self.devices)):
            self.torch.cuda.synchronize(d)

    def check(self) -> None:
        """Raise PurlinTimeoutError if any rank recorded a timed-out wait (synchronizes): the
        first timeout's sentence (:func:`purlin.atom.sm_kernel.describe`), else the first
        rank that gave up."""
        self.synchronize()
        sums = {r: (s.data_ptr(), s.numel() * 8)  # an epilogue's row sums, per rank
                for r, s in enumerate(getattr(self, "epilogue_sums", ()))}
        failed = self.core.errors(sums)
        if failed:
            _, _, why = min(failed, key=lambda e: (e[1] != isa.ERR_TIMEOUT, e[0]))
            raise PurlinTimeoutError(f"{why}; the bound collective must be bound again")

    def __call__(self, inputs=None, out=None, trace: bool = False):
        """Copy ``inputs`` (tensors, one per rank) in, run once, wait, check and return the
        outputs (views of the bound output buffers, or copies into ``out``)."""
        return call_with_tensors(self, inputs, out)

    def read_trace(self):
        """Raw trace records per rank: int64[blocks, trace_rows, 4] (row, sub, start, end);
        of the fused kernel, int64[blocks, table rows, 4] in the same format (sub: the block)."""
        self.synchronize()
        if self._fused_traces:
            return self._read_fused_trace()
        bpr = self.schedule.lanes * self.blocks_per_lane
        return [None if t is None else t.cpu().numpy().reshape(bpr, self.trace_rows, 4)
                for t in self.traces]

    def __repr__(self) -> str:
        return (f"<bound {self.schedule.title()} on {self.cluster}, {self.blocks_per_lane} "
                f"block(s) per lane>")


class GraphSet:
    """CUDA graphs of a bound collective, one per device, replayed together."""

    def __init__(self, bound, graphs, ops):
        self.bound, self.graphs, self.ops = bound, graphs, ops

    def replay(self) -> None:
        for _, graph in self.graphs:
            graph.replay()
        self.bound.calls += self.ops


def clock_pair(reference: int, device: int, rounds: int = 64):
    """Stamp arrays ``(t_send, t_remote, t_back)`` of a flag ping-pong between two GPUs (peer
    access must be enabled), for :func:`purlin.trace.measure_clocks`."""
    torch = _torch()
    from purlin.kernels.clock import pingpong

    flags = {d: torch.zeros(1, dtype=torch.int64, device=f"cuda:{d}") for d in (reference, device)}
    stamps = {d: torch.zeros(3 * rounds, dtype=torch.int64, device=f"cuda:{d}")
              for d in (reference, device)}
    streams = {d: torch.cuda.Stream(device=d) for d in (reference, device)}
    from numba import cuda

    from purlin.kernels.compat import small_grids

    for d, peer, first in ((device, reference, 0), (reference, device, 1)):
        # (one block on purpose: a ping-pong measures latency, not throughput)
        with cuda.gpus[d], small_grids():
            stream = cuda.external_stream(streams[d].cuda_stream)
            pingpong[1, 32, stream](flags[d].data_ptr(), flags[peer].data_ptr(),
                                    stamps[d].data_ptr(), rounds, first)
    for d in (reference, device):
        streams[d].synchronize()
    a = stamps[reference].cpu().numpy().reshape(rounds, 3)
    b = stamps[device].cpu().numpy().reshape(rounds, 3)
    return a[:, 0], b[:, 1], a[:, 2]


def allocate_buffers(torch, schedule, devices, flag_words: int, ll: bool = False):
    """Each rank's tensors on its device: input, output, scratch (all copies, each 16-byte
    rounded) and ``flag_words`` zeroed int64 flags; with the base addresses lowering needs
    and each rank's bytes per scratch copy. ``ll``: the scratch tensor also holds, after the
    copies, a zeroed LL area per copy (``bases[(rank, "ll")]``)."""
    from purlin.atom.lowering import ll_area_bytes, scratch_copy_bytes

    sizing = schedule.sizing
    tdt = getattr(torch, schedule.dtype)
    scratch_bytes = scratch_copy_bytes(schedule)  # 16-byte multiples, slots aligned
    inputs, outputs, scratch, flags, bases = [], [], [], [], {}
    for r in range(schedule.nranks):
        dev = torch.device("cuda", devices[r])
        plain = scratch_bytes[r] * schedule.scratch_copies
        extra = ll_area_bytes(scratch_bytes[r]) * schedule.scratch_copies if ll else 0
        inputs.append(torch.zeros(max(sizing.input_count(r), 1), dtype=tdt, device=dev))
        outputs.append(torch.zeros(max(sizing.output_count(r), 1), dtype=tdt, device=dev))
        scratch.append(torch.zeros(max(plain + extra, 16), dtype=torch.uint8, device=dev))
        flags.append(torch.zeros(flag_words, dtype=torch.int64, device=dev))
        bases[(r, "input")] = inputs[r].data_ptr()
        bases[(r, "output")] = outputs[r].data_ptr()
        bases[(r, "scratch")] = scratch[r].data_ptr()
        if ll:
            bases[(r, "ll")] = scratch[r].data_ptr() + plain
    return inputs, outputs, scratch, flags, bases, scratch_bytes


def call_with_tensors(bound, inputs=None, out=None):
    """One eager call of a GPU-bound collective (sm or ce): copy ``inputs`` (tensors or arrays,
    one per rank, None to keep what is there) into the bound input buffers, launch, wait,
    check for timeouts and return the outputs (views of the bound buffers, or copies into
    ``out``)."""
    torch, schedule = bound.torch, bound.schedule
    sizing = schedule.sizing
    if inputs is not None:
        if len(inputs) != schedule.nranks:
            raise ExecutionError(f"need {schedule.nranks} inputs, got {len(inputs)}")
        for r, x in enumerate(inputs):
            if x is None:
                continue
            x = _as_tensor(torch, x)
            want = sizing.input_count(r)
            if x.numel() != want:
                raise ExecutionError(f"input of rank {r} has {x.numel()} elements; this "
                                     f"binding expects {want}")
            if not x.is_contiguous():
                raise ExecutionError(f"input of rank {r} is not contiguous; pass "
                                     "x.contiguous()")
            dst = bound.inputs[r][:want]
            if x.dtype == torch.uint8 and dst.element_size() == 1:  # FP8 given as its bits
                dst = dst.view(torch.uint8)
            dst.copy_(x.reshape(-1).to(dst.dtype))
    bound.launch()
    bound.check()
    outs = [bound.outputs[r][:sizing.output_count(r)] for r in range(schedule.nranks)]
    if out is not None:
        for o, v in zip(out, outs):
            o.reshape(-1).copy_(v)
        return out
    return outs


def rank_blob(torch, low, device, abort_ptr: int, nlanes: int, trace=None,
              trace_rows: int = 0, control: int | None = None):
    """One rank's executor block on ``device`` (purlin.atom.lowering.build_blob: descriptor,
    control words, lane offsets, tables, source pool). Returns the block and a view of its
    control words (epoch, done counter, error record); with ``control``, the descriptor
    uses the control words at that address instead (another block of the same rank)."""
    from purlin.atom.lowering import CONTROL_AT, CONTROL_WORDS, blob_size, build_blob

    blob = torch.zeros(blob_size(low, nlanes), dtype=torch.int64, device=device)
    words = build_blob(blob.data_ptr(), low, nlanes, abort_ptr,
                       trace.data_ptr() if trace is not None else 0, trace_rows, control)
    blob.copy_(torch.from_numpy(words))
    return blob, blob[CONTROL_AT: CONTROL_AT + CONTROL_WORDS]


def _as_tensor(torch, x):
    if isinstance(x, torch.Tensor):
        return x
    return torch.as_tensor(np.asarray(x))


