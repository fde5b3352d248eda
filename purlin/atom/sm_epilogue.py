"""A bound all-reduce on the sm datapath that ends with user epilogues
(:mod:`purlin.atom.epilogue`): one program per rank ending with the epilogue's NORM op, run by
the one-shot kernel :mod:`purlin.kernels.epilogue` builds for the epilogue (or, for
:func:`purlin.atom.epilogue.rms_norm`, by the built-in ``oneshot_norm`` on the same programs:
``epilogue_kernel="builtin"``, what the benchmarks compare)."""

from __future__ import annotations

import numpy as np

from purlin.errors import CapabilityError, SpecError
from purlin.kernels import isa

EPILOGUE_KERNELS = ("generic", "builtin")


def launch_epilogue(bound, groups, blocks, wish, threads, epilogue, kernel="generic") -> None:
    """Fill ``bound.launches`` (an ``SmBound`` of a fused-ll all-reduce) with one launch per
    device of the programs ending with ``epilogue`` (one per rank, or one for every rank)."""
    from purlin.atom.fused import fused_unit, oneshot_problem, program, row_sums_bytes
    from purlin.atom.sm import fused_launch
    from purlin.kernels.epilogue import kernel_name
    from purlin.kernels.launch import Launcher

    from purlin.atom.epilogue import per_rank

    torch = bound.torch
    epis = per_rank(epilogue, bound.schedule)
    if kernel not in EPILOGUE_KERNELS:
        raise SpecError(f"epilogue_kernel must be one of {', '.join(EPILOGUE_KERNELS)}, got "
                        f"{kernel!r}")
    if bound.schedule.collective.name != "all-reduce" or bound.protocol != "fused-ll":
        raise CapabilityError(f"a user epilogue follows an all-reduce on protocol='fused-ll' "
                              f"(the one-shot kernel); got {bound.schedule.title()} on "
                              f"{bound.protocol!r}")
    unit, problem = fused_unit(bound.lowered, bound.protocol)
    if problem or unit != 8:
        raise CapabilityError(f"the epilogue's one-shot kernel takes 8-byte LL units; "
                              f"{bound.schedule.title()} {problem or f'moves {unit}-byte ones'}")
    bound.block_flags = [torch.zeros(f.numel() * isa.F_MAX_BLOCKS, dtype=torch.int64,
                                     device=f.device) for f in bound.flags]

    def flag_slot(address: int) -> int:
        rank, index = bound._flag_of(address)
        return bound.block_flags[rank].data_ptr() + index * isa.F_MAX_BLOCKS * 8

    sizing = bound.schedule.sizing
    count = sizing.output_count(0)
    per_launch = max(len(r) for r in groups.values())
    size = 1 if epis[0].wire else bound.outputs[0].element_size()  # FP8 on the wire: a byte
    bound.blocks_per_lane, bound.threads = fused_launch(
        bound.gpu, -(-count * size // 8), per_launch, 8,
        blocks=blocks, wish=wish, threads=threads, kind=bound.cluster.kind)
    names, progs, bound.epilogue_sums = [], [], []
    for r, low in enumerate(bound.lowered):
        out = bound.outputs[r][:sizing.output_count(r)]
        e = epis[r]
        hidden = e.check(out)["hidden"]
        name = kernel_name(e.form(out))
        if kernel == "builtin":
            if e.builtin is None:
                raise SpecError(f"epilogue_kernel='builtin' runs purlin.atom.epilogue.rms_norm "
                                f"only, not {e!r}")
            name = "fused-norm-oneshot"
        names.append(name)
        sums = torch.zeros(row_sums_bytes(out.numel() * out.element_size(), 8, bound.threads)
                           // 8, dtype=torch.int64, device=out.device)
        bound.epilogue_sums.append(sums)
        record = e.record(out.data_ptr(), sums.data_ptr(), hidden)
        try:
            prog = program(low, error=bound.control[r].data_ptr() + 2 * 8,
                           abort=bound.abort.data_ptr(), flag_slot=flag_slot, unit=8,
                           epilogue=record, threads=bound.threads)
        except CapabilityError as exc:
            raise CapabilityError(f"epilogue {e.name!r} on {bound.threads} threads per block: "
                                  f"{exc}") from None
        why = oneshot_problem(prog.words)
        if why:
            raise CapabilityError(f"epilogue {e.name!r} runs on the one-shot kernel, which "
                                  f"cannot run this program: {why}")
        progs.append(prog)
    for d, ranks in groups.items():
        if len({names[r] for r in ranks}) != 1:
            raise SpecError(f"the ranks on GPU {d} share a launch: give them epilogues of the "
                            "same functions, dtypes and extras' shapes")
        stride = max(progs[r].words.size for r in ranks)
        words = np.zeros(stride * len(ranks), dtype=np.int64)
        for k, r in enumerate(ranks):
            words[k * stride: k * stride + progs[r].words.size] = progs[r].words
        table = torch.from_numpy(words).to(torch.device("cuda", d))
        counters = torch.zeros(len(ranks) * isa.F_MAX_BLOCKS, dtype=torch.int64,
                               device=table.device)
        bound._keep += [table, counters, epis]
        launcher = Launcher(device=d, nranks_in_launch=len(ranks), nlanes=1,
                            blocks_per_lane=bound.blocks_per_lane, threads=bound.threads,
                            pdl=bound.pdl, kernel=names[ranks[0]], stride_words=stride)
        bound.launches.append((d, launcher, table.data_ptr(), ranks, counters.data_ptr()))
