"""Build once, launch cheaply: the executor on one device with a fixed grid.

Details: the notes after the imports; the design: ARCHITECTURE.md, "Atom datapaths".
"""

from __future__ import annotations

import ctypes

from purlin.errors import ExecutionError, SpecError
from purlin.kernels import fused
from purlin.kernels.executor import (MAX_THREADS, SIGNATURE, executor, executor_fp8,
                                     executor_fp8_pdl, executor_pdl)
from purlin.kernels.intrinsics import SIMULATOR
from purlin.kernels.occupancy import spread_shared_bytes

# How a launch works:
#
# A :class:`Launcher` compiles (once per process) and loads the executor for its device when it
# is made; a call then only writes the int64 arguments that change into a parameter block made at
# construction and calls ``cuLaunchKernel`` from ``cuda.bindings`` -- no Numba argument typing,
# no array conversion. The kernel handle is a context-independent ``CUkernel``, so the launch
# runs on whichever device owns the stream; that also makes it capturable into a CUDA graph
# when the stream is capturing.
#
#     launcher = Launcher(device=0, nlanes=4, blocks_per_lane=8, threads=512)
#     launcher(desc_ptr, stream=torch.cuda.current_stream(0).cuda_stream)
#
# ``Launcher(..., kernel="fused", stride_words=W)`` launches :mod:`purlin.kernels.fused` instead:
# rank slot ``s`` of the launch reads its program ``s * W`` words after ``desc_ptr`` and counts
# its calls in the ``isa.F_MAX_BLOCKS`` words ``s * F_MAX_BLOCKS`` words after the ``counters``
# address each call passes (``nlanes`` is 1 and ``blocks_per_lane`` the blocks of each rank);
# ``kernel="fused-norm"`` is the same kernel compiled with the NORM op (programs that end with
# an epilogue; the plain one leaves that code and its registers out), ``kernel="fused-seg"``
# the one that also runs segmented ops (``isa.F_OP_PUTS``, ``F_OP_MOVES``), and a name
# ``purlin.kernels.epilogue.kernel_name`` gave (``"epilogue-N"``) the one-shot kernel built for
# an epilogue (programs ``purlin.atom.fused.oneshot_problem`` accepts).
# ``kernel="fused-copy"`` (``"fused-seg-copy"``) is the one built for programs that only copy
# plain memory (``"fused-seg-copy-narrow"`` where segments are cut at unaligned
# destinations), ``kernel="fused-narrow"`` (``"fused-seg-narrow"``) the one for programs whose
# 8- and 4-byte units move pieces at addresses of any alignment or sum FP8
# (``purlin.atom.fused.kernel_name`` names the kernel a launch's programs need).
# ``kernel="fused-trace"`` (``"fused-norm-trace"``, ...) is
# ``"fused"`` (``"fused-norm"``, ...) with thread 0 of every block stamping each op into the
# ``trace`` buffer given at construction, ``trace_rows`` records per block
# (``purlin.kernels.fused.fused_trace``); the untraced kernels carry none of that code.
#
# A launch of a kernel in ``SPREAD`` with fewer blocks than the kernel could hold at once asks
# for dynamic shared memory it never uses, enough that an SM holds no more of its blocks than
# the grid needs (``occupancy.spread_shared_bytes``): the block scheduler otherwise puts two
# blocks on one SM while others stay idle, and a block shares that SM's issue slots and memory
# pipes (docs/PERF_NOTES.md, "The copy-only build").
#
# Under ``NUMBA_ENABLE_CUDASIM=1`` the same object launches through the simulator (the stream is
# ignored there).

KERNELS = {"executor": (executor, executor_pdl, SIGNATURE),
           "executor-fp8": (executor_fp8, executor_fp8_pdl, SIGNATURE)}
# the fused kernel compiled with what its programs need: "fused", "-norm" (a NORM op) or
# "-seg" (segmented ops), "-copy" (plain copies only) or "-narrow" (units at odd addresses,
# FP8 sums; after "-seg-copy": segments cut at unaligned destinations), and each one's
# "-trace" twin
for _name in ("fused", "fused-norm", "fused-seg", "fused-copy", "fused-seg-copy",
              "fused-seg-copy-narrow", "fused-narrow", "fused-seg-narrow"):
    for _traced in (False, True):
        _attr = _name.replace("-", "_") + ("_trace" if _traced else "")
        KERNELS[_name + "-trace" * _traced] = (
            getattr(fused, _attr), getattr(fused, _attr + "_pdl"),
            fused.TRACE_SIGNATURE if _traced else fused.SIGNATURE)
TRACED = tuple(k for k in KERNELS if k.endswith("-trace"))  # + the trace buffer's
# address and rows per block

DEFAULT_TIMEOUT_NS = 10_000_000_000  # 10 s per wait


