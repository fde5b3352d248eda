"""The cpu datapath: numpy buffers, real flags and real, time-limited waiting.

It is the reference every other datapath is compared with, and the default where there is no
GPU. Flags are integer counters guarded by one condition variable per rank, so a wait sleeps
until a notify arrives instead of spinning. A bound schedule runs one thread per (rank, lane),
each walking its lane's steps in program order; flags keep growing across calls (call e waits
for ``(e + w.call) * per_call + value``), exactly as on a GPU, so calls need no reset.

>>> import numpy as np
>>> mem = CpuMemory(nranks=2, lanes=1)
>>> dst = np.zeros(2); reduce_into(dst, [np.ones(2), np.full(2, 2.0)], "avg", 2)
>>> dst.tolist()
[1.5, 1.5]

FP8 (``float8_e4m3fn``, ``float8_e5m2``) is held as its bits in uint8 buffers: a copy moves
the bytes (bit-exact, NaN payloads included); a reduction decodes its sources to float32,
accumulates in float32 in the step's source order and rounds once, on the write into an FP8
buffer. A reducing collective's scratch holds float32, so partial sums between hops (a ring,
two-phase) are not rounded to FP8 on the way.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict

import numpy as np

from purlin.errors import CapabilityError, ExecutionError, PurlinTimeoutError
from purlin.snac.ir import Consume, Flag, Notify, Schedule, Stage
from purlin.snac.planner import Capabilities
from purlin.spec.dtypes import FP8, dtype as as_dtype, fp8_decode, fp8_encode

CAPABILITIES = Capabilities(name="cpu", can_reduce=True)
RUNS_ON = ("cpu",)  # cluster kinds (purlin.atom's registry)
DTYPES = ("float16", "float32", "float64", "int32", "int64", *FP8)

_UFUNC = {"sum": np.add, "avg": np.add, "max": np.maximum, "min": np.minimum}


def check_dtype(dtype_name: str) -> None:
    if dtype_name not in DTYPES:
        raise CapabilityError(f"the cpu datapath moves {', '.join(DTYPES)}, not {dtype_name} "
                              "(numpy has no bfloat16; use the sm datapath on a GPU)")


def copy_into(dst: np.ndarray, src: np.ndarray, fp8: str | None = None) -> None:
    """Atom copy. With ``fp8`` (the dtype's name), uint8 arrays hold FP8 bits and float32
    ones decoded values (a reducing collective's scratch): bits to bits is a byte copy."""
    if fp8 and dst.dtype != src.dtype:
        if dst.dtype == np.uint8:
            fp8_encode(src, fp8, out=dst)
        else:
            np.copyto(dst, fp8_decode(src, fp8))
        return
    np.copyto(dst, src)


def reduce_into(dst: np.ndarray, srcs, op: str, divisor: int = 1,
                fp8: str | None = None) -> None:
    """Atom reduce of k sources into ``dst`` in one pass, element-wise in the sources' order
    (never numpy's pairwise sum), in a fixed accumulation type (float16 and FP8 -- ``fp8``
    names it; see :func:`copy_into` -- in float32, every other dtype in its own), rounded once
    on the write: deterministic mode relies on it."""
    acc_type = np.float32 if dst.dtype == np.float16 or fp8 else dst.dtype

    def load(src):
        if fp8 and src.dtype == np.uint8:
            return fp8_decode(src, fp8)
        return src.astype(acc_type, copy=False)

    acc = np.array(load(srcs[0]), dtype=acc_type, copy=True)
    ufunc = _UFUNC[op]
    with np.errstate(invalid="ignore", over="ignore"):  # NaN and inf are data, as on a GPU
        for src in srcs[1:]:
            ufunc(acc, load(src), out=acc)
        if op == "avg":
            acc = (acc / divisor).astype(acc_type, copy=False)
    if fp8 and dst.dtype == np.uint8:
        fp8_encode(acc, fp8, out=dst)  # the one rounding
        return
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


class CpuRun:
    """A schedule bound to numpy buffers on the cpu datapath; call it once per collective."""

    def __init__(self, schedule: Schedule, timeout: float = 5.0):
        self.schedule = schedule
        self.timeout = timeout
        check_dtype(schedule.dtype)
        self.np_dtype = as_dtype(schedule.dtype).numpy()
        self.fp8 = schedule.dtype if schedule.dtype in FP8 else None
        n = schedule.nranks
        self.memory = CpuMemory(n, schedule.lanes)
        # FP8 partial sums stay float32 between hops: one rounding, on the write to an output
        held = (np.float32 if self.fp8 and schedule.collective.op.is_reduce
                else self.np_dtype)
        self.scratch = [np.zeros(c * schedule.scratch_copies, dtype=held)
                        for c in schedule.scratch]
        self.per_call = schedule.flags()
        self.epoch = 0
        self.broken: str | None = None
        self.lane_steps = {(r, lane): [(i, s) for i, s in enumerate(schedule.steps[r])
                                       if s.lane == lane]
                           for r in range(n) for lane in sorted({s.lane for s in
                                                                 schedule.steps[r]})}

    def __call__(self, inputs, outputs, trace: list | None = None) -> None:
        """Run one call: ``inputs[r]`` and ``outputs[r]`` are flat numpy arrays of rank r."""
        if self.broken:
            raise ExecutionError(f"this bound collective failed earlier and its flags are out "
                                 f"of step ({self.broken}); bind it again")
        buffers = [{"input": inputs[r], "output": outputs[r], "scratch": self.scratch[r]}
                   for r in range(self.schedule.nranks)]
        errors: list[tuple[float, BaseException]] = []
        deadline = time.monotonic() + self.timeout
        threads = [threading.Thread(target=self._lane, daemon=True,
                                    args=(key, buffers, deadline, errors, trace))
                   for key in self.lane_steps]
        for t in threads:
            t.start()
        for t in threads:
            t.join(self.timeout + 5)
        if any(t.is_alive() for t in threads):
            self.memory.abort.set()
            self.broken = "a lane thread did not finish"
            raise PurlinTimeoutError(f"{self.schedule.title()}: a lane thread is still running "
                                     f"{self.timeout + 5:.1f} s after its deadline")
        self.epoch += 1
        if errors:
            self.broken = str(errors[0][1])
            errors.sort(key=lambda e: e[0])
            raise errors[0][1]

    def _view(self, buffers, region, call_scratch_shift):
        buf = buffers[region.rank][region.buffer]
        off = region.offset + (call_scratch_shift[region.rank] if region.buffer == "scratch"
                               else 0)
        return buf[off: off + region.count]

    def _lane(self, key, buffers, deadline, errors, trace) -> None:
        rank, lane = key
        s = self.schedule
        parity = self.epoch % s.scratch_copies
        shift = [parity * c for c in s.scratch]
        try:
            for index, step in self.lane_steps[key]:
                where = f"rank {rank} step {index} (lane {lane}, call {self.epoch})"
                t0 = time.perf_counter_ns()
                if isinstance(step, Notify):
                    self.memory.notify(step.flag)
                    _record(trace, rank, lane, index, "notify", t0)
                    continue
                if isinstance(step, Consume) and step.waits:
                    for w in step.waits:
                        # a flag no step notifies grows by 0: wait (and time out) as on a GPU
                        target = (self.epoch + w.call) * self.per_call.get(w.flag, 0) + w.value
                        if target > 0:
                            self.memory.wait(w.flag, target, deadline, where)
                    _record(trace, rank, lane, index, "wait", t0)
                    t0 = time.perf_counter_ns()
                if step.moves_data:
                    dst = self._view(buffers, step.dst, shift)
                    srcs = [self._view(buffers, r, shift) for r in step.srcs]
                    if step.op == "copy":
                        copy_into(dst, srcs[0], self.fp8)
                    else:
                        reduce_into(dst, srcs, step.op, s.divisor(step), self.fp8)
                    _record(trace, rank, lane, index,
                            "stage" if isinstance(step, Stage) else "consume", t0)
        except PurlinTimeoutError as exc:
            errors.append((time.monotonic(), exc))
            self.memory.abort.set()
        except Exception as exc:  # a bug, not a timeout: keep it and stop the others
            errors.append((time.monotonic(), ExecutionError(f"rank {rank} lane {lane}: {exc!r}")))
            self.memory.abort.set()


def _record(trace, rank, lane, index, kind, t0) -> None:
    if trace is not None:
        trace.append((rank, lane, index, kind, t0, time.perf_counter_ns()))


def bind(cluster, schedule: Schedule, *, timeout: float = 5.0, epilogue=None,
         **options) -> "CpuBound":
    """Bind ``schedule`` on the cpu datapath. The other datapaths' options (blocks per lane,
    protocol, ...) mean nothing here and are ignored, so one call binds on any cluster.
    ``epilogue``: user epilogues after an all-reduce (one per rank, or one for all), run on
    each rank's output by their host reference (``purlin.atom.epilogue``)."""
    bound = CpuBound(cluster, schedule, timeout)
    if epilogue is not None:
        from purlin.atom.epilogue import per_rank

        bound.epilogues = per_rank(epilogue, schedule)
    return bound


class CpuBound:
    """A schedule bound to the cpu datapath: ``bound(inputs) -> outputs``, numpy arrays or
    torch tensors in, the same kind out."""

    def __init__(self, cluster, schedule: Schedule, timeout: float):
        self.cluster, self.schedule = cluster, schedule
        self.run = CpuRun(schedule, timeout)
        self.last_trace: list = []
        self.epilogues = None  # per rank, run on its output after each call

    def __call__(self, inputs, out=None, trace: bool = False) -> list:
        """Run once. ``inputs[r]`` is rank r's array or tensor (any shape, flattened); ``out``
        may give the output arrays; in-place (an output sharing memory with an input) is
        refused. Torch tensors in (any device) give torch tensors out, of the inputs' dtype
        and device; an output as long as its rank's input takes the input's shape."""
        s = self.schedule
        inputs = check_inputs(s, inputs)
        tensors = next((x for x in inputs if _is_tensor(x)), None)
        dt = self.run.np_dtype
        # FP8 comes as torch float8 tensors or as uint8 numpy arrays of the bits
        names = (s.dtype, "uint8") if self.run.fp8 else (dt.name,)
        flat_in, given_in = [], []
        for r, x in enumerate(inputs):
            if x is None:
                flat_in.append(np.zeros(0, dtype=dt))
                continue
            if _dtype_name(x) not in names:
                raise ExecutionError(f"input of rank {r} is {_dtype_name(x)}; this binding "
                                     f"moves {s.dtype}")
            x = _host_view(x)
            given_in.append(x)  # reshape may copy (non-contiguous): check overlap on the original
            flat_in.append(x.reshape(-1))
        sizing = s.sizing
        given_out = out
        if out is None:
            out = [np.empty(sizing.output_count(r), dtype=dt) for r in range(s.nranks)]
        if len(out) != s.nranks:
            raise ExecutionError(f"{s.collective.name} on {s.nranks} ranks needs {s.nranks} "
                                 f"outputs, got {len(out)}")
        flat_out, copy_back = [], []
        for r, o in enumerate(out):
            size = o.numel() if _is_tensor(o) else np.size(o)
            if size != sizing.output_count(r) or _dtype_name(o) not in names:
                raise ExecutionError(f"output of rank {r} must hold {sizing.output_count(r)} "
                                     f"{s.dtype} elements, got {size} {_dtype_name(o)}")
            host = _host_view(o)
            if any(np.shares_memory(host, x) for x in given_in if x.size):
                raise ExecutionError(f"output of rank {r} shares memory with an input: in-place "
                                     "collectives are not supported; pass a separate output")
            flat = host.reshape(-1)
            if host.size and not np.shares_memory(flat, host):  # reshape copied: write back
                copy_back.append((host, flat))
            flat_out.append(flat)
        records = [] if trace else None
        sums = None
        if self.epilogues is not None:  # their prologues, on copies of the inputs
            from purlin.atom.epilogue import prologues_on_inputs, wire_sums

            sums = wire_sums(self.epilogues, flat_in)  # FP8 on the wire: the kernel's sum
            flat_in = prologues_on_inputs(self.epilogues, flat_in)
        self.run(flat_in, flat_out, records)
        for host, flat in copy_back:
            np.copyto(host, flat.reshape(host.shape))
        for r, o in enumerate(out):  # a tensor off the host was computed in a copy
            if _is_tensor(o) and not np.shares_memory(_host_view(o), flat_out[r]):
                o.copy_(_torch_from(flat_out[r], o).reshape(o.shape))
        self.last_trace = records or []
        result = list(out)
        if given_out is None and tensors is not None:
            result = [_as_tensor_like(o, inputs[r], tensors) for r, o in enumerate(out)]
        if self.epilogues is not None:
            from purlin.atom.epilogue import run_on_outputs

            run_on_outputs(self.epilogues, result, sums)
        return result

    def __repr__(self) -> str:
        return f"<bound {self.schedule.title()} on {self.cluster}>"


def check_inputs(schedule: Schedule, inputs) -> list:
    """``inputs`` as a list after checking there is one per rank, of the rank's length."""
    s = schedule
    inputs = list(inputs)
    if len(inputs) != s.nranks:
        raise ExecutionError(f"{s.collective.name} on {s.nranks} ranks needs {s.nranks} "
                             f"inputs, got {len(inputs)}")
    for r, x in enumerate(inputs):
        want = s.sizing.input_count(r)
        if x is None:
            if want:
                raise ExecutionError(f"rank {r} needs an input of {want} elements, got None")
            continue
        n = int(np.prod(x.shape)) if hasattr(x, "shape") else len(x)
        if n != want:
            raise ExecutionError(f"input of rank {r} has {n} elements; this binding of "
                                 f"{s.collective.name} expects {want}")
    return inputs


def _is_tensor(x) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "detach")


def _dtype_name(x) -> str:
    """The element type of an array, tensor or sequence, as Purlin spells it."""
    if _is_tensor(x):
        return str(x.dtype).removeprefix("torch.")
    return np.asarray(x).dtype.name


def _host_view(x) -> np.ndarray:
    """``x`` as a numpy array: a torch tensor in host memory as a view of it, one elsewhere as
    a copy."""
    if _is_tensor(x):
        x = x.detach().cpu()
        if str(x.dtype).removeprefix("torch.") in FP8:  # numpy has no FP8: view the bits
            import torch

            x = x.view(torch.uint8)
        return x.numpy()
    return np.asarray(x)


def _torch_from(a: np.ndarray, like):
    import torch

    t = torch.from_numpy(np.ascontiguousarray(a))
    if str(like.dtype).removeprefix("torch.") in FP8:
        t = t.view(like.dtype)
    return t.to(like.device)


def _as_tensor_like(o: np.ndarray, x, first):
    """Output ``o`` as a tensor on the inputs' device, in rank input ``x``'s shape when it has
    as many elements."""
    t = _torch_from(o, first)
    if x is not None and _is_tensor(x) and x.numel() == t.numel():
        t = t.reshape(x.shape)
    return t
