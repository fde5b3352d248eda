"""The CUDA driver calls of the ce datapath (``cuda.bindings.driver``), built once, issued fast.

:func:`compile_program` turns the lowered operations of one device and call into a list of
prepared driver calls; :func:`issue` runs them with the caller's main stream filled in. Copies
are ``cuMemcpyAsync`` over unified addresses (a copy engine moves peer data over NVLink), counter
operations are one ``cuStreamBatchMemOp`` per run of consecutive operations of a stream:

* wait: ``CU_STREAM_MEM_OP_WAIT_VALUE_64`` with ``GEQ`` (a cyclic, i.e. signed, compare);
* add: ``CU_STREAM_MEM_OP_ATOMIC_REDUCTION`` (``ADD``, unsigned 64-bit; CUDA 13.1 drivers and
  devices reporting ``CU_DEVICE_ATTRIBUTE_ATOMIC_REDUCTION_SUPPORTED``). Where that is missing,
  adds go to a one-thread-per-add kernel (``red.release.sys.add``): a few µs per launch and no
  bulk SM use;
* write: ``CU_STREAM_MEM_OP_WRITE_VALUE_64`` (the executor's call counter).

Everything here is capturable into a CUDA graph.
"""

from __future__ import annotations

import ctypes
import os

from purlin.atom.ce_lowering import (Add, Launch, Memcpy, Record, WaitEvent, WaitGeq, Write)
from purlin.errors import CapabilityError, ExecutionError

MAIN = "main"          # stands for the caller's stream until a call fills it in
MAX_BATCH = 255        # cuStreamBatchMemOp takes fewer than 256 operations
U64 = 1 << 64


def driver():
    from cuda.bindings import driver as d

    return d


def check(result, what: str):
    """Raise ExecutionError unless a driver call returned CUDA_SUCCESS; return its value."""
    d = driver()
    err = result[0]
    if err != d.CUresult.CUDA_SUCCESS:
        raise ExecutionError(f"{what} failed: {err!r}")
    return result[1] if len(result) == 2 else result[1:]


class DeviceContext:
    """The primary context of a device, pushed around driver calls that need a current one;
    :meth:`release` gives back the reference this object holds."""

    def __init__(self, device: int):
        d = driver()
        self.device = device
        self.ctx = check(d.cuDevicePrimaryCtxRetain(d.CUdevice(device)),
                         f"cuDevicePrimaryCtxRetain({device})")

    def release(self) -> None:
        if self.ctx is not None:
            d = driver()
            d.cuDevicePrimaryCtxRelease(d.CUdevice(self.device))
            self.ctx = None

    def __enter__(self):
        check(driver().cuCtxPushCurrent(self.ctx), "cuCtxPushCurrent")
        return self

    def __exit__(self, *exc):
        driver().cuCtxPopCurrent()


def device_support(device: int) -> dict:
    """What the device's driver offers the ce datapath (attribute name -> value)."""
    d = driver()
    attrs = {}
    for name in ("CAN_USE_64_BIT_STREAM_MEM_OPS", "ATOMIC_REDUCTION_SUPPORTED",
                 "ASYNC_ENGINE_COUNT"):
        attr = getattr(d.CUdevice_attribute, f"CU_DEVICE_ATTRIBUTE_{name}", None)
        value = 0
        if attr is not None:
            err, value = d.cuDeviceGetAttribute(attr, device)
            value = value if err == d.CUresult.CUDA_SUCCESS else 0
        attrs[name] = int(value)
    err, version = d.cuDriverGetVersion()
    attrs["DRIVER_VERSION"] = int(version)
    try:  # the bindings know the operation (their enum names have varied between releases)
        add_param(0, 1)
        known = True
    except (AttributeError, StopIteration, TypeError):
        known = False
    attrs["atomic_add"] = bool(known and attrs["ATOMIC_REDUCTION_SUPPORTED"]
                               and os.environ.get("PURLIN_CE_ADD") != "kernel")
    return attrs


def max_connections() -> int:
    """Hardware work queues per device the driver maps streams onto."""
    try:
        return int(os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "8"))
    except ValueError:
        return 8


