"""A bound all-reduce on the sm datapath that ends with user epilogues
(:mod:`purlin.atom.epilogue`): one program per rank ending with the epilogue's NORM op, run by
the one-shot kernel :mod:`purlin.kernels.epilogue` builds for the epilogue."""

from __future__ import annotations

from purlin.errors import CapabilityError, SpecError


def launch_epilogue(bound, groups, blocks, wish, threads, epilogue) -> None:
    """Fill ``bound.launches`` (an ``SmBound`` of a fused-ll all-reduce) with one launch per
    device of the programs ending with ``epilogue`` (one per rank, or one for every rank)."""
    from purlin.atom.epilogue import per_rank
    from purlin.atom.fused import fused_unit, program, row_sums_bytes
    from purlin.atom.sm import fused_launch
    from purlin.atom.sm_kernel import RankKernel, one_shot_kernel

    torch = bound.torch
    epis = per_rank(epilogue, bound.schedule)
    if bound.schedule.collective.name != "all-reduce" or bound.protocol != "fused-ll":
        raise CapabilityError(f"a user epilogue follows an all-reduce on protocol='fused-ll' "
                              f"(the one-shot kernel); got {bound.schedule.title()} on "
                              f"{bound.protocol!r}")
    unit, problem = fused_unit(bound.lowered, bound.protocol)
    if problem or unit != 8:
        raise CapabilityError(f"the epilogue's one-shot kernel takes 8-byte LL units; "
                              f"{bound.schedule.title()} {problem or f'moves {unit}-byte ones'}")
    bound._slots_per_block()
    sizing = bound.schedule.sizing
    count = sizing.output_count(0)
    per_launch = max(len(r) for r in groups.values())
    bound.blocks_per_lane, bound.threads = fused_launch(
        bound.gpu, -(-count * bound.outputs[0].element_size() // 8), per_launch, 8,
        blocks=blocks, wish=wish, threads=threads, kind=bound.cluster.kind)
    names, progs, bound.epilogue_sums = [], [], []
    for r, low in enumerate(bound.lowered):
        out = bound.outputs[r][:sizing.output_count(r)]
        e = epis[r]
        hidden = e.check(out)["hidden"]
        sums = torch.zeros(row_sums_bytes(out.numel() * out.element_size(), 8, bound.threads)
                           // 8, dtype=torch.int64, device=out.device)
        bound.epilogue_sums.append(sums)
        record = e.record(out.data_ptr(), sums.data_ptr(), hidden)
        try:
            prog = program(low, error=bound.control[r].data_ptr() + 2 * 8,
                           abort=bound.abort.data_ptr(), flag_slot=bound.flag_map.slot, unit=8,
                           epilogue=record, threads=bound.threads)
        except CapabilityError as exc:
            raise CapabilityError(f"epilogue {e.name!r} on {bound.threads} threads per block: "
                                  f"{exc}") from None
        name, why = one_shot_kernel(e, out, prog.words)
        if why:
            raise CapabilityError(f"epilogue {e.name!r} runs on the one-shot kernel, which "
                                  f"cannot run this program: {why}")
        names.append(name)
        progs.append(prog)
    for d, ranks in groups.items():
        if len({names[r] for r in ranks}) != 1:
            raise SpecError(f"the ranks on GPU {d} share a launch: give them epilogues of the "
                            "same functions, dtypes and extras' shapes")
        k = RankKernel.fused(torch, torch.device("cuda", d), ranks,
                             [progs[r].words for r in ranks], [bound.control[r] for r in ranks],
                             blocks=bound.blocks_per_lane, threads=bound.threads, pdl=bound.pdl,
                             kernel=names[ranks[0]])
        bound._keep += k.keep + [epis]
        bound.launches.append(k)
