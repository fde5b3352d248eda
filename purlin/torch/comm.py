"""``Communicator``: Purlin collectives for a ``torch.distributed`` process group.

One process per GPU (or per CPU rank), as with NCCL; each (collective, size, dtype) is prepared
in a symmetric staging area on its first call. How it works, what it refuses and what falls
back to ``torch.distributed``: ARCHITECTURE.md, "Runtime" (process mode).
"""

from __future__ import annotations

import importlib
import math
import socket
import sys
import warnings
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from purlin.atom.sm import LL_MAX_BYTES  # LL transfers up to this size; larger: flags
from purlin.atom.sm import PROTOCOLS as SM_PROTOCOLS
from purlin.atom.sm import fast_protocol, is_fused
from purlin.errors import CallMismatchError, CapabilityError, CountError, ExecutionError, \
    OpDtypeError, PurlinError, PurlinTimeoutError, SpecError
from purlin.runtime.fingerprint import Call
from purlin.runtime.shm import layout
from purlin.snac.planner import plan, split
from purlin.spec import collectives
from purlin.spec.collective import Collective
from purlin.torch.common import Shape, Work, capturing as _capturing, \
    dtype_name as _dtype_name, gather_into, op_label, op_name as _op_name, overlap, \
    scatter_into, torch_op as _torch_op
from purlin.torch.hierarchy import Hierarchy
from purlin.torch.staging import Staging

DEFAULT_STAGING = 256 << 20
DEFAULT_TIMEOUT = 10.0
PROCESS_PATHS = {"cpu": ("purlin.torch.cpu_path", "CpuPath"),  # process-mode paths
                 "sm": ("purlin.torch.sm_path", "SmPath")}
PROTOCOLS = (*SM_PROTOCOLS, "auto")  # of the sm datapath
_NO_OP = object()  # a function without a reduce op


@dataclass(frozen=True)
class CommOptions:
    """The knobs of a :class:`Communicator` beyond its group, datapath and timeout: what the
    defaults pick is right for a user; experiments and benchmarks set them. What each does and
    why: ARCHITECTURE.md, "Knobs".

    >>> CommOptions(protocol="fused-ll").protocol
    'fused-ll'
    """

    staging_bytes: int = DEFAULT_STAGING
    strategy: str = "auto"
    chunks: int | None = None
    lanes: int | None = None
    protocol: str = "auto"
    zero_copy: bool = False
    pdl: bool | None = None
    blocks_per_lane: int | None = None
    threads: int = 512
    epilogue_grid: str | int | None = None
    # all_reduce_add_rms_norm's kernel: "auto", the one-shot kernel built for the epilogue
    # (``purlin.atom.epilogue.rms_norm``) where it runs the program, else the fused kernel's
    # NORM op; "fused", the NORM op everywhere (what benchmarks compare the one-shot kernel with)
    epilogue_kernel: str = "auto"
    deterministic: bool = False  # bitwise-reproducible sums (ARCHITECTURE.md, "SNAC")

    def __post_init__(self):
        if self.protocol not in PROTOCOLS:
            raise CapabilityError(f"Communicator protocol must be one of {', '.join(PROTOCOLS)}, "
                                  f"got {self.protocol!r}")
        grid = self.epilogue_grid
        if not (grid in (None, "rows") or isinstance(grid, int) and not isinstance(grid, bool)
                and 0 < grid <= 512 and grid % 32 == 0):
            raise SpecError(f"epilogue_grid must be None, 'rows' or threads per block (a "
                            f"multiple of 32 up to 512), got {grid!r}")
        if self.epilogue_kernel not in ("auto", "fused"):
            raise SpecError(f"epilogue_kernel must be 'auto' or 'fused', got "
                            f"{self.epilogue_kernel!r}")
        if not isinstance(self.staging_bytes, int) or self.staging_bytes <= 0:
            raise SpecError(f"staging_bytes must be a positive int, got {self.staging_bytes!r}")
        if not isinstance(self.deterministic, bool):
            raise SpecError(f"deterministic must be True or False, got {self.deterministic!r}")


