"""The ce datapath: copy engines move the bytes, stream memory operations order them.

A copy is ``cudaMemcpyAsync`` between peers (a copy engine; no SM), a Notify an atomic add on the
flag in the owner's memory and a wait a ``GEQ`` stream wait, both ``cuStreamBatchMemOp``
operations; one CUDA stream per (rank, lane). Copy engines cannot reduce, so the datapath
reports ``Capabilities(name="ce", can_reduce=False, reduce_engine="sm")``: the planner puts
reductions on ``sm`` and the bound collective runs them with the existing executor kernel, fed
a table of only its sm steps and the waits and notifies that order them (mixed schedules).
How flags stay replayable in CUDA graphs: ``purlin.atom.ce_lowering``.

Bind through the cluster: ``Cluster.local(2).bind(collectives.all_gather(2), nbytes=1 << 26,
datapath="ce")``; then ``bound(inputs)``, ``bound.launch()`` or ``bound.capture(ops)`` exactly
as on the sm datapath.

>>> CAPABILITIES
Capabilities(name='ce', can_reduce=False, reduce_engine='sm')
>>> from purlin.spec import collectives
>>> auto_datapath(collectives.all_gather(2), nbytes=256 << 20, dtype="bfloat16")
'ce'
>>> auto_datapath(collectives.all_reduce(2), nbytes=256 << 20, dtype="bfloat16")
'sm'
"""

from __future__ import annotations

import time
import warnings

from purlin.atom.ce_lowering import (Record, assign_engines, ce_flag_slots, chain_lanes,
                                    lower_ce)
from purlin.errors import CapabilityError, ExecutionError, PurlinTimeoutError
from purlin.kernels import isa
from purlin.snac.planner import Capabilities

CAPABILITIES = Capabilities(name="ce", can_reduce=False, reduce_engine="sm")
RUNS_ON = ("local", "virtual", "cpu")  # a cpu cluster runs its mixed plans on the cpu path
TORCH_DTYPES = ("bfloat16", "float16", "float32", "int32", "float64", "float8_e4m3fn",
                "float8_e5m2")  # FP8: copies as bytes, its sums on sm in one rounding
DEFAULT_THREADS = 512
# where copy engines beat the sm datapath on 2 x H200 (with side copies): all-gather and
# all-to-all from 128 MiB (235 µs against 256-258), broadcast even at 128 MiB and ahead from
# 256 MiB; at 64 MiB sm was faster (138 against 145-160 µs), at 16 MiB twice as fast
AUTO_MIN_BYTES = 128 << 20
SAFE_CONNECTIONS = 32       # hardware queues per device under which ce graphs ran (ask_for_queues)
RELEASE_VALUE = 1 << 62     # written into every counter to free stuck waits after a timeout


def auto_datapath(collective, *, count=None, nbytes=None, dtype="float32", chunk_sizes=None,
                  sizing=None) -> str:
    """``"ce"`` for a pure copy of at least AUTO_MIN_BYTES (the largest per-rank buffer), where
    copy engines match SM bandwidth and leave the SMs to compute; ``"sm"`` otherwise."""
    if collective.op.is_reduce:
        return "sm"
    if sizing is None:
        if count is None and nbytes is None and chunk_sizes is None:
            return "sm"
        sizing = collective.sized(count, nbytes=nbytes, dtype=dtype, chunk_sizes=chunk_sizes)
    return "ce" if sizing.message_bytes >= AUTO_MIN_BYTES else "sm"


def ask_for_queues() -> bool:
    """Ask CUDA for SAFE_CONNECTIONS hardware queues per device (its default is 8) unless the
    user chose a number or CUDA has already started in this process; return whether the
    process has (or will get) that many. With 8, CUDA graphs of this datapath hung on 2 x H200
    and with 32 they ran: streams beyond the queue count share queues, and a stream waiting on
    a counter then holds up the one behind it. ``Cluster.local`` and ``Cluster.virtual`` ask
    before they start CUDA, and a bind here asks again, so ``import purlin`` changes nothing."""
    import os

    from purlin.atom import ce_driver as drv

    if "CUDA_DEVICE_MAX_CONNECTIONS" not in os.environ and not _cuda_started():
        os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = str(SAFE_CONNECTIONS)
    return drv.max_connections() >= SAFE_CONNECTIONS


