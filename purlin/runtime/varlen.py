"""Binding a variable-length collective (``purlin.spec.varlen.VarLen``): the padded collective
is planned, verified and bound once at capacity; each call packs, runs and unpacks.

* ``bound(inputs, counts)``: host counts (checked on the host, a CountError naming rank and
  chunk), packed inputs of exactly the counts' rows; returns the packed outputs.
* ``bound.launch(inputs, counts)``: counts as a device tensor (GPU clusters; a host tensor on
  the cpu datapath), packed inputs of any length up to the rank's capacity; returns each
  rank's output buffer (capacity-sized, the packed rows first) and its counts per output
  chunk, as device tensors, with no host synchronization -- capturable into a CUDA graph. A
  bad count is caught by the pack kernel: :meth:`VarLenBound.check` raises it.

>>> import numpy as np
>>> from purlin.runtime import Cluster
>>> from purlin.spec.varlen import all_to_all_v
>>> a2a = bind_varlen(Cluster.cpu(2), all_to_all_v(2, capacity=3), dtype="float64")
>>> outs = a2a([np.array([1., 2., 3.]), np.array([4., 5.])], [[1, 2], [0, 2]])
>>> [o.tolist() for o in outs]
[[1.0], [2.0, 3.0, 4.0, 5.0]]
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from purlin.errors import CountError, ExecutionError
from purlin.spec.collective import _fmt
from purlin.spec.dtypes import FP8, dtype as as_dtype
from purlin.spec.varlen import VarLen

_INT_VIEW = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}


def bind_varlen(cluster, varlen: VarLen, strategy: str = "direct-push", *, dtype="float32",
                **options) -> "VarLenBound":
    """Plan, verify and bind ``varlen`` at capacity on ``cluster`` (``options`` as
    :meth:`Cluster.bind`'s: chunks, lanes, timeout, datapath, protocol, ...)."""
    if not isinstance(varlen, VarLen):
        raise ExecutionError(f"bind_varlen takes a VarLen, got {varlen!r}")
    dt = as_dtype(dtype)
    bound = cluster.bind(varlen.collective, strategy, sizing=varlen.sized(dt.name), **options)
    return VarLenBound(cluster, varlen, bound, dt.name)


class VarLenBound:
    """A variable-length collective bound at capacity: see the module docstring."""

    def __init__(self, cluster, varlen: VarLen, bound, dtype: str):
        self.cluster, self.varlen, self.bound, self.dtype = cluster, varlen, bound, dtype
        self.schedule = bound.schedule
        self.head, self.slot = varlen.slot(dtype)
        self.gpu = cluster.kind != "cpu"
        self._meta = None
        if self.gpu:
            self._prepare_gpu()

    # -- host counts --------------------------------------------------------------------------
    def __call__(self, inputs, counts) -> list:
        """Run once with host ``counts`` (see ``VarLen.counts``) on packed ``inputs`` (one per
        rank, exactly its counts' rows); returns the packed outputs (numpy arrays for numpy
        inputs, tensors for tensors)."""
        v = self.varlen
        counts = v.counts(counts)
        inputs = self._inputs(inputs)
        for r, x in enumerate(inputs):
            v.check_packed(r, _numel(x), counts)
        if not self.gpu:
            outs, _ = self._host_run(inputs, counts)
            return outs
        torch = self.bound.torch
        dev = self.bound.inputs[0].device
        inputs = [torch.as_tensor(x).to(self.bound.inputs[r].device)
                  for r, x in enumerate(inputs)]
        outs, _ = self.launch(inputs, torch.tensor(counts, dtype=torch.int64, device=dev))
        self.check()
        return [o[:sum(v.output_counts(r, counts)) * v.row].clone() for r, o in enumerate(outs)]

    def _inputs(self, inputs) -> list:
        inputs = list(inputs)
        if len(inputs) != self.varlen.nranks:
            raise ExecutionError(f"{self.varlen.name} on {self.varlen.nranks} ranks needs "
                                 f"{self.varlen.nranks} inputs, got {len(inputs)}")
        return inputs

    def _host_run(self, inputs, counts):
        """Pack on the host, run the padded collective, unpack (cpu datapath)."""
        v, dt = self.varlen, self.dtype
        tensors = next((x for x in inputs if _is_tensor(x)), None)
        padded = [v.pack(r, _host(x).reshape(-1), counts, dt) for r, x in enumerate(inputs)]
        outs = self.bound(padded)
        packed, got = [], []
        for r, o in enumerate(outs):
            p, c = v.unpack(r, np.asarray(o), dt, counts)
            packed.append(p)
            got.append(c)
        if tensors is not None:
            packed = [_tensor_like(p, tensors) for p in packed]
        return packed, got

    # -- device counts ------------------------------------------------------------------------
    def launch(self, inputs, counts):
        """Run once with ``counts`` a tensor (int32/int64, one per chunk name in
        ``VarLen.names`` order) on packed ``inputs`` (any length up to each rank's capacity).
        Returns (outputs, counts): per rank its capacity-sized output (the packed rows first)
        and its rows per output chunk. GPU: on the current stream, no host sync (call
        :meth:`check` after synchronizing, or let an eager call do it)."""
        inputs = self._inputs(inputs)
        if not self.gpu:
            import torch

            host = [int(c) for c in counts.reshape(-1).tolist()]
            checked = self.varlen.counts(host)
            padded_in = []
            for r, x in enumerate(inputs):  # a launch takes any length up to capacity
                rows = self.varlen.input_counts(r, checked)
                if sum(rows) * self.varlen.row > _numel(x):
                    raise CountError(f"input of rank {r} holds {_numel(x)} elements; its "
                                     f"counts {list(rows)} need {sum(rows) * self.varlen.row}")
                padded_in.append(x.reshape(-1)[:sum(rows) * self.varlen.row])
            packed, got = self._host_run(padded_in, checked)
            outs = []
            for r, p in enumerate(packed):
                cap = self.varlen.output_capacity(r)
                o = torch.zeros(cap, dtype=p.dtype) if _is_tensor(p) else \
                    np.zeros(cap, dtype=p.dtype)
                o[:len(p)] = p
                outs.append(o)
            return outs, [torch.tensor(c, dtype=torch.int64) for c in got]
        return self._gpu_launch(inputs, counts)

    def _prepare_gpu(self) -> None:
        torch = self.bound.torch
        v, c = self.varlen, self.varlen.collective
        self.view = kernel_view(v, self.dtype)
        idt = getattr(torch, self.view.int_name)
        self._views, self._meta, self._outs, self._out_counts, self._errors = [], [], [], [], []
        for r in range(v.nranks):
            dev = self.bound.inputs[r].device
            self._meta.append([torch.from_numpy(m).to(dev) for m in slot_meta(v, r, self.dtype)])
            i, o = self.bound.inputs[r], self.bound.outputs[r]
            self._views.append((i.view(idt), i.view(torch.int64), o.view(idt),
                                o.view(torch.int64)))
            out = torch.zeros(max(v.output_capacity(r), 1), dtype=getattr(torch, self.dtype),
                              device=dev)
            self._outs.append(out)
            self._out_counts.append(torch.zeros(max(len(c.output[r]), 1), dtype=torch.int64,
                                                device=dev))
            self._errors.append(torch.zeros(16, dtype=torch.int64, device=dev))
        self._int_dtype = idt
        self._groups()

    def _groups(self) -> None:
        """The pack and unpack launches: one each per device, over the ranks on it (at most
        ``MAX_GROUP`` a launch; their fixed kernel arguments converted once, so a call only
        adds its inputs and counts)."""
        from numba import cuda

        from purlin.atom.sm import gpu_of
        from purlin.kernels import varlen as kv

        torch, v, c, kw = self.bound.torch, self.varlen, self.varlen.collective, self.view
        arr = cuda.as_cuda_array
        by_device: dict = {}
        for r in range(v.nranks):
            by_device.setdefault(self.bound.inputs[r].device, []).append(r)
        self._pack_groups, self._unpack_groups = [], []
        for dev, ranks in by_device.items():
            # host tensors (the CUDA simulator): any grid is correct, the smallest is fastest
            sms = gpu_of(torch, dev.index or 0).sms if dev.type == "cuda" else 1
            def launches(positions):  # the ranks with chunks there, MAX_GROUP a launch
                busy = [r for r in ranks if positions[r]]
                for k in range(0, len(busy), kv.MAX_GROUP):
                    group = busy[k:k + kv.MAX_GROUP]
                    yield group, kv.group_grid(max(len(positions[r]) for r in group),
                                               len(group), v.capacity * kw.row, sms)

            for ins, grid in launches(c.input):
                m = [self._meta[r][0] for r in ins]
                self._pack_groups.append(_Launch(
                    dev, tuple(ins), grid,
                    (tuple(arr(self._views[r][0]) for r in ins),
                     tuple(arr(self._views[r][1]) for r in ins)),
                    (tuple(arr(t) for t in m), tuple(len(c.input[r]) for r in ins), kw.head,
                     kw.row, v.capacity, tuple(arr(self._errors[r]) for r in ins),
                     tuple(ins))))
            for outs, grid in launches(c.output):
                m = [self._meta[r][1] for r in outs]
                self._unpack_groups.append(_Launch(
                    dev, tuple(outs), grid,
                    (tuple(arr(self._views[r][2]) for r in outs),
                     tuple(arr(self._views[r][3]) for r in outs),
                     tuple(arr(self._outs[r].view(self._int_dtype)) for r in outs)),
                    (tuple(arr(t) for t in m), tuple(len(c.output[r]) for r in outs),
                     kw.head, kw.row, v.capacity,
                     tuple(arr(self._out_counts[r]) for r in outs))))

    def _gpu_launch(self, inputs, counts):
        from numba import cuda

        from purlin.kernels import varlen as kv
        from purlin.kernels.compat import small_grids

        torch, v, c = self.bound.torch, self.varlen, self.varlen.collective
        if not (isinstance(counts, torch.Tensor) and counts.numel() == len(v.names)):
            raise CountError(f"{v.name}: launch takes the counts as a tensor of "
                             f"{len(v.names)} integers (one per chunk name), got {counts!r}")
        if counts.dtype not in (torch.int32, torch.int64):
            raise CountError(f"{v.name}: counts must be int32 or int64, got {counts.dtype}")
        counts = counts.reshape(-1)
        stream = cuda.external_stream(torch.cuda.current_stream().cuda_stream)
        arr = cuda.as_cuda_array
        srcs = {}
        for r, x in enumerate(inputs):
            if not c.input[r]:
                continue
            if x is None:  # nothing to send: every count of this rank must be 0
                x = self.bound.inputs[r][:0]
            if x.numel() > v.input_capacity(r) or not x.is_contiguous() or \
                    x.device != self.bound.inputs[r].device or \
                    x.dtype != self.bound.inputs[r].dtype:
                raise ExecutionError(f"input of rank {r} must be a contiguous {self.dtype} "
                                     f"tensor on {self.bound.inputs[r].device} of at most "
                                     f"{v.input_capacity(r)} elements, got {x.numel()} "
                                     f"{x.dtype} on {x.device}")
            x = x.reshape(-1)[:x.numel() // v.row * v.row]  # whole rows: whole units
            src = x.view(self._int_dtype) if x.numel() else self._views[r][0][:1]
            srcs[r] = (arr(src), x.numel() // v.row * self.view.row)
        with small_grids():  # small calls get small grids on purpose
            for g in self._pack_groups:  # one launch per device for all its ranks
                cr = arr(counts if counts.device == g.device else counts.to(g.device))
                kv.pack_group[g.grid, kv.THREADS, stream](
                    tuple(srcs[r][0] for r in g.ranks), tuple(srcs[r][1] for r in g.ranks),
                    *g.fixed, cr, *g.tables)
            self.bound.launch()
            for g in self._unpack_groups:
                cr = arr(counts if counts.device == g.device else counts.to(g.device))
                kv.unpack_group[g.grid, kv.THREADS, stream](*g.fixed, cr, *g.tables)
        return ([o[:v.output_capacity(r)] for r, o in enumerate(self._outs)],
                [k[:len(c.output[r])] for r, k in enumerate(self._out_counts)])

    def check(self) -> None:
        """Raise the first bad count a pack kernel recorded (CountError: rank, chunk, count,
        capacity; the other ranks that recorded one named too), then any timeout of the
        collective (synchronizes). Every record is cleared once reported."""
        if not self.gpu:
            return
        from purlin.kernels import isa

        self.bound.synchronize()
        failed = []
        for r, err in enumerate(self._errors):
            rec = err.cpu().numpy().copy()
            if rec[isa.E_CODE] != isa.ERR_NONE:
                failed.append((r, rec))
                err.zero_()
        if failed:
            r, rec = failed[0]
            name = self.varlen.names[int(rec[isa.E_FLAG])]
            where = f"rank {r} chunk {_fmt(name)} (input position {int(rec[isa.E_STEP])})"
            also = (f"; ranks {[k for k, _ in failed[1:]]} recorded one too"
                    if len(failed) > 1 else "")
            if rec[isa.E_CODE] == isa.ERR_COUNT:
                seen, cap = int(rec[isa.E_SEEN]), int(rec[isa.E_EXPECTED])
                why = "is negative" if seen < 0 else f"is over the capacity of {cap} rows"
                raise CountError(f"{where}: count {seen} {why} (caught on the GPU by the pack "
                                 f"kernel; {max(min(seen, cap), 0)} rows were sent{also}); "
                                 "bind with a larger capacity, or send fewer rows")
            raise CountError(f"{where}: the counts up to this chunk need "
                             f"{int(rec[isa.E_SEEN])} rows but the packed input holds "
                             f"{int(rec[isa.E_EXPECTED])} (caught on the GPU by the pack "
                             f"kernel; the rows past the input were not sent{also})")
        self.bound.check()

    def __repr__(self) -> str:
        return f"<bound {self.varlen!r}, {self.schedule.strategy}, on {self.cluster}>"


@dataclass(frozen=True)
class _Launch:
    """One pack or unpack launch: its device, ranks, grid and fixed arguments (those before
    the counts and those after)."""

    device: object
    ranks: tuple
    grid: tuple
    fixed: tuple
    tables: tuple


@dataclass(frozen=True)
class KernelView:
    """How the pack/unpack kernels see the buffers of a VarLen in a dtype: as integers of
    ``unit`` bytes, the widest (up to 8) that a row is a whole number of, so rows move in
    wide words whatever the dtype; ``head`` and ``row`` in those units.

    >>> from purlin.spec.varlen import all_to_all_v
    >>> kernel_view(all_to_all_v(2, 3, row=4), "bfloat16")
    KernelView(unit=8, int_name='int64', head=2, row=1)
    """

    unit: int
    int_name: str
    head: int
    row: int


def kernel_view(varlen: VarLen, dtype) -> KernelView:
    size = as_dtype(dtype).itemsize
    row_bytes = varlen.row * size
    unit = next(u for u in (8, 4, 2, 1) if row_bytes % u == 0 and u >= size or u == size)
    head, _ = varlen.slot(dtype)
    return KernelView(unit, _INT_VIEW[unit], head * size // unit, row_bytes // unit)


def slot_meta(varlen: VarLen, rank: int, dtype) -> tuple[np.ndarray, np.ndarray]:
    """The pack and unpack kernels' tables of ``rank`` (``purlin.kernels.varlen``): per input
    and per output position, the chunk's index in the counts, its slot's first unit (of
    :func:`kernel_view`) and its header's int64 word.

    >>> from purlin.spec.varlen import all_to_all_v
    >>> slot_meta(all_to_all_v(2, 3), 1, "float32")[1].tolist()
    [[1, 0, 0], [3, 8, 4]]
    """
    from purlin.kernels.isa import VL_META_WIDTH as META_WIDTH  # no Numba needed here

    _, slot = varlen.slot(dtype)
    size = as_dtype(dtype).itemsize
    unit = kernel_view(varlen, dtype).unit
    tables = []
    for row in (varlen.collective.input[rank], varlen.collective.output[rank]):
        m = np.zeros((max(len(row), 1), META_WIDTH), dtype=np.int64)
        for p, name in enumerate(row):
            m[p] = (varlen.index(name), p * slot * size // unit, p * slot * size // 8)
        tables.append(m)
    return tables[0], tables[1]


def _is_tensor(x) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "detach")


def _numel(x) -> int:
    return int(x.numel()) if _is_tensor(x) else int(np.size(x))


def _host(x) -> np.ndarray:
    """A numpy view (or copy) of ``x``: FP8 tensors as their uint8 bits."""
    if _is_tensor(x):
        x = x.detach().cpu()
        if str(x.dtype).removeprefix("torch.") in FP8:
            import torch

            x = x.view(torch.uint8)
        return x.numpy()
    return np.asarray(x)


def _tensor_like(a: np.ndarray, like):
    import torch

    t = torch.from_numpy(np.ascontiguousarray(a))
    if str(like.dtype).removeprefix("torch.") in FP8:
        t = t.view(like.dtype)
    return t.to(like.device)