# -- parameters ---------------------------------------------------------------------------------
def wait_param(addr: int, value: int):
    d = driver()
    p = d.CUstreamBatchMemOpParams()
    op = d.CUstreamBatchMemOpType.CU_STREAM_MEM_OP_WAIT_VALUE_64
    p.operation = op
    p.waitValue.operation = op
    p.waitValue.address = addr
    p.waitValue.value64 = value % U64
    p.waitValue.flags = d.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ
    return p


def write_param(addr: int, value: int):
    d = driver()
    p = d.CUstreamBatchMemOpParams()
    op = d.CUstreamBatchMemOpType.CU_STREAM_MEM_OP_WRITE_VALUE_64
    p.operation = op
    p.writeValue.operation = op
    p.writeValue.address = addr
    p.writeValue.value64 = value % U64
    p.writeValue.flags = 0
    return p


def add_param(addr: int, value: int):
    d = driver()
    p = d.CUstreamBatchMemOpParams()
    op = d.CUstreamBatchMemOpType.CU_STREAM_MEM_OP_ATOMIC_REDUCTION
    p.operation = op
    ar = p.atomicReduction
    ar.operation = op
    ar.flags = 0
    ar.reductionOp = _member(d.CUstreamAtomicReductionOpType, "ADD")
    ar.dataType = _member(d.CUstreamAtomicReductionDataType, "64")
    ar.address = addr
    ar.value = value % U64
    return p


def _member(enum, part: str):
    """The member of ``enum`` whose name contains ``part`` (ADD; 64 for unsigned 64-bit)."""
    return next(m for m in enum if part in m.name)


