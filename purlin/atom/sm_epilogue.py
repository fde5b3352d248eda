"""A bound all-reduce on the sm datapath that ends with user epilogues
(:mod:`purlin.atom.epilogue`), at any size (:func:`bind_epilogue` picks):

* :func:`launch_epilogue`: one program per rank ending with the epilogue's NORM op, run by the
  one-shot kernel :mod:`purlin.kernels.epilogue` builds for the epilogue;
* :func:`add_device_epilogue`: elsewhere, the all-reduce bound as without an epilogue and then
  the epilogue kernel built from the same device functions on each rank's output (and the
  prologue kernel on its input before), one launch per device;
* :class:`DeviceEpilogue`: those two kernels on one tensor, for a process-mode communicator.
"""

from __future__ import annotations

import numpy as np

from purlin.errors import CapabilityError, SpecError
from purlin.kernels import isa


def launch_epilogue(bound, blocks, wish, threads, epilogue) -> None:
    """Add to ``bound.core`` (an ``SmBound``'s prepared kernel of a fused-ll all-reduce) one
    launch per device of the programs ending with ``epilogue`` (one per rank, or one for
    every rank)."""
    from purlin.atom.epilogue import per_rank
    from purlin.atom.fused import fused_unit, program, row_sums_bytes
    from purlin.atom.sm import fused_launch
    from purlin.atom.sm_kernel import one_shot_kernel

    torch, core = bound.torch, bound.core
    epis = per_rank(epilogue, bound.schedule)
    if bound.schedule.collective.name != "all-reduce" or core.protocol != "fused-ll":
        raise CapabilityError(f"a user epilogue follows an all-reduce on protocol='fused-ll' "
                              f"(the one-shot kernel); got {bound.schedule.title()} on "
                              f"{core.protocol!r}")
    unit, problem = fused_unit(core.lowered, core.protocol)
    if problem or unit != 8:
        raise CapabilityError(f"the epilogue's one-shot kernel takes 8-byte LL units; "
                              f"{bound.schedule.title()} {problem or f'moves {unit}-byte ones'}")
    sizing = bound.schedule.sizing
    count = sizing.output_count(0)
    size = 1 if epis[0].wire else bound.outputs[0].element_size()  # FP8 on the wire: a byte
    core.blocks_per_lane, core.threads = fused_launch(
        core.gpu, -(-count * size // 8), core.per_launch, 8,
        blocks=blocks, wish=wish, threads=threads, kind=core.kind)
    names, progs, bound.epilogue_sums = [], [], []
    for r, low in enumerate(core.lowered):
        out = bound.outputs[r][:sizing.output_count(r)]
        e = epis[r]
        hidden = e.check(out)["hidden"]
        sums = torch.zeros(row_sums_bytes(out.numel() * out.element_size(), 8, core.threads)
                           // 8, dtype=torch.int64, device=out.device)
        bound.epilogue_sums.append(sums)
        record = e.record(out.data_ptr(), sums.data_ptr(), hidden)
        try:
            prog = program(low, error=core.error_at(r), abort=core.abort,
                           flag_slot=core.flags.slot, unit=8, epilogue=record,
                           threads=core.threads)
        except CapabilityError as exc:
            raise CapabilityError(f"epilogue {e.name!r} on {core.threads} threads per block: "
                                  f"{exc}") from None
        name, why = one_shot_kernel(e, out, prog.words)
        if why:
            raise CapabilityError(f"epilogue {e.name!r} runs on the one-shot kernel, which "
                                  f"cannot run this program: {why}")
        names.append(name)
        progs.append([prog])  # (one lane: an epilogue's program is the rank's whole table)
    for device, ranks in core.groups:
        if len({names[r] for r in ranks}) != 1:
            raise SpecError(f"the ranks on GPU {device.index} share a launch: give them "
                            "epilogues of the same functions, dtypes and extras' shapes")
    core.launch_programs(progs, lambda device, ranks: {"kernel": names[ranks[0]]})
    core.keep.append(epis)


# ---- the epilogue kernel after the all-reduce's own path (kernels.epilogue.apply_kernels)

def bind_epilogue(cluster, schedule, *, protocol, fallback, epilogue, blocks_per_lane,
                  threads, **options):
    """``purlin.atom.sm.bind`` with ``epilogue``: the one-shot kernel with the epilogue inside
    where it runs -- asked for (``protocol="fused-ll"``: that or a refusal), or tried at an
    LL size whatever the protocol (``strategy="auto"``'s included) -- else the all-reduce
    bound as without an epilogue, on its protocol (none named: the fast path), then one epilogue launch per device on the
    outputs (and a prologue launch on the inputs before it): :func:`add_device_epilogue`."""
    from purlin.atom import sm
    from purlin.atom.epilogue import per_rank

    epis = per_rank(epilogue, schedule)
    pdl = options.pop("pdl")  # None: the one-shot kernel without, the path below its default
    oneshot = dict(blocks_per_lane=blocks_per_lane, threads=threads, protocol="fused-ll",
                   epilogue=epilogue, pdl=bool(pdl), **options)
    if protocol == "fused-ll" and not fallback:
        try:
            return sm.SmBound(cluster, schedule, **oneshot)
        except CapabilityError as exc:
            raise CapabilityError(
                f"{exc}; protocol='fused-ll' asks for the one-shot kernel with the epilogue "
                f"inside -- bind without protocol= (or with strategy='auto') to run "
                f"{schedule.title()} on its own path and then the epilogue kernel") from None
    if schedule.sizing.message_bytes <= sm.LL_MAX_BYTES:
        try:
            return sm.SmBound(cluster, schedule, **oneshot)
        except CapabilityError:
            if epis[0].wire:
                raise
            # not one shot (a strategy, rows or a grid it cannot run): the path below
    if epis[0].wire:
        raise CapabilityError(wire_refusal(epis[0], schedule.sizing.message_bytes))
    bound = sm.bind(cluster, schedule, protocol=protocol, fallback=fallback, pdl=pdl,
                    blocks_per_lane=blocks_per_lane, threads=threads, **options)
    add_device_epilogue(bound, epis)
    return bound


def add_device_epilogue(bound, epis) -> None:
    """Wrap ``bound``'s launches (any protocol) with the epilogue kernel on each rank's
    output after them, and the prologue kernel on each rank's input before them (where the
    epilogues have one), one launch per device each; ``launch`` and ``capture`` run them in
    that order on each device's stream."""
    torch = bound.torch
    sizing = bound.schedule.sizing
    groups: dict[int, list[int]] = {}
    for r, d in enumerate(bound.devices):
        groups.setdefault(d, []).append(r)
    outputs = [bound.outputs[r][:sizing.output_count(r)] for r in range(len(epis))]
    inputs = [bound.inputs[r][:sizing.input_count(r)] for r in range(len(epis))]
    before, after = [], []
    for d, ranks in groups.items():
        if any(epis[r].prologue is not None for r in ranks):
            before.append(_device_launch(torch, bound, d, ranks, epis, inputs, True))
        after.append(_device_launch(torch, bound, d, ranks, epis, outputs, False))
    runs = bound.kernel
    bound.launches = before + bound.launches + after
    bound.kernel = f"{'prologue kernel then ' if before else ''}{runs} then epilogue kernel"
    bound.epilogues = epis


def _device_launch(torch, bound, device, ranks, epis, tensors, prologue):
    """One launch of the standalone kernel over ``ranks`` on ``device`` (:func:`apply_launch`),
    kept alive by ``bound``."""
    k = apply_launch(torch, device, [epis[r] for r in ranks], [tensors[r] for r in ranks],
                     bound.gpu.sms, prologue, ranks=ranks, pdl=bound.pdl)
    bound._keep += k.keep + [epis]
    return k


def apply_launch(torch, device: int, epis, tensors, sms: int, prologue: bool = False, *,
                 ranks=None, pdl: bool = False):
    """The standalone kernel over ``epis[k]`` on ``tensors[k]`` (:func:`apply_table`) as one
    launch on GPU ``device``: a ``RankKernel`` without error records (nothing in it waits)."""
    from purlin.atom.sm_kernel import RankKernel, launcher

    words, stride, name, blocks, threads = apply_table(epis, tensors, sms, prologue)
    table = torch.from_numpy(words).to(torch.device("cuda", device))
    unused = torch.zeros(1, dtype=torch.int64, device=table.device)  # (the call counters')
    run = launcher(device=device, nranks_in_launch=len(epis), nlanes=1, blocks_per_lane=blocks,
                   threads=threads, pdl=pdl, kernel=name, stride_words=stride)
    return RankKernel(device, ranks if ranks is not None else range(len(epis)), run,
                      table.data_ptr(), unused.data_ptr(), [], keep=[table, unused])


def apply_words(epilogue, tensor, prologue: bool = False) -> np.ndarray:
    """The standalone kernel's table for one rank (``kernels.epilogue``'s ``A_*`` words):
    ``epilogue`` on ``tensor`` (a flat, contiguous all-reduce output; ``prologue``: the
    rank's input). Refused where a row is not whole 8-byte units (the kernel's item)."""
    from purlin.kernels import epilogue as ep

    info = epilogue.check(tensor, epilogue.hidden)
    hidden, size = info["hidden"], tensor.element_size()
    count = tensor.numel()
    by_row = epilogue.stat is not None or any(info["per_column"])
    if (hidden * size if by_row else count * size) % 8:
        what = (f"rows of {hidden} {tensor.dtype} elements ({hidden * size} bytes)" if by_row
                else f"{count} {tensor.dtype} elements ({count * size} bytes)")
        raise CapabilityError(f"epilogue {epilogue.name!r}: the epilogue kernel takes whole "
                              f"8-byte units, and {what} are not; use rows of a multiple of "
                              f"{8 // size} elements")
    items = count * size // 8
    row_items = hidden * size // 8 if hidden * size % 8 == 0 else items
    ptr = (lambda t: 0 if t is None else t.data_ptr())
    out = epilogue.out if epilogue.out is not None and not prologue else tensor
    words = np.zeros(ep.APPLY_WORDS + len(epilogue.extras), dtype=np.int64)
    words[ep.A_TARGET] = tensor.data_ptr()
    words[ep.A_RESIDUAL] = 0 if prologue else ptr(epilogue.residual)
    words[ep.A_OUT] = out.data_ptr()
    words[ep.A_ROW_OUT] = 0 if prologue else ptr(epilogue.row_out)
    words[ep.A_ITEMS] = items
    words[ep.A_ROW_ITEMS] = max(row_items, 1)
    words[ep.APPLY_WORDS:] = [t.data_ptr() for t in epilogue.extras]
    return words


def wire_refusal(epilogue, nbytes: int) -> str:
    """Why ``epilogue``'s FP8 wire cannot follow an all-reduce of ``nbytes`` on its own path."""
    from purlin.atom import sm

    return (f"epilogue {epilogue.name!r}: wire={epilogue.wire!r} runs inside the one-shot "
            f"kernel (direct-push, LL sizes up to {sm.LL_MAX_BYTES} bytes), not after an "
            f"all-reduce of {nbytes} bytes on its own path, which sends the element type; "
            "leave wire out there")


def apply_table(epis, tensors, sms: int, prologue: bool = False) -> tuple:
    """(words, stride, kernel name, blocks per rank, threads) of one launch of the standalone
    kernel over ``epis[k]`` on ``tensors[k]`` (the ranks of one device, slot by slot): a row
    a block (threads: the row's items, up to ``isa.MAX_THREADS``), or per element a
    grid-stride loop; at most 16 blocks per SM of the launch (nothing waits across blocks,
    so they need not all be resident). Refused for an FP8 wire (the one-shot kernel's)."""
    from purlin.kernels.epilogue import apply_kernel_name

    if epis[0].wire:
        raise CapabilityError(wire_refusal(epis[0], tensors[0].numel()
                                           * tensors[0].element_size()))
    names = []
    tables = []
    for e, t in zip(epis, tensors):
        names.append(apply_kernel_name(e.form(t, e.hidden), prologue))
        tables.append(apply_words(e, t, prologue))
    if len(set(names)) != 1:
        raise SpecError("the ranks on one GPU share a launch: give them epilogues of the same "
                        "functions, dtypes and extras' shapes")
    from purlin.kernels import epilogue as ep

    per_row = epis[0].stat is not None and not prologue
    work = max(int(w[ep.A_ROW_ITEMS] if per_row else w[ep.A_ITEMS]) for w in tables)
    threads = min(isa.MAX_THREADS, max(32, -(-work // 32) * 32))
    wanted = max(int(w[ep.A_ITEMS] // w[ep.A_ROW_ITEMS]) for w in tables) if per_row else \
        -(-work // threads)
    blocks = max(1, min(wanted, 16 * sms // len(epis)))
    stride = max(w.size for w in tables)
    words = np.zeros(stride * len(tables), dtype=np.int64)
    for k, w in enumerate(tables):
        words[k * stride: k * stride + w.size] = w
    return words, stride, names[0], blocks, threads


class DeviceEpilogue:
    """``epilogue`` on one GPU tensor by the standalone kernels, for a caller that runs the
    all-reduce itself (a process-mode communicator): :meth:`prologue` before it,
    :meth:`apply` after, each one launch on the tensor's current stream (capturable)."""

    def __init__(self, tensor, epilogue):
        import torch

        self.epilogue, self.tensor = epilogue, tensor.reshape(-1)
        device = tensor.device.index if tensor.device.index is not None else \
            torch.cuda.current_device()
        self.device, self._keep, self._launches = device, [epilogue], {}
        self.pinned = False  # a captured graph launches it: never dropped
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        for prologue in ((False, True) if epilogue.prologue is not None else (False,)):
            k = apply_launch(torch, device, [epilogue], [self.tensor], sms, prologue)
            self._keep += k.keep
            self._launches[prologue] = k

    def _run(self, prologue: bool) -> None:
        import torch

        from purlin.kernels.launch import DEFAULT_TIMEOUT_NS

        if prologue in self._launches:  # (timeout and counters unused: nothing waits)
            self._launches[prologue].launch(torch.cuda.current_stream(self.device).cuda_stream,
                                            DEFAULT_TIMEOUT_NS)

    def prologue(self) -> None:
        """The prologue on the tensor, in place (nothing where the epilogue has none)."""
        self._run(True)

    def apply(self) -> None:
        """The epilogue on the tensor (holding the all-reduce's sum)."""
        self._run(False)


_DEVICE_EPILOGUES: dict = {}
_MAX_KEPT = 64


def device_epilogue(tensor, epilogue, capturing: bool = False) -> DeviceEpilogue:
    """The :class:`DeviceEpilogue` of ``epilogue`` on ``tensor``, made once per tensor
    address and epilogue (the last ``_MAX_KEPT``; those a capture used are kept for good).
    While capturing a CUDA graph none can be made (its table is copied to the GPU and its
    kernel loaded): call once outside the capture first."""
    key = (tensor.data_ptr(), tensor.numel(), str(tensor.dtype), *epilogue.key())
    found = _DEVICE_EPILOGUES.pop(key, None)
    if found is None:
        if capturing:
            raise CapabilityError(f"epilogue {epilogue.name!r} on these tensors is not set up "
                                  "and a CUDA graph is being captured: run the call once "
                                  "outside the capture first (it prepares the epilogue kernel)")
        found = DeviceEpilogue(tensor, epilogue)
        unpinned = [k for k, v in _DEVICE_EPILOGUES.items() if not v.pinned]
        if len(unpinned) >= _MAX_KEPT:
            del _DEVICE_EPILOGUES[unpinned[0]]
    found.pinned = found.pinned or capturing
    _DEVICE_EPILOGUES[key] = found  # (last used last)
    return found