# the kernels whose launches ask for spread_shared_bytes: the copy-only builds, where it was
# measured (the general builds fit one 512-thread block an SM by registers; their smaller
# launches, where more fit, are not measured yet). An empty set: the scheduler places blocks.
SPREAD = frozenset({"fused-copy", "fused-seg-copy", "fused-seg-copy-narrow", "fused-copy-trace",
                    "fused-seg-copy-trace", "fused-seg-copy-narrow-trace"})


def _kernels(name: str) -> tuple:
    """(kernel, PDL kernel, signature) named ``name``: one of ``KERNELS``, or a user
    epilogue's (``purlin.kernels.epilogue.kernel_name``)."""
    if name in KERNELS:
        return KERNELS[name]
    from purlin.kernels.epilogue import by_name

    return by_name(name)


class Launcher:
    """Launches the executor over ``nranks_in_launch`` ranks of ``nlanes`` lanes each.

    The grid is ``nranks_in_launch * nlanes * blocks_per_lane`` blocks of ``threads`` threads.
    Call it with the address of the ranks' descriptors (int64[nranks_in_launch, DESC_WIDTH] in
    device memory), a CUDA stream handle as an int (0: the legacy default stream of this
    device) and optionally a per-wait time limit in nanoseconds. ``pdl=True`` (sm_90 and
    newer) launches ``executor_pdl`` with programmatic stream serialization, so the launch
    overlaps the end of the kernel before it on the stream.
    """

    def __init__(self, device: int = 0, nranks_in_launch: int = 1, nlanes: int = 1,
                 blocks_per_lane: int = 1, threads: int = 256, head_words: int = 0,
                 pdl: bool = False, kernel: str = "executor", stride_words: int = 0,
                 trace: int = 0, trace_rows: int = 0):
        for name, value in (("nranks_in_launch", nranks_in_launch), ("nlanes", nlanes),
                            ("blocks_per_lane", blocks_per_lane), ("threads", threads)):
            if int(value) < 1:
                raise SpecError(f"Launcher needs {name} >= 1, got {value}")
        if threads > MAX_THREADS:
            raise SpecError(f"the executor is compiled for at most {MAX_THREADS} threads per "
                            f"block, got threads={threads}")
        if kernel not in KERNELS and not kernel.startswith("epilogue-"):
            raise SpecError(f"Launcher kernel must be one of {', '.join(KERNELS)}, got "
                            f"{kernel!r}")
        self.kernel = kernel
        self.trace = (int(trace), int(trace_rows)) if kernel in TRACED else ()
        if kernel in TRACED and not (trace and trace_rows > 0):
            raise SpecError(f"Launcher kernel {kernel!r} needs its trace buffer: trace=<address> "
                            f"and trace_rows>=1, got trace={trace}, trace_rows={trace_rows}")
        # fused, fused-norm, an epilogue's one-shot kernel (kernels.epilogue): + call counters
        self.fused = kernel.startswith(("fused", "epilogue-"))
        self.device = int(device)
        self.nranks_in_launch = int(nranks_in_launch)
        self.blocks_per_lane = int(blocks_per_lane)
        self.threads = int(threads)
        # a one-rank launch whose descriptor starts a contiguous block (lowering.build_blob)
        # of at least this many int64 words prefetches them (0: no prefetch)
        self.head_words = int(head_words) if self.nranks_in_launch == 1 else 0
        if self.fused:  # its fifth argument: the words between two ranks' programs
            self.head_words = int(stride_words)
        self.grid = self.nranks_in_launch * int(nlanes) * self.blocks_per_lane
        self.pdl = bool(pdl)
        self.registers = None  # per thread, once loaded on a GPU
        self.shared_bytes = 0  # dynamic shared memory asked for (spread_shared_bytes)
        if SIMULATOR:
            self._launch = self._launch_simulated
            return
        self._load()
        self._launch = self._launch_driver

    def __call__(self, desc_ptr: int, stream: int = 0,
                 timeout_ns: int = DEFAULT_TIMEOUT_NS, counters: int = 0) -> None:
        if self.fused and not counters:
            raise ExecutionError("the fused kernel needs the address of its call counters "
                                 "(counters=)")
        self._launch(desc_ptr, stream, timeout_ns, counters)

    def __repr__(self) -> str:
        return (f"Launcher(device={self.device}, grid={self.grid}, threads={self.threads}, "
                f"nranks_in_launch={self.nranks_in_launch}, "
                f"blocks_per_lane={self.blocks_per_lane})")

    # -- driver path ---------------------------------------------------------------------------

    def _load(self) -> None:
        from cuda.bindings import driver
        from numba import cuda

        with cuda.gpus[self.device]:
            if self.pdl and cuda.get_current_device().compute_capability < (9, 0):
                raise ExecutionError(f"pdl=True needs compute capability 9.0 or newer; GPU "
                                     f"{self.device} has "
                                     f"{cuda.get_current_device().compute_capability}")
            kernel = _kernels(self.kernel)[self.pdl].compile(_kernels(self.kernel)[2])
            kernel.bind()
            # numba-cuda keeps the loaded function on its code library, one per device
            cufunc = kernel._codelibrary.get_cufunc()
            self._context = cuda.current_context().handle
            self.registers = cufunc.attrs.regs
            self._function = driver.CUfunction(int(cufunc.handle))
            if self.kernel in SPREAD:  # (the function's attribute is set in its context)
                self.shared_bytes = self._spread(driver, cufunc.attrs.shared)
        self._driver = driver
        nargs = (6 if self.fused else 5) + len(self.trace)  # fused: + call counters (+ trace)
        self._values = (ctypes.c_int64 * nargs)(0, self.nranks_in_launch, self.blocks_per_lane,
                                                0, self.head_words, *((0, *self.trace)
                                                                      if self.fused else ()))
        base = ctypes.addressof(self._values)
        self._params = (ctypes.c_void_p * nargs)(*(base + 8 * i for i in range(nargs)))
        self._params_addr = ctypes.addressof(self._params)
        self._streams = {}
        self._config = None
        if self.pdl:
            cfg = driver.CUlaunchConfig()
            cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = self.grid, 1, 1
            cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = self.threads, 1, 1
            cfg.sharedMemBytes = self.shared_bytes
            attr = driver.CUlaunchAttribute()
            attr.id = (driver.CUlaunchAttributeID
                       .CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION)
            attr.value.programmaticStreamSerializationAllowed = 1
            cfg.attrs = [attr]
            cfg.numAttrs = 1
            self._config = cfg

    def _launch_driver(self, desc_ptr, stream, timeout_ns, counters) -> None:
        values = self._values
        values[0] = desc_ptr
        values[3] = timeout_ns
        if self.fused:
            values[5] = counters
        handle = self._streams.get(stream)
        if handle is None:
            handle = self._streams[stream] = self._driver.CUstream(stream)
        if stream == 0:  # the NULL stream belongs to whichever context is current
            self._driver.cuCtxPushCurrent(self._context)
            err = self._launch_on(handle)
            self._driver.cuCtxPopCurrent()
        else:
            err = self._launch_on(handle)
        if err:
            raise ExecutionError(f"cuLaunchKernel of the {self.kernel} on device {self.device} "
                                 f"failed: {err!r} (grid {self.grid} x {self.threads})")

    def _launch_on(self, handle):
        if self._config is not None:
            self._config.hStream = handle
            (err,) = self._driver.cuLaunchKernelEx(self._config, self._function,
                                                   self._params_addr, 0)
            return err
        (err,) = self._driver.cuLaunchKernel(self._function, self.grid, 1, 1, self.threads,
                                             1, 1, self.shared_bytes, handle, self._params_addr,
                                             0)
        return err

    def _spread(self, driver, static: int) -> int:
        """The dynamic shared memory that keeps this launch's blocks on as many SMs as it
        has blocks, up to every SM (:func:`spread_shared_bytes`). Where it is asked for, the
        kernel's limit is raised to the most a block may ask for, not to this launch's need:
        the limit belongs to the function that every launcher of the kernel shares, and a
        later launcher's smaller need must not refuse an earlier one's launch."""
        a = driver.CUdevice_attribute
        (_, dev) = driver.cuDeviceGet(self.device)

        def attr(name):
            (_, value) = driver.cuDeviceGetAttribute(getattr(a, name), dev)
            return int(value)

        per_block = attr("CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN")
        shared = spread_shared_bytes(
            self.grid, self.threads, self.registers, static,
            sms=attr("CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT"),
            per_sm=attr("CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR"),
            reserved=attr("CU_DEVICE_ATTRIBUTE_RESERVED_SHARED_MEMORY_PER_BLOCK"),
            per_block=per_block)
        if shared:  # (numba-cuda loads a library: the handle is a CUkernel)
            (err,) = driver.cuKernelSetAttribute(
                driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                per_block - static, driver.CUkernel(int(self._function)), dev)
            if err != driver.CUresult.CUDA_SUCCESS:  # (then the scheduler places the blocks)
                return 0
        return shared

    # -- simulator path ------------------------------------------------------------------------

    def _launch_simulated(self, desc_ptr, stream, timeout_ns, counters) -> None:
        kernel = _kernels(self.kernel)[self.pdl]
        args = (int(desc_ptr), self.nranks_in_launch, self.blocks_per_lane, int(timeout_ns),
                self.head_words)
        kernel[self.grid, self.threads](*args, *((int(counters),) if self.fused else ()),
                                        *self.trace)