class Communicator:
    """Purlin collectives on the ranks of ``group`` (default: the world).

    ``datapath``: ``"sm"`` (GPUs, symmetric memory), ``"cpu"`` (shared memory) or ``"auto"``
    (``"sm"`` on an NCCL group with CUDA, else ``"cpu"``). ``timeout``: seconds a wait may last
    (per wait on GPUs, per call on the CPU). ``options``: a :class:`CommOptions` (staging
    size, strategy, protocol and the other knobs). ``ranks_per_node``/``node_of_rank``: which
    ranks share a node (default: by hostname).

        comm = Communicator()                                      # the common case
        comm = Communicator(group, options=CommOptions(protocol="fused-ll", zero_copy=True))

    The functions take ``torch.distributed``'s arguments (``group`` -- None or this
    communicator's --, ``async_op``, ``group_src``/``group_dst``); what falls back to
    the process group and why: ARCHITECTURE.md, "Runtime".
    """

    def __init__(self, group=None, datapath: str = "auto", timeout: float = DEFAULT_TIMEOUT, *,
                 options: CommOptions | None = None, ranks_per_node: int | None = None,
                 node_of_rank=None):
        if not dist.is_available() or not dist.is_initialized():
            raise ExecutionError("purlin.torch.Communicator needs torch.distributed: call "
                                 "dist.init_process_group(...) first")
        options = CommOptions() if options is None else options
        if not isinstance(options, CommOptions):
            raise SpecError(f"options must be a purlin.torch.CommOptions, got {options!r}")
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or \
                not 0 < timeout < float("inf"):
            raise SpecError(f"timeout must be a positive number of seconds, got {timeout!r}")
        self.options = options
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.nranks = dist.get_world_size(self.group)
        self.global_ranks = dist.get_process_group_ranks(self.group)
        self.backend = str(dist.get_backend(self.group))
        self.datapath = _choose_datapath(datapath, self.backend)
        o = options
        self.protocol, self.zero_copy, self.pdl = o.protocol, bool(o.zero_copy), o.pdl
        self.epilogue_grid, self.epilogue_kernel = o.epilogue_grid, o.epilogue_kernel
        self.timeout, self.strategy = float(timeout), o.strategy
        self.chunks, self.lanes = o.chunks, o.lanes
        self.staging_bytes = int(o.staging_bytes)
        self.broken: str | None = None      # why a call failed: the flags are out of step
        self._broken_as = PurlinTimeoutError
        self.closed = False
        self._warned: set = set()
        self._cache: dict = {}
        self._slots: dict = {}              # the variable-length all-to-all's, per capacity
        self._colls: dict = {}
        self._agreed: set = set()           # fallback calls every rank agreed on once
        self.calls = 0                      # calls made, for their fingerprints
        self.evictions = 0
        self.path = self.hierarchy = self.staging = None
        self.node_of_rank = self._nodes(ranks_per_node, node_of_rank)
        if len(set(self.node_of_rank)) > 1:
            if o.deterministic:
                raise CapabilityError(
                    f"CommOptions(deterministic=True) runs on one node: ranks "
                    f"{self.global_ranks} span nodes {sorted(set(self.node_of_rank))}, and "
                    "the hierarchical path sums node by node (a sum built hop by hop); use "
                    "a group within one node, or deterministic=False")
            self.hierarchy = Hierarchy(self)
            self.device = self.hierarchy.device
        elif self.nranks > 1:
            module, cls = PROCESS_PATHS[self.datapath]
            path_cls = getattr(importlib.import_module(module), cls)
            self.path = path_cls(self.group, self.rank, self.nranks, self.staging_bytes,
                                 self.timeout, blocks_per_lane=o.blocks_per_lane,
                                 threads=o.threads)
            self.device = self.path.device
            self.staging = Staging(self.staging_bytes)
        else:
            self.device = torch.device("cuda", torch.cuda.current_device()) \
                if self.datapath == "sm" else torch.device("cpu")

    # -- the torch.distributed functions, with its signatures -------------------------------------
    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM, group=None,
                   async_op: bool = False):
        """Reduce ``tensor`` over the ranks, in place (``dist.all_reduce``; with a fused
        epilogue: :meth:`all_reduce_epilogue`)."""
        fn = "all_reduce"
        name = self._start(fn, group, op)
        with torch.no_grad():  # in place on a leaf that requires grad, as torch does
            call = self._next(fn, tensor, tensor.numel(), op, name)
            why = self._refuse(fn, [tensor], op, name)
            if why is None and tensor.numel():
                if self.hierarchy is not None:
                    why = self.hierarchy.run("all-reduce", name, tensor, tensor, tensor.numel())
                else:
                    why = self._call(("all-reduce", tensor.numel(), tensor.dtype, name, 0),
                                     tensor, tensor, call=call)
            elif why is None:
                self._announce(call)
            if why:
                self._fallback(fn, why, lambda t: dist.all_reduce(
                    t, op=_torch_op(op), group=self.group), tensor, written=(0,), call=call)
        return self._done(async_op, [tensor])

    def all_reduce_add_rms_norm(self, tensor: torch.Tensor, residual: torch.Tensor,
                                weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
        """A decoder layer's all-reduce and what follows it: ``residual += sum over ranks of
        tensor``, then ``tensor = rms_norm(residual) * weight`` (rows of ``weight.numel()``
        elements, float32 inside, one rounding). Both in place; returns ``tensor``.

        On the fused kernel (sm datapath, a fused protocol for this size) it is one launch:
        the all-reduce's kernel ends with the add and the norm -- on LL sizes the one-shot
        kernel built for the epilogue :func:`purlin.atom.epilogue.rms_norm` (as
        :meth:`all_reduce_epilogue`), elsewhere the fused kernel's NORM op (``CommOptions.
        epilogue_kernel``) -- an all-reduce prepared for this, apart from :meth:`all_reduce`'s
        of the same size, on the communicator's ``epilogue_grid`` (its input region: ``input_buffer(
        "all_reduce_add_rms_norm", count, dtype, hidden=...)``). Elsewhere -- the cpu
        datapath, the interpreter's sizes, rows the kernel's blocks do not divide --
        :meth:`all_reduce` and then the same in PyTorch, with a one-time warning saying why.

            h = comm.all_reduce_add_rms_norm(o, x, norm_weight, 1e-5)  # x += sum(o); h = norm(x)
        """
        fn = "all_reduce_add_rms_norm"
        hidden = weight.numel()
        if tensor.numel() != residual.numel() or hidden == 0 or tensor.numel() % hidden:
            raise SpecError(f"rank {self.rank}: {fn} needs a residual of the tensor's "
                            f"{tensor.numel()} elements and whole rows of the weight's "
                            f"{hidden}; got a residual of {residual.numel()}")
        if not tensor.is_floating_point() or residual.dtype != tensor.dtype or \
                weight.dtype != tensor.dtype:
            raise SpecError(f"rank {self.rank}: {fn} needs floating tensor, residual and weight "
                            f"of one dtype; got {tensor.dtype}, {residual.dtype}, "
                            f"{weight.dtype}")
        if overlap(tensor, residual):
            raise SpecError(f"rank {self.rank}: {fn}: the tensor and the residual overlap")
        why = self._refuse(fn, [tensor, residual, weight], dist.ReduceOp.SUM, "sum")
        if why is None and tensor.numel():
            if self.hierarchy is not None:
                why = "the group spans nodes"
            elif self.datapath != "sm":
                why = f"the {self.datapath} datapath has no fused kernel"
            elif not (residual.is_contiguous() and weight.is_contiguous()):
                why = "a strided residual or weight"
            else:
                call = self._next(fn, tensor, tensor.numel(), "sum", "sum")
                why = self._call(_norm_key(tensor.numel(), tensor.dtype, hidden), tensor,
                                 tensor, norm=(residual, weight, float(eps)), call=call)
        if why:
            self._warn_once(fn, why, f"runs as all_reduce and then PyTorch: {why}")
            self.all_reduce(tensor)
            add_rms_norm(tensor, residual, weight, eps)
        return tensor

    def all_reduce_epilogue(self, tensor: torch.Tensor, epilogue) -> torch.Tensor:
        """``tensor`` = the sum over ranks, then user ``epilogue`` (a :class:`purlin.Epilogue`,
        checked here: a bad device function or dtype is a SpecError naming it) on it, rows of
        ``epilogue.hidden`` or of the tensor's last dimension. On the fused kernel (sm
        datapath, an LL size) it is one launch: the one-shot kernel built for the epilogue,
        on the all-reduce :meth:`all_reduce_add_rms_norm` prepares for those rows. Other
        sizes on the sm datapath: :meth:`all_reduce`, then the epilogue kernel on the tensor
        (and the prologue kernel before it; ``purlin.atom.sm_epilogue.DeviceEpilogue``).
        Elsewhere (the cpu datapath, a group across nodes, a strided tensor): the all-reduce,
        then the epilogue's host reference, with a one-time warning saying why. Returns
        ``tensor``."""
        import copy

        fn = "all_reduce_epilogue"
        hidden = epilogue.check(tensor)["hidden"]
        epilogue = copy.copy(epilogue)
        epilogue.hidden = hidden  # the rows the staging area's flat view is cut into
        why = self._refuse(fn, [tensor], dist.ReduceOp.SUM, "sum")
        if why is None and tensor.numel():
            if self.hierarchy is not None:
                why = "the group spans nodes"
            elif self.datapath != "sm":
                why = f"the {self.datapath} datapath has no fused kernel"
            elif not tensor.is_contiguous():
                why = "a strided tensor"
            else:
                call = self._next(fn, tensor, tensor.numel(), "sum", "sum")
                why = self._call(_norm_key(tensor.numel(), tensor.dtype, hidden), tensor,
                                 tensor, norm=epilogue, call=call)
        if why and self.hierarchy is None and self.datapath == "sm" and tensor.is_cuda \
                and tensor.is_contiguous():
            from purlin.atom.sm_epilogue import device_epilogue

            try:
                kernels = device_epilogue(tensor, epilogue, _capturing())
            except CapabilityError as exc:
                if _capturing():  # (the host reference cannot run in a graph either)
                    raise
                why = str(exc)
            else:
                kernels.prologue()
                self.all_reduce(tensor)
                kernels.apply()
                return tensor
        if why:
            self._warn_once(fn, why, f"runs as all_reduce and then the epilogue's host "
                                     f"reference: {why}")
            epilogue.reference_prologue(tensor)
            self.all_reduce(tensor)
            if epilogue.builtin is not None:  # rms_norm: PyTorch's own kernels
                add_rms_norm(tensor, epilogue.residual, *epilogue.builtin)
            else:
                epilogue.reference(tensor)
        return tensor

    def all_gather_into_tensor(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                               group=None, async_op: bool = False):
        """Rank r's ``input_tensor`` lands in part r of every rank's ``output_tensor``."""
        self._start("all_gather_into_tensor", group)
        with torch.no_grad():
            self._all_gather("all_gather_into_tensor", output_tensor, input_tensor)
        return self._done(async_op, [output_tensor])

    def _all_gather(self, fn, output, input) -> None:
        call = self._next(fn, input, input.numel())
        why = self._refuse(fn, [output, input])
        if why is None and output.numel() != self.nranks * input.numel():
            why = "output size is not world size x input size"
        if why is None and input.numel():
            if self.hierarchy is not None:
                why = self.hierarchy.run("all-gather", "copy", input, output, output.numel())
            else:
                why = self._call(("all-gather", input.numel(), input.dtype, "copy", 0),
                                 input, output, call=call)
        elif why is None:
            self._announce(call)
        if why:
            self._fallback(fn, why, lambda o, i: gather_into(o, i, group=self.group),
                           output, input, written=(0,), call=call)

    def reduce_scatter_tensor(self, output: torch.Tensor, input: torch.Tensor,
                              op=dist.ReduceOp.SUM, group=None, async_op: bool = False):
        """Part r of the reduction of every rank's ``input`` lands in rank r's ``output``."""
        name = self._start("reduce_scatter_tensor", group, op)
        with torch.no_grad():
            self._reduce_scatter("reduce_scatter_tensor", output, input, op, name)
        return self._done(async_op, [output])

    def _reduce_scatter(self, fn, output, input, op, name) -> None:
        call = self._next(fn, output, output.numel(), op, name)
        why = self._refuse(fn, [output, input], op, name)
        if why is None and input.numel() != self.nranks * output.numel():
            why = "input size is not world size x output size"
        if why is None and output.numel():
            if self.hierarchy is not None:
                why = self.hierarchy.run("reduce-scatter", name, input, output, input.numel())
            else:
                why = self._call(("reduce-scatter", output.numel(), output.dtype, name, 0),
                                 input, output, call=call)
        elif why is None:
            self._announce(call)
        if why:
            self._fallback(fn, why, lambda o, i: scatter_into(
                o, i, op=_torch_op(op), group=self.group), output, input, written=(0,),
                call=call)

    # the names torch 2.13 gives them
    all_gather_single = all_gather_into_tensor
    reduce_scatter_single = reduce_scatter_tensor

    def all_gather(self, tensor_list: list, tensor: torch.Tensor, group=None,
                   async_op: bool = False):
        """Rank r's ``tensor`` lands in ``tensor_list[r]`` of every rank (``dist.all_gather``):
        through one flat output where the list holds world size tensors of ``tensor``'s
        shape, dtype and device, else on ``torch.distributed``."""
        fn = "all_gather"
        self._start(fn, group)
        n, k = self.nranks, tensor.numel()
        with torch.no_grad():
            if len(tensor_list) == n and all(
                    t.shape == tensor.shape and t.dtype == tensor.dtype and
                    t.device == tensor.device for t in tensor_list):
                flat = torch.empty(n * k, dtype=tensor.dtype, device=tensor.device)
                self._all_gather(fn, flat, tensor)
                for r, t in enumerate(tensor_list):
                    t.copy_(flat[r * k:(r + 1) * k].view(t.shape))
            else:
                call = self._next(fn, tensor, k)
                self._fallback(fn, "a list of tensors of other shapes, dtypes or devices",
                               lambda t: dist.all_gather(tensor_list, t, group=self.group),
                               tensor, call=call)
        return self._done(async_op, list(tensor_list))

    def reduce_scatter(self, output: torch.Tensor, input_list: list, op=dist.ReduceOp.SUM,
                       group=None, async_op: bool = False):
        """The reduction of every rank's ``input_list[r]`` lands in rank r's ``output``
        (``dist.reduce_scatter``): through one flat input where the list holds world size
        tensors of ``output``'s shape, dtype and device, else on ``torch.distributed``."""
        fn = "reduce_scatter"
        name = self._start(fn, group, op)
        with torch.no_grad():
            if len(input_list) == self.nranks and all(
                    t.shape == output.shape and t.dtype == output.dtype and
                    t.device == output.device for t in input_list):
                flat = torch.cat([t.reshape(-1) for t in input_list])
                self._reduce_scatter(fn, output, flat, op, name)
            else:
                call = self._next(fn, output, output.numel(), op, name)
                self._fallback(fn, "a list of tensors of other shapes, dtypes or devices",
                               lambda o: dist.reduce_scatter(o, input_list, op=_torch_op(op),
                                                             group=self.group),
                               output, written=(0,), call=call)
        return self._done(async_op, [output])

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor,
                          output_split_sizes=None, input_split_sizes=None, group=None,
                          async_op: bool = False):
        """Part j of rank r's ``input`` lands in part r of rank j's ``output``; parts are rows
        (dim 0), even or given per rank by the split sizes (lists of ints, as torch takes
        them). Split sizes run on Purlin as the padded all-to-all of :meth:`all_to_all_v`
        at a capacity the ranks agree on (an all-reduce of their largest split, rounded up
        to a power of two so that prepared sizes are reused)."""
        fn = "all_to_all_single"
        self._start(fn, group)
        n = self.nranks
        uneven = output_split_sizes is not None or input_split_sizes is not None
        with torch.no_grad():  # with split sizes the ranks' sizes differ: -1 for any
            call = self._next(fn, input, -1 if uneven else input.numel())
            why = self._refuse(fn, [output, input])
            if why is None and uneven:
                # even splits on this rank say nothing of the others': only None is the same
                # promise everywhere, so every rank takes the same road, the padded one
                why = self._all_to_all_splits(output, input, output_split_sizes,
                                              input_split_sizes, call)
            elif why is None and (input.numel() != output.numel() or input.numel() % n):
                why = "input and output are not the same size, divisible by the world size"
            elif why is None and self.hierarchy is not None:
                why = "the group spans nodes (all-to-all runs on the group's backend)"
            elif why is None and input.numel():
                why = self._call(("all-to-all", input.numel() // n, input.dtype, "copy", 0),
                                 input, output, call=call)
            elif why is None:
                self._announce(call)
            if why:
                self._fallback(fn, why, lambda o, i: dist.all_to_all_single(
                    o, i, output_split_sizes, input_split_sizes, group=self.group), output,
                    input, written=(0,), call=call)
        return self._done(async_op, [output])

    def all_to_all_v(self, output: torch.Tensor, input: torch.Tensor,
                     input_splits: torch.Tensor, capacity: int | None = None, group=None,
                     check: bool = True) -> torch.Tensor:
        """The all-to-all with split sizes in a tensor on the device (an MoE router's
        per-expert token counts), never read by the host: rank r sends ``input_splits[j]``
        rows (dim 0) of ``input``, in order, to rank j; ``output`` receives, packed in rank
        order, what every rank sent here. Returns the rows received from each rank (int64,
        on the device). ``capacity``: the most rows one rank sends another, the same on
        every rank (default ``input.size(0)``); ``output`` must have room for ``nranks x
        capacity`` rows. No host synchronization on GPUs, so a call can be captured into a
        CUDA graph (after one eager call of its size). A split below 0, over capacity or
        past the input is caught on the device (no row leaves its slot) and raised as a
        CountError naming the rank and its split after the call (``check=False``, or
        inside a capture: at the next :meth:`check_counts`).

            got = comm.all_to_all_v(recv, tokens, counts_per_rank, capacity=256)
        """
        fn = "all_to_all_v"
        self._start(fn, group)
        n = self.nranks
        with torch.no_grad():
            row = self._row_elements(fn, output, input)
            cap = input.size(0) if capacity is None else capacity
            if isinstance(cap, bool) or not isinstance(cap, int) or cap < 1:
                raise SpecError(f"rank {self.rank}: {fn}: capacity must be a whole number of "
                                f"rows >= 1, got {capacity!r}")
            if output.size(0) < n * cap or not output.is_contiguous():
                raise SpecError(f"rank {self.rank}: {fn}: output must be contiguous with room "
                                f"for {n} x {cap} rows (capacity rows from every rank), got "
                                f"{tuple(output.shape)}")
            if not (isinstance(input_splits, torch.Tensor) and input_splits.numel() == n
                    and not input_splits.is_floating_point()
                    and input_splits.device == input.device):
                raise CountError(f"rank {self.rank}: {fn} takes input_splits as an integer "
                                 f"tensor of {n} rows (one per rank) on {input.device}, got "
                                 f"{input_splits!r}")
            counts = torch.zeros(n * n, dtype=torch.int64, device=input.device)
            counts[self.rank * n:(self.rank + 1) * n] = input_splits.reshape(-1)
            call = self._next(fn, input, cap * row)
            got = self._all_to_all_padded(output.reshape(-1), input.contiguous().reshape(-1),
                                          counts, cap, row, call)
            if isinstance(got, str):
                raise CapabilityError(f"rank {self.rank}: {fn} cannot run on Purlin here: {got}")
            slots, out_counts = got
            if check and not _capturing():
                slots.check()
            return out_counts.clone()

    def check_counts(self) -> None:
        """Raise the first bad split a device-side check of :meth:`all_to_all_v` recorded
        (CountError; synchronizes), for calls made with ``check=False`` or captured;
        :meth:`check` does it too."""
        for slots in self._slots.values():
            slots.check()

    def _row_elements(self, fn, output, input) -> int:
        """Elements per row (dim 0) of ``input``, which ``output``'s rows must match."""
        if input.dim() == 0 or output.dim() == 0:
            raise SpecError(f"rank {self.rank}: {fn} splits dim 0; got a 0-d tensor")
        row = math.prod(input.shape[1:])
        out_row = math.prod(output.shape[1:])
        if row != out_row or input.dtype != output.dtype or row == 0:
            raise SpecError(f"rank {self.rank}: {fn}: input rows of {tuple(input.shape[1:])} "
                            f"{input.dtype} and output rows of {tuple(output.shape[1:])} "
                            f"{output.dtype} must match")
        return row

    def _all_to_all_splits(self, output, input, output_split_sizes, input_split_sizes,
                           call) -> str | None:
        """The all-to-all with host split sizes, on Purlin; a string says why it cannot."""
        fn, n = "all_to_all_single", self.nranks
        if self.hierarchy is not None:
            return "the group spans nodes (all-to-all runs on the group's backend)"
        row = self._row_elements(fn, output, input)
        splits = []
        for what, given, t in (("input", input_split_sizes, input),
                               ("output", output_split_sizes, output)):
            if given is None:
                if t.size(0) % n:
                    raise SpecError(f"rank {self.rank}: {fn}: {what} of {t.size(0)} rows does "
                                    f"not split evenly over {n} ranks; give {what}_split_sizes")
                given = [t.size(0) // n] * n
            given = list(given)
            if len(given) != n or any(isinstance(c, bool) or not isinstance(c, int) or c < 0
                                      for c in given):
                raise CountError(f"rank {self.rank}: {fn}: {what}_split_sizes must be {n} "
                                 f"whole numbers >= 0 (one per rank), got {given!r}")
            if sum(given) != t.size(0):
                raise CountError(f"rank {self.rank}: {fn}: {what}_split_sizes {given} sum to "
                                 f"{sum(given)} rows but the {what} has {t.size(0)}")
            splits.append(given)
        if self.path is not None and _dtype_name(input) not in self.path.dtypes:
            return f"dtype {_dtype_name(input)}"
        if _capturing():  # agreeing on a capacity and checking the splits read the host
            return ("split sizes inside a CUDA graph capture (all_to_all_v takes them in a "
                    "tensor and captures)")
        self._announce(call)
        largest = torch.tensor([max(max(splits[0]), max(splits[1]), 1)], dtype=torch.int32,
                               device=self.device)
        if self.nranks > 1:
            self.all_reduce(largest, op=dist.ReduceOp.MAX)
        cap = 1 << (int(largest.item()) - 1).bit_length()
        counts = torch.zeros(n * n, dtype=torch.int64)
        counts[self.rank * n:(self.rank + 1) * n] = torch.tensor(splits[0])
        flat_out = output.reshape(-1) if output.is_contiguous() else \
            torch.empty(output.numel(), dtype=output.dtype, device=output.device)
        got = self._all_to_all_padded(flat_out, input.contiguous().reshape(-1),
                                      counts.to(input.device), cap, row, None,
                                      expect=splits[1])
        if isinstance(got, str):
            return got
        if flat_out.data_ptr() != output.data_ptr():
            output.copy_(flat_out.view(output.shape))
        return None

    def _all_to_all_padded(self, flat_out, flat_in, counts, cap: int, row: int, call,
                           expect=None):
        """Pack, run the all-to-all of ``cap``-row slots, unpack (purlin.torch.varlen);
        ``expect``: the rows each rank must have sent (host splits), checked before anything
        is unpacked. (slots, rows received per rank), or a string saying why it cannot."""
        from purlin.spec.varlen import VarLen
        from purlin.torch.varlen import Slots

        self._announce(call)
        key = (cap, row, flat_in.dtype, flat_in.device)
        slots = self._slots.get(key)
        if slots is None:
            v = VarLen(self._collective("all-to-all", "copy", 0), cap, row)
            slots = self._slots[key] = Slots(v, self.rank, flat_in.dtype, flat_in.device)
        slots.pack(flat_in, counts)
        if self.path is None and self.hierarchy is None:  # one rank: its slots are its output
            slots.padded_out.copy_(slots.padded_in)
        else:
            why = self._run_sized(slots.varlen.collective, slots.sizing, slots.padded_in,
                                  slots.padded_out)
            if why:
                return why
        if expect is not None:
            slots.expect(expect)
        return slots, slots.unpack(flat_out, counts)

    def broadcast(self, tensor: torch.Tensor, src: int | None = None, group=None,
                  async_op: bool = False, group_src: int | None = None):
        """``tensor`` of global rank ``src`` (or group rank ``group_src``) lands in
        ``tensor`` of every rank."""
        fn = "broadcast"
        self._start(fn, group)
        root = self._root(fn, src, group_src, "src")
        with torch.no_grad():
            call = self._next(fn, tensor, tensor.numel(), root=root)
            why = self._refuse(fn, [tensor])
            if why is None and self.hierarchy is not None:
                why = "the group spans nodes (broadcast runs on the group's backend)"
            if why is None and tensor.numel():
                me = root == self.rank
                why = self._call(("broadcast", tensor.numel(), tensor.dtype, "copy", root),
                                 tensor if me else None, None if me else tensor, call=call)
            elif why is None:
                self._announce(call)
            if why:
                self._fallback(fn, why, lambda t: dist.broadcast(
                    t, src=self.global_ranks[root], group=self.group), tensor, written=(0,),
                    call=call)
        return self._done(async_op, [tensor])

    def reduce(self, tensor: torch.Tensor, dst: int | None = None, op=dist.ReduceOp.SUM,
               group=None, async_op: bool = False, group_dst: int | None = None):
        """The reduction of every rank's ``tensor`` lands in ``tensor`` of global rank ``dst``
        (or group rank ``group_dst``); the others' tensors are left as they were."""
        fn = "reduce"
        name = self._start(fn, group, op)
        root = self._root(fn, dst, group_dst, "dst")
        with torch.no_grad():
            call = self._next(fn, tensor, tensor.numel(), op, name, root=root)
            why = self._refuse(fn, [tensor], op, name)
            if why is None and self.hierarchy is not None:
                why = "the group spans nodes (reduce runs on the group's backend)"
            if why is None and tensor.numel():
                why = self._call(("reduce", tensor.numel(), tensor.dtype, name, root), tensor,
                                 tensor if root == self.rank else None, call=call)
            elif why is None:
                self._announce(call)
            if why:
                # gloo writes its scratch into non-roots' tensors: they reduce a copy
                me = root == self.rank
                self._fallback(fn, why, lambda t: dist.reduce(
                    t if me else t.clone(), dst=self.global_ranks[root], op=_torch_op(op),
                    group=self.group), tensor, written=(0,) if me else (), call=call)
        return self._done(async_op, [tensor])

    def run(self, collective: Collective, input: torch.Tensor | None = None,
            output: torch.Tensor | None = None, *, sizing=None, chunk_sizes=None,
            dtype=None) -> torch.Tensor:
        """This rank's part of any collective declared over the group's ranks; returns this
        rank's output (``output`` if given, else a new tensor).

        Chunk sizes come from ``sizing`` or ``chunk_sizes`` (needed for uneven chunks, and on a
        rank that holds neither input nor output), else from this rank's input (or output)
        length, evenly. Every rank must describe the same sizes.
        """
        sizing = self._custom_sizing(collective, input, output, sizing, chunk_sizes, dtype)
        count = sizing.output_count(self.rank)
        if output is None:
            output = torch.empty(count, dtype=getattr(torch, sizing.dtype.name),
                                 device=self.device)
        why = self._run_sized(collective, sizing, input, output)
        if why:
            raise CapabilityError(f"{collective.name} cannot run on Purlin here ({why}) and "
                                  "has no torch.distributed equivalent to fall back to")
        return output

    def input_buffer(self, function: str, count: int, dtype, *, op="sum",
                     src: int = 0, hidden: int | None = None) -> torch.Tensor:
        """The staging input region of a standard collective, as a 1-D tensor: fill it and
        pass it as the input (for all_reduce: the tensor) to skip the copy in. ``count`` is
        what the function's tensor argument holds (all_reduce, all_reduce_add_rms_norm --
        give ``hidden``, its weight's length --, broadcast, reduce: the tensor;
        all_gather_into_tensor: the input; reduce_scatter_tensor: the output; all_to_all_single:
        the input). The region stays reserved for this size from then on."""
        if self.path is None:
            raise CapabilityError("input_buffer needs a single-node group of 2 or more ranks")
        kind = function.replace("_into_tensor", "").replace("_tensor", "") \
            .replace("_single", "").replace("_", "-")
        dtype = getattr(torch, str(dtype).removeprefix("torch.")) if not isinstance(
            dtype, torch.dtype) else dtype
        root = self._group_rank(src)
        if kind == "all-reduce-add-rms-norm":
            if not hidden or count % hidden:
                raise SpecError(f"rank {self.rank}: input_buffer({function!r}) needs hidden, "
                                f"the norm's row length, dividing count {count}; got {hidden}")
            key = _norm_key(count, dtype, hidden)
        elif hidden is not None:
            raise SpecError(f"rank {self.rank}: input_buffer({function!r}) takes no hidden "
                            f"(the norm's row length, for 'all_reduce_add_rms_norm'); got "
                            f"{hidden}")
        else:
            key = {"all-to-all": ("all-to-all", count // self.nranks, dtype, "copy", 0),
                   "all-gather": ("all-gather", count, dtype, "copy", 0),
                   "broadcast": ("broadcast", count, dtype, "copy", root),
                   }.get(kind, (kind, count, dtype, _op_name(op) or "sum",
                                root if kind == "reduce" else 0))
        call = self._next("input_buffer", torch.empty(0, dtype=dtype), count,
                          op if kind in ("all-reduce", "reduce-scatter", "reduce") else None,
                          _op_name(op) or "sum", root=root if kind in ("broadcast", "reduce")
                          else None)
        prepared = self._prepared(key, call=call)
        if isinstance(prepared, str):
            raise CapabilityError(f"{function} of {count} {dtype} elements cannot be staged: "
                                  f"{prepared}")
        self.staging.pin(key)
        return prepared.input

    def plans(self) -> list[dict]:
        """What each collective prepared so far runs: function, elements, dtype, op, root,
        strategy, chunks, lanes, and on the sm datapath protocol, PDL and blocks (per lane;
        the fused kernel's per rank), ``epilogues``: how many programs with the RMSNorm
        epilogue it holds (:meth:`all_reduce_add_rms_norm`) and ``norm_kernel``: the kernel
        they run on ("generic": the one-shot kernel built for the epilogue, "fused-norm": the
        fused kernel's NORM op). Sizes that could not be prepared say why.

            comm.all_reduce(x); comm.plans()[-1]["protocol"]     # e.g. 'fused-ll'
        """
        out = []
        for key, prepared in self._cache.items():
            kind, count, dtype, op, root = key[:5] if key[0] != "run" else (
                key[1].name, None, key[3], None, None)
            row = {"function": kind, "count": count, "dtype": str(dtype).removeprefix("torch."),
                   "op": op, "root": root}
            if len(key) > 5 and key[0] != "run":  # prepared for the RMSNorm epilogue
                row.update(function="all-reduce-add-rms-norm", hidden=key[5])
            if isinstance(prepared, str):
                row["unprepared"] = prepared
            else:
                s = prepared.schedule
                row.update(strategy=s.strategy, chunks=s.chunks, lanes=s.lanes)
                for name in ("protocol", "pdl", "blocks_per_lane", "norm_kernel"):
                    if hasattr(prepared, name):
                        row[name] = getattr(prepared, name)
                if hasattr(prepared, "epilogues"):
                    row["epilogues"] = prepared.epilogues()
            out.append(row)
        return out

    # -- errors ----------------------------------------------------------------------------------
    def check(self) -> None:
        """Raise :class:`PurlinTimeoutError` if a wait of an earlier call timed out (on GPUs this
        synchronizes the device; call it after a graph replay or every few steps)."""
        if self.hierarchy is not None:
            if self.hierarchy.intra is not None:
                self.hierarchy.intra.check()
            return
        if self.closed:
            return
        if self.path is not None and not self.broken:
            prepared = [p for p in self._cache.values() if not isinstance(p, str)]
            errors = self.path.check(prepared)
            if errors:
                more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
                self.broken, self._broken_as = errors[0] + more, PurlinTimeoutError
        if self.broken:
            raise self._broken_as(self.broken)
        self.check_counts()

    def close(self) -> None:
        """Release the staging area (the communicator cannot be used afterwards)."""
        for p in self._cache.values():
            if not isinstance(p, str) and self.path is not None:
                self.path.forget(p)
        self._cache = {}
        if self.path is not None:
            self.path.close()
        if self.hierarchy is not None and self.hierarchy.intra is not None:
            self.hierarchy.intra.close()
        self.closed = True

    def __repr__(self) -> str:
        where = (f"hierarchical over nodes {list(self.hierarchy.plan_nodes)}"
                 if self.hierarchy is not None else f"datapath {self.datapath}")
        return (f"<purlin.torch.Communicator rank {self.rank} of {self.nranks}, {where}, "
                f"{len(self._cache)} prepared>")

    # -- internals -------------------------------------------------------------------------------
    def _nodes(self, ranks_per_node, node_of_rank) -> tuple:
        n = self.nranks
        if node_of_rank is not None:
            nodes = tuple(node_of_rank)
            if len(nodes) != n:
                raise SpecError(f"node_of_rank names {len(nodes)} ranks; the group has {n}")
            return nodes
        if ranks_per_node is not None:
            if not isinstance(ranks_per_node, int) or ranks_per_node < 1 or n % ranks_per_node:
                raise SpecError(f"ranks_per_node={ranks_per_node!r} must divide the group's "
                                f"{n} ranks")
            return tuple(r // ranks_per_node for r in range(n))
        names = [None] * n
        dist.all_gather_object(names, socket.gethostname(), group=self.group)
        return tuple(names)

    def _group_rank(self, global_rank: int) -> int:
        if self.group is dist.group.WORLD:
            return int(global_rank)
        return dist.get_group_rank(self.group, global_rank)

    def _refuse(self, fn, tensors, op=None, op_name=None) -> str | None:
        """Why Purlin cannot run ``fn`` on these tensors (None if it can)."""
        if self.closed:
            raise ExecutionError(f"{fn}: this communicator is closed")
        if self.broken:
            raise ExecutionError(f"{fn}: this communicator failed earlier ({self.broken}); "
                                 "create a new one")
        if self.path is None and self.hierarchy is None:
            return "the group has a single rank"
        first = tensors[0]
        for t in tensors:
            if t.dtype != first.dtype:
                return "input and output dtypes differ"
            if t.device != self.device:
                return f"tensor on {t.device}, communicator on {self.device}"
        name = _dtype_name(first)
        if name not in self._dtypes():
            return f"dtype {name}"
        if op is not None:
            if op_name is None:
                return f"reduce op {op_label(op)}"
            if op_name == "avg" and not (first.is_floating_point() or first.is_complex()):
                raise OpDtypeError(f"rank {self.rank}: {fn}: AVG of {name} tensors has no "
                                   f"{name} result (torch.distributed writes the sum, then "
                                   "raises); use SUM and divide, or a floating dtype")
        return None

    def _dtypes(self):
        if self.hierarchy is not None:
            return self.hierarchy.dtypes
        return self.path.dtypes

    def _warn_once(self, fn: str, why: str, text: str) -> None:
        """Warn ``purlin.torch: {fn} {text}`` once per function and reason (``why`` up to a
        parenthesis: sizes and counts do not make new reasons), at the caller's line."""
        key = (fn, why.split(" (")[0])
        if key in self._warned:
            return
        self._warned.add(key)
        level, frame = 1, sys._getframe(0)
        while frame is not None and frame.f_globals.get("__name__", "").startswith(
                "purlin.torch"):
            frame, level = frame.f_back, level + 1
        warnings.warn(f"purlin.torch: {fn} {text}", RuntimeWarning, stacklevel=level)

    def _fallback(self, fn: str, why: str, call_fn, *tensors, written=(), call=None) -> None:
        """``call_fn(*tensors)`` on torch.distributed, warning once per function and reason.
        Non-contiguous tensors travel as contiguous copies (gloo reduces a strided view's
        storage, not the view), and those written are copied back. ``call``: its fingerprint,
        announced (and on the first such call compared with every rank's)."""
        self._warn_once(fn, why, f"falls back to torch.distributed ({self.backend}): {why}")
        if call is not None:
            call = replace(call, fallback=True)
            self._announce(call)
            key = (call.function, call.dtype, call.count, call.op, call.root)
            if key not in self._agreed and not _capturing():
                self._agree(call)
                self._agreed.add(key)
        dense = [t if t.is_contiguous() else t.contiguous() for t in tensors]
        call_fn(*dense)
        for i in written:
            if dense[i] is not tensors[i]:
                tensors[i].copy_(dense[i])

    # -- arguments and call fingerprints ---------------------------------------------------------
    def _start(self, fn: str, group, op=_NO_OP) -> str | None:
        """Check what every function takes (before anything runs): ``group`` must be None or
        this communicator's; returns the Purlin name of ``op`` (OpError for what is no op)."""
        if group is not None and group != self.group:
            raise SpecError(f"rank {self.rank}: {fn} got another group than this "
                            f"communicator's ({self.nranks} ranks {self.global_ranks}): pass "
                            "group=None, or use the communicator of that group "
                            "(purlin.torch.init(group) and purlin.torch's functions route "
                            "by group)")
        return None if op is _NO_OP else _op_name(op)

    def _root(self, fn: str, rank, group_rank, what: str) -> int:
        """The group rank of ``rank`` (global) or ``group_rank``: exactly one of them, as
        torch.distributed takes them."""
        if (rank is None) == (group_rank is None):
            raise SpecError(f"rank {self.rank}: {fn} needs exactly one of {what}= (a global "
                            f"rank) and group_{what}= (a rank of the group); got {what}={rank!r}, "
                            f"group_{what}={group_rank!r}")
        value = rank if group_rank is None else group_rank
        if isinstance(value, bool) or not isinstance(value, int):
            raise SpecError(f"rank {self.rank}: {fn}: {what} must be an int, got {value!r}")
        if group_rank is not None:
            if not 0 <= group_rank < self.nranks:
                raise SpecError(f"rank {self.rank}: {fn}: group_{what}={group_rank} is not a rank "
                                f"of the group's {self.nranks}")
            return int(group_rank)
        if rank not in self.global_ranks:
            raise SpecError(f"rank {self.rank}: {fn}: {what}={rank} is not in the group (global "
                            f"ranks {self.global_ranks})")
        return self.global_ranks.index(rank)

    def _next(self, fn: str, tensor, count: int, op=None, name=None, root=None) -> Call | None:
        """The fingerprint of this rank's next call (None where there is no staging area)."""
        if self.path is None:
            return None
        self.calls += 1
        label = None if op is None else (name or op_label(op).lower())
        return Call(self.calls, fn, _dtype_name(tensor), int(count), label, root)

    def _announce(self, call) -> None:
        if call is not None and self.path is not None:
            self.path.announce(call)

    def _agree(self, call) -> None:
        """Every rank reached ``call`` and it is the same call (the barrier of a first use)."""
        try:
            self.path.agree(call)
        except (CallMismatchError, PurlinTimeoutError) as exc:
            self.broken, self._broken_as = str(exc), type(exc)
            raise

    def _done(self, async_op: bool, tensors):
        """None, or with ``async_op`` a finished :class:`purlin.torch.common.Work`."""
        if not async_op:
            return None
        event = None
        if self.device.type == "cuda" and not _capturing():
            event = torch.cuda.Event()
            event.record()
        return Work(tensors, event)

    def _collective(self, kind: str, op: str, root: int) -> Collective:
        key = (kind, op, root)
        if key not in self._colls:
            self._colls[key] = collectives.standard(kind, self.nranks, root=root,
                                                    op=op if op != "copy" else "sum")
        return self._colls[key]

    def _sizing(self, key):
        kind, count, dtype, op, root = key[:5]
        coll = self._collective(kind, op, root)
        n = self.nranks
        if kind == "all-reduce":
            sizes = dict(zip(range(n), (c for _, c in _parts(count, n))))
        elif kind in ("all-gather", "reduce-scatter"):
            sizes = {r: count for r in range(n)}
        elif kind == "all-to-all":
            sizes = {(r, j): count for r in range(n) for j in range(n)}
        else:
            sizes = {"x": count}
        return coll.sized(chunk_sizes=sizes, dtype=str(dtype).removeprefix("torch."))

    def _plan(self, sizing):
        """(schedule, the ``purlin.runtime.auto`` choice or None) for a sizing: the
        communicator's strategy, or the choice for this size (strategy, chunks, lanes, and
        blocks, protocol and PDL where a tuning table gives them)."""
        coll = sizing.collective
        chunks, lanes, choice = self.chunks or 1, self.lanes or 1, None
        strategy = self.strategy
        if strategy == "auto" or self.protocol == "auto":
            from purlin.runtime import auto

            choice = auto.select(coll, Shape(self.datapath), dtype=sizing.dtype.name,
                                 chunk_sizes=dict(sizing.chunks),
                                 deterministic=self.options.deterministic)
        if strategy == "auto":
            strategy = choice.strategy
            chunks, lanes = self.chunks or choice.chunks, self.lanes or choice.lanes
        if strategy == "two-phase" and not coll.op.is_reduce:
            strategy = "direct-push"
        return plan(coll, strategy, sizing=sizing, chunks=chunks, lanes=lanes,
                    deterministic=self.options.deterministic), choice

    def _protocol(self, schedule, choice) -> tuple[str, bool]:
        """(protocol, PDL) this schedule runs with on the sm datapath: the communicator's
        protocol (under "auto" the choice's for its plan, else the fast path:
        ``purlin.atom.sm.fast_protocol``), LL only up to LL_MAX_BYTES (LL doubles the bytes
        on the wire) and where the lowering can send pairs so, a fused protocol only where the
        fused kernel can run the plan (else the interpreter's protocol)."""
        from purlin.atom.fused import fused_problems
        from purlin.atom.lowering import ll_transfers

        if self.datapath != "sm":
            return "simple", False
        protocol, pdl = self.protocol, self.pdl
        if protocol == "auto":  # the choice's (a table's, else the fast path) for its plan
            same = choice is not None and choice.strategy == schedule.strategy
            protocol = choice.protocol if same else fast_protocol(schedule)
            pdl = (choice.pdl if same else None) if pdl is None else pdl
        if protocol in ("ll", "fused-ll") and not (
                schedule.sizing.message_bytes <= LL_MAX_BYTES and ll_transfers(schedule)):
            protocol = {"ll": "simple", "fused-ll": "fused"}[protocol]
        if is_fused(protocol) and fused_problems(schedule)[protocol]:
            protocol = "ll" if protocol == "fused-ll" else "simple"
        if pdl is None:
            pdl = is_fused(protocol)
        return protocol, bool(pdl)

    def _prepared(self, key, sizing=None, capturing=None, call=None):
        """The prepared collective for ``key``, preparing it on a miss; a string says why it
        cannot be prepared. ``call``: the fingerprint to announce (on a miss: to compare with
        every rank's, the barrier before anyone notifies the new flags)."""
        found = self._cache.get(key)
        if found is not None:
            if not isinstance(found, str):
                self.staging.touch(key)
                self._announce(call)
            return found
        if _capturing() if capturing is None else capturing:
            return ("first call of this size inside a CUDA graph capture (call each size once "
                    "eagerly before capturing)")
        schedule, choice = self._plan(sizing or self._sizing(key))
        protocol, pdl = self._protocol(schedule, choice)
        # a table's blocks were measured with its own protocol: elsewhere the default
        blocks = choice.blocks_per_lane if choice is not None and (
            choice.protocol == protocol and choice.strategy == schedule.strategy) else None
        # with LL areas where LL transfers go, and flag slots per block for the fused kernel
        lay = layout(schedule, ll=protocol in ("ll", "fused-ll"),
                     block_flags=is_fused(protocol))
        offset = self.staging.place(key, lay.size)
        if offset is None:
            victims = self.staging.victims(lay.size)
            if victims is None:
                why = (f"needs {lay.size} bytes of staging, more than the "
                       f"{self.staging_bytes} available (raise staging_bytes)")
                self._cache[key] = why
                return why
            self.path.quiesce()  # nobody still uses what is evicted
            for victim in victims:
                self.evictions += 1
                self.staging.free(victim)
                self.path.forget(self._cache.pop(victim))
            offset = self.staging.place(key, lay.size)
        sm = {"protocol": protocol, "pdl": pdl} if self.datapath == "sm" else {}
        if sm and len(key) > 5 and key[0] == "all-reduce":  # for the RMSNorm epilogue
            sm.update(row_bytes=key[5] * key[2].itemsize, epilogue_grid=self.epilogue_grid,
                      epilogue_kernel=self.epilogue_kernel)
        prepared = self.path.prepare(schedule, offset, lay, blocks_per_lane=blocks, **sm)
        if call is None:
            call = self._next("run", torch.empty(0, dtype=getattr(torch, schedule.dtype)), 0)
        self._announce(call)
        try:
            self._agree(call)  # every rank zeroed its flags before anyone notifies them
        except PurlinError:
            self.path.forget(prepared)
            self.staging.free(key)
            raise
        self._cache[key] = prepared
        return prepared

    def _call(self, key, src, dst, sizing=None, norm=None, call=None) -> str | None:
        """Run prepared ``key`` from ``src`` into ``dst`` (ending with the epilogue ``norm``,
        (residual, weight, eps), where given); a string says why it could not (nothing ran)."""
        capturing = _capturing()
        prepared = self._prepared(key, sizing, capturing, call)
        if isinstance(prepared, str):
            return prepared
        if norm is not None and not hasattr(prepared, "norm_problem"):
            return f"the {self.datapath} datapath has no fused kernel"
        if capturing:
            self.staging.pin(key)  # a captured graph keeps its addresses for ever
        # zero_copy: the executor reads / writes the user's tensors where no peer needs them
        move_in, move_out = (prepared.movable(src, dst, capturing) if self.zero_copy
                             and hasattr(prepared, "movable") else (False, False))
        if norm is not None:
            why = prepared.norm_problem(src if move_in else None, dst if move_out else None,
                                        norm, capturing)
            if why:
                return why
        # views of the regions in the user's shapes: strided tensors copy without a temporary
        if src is not None and prepared.input.numel() and not move_in and not (
                src.data_ptr() == prepared.input.data_ptr() and src.is_contiguous()):
            prepared.input.view(src.shape).copy_(src)
        try:
            if move_in or move_out or norm is not None:
                prepared.launch(src if move_in else None, dst if move_out else None, capturing,
                                **({"norm": norm} if norm is not None else {}))
            else:
                prepared.launch()
        except PurlinError as exc:
            self.broken, self._broken_as = str(exc), type(exc)
            raise
        if dst is not None and prepared.output.numel() and not move_out:
            dst.copy_(prepared.output.view(dst.shape))
        return None

    def _custom_sizing(self, collective, input, output, sizing, chunk_sizes, dtype):
        if collective.nranks != self.nranks:
            raise SpecError(f"{collective.name} is declared for {collective.nranks} ranks; the "
                            f"group has {self.nranks}")
        if sizing is not None:
            return sizing
        ref = input if input is not None else output
        dt = dtype if dtype is not None else (_dtype_name(ref) if ref is not None else None)
        if dt is None:
            raise SpecError(f"rank {self.rank} passes neither input nor output to "
                            f"{collective.name}: give dtype and chunk_sizes (or a sizing)")
        dt = str(dt).removeprefix("torch.")
        if chunk_sizes is not None:
            return collective.sized(chunk_sizes=chunk_sizes, dtype=dt)
        for t, row in ((input, collective.input[self.rank]),
                       (output, collective.output[self.rank])):
            if t is not None and row:
                if t.numel() % len(row):
                    raise SpecError(f"rank {self.rank}: {t.numel()} elements do not split into "
                                    f"its {len(row)} chunks of {collective.name}")
                each = t.numel() // len(row)
                return collective.sized(chunk_sizes=lambda _name: each, dtype=dt)
        raise SpecError(f"rank {self.rank} holds no chunk of {collective.name}: give "
                        "chunk_sizes (or a sizing) so that it plans the same sizes as the others")

    def _run_sized(self, collective, sizing, input, output) -> str | None:
        """Run a custom collective with a given sizing; a string says why it could not."""
        if self.closed:
            raise ExecutionError("run: this communicator is closed")
        if self.broken:
            raise ExecutionError(f"run: this communicator failed earlier ({self.broken})")
        if self.path is None:
            return ("the group spans nodes" if self.hierarchy is not None
                    else "the group has a single rank")
        if sizing.dtype.name not in self.path.dtypes:
            return f"dtype {sizing.dtype.name}"
        for what, t, want in (("input", input, sizing.input_count(self.rank)),
                              ("output", output, sizing.output_count(self.rank))):
            if want and (t is None or t.numel() != want):
                got = "none" if t is None else f"{t.numel()} elements"
                raise SpecError(f"rank {self.rank}: {collective.name} needs an {what} of {want} "
                                f"elements here, got {got}")
            if t is not None and want and (not t.is_contiguous() or t.device != self.device or
                                           _dtype_name(t) != sizing.dtype.name):
                raise SpecError(f"rank {self.rank}: the {what} must be a contiguous "
                                f"{sizing.dtype.name} tensor on {self.device}, got "
                                f"{t.dtype} on {t.device}")
        key = ("run", collective, sizing.chunks, sizing.dtype.name)
        ref = torch.empty(0, dtype=getattr(torch, sizing.dtype.name))
        call = self._next("run", ref, sum(dict(sizing.chunks).values()))
        return self._call(key, input, output, sizing=sizing, call=call)


def add_rms_norm(tensor: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> torch.Tensor:
    """``residual += tensor``; ``tensor = rms_norm(residual) * weight`` in PyTorch (two
    kernels: the add and ``torch.rms_norm``): what
    :meth:`Communicator.all_reduce_add_rms_norm` does after its all-reduce where the fused
    kernel does not run it.

    >>> x, r = torch.tensor([[1., 2.]]), torch.tensor([[2., 2.]])
    >>> add_rms_norm(x, r, torch.ones(2), 0.0), r
    (tensor([[0.8485, 1.1314]]), tensor([[3., 4.]]))
    """
    residual.add_(tensor.reshape(residual.shape))
    rows = residual.reshape(-1, weight.numel())
    tensor.copy_(torch.rms_norm(rows, (weight.numel(),), weight, eps).reshape(tensor.shape))
    return tensor


def _norm_key(count: int, dtype, hidden: int) -> tuple:
    """The prepared all-reduce of ``all_reduce_add_rms_norm`` over rows of ``hidden``: apart
    from plain ``all_reduce``'s of the same size, since its grid is made for the rows."""
    return ("all-reduce", count, dtype, "sum", 0, hidden)


def _parts(count: int, parts: int):
    """``split`` that keeps empty parts, so every rank's chunk exists."""
    out = split(count, parts)
    return out + [(count, 0)] * (parts - len(out))


def _choose_datapath(datapath: str, backend: str) -> str:
    if datapath == "auto":
        return "sm" if "nccl" in backend and torch.cuda.is_available() else "cpu"
    if datapath not in PROCESS_PATHS:
        raise CapabilityError(f"unknown datapath {datapath!r} for process mode; use "
                              f"{', '.join(PROCESS_PATHS)} or 'auto'")
    return datapath