def _cuda_started() -> bool:
    """Has PyTorch or Numba started CUDA in this process (so the variable is read already)?"""
    import sys

    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return True
    numba_driver = sys.modules.get("numba.cuda.cudadrv.driver")
    return bool(numba_driver is not None and getattr(numba_driver.driver, "pid", None))


_warned_queues = False


def _warn_few_queues() -> None:
    """Warn, once per process, that CUDA runs with fewer queues than this datapath's graphs
    need (a plain call still runs; ``CeBound._check_connections`` refuses what cannot)."""
    global _warned_queues
    if _warned_queues or ask_for_queues():
        return
    from purlin.atom import ce_driver as drv

    _warned_queues = True
    warnings.warn(f"CUDA_DEVICE_MAX_CONNECTIONS={drv.max_connections()}: CUDA graphs of the ce "
                  "datapath hung with 8 hardware queues per device on 2 x H200 and ran with "
                  f"{SAFE_CONNECTIONS}; set CUDA_DEVICE_MAX_CONNECTIONS={SAFE_CONNECTIONS} "
                  "before CUDA starts (before the first torch.cuda call or Cluster.local)",
                  RuntimeWarning, stacklevel=3)


# GPU -> why: a ce collective could not be drained there. Anything that waits for that GPU
# (a bind's synchronize) would wait for ever, so binds on it fail at once instead.
STUCK: dict = {}


def refuse_stuck(devices) -> None:
    """Raise ExecutionError if a ce collective left one of ``devices`` stuck in this process.

    >>> refuse_stuck([0, 1])  # nothing stuck
    """
    for d in dict.fromkeys(devices):
        if d in STUCK:
            raise ExecutionError(f"GPU {d} still runs a stuck copy-engine collective ({STUCK[d]})"
                                 "; nothing more can be bound on it in this process")


def bind(cluster, schedule, *, timeout: float = 5.0, blocks_per_lane: int | None = None,
         threads: int = DEFAULT_THREADS, trace_rows: int = 0):
    problem = stage_lanes_problem(schedule)
    if problem:
        raise CapabilityError(problem)
    refuse_stuck(cluster.devices)
    _warn_few_queues()
    if trace_rows:
        raise CapabilityError("the ce datapath records no measured trace yet; use "
                              "purlin.trace.engines.predict_on_ce for its predicted timeline")
    return CeBound(cluster, schedule, timeout=timeout, blocks_per_lane=blocks_per_lane,
                   threads=threads)


def stage_lanes_problem(schedule) -> str | None:
    """Why the ce datapath will not run ``schedule``'s lanes by stage (None: it will).

    A copy-engine stream that waits for a peer's notify of the same call can hold up every
    stream that shares its hardware queue; lanes by stage then put such a wait ahead of
    transfers the peer is waiting for (2 x H200: a two-phase all-reduce with 2 lanes by stage
    hung in a graph replay). Lanes by stage whose copy-engine lanes only copy and notify (waits
    only on earlier calls' acknowledgements), with every same-call wait on the SMs, such as a
    direct-push all-reduce, are run.

    >>> from purlin.spec import collectives
    >>> from purlin.snac import plan
    >>> ar = collectives.all_reduce(2)
    >>> stage_lanes_problem(plan(ar, "direct-push", count=64, chunks=4, lanes=2,
    ...                          lanes_by="stage", capabilities=CAPABILITIES)) is None
    True
    >>> print(stage_lanes_problem(plan(ar, "two-phase", count=64, chunks=4, lanes=3,
    ...                                lanes_by="stage", capabilities=CAPABILITIES)))
    ... # doctest: +ELLIPSIS
    lanes by stage on the ce datapath: rank 0 step 10 (lane 2) waits on a copy engine for ...
    """
    if schedule.lanes_by == "piece":
        return None
    engines = assign_engines(schedule)
    for rank, steps in enumerate(schedule.steps):
        for i, step in enumerate(steps):
            same_call = [w for w in getattr(step, "waits", ()) if w.call == 0]
            if engines[rank][i] == "ce" and same_call:
                return (f"lanes by stage on the ce datapath: rank {rank} step {i} (lane "
                        f"{step.lane}) waits on a copy engine for {same_call[0].flag} of the "
                        "same call, and a stream that waits can hold up another lane's "
                        "transfers in a shared hardware queue (a graph replay hung so); use "
                        "lanes_by='piece', a strategy whose same-call waits are on the SMs "
                        "(direct-push), or the sm datapath")
    return None