# -- the fallback add kernel --------------------------------------------------------------------
class AddKernel:
    """``add_counters(pairs, n)``: thread i adds pairs[2i + 1] to the counter at pairs[2i] with a
    system-scope release (the stream order already put every earlier copy before it)."""

    _functions: dict = {}
    _dispatcher = None

    def __init__(self, device: int):
        self.device = device
        self.function = self._load(device)
        self._values = (ctypes.c_int64 * 2)(0, 0)
        base = ctypes.addressof(self._values)
        self._params = (ctypes.c_void_p * 2)(base, base + 8)

    @classmethod
    def _load(cls, device):
        if device in cls._functions:
            return cls._functions[device]
        from numba import cuda

        from purlin.kernels.intrinsics import load_i64, red_release_add

        if cls._dispatcher is None:
            def add_counters(pairs, n):
                i = cuda.grid(1)
                if i < n:
                    red_release_add(load_i64(pairs + 16 * i), load_i64(pairs + 16 * i + 8))

            cls._dispatcher = cuda.jit(add_counters)
        with cuda.gpus[device]:
            kernel = cls._dispatcher.compile("void(int64, int64)")
            kernel.bind()
            cufunc = kernel._codelibrary.get_cufunc()
        fn = driver().CUfunction(int(cufunc.handle))
        preload(fn, device)
        cls._functions[device] = fn
        return fn

    def __call__(self, pairs_ptr: int, n: int, stream) -> None:
        d = driver()
        self._values[0], self._values[1] = pairs_ptr, n
        blocks = max(1, (n + 127) // 128)
        check(d.cuLaunchKernel(self.function, blocks, 1, 1, 128, 1, 1, 0, stream,
                               ctypes.addressof(self._params), 0), "launching add_counters")


def preload(function, device: int) -> None:
    """Finish loading a kernel now, where the driver can (best effort). Under CUDA's lazy
    loading the first launch loads it, and such a launch blocked the host for good on 2xH200
    (driver 13.0) while the other GPU's stream sat in a counter wait; so every kernel the
    datapath launches is loaded, and the add kernel also launched once, at bind time."""
    d = driver()
    if not hasattr(d, "cuFuncLoad"):
        return
    try:
        with DeviceContext(device):
            fn = function
            if hasattr(d, "cuKernelGetFunction"):  # numba-cuda hands out library kernels
                err, per_context = d.cuKernelGetFunction(d.CUkernel(int(function)))
                if err == d.CUresult.CUDA_SUCCESS:
                    fn = per_context
            d.cuFuncLoad(fn)
    except Exception:  # noqa: BLE001 - an older driver: the warm-up launch still loads it
        pass


# -- programs -----------------------------------------------------------------------------------
class Resources:
    """Streams, events, launchers and device arrays a device program refers to."""

    def __init__(self, device: int, streams: dict, events: dict, launch, add_kernel,
                 pair_array, atomic_add: bool):
        self.device = device
        self.streams = streams          # (rank, lane) -> CUstream
        self.events = events            # event name -> CUevent
        self.launch = launch            # callable(stream handle int)
        self.add_kernel = add_kernel    # AddKernel or None
        self.pair_array = pair_array    # callable(list of (addr, value)) -> device address
        self.atomic_add = atomic_add


def compile_program(program, lanes, res: Resources) -> list:
    """Prepared calls ``(function, args)`` for one device and call: ``program`` is the
    DeviceProgram, ``lanes`` the ``{(rank, lane): ops}`` of the device's ranks. The caller's
    stream appears as MAIN in ``args`` (see :func:`bind_main`)."""
    calls = []
    calls += _stream_calls(program.head, MAIN, res)
    for key, ops in lanes.items():
        if ops:
            calls += _stream_calls(ops, res.streams[key], res)
    calls += _stream_calls(program.tail, MAIN, res)
    return calls


def bind_main(calls, main_handle: int) -> list:
    """The calls with MAIN replaced by the stream ``main_handle``."""
    d = driver()
    main = d.CUstream(main_handle)
    out = []
    for fn, args in calls:
        if any(a is MAIN for a in args):
            args = tuple((main_handle if fn == "launch" else main) if a is MAIN else a
                         for a in args)
        out.append((fn, args))
    return out


def issue(calls, res: Resources) -> None:
    """Enqueue prepared calls (asynchronous)."""
    ok = driver().CUresult.CUDA_SUCCESS
    for fn, args in calls:
        if fn == "launch":
            res.launch(*args)
            continue
        if isinstance(fn, AddKernel):
            fn(*args)
            continue
        result = fn(*args)
        if result[0] != ok:
            raise ExecutionError(f"{getattr(fn, '__name__', fn)} on GPU {res.device} failed: "
                                 f"{result[0]!r}")


def _stream_calls(ops, stream, res: Resources) -> list:
    d = driver()
    calls, batch, adds = [], [], []

    def flush_batch():
        for k in range(0, len(batch), MAX_BATCH):
            part = batch[k: k + MAX_BATCH]
            calls.append((d.cuStreamBatchMemOp, (stream, len(part), part, 0)))
        batch.clear()

    def flush_adds():
        if adds:
            calls.append((res.add_kernel, (res.pair_array(list(adds)), len(adds), stream)))
            adds.clear()

    def flush():
        flush_adds()
        flush_batch()

    for op in ops:
        if isinstance(op, Add):
            if res.atomic_add:
                batch.append(add_param(op.addr, op.value))
            else:
                flush_batch()
                adds.append((op.addr, op.value))
            continue
        if isinstance(op, (WaitGeq, Write)):
            flush_adds()
            batch.append(wait_param(op.addr, op.value) if isinstance(op, WaitGeq)
                         else write_param(op.addr, op.value))
            continue
        flush()
        if isinstance(op, Memcpy):
            calls.append((d.cuMemcpyAsync, (op.dst, op.src, op.nbytes, stream)))
        elif isinstance(op, Record):
            calls.append((d.cuEventRecord, (res.events[op.event], stream)))
        elif isinstance(op, WaitEvent):
            calls.append((d.cuStreamWaitEvent, (stream, res.events[op.event], 0)))
        elif isinstance(op, Launch):
            calls.append(("launch", (stream,)))
        else:  # pragma: no cover - the lowering makes no other operation
            raise CapabilityError(f"the ce driver cannot issue {op!r}")
    flush()
    return calls


def create_stream(ctx: DeviceContext):
    d = driver()
    with ctx:
        return check(d.cuStreamCreate(int(d.CUstream_flags.CU_STREAM_NON_BLOCKING)),
                     f"cuStreamCreate on GPU {ctx.device}")


def destroy(ctx: DeviceContext, streams=(), events=()) -> None:
    """Destroy driver streams and events (best effort). Work still queued on a stream runs to
    its end first: the driver frees the stream afterwards."""
    d = driver()
    with ctx:
        for stream in streams:
            d.cuStreamDestroy(stream)
        for event in events:
            d.cuEventDestroy(event)


def create_event(ctx: DeviceContext):
    d = driver()
    with ctx:
        return check(d.cuEventCreate(int(d.CUevent_flags.CU_EVENT_DISABLE_TIMING)),
                     f"cuEventCreate on GPU {ctx.device}")