FREE_SMS = 4   # SMs the sm part leaves free for the counter-add kernel (ce_driver.AddKernel)


def sm_part_blocks(requested, message_bytes: int, lanes: int, lanes_per_device: int, sms: int,
                   atomic_add: bool) -> int:
    """Blocks per lane of the ce datapath's sm part (its reductions).

    Where the driver cannot add to a counter from a stream, the copy engines' notifies and
    hand-offs are a one-block kernel, and the sm part's blocks spin on those counters: if they
    held every SM, that kernel could never start. So the sm part then leaves ``FREE_SMS`` SMs
    free; an explicit ``requested`` beyond that is refused.

    >>> sm_part_blocks(None, 64 << 20, 1, 1, 132, atomic_add=False)
    128
    >>> sm_part_blocks(None, 64 << 20, 1, 1, 132, atomic_add=True)
    132
    """
    from purlin.atom.sm import default_blocks_per_lane

    limit = sms if atomic_add else max(1, (sms - FREE_SMS) // max(lanes_per_device, 1))
    if requested is None:
        return min(default_blocks_per_lane(message_bytes, lanes, sms), limit)
    if requested > limit:
        raise CapabilityError(
            f"blocks_per_lane={requested} x {lanes_per_device} lane(s) per GPU would hold every "
            f"one of the {sms} SMs while the ce datapath's counter-add kernel needs one (this "
            f"driver has no stream atomic add); use at most {limit}")
    return int(requested)


# -- binding ------------------------------------------------------------------------------------
class CeBound:
    """A schedule bound to GPUs on the ce datapath; the same surface as the sm datapath's
    ``SmBound``: ``inputs[r]`` / ``outputs[r]`` tensors, ``launch()``, ``check()``,
    ``capture(ops)``, ``synchronize()`` and ``bound(inputs)``."""

    def __init__(self, cluster, schedule, *, timeout, blocks_per_lane, threads):
        from purlin.atom import ce_driver as drv
        from purlin.atom.sm import _torch, allocate_buffers, check_dtype

        self.closed = False
        check_dtype(schedule.dtype, "ce", TORCH_DTYPES)
        from purlin.atom.sm import check_fp8_reduction

        check_fp8_reduction(schedule, "ce")
        torch = _torch()
        self.cluster, self.schedule, self.timeout, self.torch = cluster, schedule, timeout, torch
        self.broken: str | None = None
        n, lanes = schedule.nranks, schedule.lanes
        sizing = schedule.sizing
        self.engines = assign_engines(schedule)
        uses_sm = any("sm" in e for e in self.engines)
        self.devices = devs = tuple(cluster.devices)
        self.support = {d: drv.device_support(d) for d in dict.fromkeys(devs)}
        self.atomic_add = all(sup["atomic_add"] for sup in self.support.values())
        bpl = 1
        if uses_sm:
            sms = min(torch.cuda.get_device_properties(d).multi_processor_count
                      for d in dict.fromkeys(devs))
            per_device = max(sum(1 for d in devs if d == dev) for dev in set(devs)) * lanes
            bpl = sm_part_blocks(blocks_per_lane, sizing.message_bytes, lanes, per_device, sms,
                                 self.atomic_add)
        self.blocks_per_lane, self.threads = bpl, threads
        self.inputs, self.outputs, self.scratch, self.flags, bases, scratch_bytes = \
            allocate_buffers(torch, schedule, devs, ce_flag_slots(n, lanes))
        self.control = [torch.zeros(2 + isa.ERR_WIDTH, dtype=torch.int64,
                                    device=torch.device("cuda", devs[r])) for r in range(n)]
        self.abort = torch.zeros(1, dtype=torch.int64, device=torch.device("cuda", devs[0]))

        def lowered(side_copies):
            return lower_ce(schedule, bases, {r: self.flags[r].data_ptr() for r in range(n)},
                            {r: self.control[r].data_ptr() for r in range(n)}, devs,
                            blocks_per_lane=bpl, scratch_bytes=scratch_bytes,
                            side_copies=side_copies)

        self.lowered = lowered(True)
        if max(self._streams().values()) > drv.max_connections():
            self.lowered = lowered(False)  # side streams only where the queues allow them
        self._initial_flags = []
        for r, low in enumerate(self.lowered.ranks):
            for addr, value in low.init.items():
                self.flags[r][(addr - self.flags[r].data_ptr()) // 8] = value
            self._initial_flags.append(self.flags[r].clone())
        for d, sup in self.support.items():
            if not sup["CAN_USE_64_BIT_STREAM_MEM_OPS"]:
                raise CapabilityError(f"GPU {d} does not offer 64-bit stream memory operations "
                                      "(CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS), "
                                      "which the ce datapath waits with")
        self._check_connections(drv)
        self._keep: list = []
        self.timeout_ns = int(timeout * 1e9)
        self._build(drv, torch, threads)
        self._warm_up(drv)
        self.calls = 0
        self._bound_calls: dict = {}
        self.synchronize()

    def _check_connections(self, drv) -> None:
        """Streams beyond the device's hardware queues share one, and a stream waiting on a
        counter would then hold up the stream behind it: refuse rather than risk a hang."""
        limit = drv.max_connections()
        for d, needed in self._streams().items():
            if needed > limit:
                raise CapabilityError(
                    f"the ce datapath needs {needed} streams on GPU {d} (one per active "
                    f"(rank, lane) plus the caller's) but the driver maps streams onto "
                    f"CUDA_DEVICE_MAX_CONNECTIONS={limit} hardware queues; a waiting stream "
                    "could block another one. Use fewer lanes, or set "
                    "CUDA_DEVICE_MAX_CONNECTIONS (up to 32) before CUDA starts")

    def _streams(self) -> dict:
        """Streams a call uses per device: one per active (rank, lane), side lanes included,
        and the caller's."""
        return {d: 1 + sum(1 for low in self.lowered.ranks if low.device == d
                           for ops in low.lanes[0] if ops)
                for d in dict.fromkeys(self.devices)}

    def _build(self, drv, torch, threads) -> None:
        from purlin.kernels.launch import Launcher

        low = self.lowered
        self.contexts = {d: drv.DeviceContext(d) for d in dict.fromkeys(self.devices)}
        self.resources, self.programs = {}, {}
        for d, ctx in self.contexts.items():
            ranks = [r for r in low.ranks if r.device == d]
            streams, events = {}, {}
            for r in ranks:
                for lane, ops in enumerate(r.lanes[0]):
                    if ops:
                        streams[(r.rank, lane)] = drv.create_stream(ctx)
                for lane_ops in (ops for per_parity in r.lanes for ops in per_parity):
                    for op in lane_ops:  # lane ends, side-copy forks
                        if isinstance(op, Record) and op.event not in events:
                            events[op.event] = drv.create_event(ctx)
            events[f"fork:d{d}"] = drv.create_event(ctx)
            events[f"end:d{d}"] = drv.create_event(ctx)
            launch = self._launcher(torch, Launcher, d, [r for r in ranks if r.sm is not None],
                                    threads)
            add_kernel = None if self.atomic_add else drv.AddKernel(d)
            res = drv.Resources(d, streams, events, launch, add_kernel,
                                self._pair_array_maker(torch, d), self.atomic_add)
            self.resources[d] = res
            for parity in range(low.parities):
                for chained in (False, True):
                    lane_ops = {}
                    for r in ranks:
                        lanes = r.lanes[parity]
                        lanes = chain_lanes(lanes, r.rank, self.schedule.lanes) \
                            if chained else lanes
                        lane_ops.update({(r.rank, lane): ops for lane, ops in enumerate(lanes)})
                    self.programs[(d, parity, chained)] = drv.compile_program(
                        low.programs[d][parity], lane_ops, res)
        # for check(): events to poll, and a stream with pinned buffers of its own to read and
        # release the counters while other streams are stuck
        self._sync_events = {d: drv.create_event(ctx) for d, ctx in self.contexts.items()}
        self._rescue_events = {d: drv.create_event(ctx) for d, ctx in self.contexts.items()}
        self._rescue = {d: drv.create_stream(ctx) for d, ctx in self.contexts.items()}
        self._host_counters = [torch.zeros(f.numel(), dtype=torch.int64, pin_memory=True)
                               for f in self.flags]
        self._release_values = torch.full((self.flags[0].numel(),), RELEASE_VALUE,
                                          dtype=torch.int64, pin_memory=True)

    def _warm_up(self, drv) -> None:
        """Launch every add kernel once (adding nothing) before any stream can wait, so that
        no first launch has to load a module while another GPU is blocked (see preload)."""
        for d, res in self.resources.items():
            if res.add_kernel is not None:
                r = self.devices.index(d)
                nothing = res.pair_array([(self.flags[r].data_ptr(), 0)])
                with self.contexts[d]:
                    res.add_kernel(nothing, 0, self._rescue[d])
        self.synchronize()

    def _pair_array_maker(self, torch, device):
        keep = self._keep  # not self: a closure holding the binding would keep it (and its
        # streams) alive until the cyclic garbage collector ran

        def make(pairs):
            t = torch.tensor([v for a, x in pairs for v in (a, _signed(x))], dtype=torch.int64,
                             device=torch.device("cuda", device))
            keep.append(t)
            return t.data_ptr()
        return make

    def _launcher(self, torch, Launcher, device, sm_ranks, threads):
        from purlin.kernels.executor import kernel_for

        if not sm_ranks:
            return None
        lanes = self.schedule.lanes
        descs = []
        for low in sm_ranks:
            dev = torch.device("cuda", device)
            even = torch.from_numpy(low.sm.tables[0]).to(dev)
            odd = torch.from_numpy(low.sm.tables[-1]).to(dev)
            offsets = torch.from_numpy(low.sm.lane_offsets).to(dev)
            srcs = torch.from_numpy(low.sm.srcs).to(dev)
            self._keep += [even, odd, offsets, srcs]
            ctl = self.control[low.rank].data_ptr()
            desc = [0] * isa.DESC_WIDTH
            desc[isa.D_RANK] = low.rank
            desc[isa.D_TABLE], desc[isa.D_TABLE_ODD] = even.data_ptr(), odd.data_ptr()
            desc[isa.D_LANES], desc[isa.D_NLANES] = offsets.data_ptr(), lanes
            desc[isa.D_SRCS] = srcs.data_ptr()
            desc[isa.D_EPOCH], desc[isa.D_DONE], desc[isa.D_ERROR] = ctl, ctl + 8, ctl + 16
            desc[isa.D_ABORT] = self.abort.data_ptr()
            descs.append(desc)
        table = torch.tensor(descs, dtype=torch.int64, device=torch.device("cuda", device))
        self._keep.append(table)
        launcher = Launcher(device=device, nranks_in_launch=len(sm_ranks), nlanes=lanes,
                            blocks_per_lane=self.blocks_per_lane, threads=threads,
                            kernel=kernel_for(t for low in sm_ranks for t in low.sm.tables))
        _check_resident(torch, device, launcher)
        if getattr(launcher, "_function", None) is not None:  # not under the simulator
            from purlin.atom.ce_driver import preload

            preload(launcher._function, device)
        desc_ptr, timeout_ns = table.data_ptr(), self.timeout_ns
        return lambda stream: launcher(desc_ptr, stream, timeout_ns)

    # -- running -----------------------------------------------------------------------------
    def launch(self, streams=None) -> None:
        """Enqueue one call on every device (asynchronous): on each device's current stream, or
        on ``streams[device]`` given as raw stream handles."""
        if self.closed:
            raise ExecutionError("this bound collective was closed: bind it again")
        if self.broken:
            raise ExecutionError(f"this bound collective failed earlier ({self.broken}); its "
                                 "counters no longer match: bind it again")
        torch = self.torch
        parity = self.calls % self.lowered.parities
        for d, ctx in self.contexts.items():
            main = streams[d] if streams else torch.cuda.current_stream(d).cuda_stream
            with ctx:
                self._issue(d, parity, main)
        self.calls += 1

    def _issue(self, device, parity, main, chained=False) -> None:
        from purlin.atom import ce_driver as drv

        key = (device, parity, int(main), chained)
        calls = self._bound_calls.get(key)
        if calls is None:
            calls = self._bound_calls[key] = drv.bind_main(
                self.programs[(device, parity, chained)], int(main))
        drv.issue(calls, self.resources[device])

    def capture(self, ops: int = 1, chain_lanes: bool = True,
                upload: str = "dry") -> "CeGraphSet":
        """Capture ``ops`` back-to-back calls into one CUDA graph per device (and, where the
        schedule alternates two scratch areas and ``ops`` is odd, a second set that starts on
        the other parity); replaying the set runs them again with nothing to reset.

        ``chain_lanes``: a rank's copy-engine lanes run one after another inside the graph
        (see ``ce_lowering.chain_lanes``); the executor still runs beside them.

        ``upload``: ``"dry"`` runs every graph once with its waits released before handing
        it out (see ``_upload``; the captured calls are then the graphs' second launches),
        ``"none"`` leaves the first launch to the first replay."""

        torch = self.torch
        _warn_few_queues()
        self.synchronize()
        parities = self.lowered.parities
        starts = [self.calls % parities]
        if parities == 2 and ops % 2:
            starts.append(1 - starts[0])
        sets = {}
        for start in starts:
            graphs = []
            for d, ctx in self.contexts.items():
                with torch.cuda.device(d):
                    graph = torch.cuda.CUDAGraph()
                    capture_stream = torch.cuda.Stream(device=d)
                    with torch.cuda.graph(graph, stream=capture_stream):
                        with ctx:
                            for k in range(ops):
                                self._issue(d, (start + k) % parities,
                                            capture_stream.cuda_stream, chain_lanes)
                graphs.append((d, graph))
            sets[start] = graphs
        self._upload(sets, upload)
        return CeGraphSet(self, sets, ops)

    def _upload(self, sets: dict, how: str) -> None:
        """Run every captured graph once while nothing can wait: each set replayed with every
        counter released (each wait passes at once; outputs and scratch get garbage, the
        bound inputs are separate buffers and only read), then the counters and the call
        count put back.

        Why: on 2 x H200 (driver 13.0) a graph's first launch did not start while a graph
        launched before it on the other GPU was running; a 50-call all-gather graph whose
        first GPU waited for the second so hung at its first replay (20 calls ran).
        ``cuGraphUpload`` beforehand did not help; a first launch in which nothing waits
        did (the ce hang probe, in git history: its ``ag-*`` variants)."""
        if how not in ("dry", "none"):
            raise ValueError(f"upload must be 'dry' or 'none', got {how!r}")
        if how == "none":
            return
        calls = self.calls
        for graph_set in sets.values():
            for f in self.flags:
                f.fill_(RELEASE_VALUE)
            self.synchronize()
            for d, g in graph_set:
                with self.torch.cuda.device(d):
                    g.replay()
            self.synchronize()
        self.reset()
        self.calls = calls

    def synchronize(self) -> None:
        for d in dict.fromkeys(self.devices):
            self.torch.cuda.synchronize(d)

    def check(self) -> None:
        """Wait for every call so far (at most ``timeout`` seconds), then raise
        PurlinTimeoutError if a wait timed out: the executor's own record, or a copy-engine
        wait that the host found stuck (its counters are then released so the GPUs go idle)."""
        from purlin.atom import ce_driver as drv

        if not self._wait_idle(drv, time.monotonic() + self.timeout):
            stuck = self._stuck_waits()
            self._release(drv, stuck)
            self.broken = stuck
            self._raise_kernel_error()
            raise PurlinTimeoutError(f"{stuck}; the counters were released and the bound "
                                     "collective must be bound again")
        self._raise_kernel_error()

    def _wait_idle(self, drv, deadline: float) -> bool:
        """Record an event on every device's current stream; poll them until ``deadline``."""
        d_ = drv.driver()
        torch = self.torch
        for d, ctx in self.contexts.items():
            with ctx:
                drv.check(d_.cuEventRecord(self._sync_events[d],
                                           d_.CUstream(torch.cuda.current_stream(d).cuda_stream)),
                          "cuEventRecord")
        return self._poll(drv, dict(self._sync_events), deadline)

    def _poll(self, drv, pending: dict, deadline: float) -> bool:
        d_ = drv.driver()
        while pending:
            for d in list(pending):
                with self.contexts[d]:
                    err = d_.cuEventQuery(pending[d])[0]
                if err == d_.CUresult.CUDA_SUCCESS:
                    del pending[d]
                elif err != d_.CUresult.CUDA_ERROR_NOT_READY:
                    raise ExecutionError(f"GPU {d} failed while running the ce datapath: {err!r}")
            if pending and time.monotonic() > deadline:
                return False
            if pending:
                time.sleep(1e-4)
        return True

    def _stuck_waits(self) -> str:
        """Which waits are not satisfied now, from a snapshot of the counters (best effort)."""
        from purlin.atom.ce_lowering import WaitGeq

        values = self._read_counters()
        if values is None:
            return (f"the ce datapath did not finish within {self.timeout:.3g} s and its "
                    "counters could not be read")
        found = []
        parity = (self.calls - 1) % self.lowered.parities
        for low in self.lowered.ranks:
            for lane, ops in enumerate(low.lanes[parity]):
                for op in ops:
                    if isinstance(op, WaitGeq):
                        seen = self._counter(values, op.addr)
                        if seen is not None and seen < op.value:
                            found.append(f"rank {low.rank} lane {lane} step {op.step} "
                                         f"({op.what}) waits for {self._name(op.addr)} >= "
                                         f"{op.value}, saw {seen}")
                            break
        what = "; ".join(found[:4]) or "no stream wait is unsatisfied (the executor may be)"
        return f"the ce datapath did not finish within {self.timeout:.3g} s: {what}"

    def _read_counters(self):
        """Every rank's counters, copied on a stream of their own into pinned memory made at
        bind time (no call here may wait for the stuck GPUs); None if that does not finish."""
        from purlin.atom import ce_driver as drv

        d_ = drv.driver()
        events = []
        for r, f in enumerate(self.flags):
            d = self.devices[r]
            with self.contexts[d]:
                drv.check(d_.cuMemcpyDtoHAsync(self._host_counters[r].data_ptr(), f.data_ptr(),
                                               8 * f.numel(), self._rescue[d]),
                          "cuMemcpyDtoHAsync")
                drv.check(d_.cuEventRecord(self._rescue_events[d], self._rescue[d]),
                          "cuEventRecord")
                events.append(d)
        if not self._poll(drv, {d: self._rescue_events[d] for d in events},
                          time.monotonic() + 1.0):
            return None
        return [(f.data_ptr(), self._host_counters[r].numpy().copy())
                for r, f in enumerate(self.flags)]

    @staticmethod
    def _counter(values, addr):
        for base, arr in values:
            if base <= addr < base + 8 * arr.size:
                return int(arr[(addr - base) // 8])
        return None

    def _name(self, addr: int) -> str:
        n, lanes = self.schedule.nranks, self.schedule.lanes
        for r, f in enumerate(self.flags):
            base = f.data_ptr()
            if base <= addr < base + 8 * f.numel():
                k = (addr - base) // 8
                if k < n * lanes:
                    return f"flag(r{r}<-r{k // lanes}.l{k % lanes})"
                kind = "lane barrier" if k < n * lanes + lanes else "hand-off counter"
                return f"{kind} of r{r} lane {(k - n * lanes) % lanes}"
        return f"counter at {addr:#x}"

    def _release(self, drv, stuck: str = "") -> None:
        """Write RELEASE_VALUE into every counter and raise ABORT, so that every stream wait
        and executor wait passes and the GPUs drain (results are garbage)."""
        d_ = drv.driver()
        for r, f in enumerate(self.flags):
            d = self.devices[r]
            with self.contexts[d]:
                drv.check(d_.cuMemcpyHtoDAsync(f.data_ptr(), self._release_values.data_ptr(),
                                               8 * f.numel(), self._rescue[d]),
                          "cuMemcpyHtoDAsync")
        d0 = self.devices[0]
        with self.contexts[d0]:
            drv.check(d_.cuMemcpyHtoDAsync(self.abort.data_ptr(),
                                           self._release_values.data_ptr(), 8,
                                           self._rescue[d0]), "cuMemcpyHtoDAsync")
        if not self._wait_idle(drv, time.monotonic() + max(10.0, self.timeout)):
            why = (f"{stuck or 'the ce datapath timed out'}; it stayed stuck after its "
                   "counters were released (seen when a CUDA graph's first launch waited for "
                   "the other GPU's running graph: capture with CeBound.capture, which "
                   "launches each graph once first; or streams sharing a hardware queue); "
                   "the GPUs need a new process")
            for d in self.contexts:
                STUCK.setdefault(d, why)
            raise PurlinTimeoutError(why)

    def _raise_kernel_error(self) -> None:
        records = [c[2:].cpu().numpy() for c in self.control]
        failed = [(r, rec) for r, rec in enumerate(records) if rec[isa.E_CODE] != isa.ERR_NONE]
        if not failed:
            return
        r, rec = next(((r, rec) for r, rec in failed if rec[isa.E_CODE] == isa.ERR_TIMEOUT),
                      failed[0])
        self.broken = self.broken or "the executor timed out"
        raise PurlinTimeoutError(
            f"rank {r} step {int(rec[isa.E_STEP])} (sm part, lane {int(rec[isa.E_LANE])}) "
            f"timed out after {self.timeout:.3g} s waiting on {self._name(int(rec[isa.E_FLAG]))} "
            f"from rank {int(rec[isa.E_PEER])}: expected >= {int(rec[isa.E_EXPECTED])}, saw "
            f"{int(rec[isa.E_SEEN])}; the bound collective must be bound again")

    def reset(self) -> None:
        """Put counters and call counts back to their starting values (after an error, once
        the GPUs are idle)."""
        self.synchronize()
        for f, init in zip(self.flags, self._initial_flags):
            f.copy_(init)
        for c in self.control:
            c.zero_()
        self.abort.zero_()
        self.calls, self.broken = 0, None
        self.synchronize()

    def close(self) -> None:
        """Give back the streams, events and context references this binding created (also
        when it is garbage-collected). Each binding makes a stream per active (rank, lane) and
        one more per device; the driver spreads streams over only CUDA_DEVICE_MAX_CONNECTIONS
        hardware queues, so bindings that were never given back end up sharing queues with the
        live ones."""
        from purlin.atom import ce_driver as drv

        contexts, self.contexts = getattr(self, "contexts", {}), {}
        self.closed = True
        for d, ctx in contexts.items():
            res = getattr(self, "resources", {}).get(d)
            streams = list(res.streams.values()) if res else []
            events = list(res.events.values()) if res else []
            streams += [s for s in (getattr(self, "_rescue", {}).get(d),) if s is not None]
            events += [e for e in (getattr(self, "_sync_events", {}).get(d),
                                   getattr(self, "_rescue_events", {}).get(d)) if e is not None]
            try:
                drv.destroy(ctx, streams, events)
            finally:
                ctx.release()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown: the driver may be gone
            pass

    def __call__(self, inputs=None, out=None, trace: bool = False):
        """Copy ``inputs`` (tensors, one per rank) in, run once, wait, check and return the
        outputs (views of the bound output buffers, or copies into ``out``)."""
        if trace:
            raise CapabilityError("the ce datapath records no measured trace yet")
        from purlin.atom.sm import call_with_tensors

        return call_with_tensors(self, inputs, out)


    def __repr__(self) -> str:
        add = "stream atomic add" if self.atomic_add else "add kernel"
        sm = f", sm part {self.blocks_per_lane} block(s) per lane" if self.lowered.uses_sm else ""
        return f"<bound {self.schedule.title()} on {self.cluster}, ce datapath ({add}{sm})>"


class CeGraphSet:
    """CUDA graphs of a ce-bound collective, one per device (per starting parity where needed),
    replayed together."""

    def __init__(self, bound, sets, ops):
        self.bound, self.sets, self.ops = bound, sets, ops

    @property
    def graphs(self) -> list:
        """The (device, graph) pairs that the next replay runs."""
        parities = self.bound.lowered.parities
        return self.sets.get(self.bound.calls % parities) or next(iter(self.sets.values()))

    def replay(self) -> None:
        for _, graph in self.graphs:
            graph.replay()
        self.bound.calls += self.ops


def _signed(value: int) -> int:
    value %= 1 << 64
    return value - (1 << 64) if value >= 1 << 63 else value


def _check_resident(torch, device, launcher) -> None:
    """Every block of the executor must be resident at once, or a wait could starve."""
    from purlin.kernels.occupancy import resident_blocks

    sms = torch.cuda.get_device_properties(device).multi_processor_count
    if launcher.grid > resident_blocks(sms, launcher.threads):
        raise CapabilityError(f"{launcher.grid} executor blocks of {launcher.threads} threads "
                              f"cannot all be resident on GPU {device} ({sms} SMs); use fewer "
                              "lanes or blocks per lane")
