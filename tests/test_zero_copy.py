"""Process mode's zero_copy choice, without GPUs: which of the caller's tensors the executor
may use in place of the staging regions (``SmPrepared.movable``). Whether the relocated tables
then compute the right thing is ``tests/test_lowering_host.py``'s
``test_local_buffers_may_move_to_other_memory``."""

import torch

from purlin.atom.lowering import local_buffers
from purlin.snac import plan
from purlin.spec import collectives
from purlin.torch.sm_path import SmPrepared


def _prepared(strategy, count=64):
    p = object.__new__(SmPrepared)
    p.local = local_buffers(plan(collectives.all_reduce(2), strategy, count=count), 0)
    staging = torch.zeros(4 * count, dtype=torch.float32)
    p.input, p.output = staging[:count], staging[2 * count: 3 * count]
    p.fused = False
    return p


def test_push_moves_both_out_of_place_and_only_the_output_in_place():
    p = _prepared("direct-push")
    x, y = torch.ones(64), torch.zeros(64)
    assert p.movable(x, y) == (True, True)
    assert p.movable(x, x) == (False, True)  # in place: the input is copied in first
    assert p.movable(None, y) == (False, True)


def test_the_fused_kernel_moves_only_what_it_can_run_relocated():
    p = _prepared("direct-push")
    x, y = torch.ones(64), torch.zeros(64)
    p.fused, p._relocated = True, lambda src, dst, capturing: None  # refused
    assert p.movable(x, y) == (False, False)
    p._relocated = lambda src, dst, capturing: 1 << 40  # built
    assert p.movable(x, y) == (True, True)


def test_pull_moves_only_the_output_the_peers_do_not_read():
    p = _prepared("direct-pull")
    assert p.movable(torch.ones(64), torch.zeros(64)) == (False, True)


def test_strided_small_or_misaligned_tensors_stay_copied():
    p = _prepared("direct-push")
    big = torch.zeros(256)
    assert p.movable(big[::2][:64], big[::2][64:128]) == (False, False)  # not contiguous
    assert p.movable(torch.ones(32), torch.ones(65)) == (False, False)   # other sizes
    assert p.movable(big[1:65], big[129:193]) == (False, False)          # 4 bytes off 16
    assert p.movable(big[4:68], big[132:196]) == (True, True)            # 16 bytes: fine
    assert p.movable(torch.ones(64, dtype=torch.float64), None) == (False, False)


def test_a_capture_moves_only_a_pair_an_eager_call_used():
    from collections import OrderedDict

    p = _prepared("direct-push")
    p._moved = OrderedDict()
    x, y = torch.ones(64), torch.zeros(64)
    assert p.movable(x, y, capturing=True) == (False, False)
    p._moved[p._key(x, y)] = "relocated before"
    assert p.movable(x, y, capturing=True) == (True, True)


def test_every_fused_program_of_a_collective_has_the_launch_s_length():
    """The launch reads ``stride_words`` words of a program into shared memory: the base
    program, its relocations and those ending with the RMSNorm epilogue are all that long
    (zero-padded), so an epilogue's op and parameters are read whole."""
    import types

    from purlin.atom.fused import epilogue_problem
    from purlin.atom.fused_rows import launch_ops
    from purlin.atom.lowering import lower
    from purlin.atom.sm_kernel import Flags
    from purlin.kernels import isa
    from purlin.runtime.shm import layout

    s = plan(collectives.all_reduce(2), "direct-push", count=1024, dtype="bfloat16")
    lay = layout(s, block_flags=True)
    ptrs = [1 << 40, 2 << 40]
    bases = {(q, b): ptrs[q] + lay.offset(q, b) for q in range(2)
             for b in ("input", "output", "scratch")}
    p = object.__new__(SmPrepared)
    p.path = types.SimpleNamespace(device=torch.device("cpu"), ptrs=ptrs, rank=0)
    flags = Flags(2, 1, lay.flag_count, {q: ptrs[q] + lay.flags for q in range(2)},
                  slots={q: ptrs[q] + lay.block_flags for q in range(2)})
    lowered = lower(s, bases, flags.flags)
    p.core = types.SimpleNamespace(  # (the prepared kernel's parts relocation reads)
        unit=16, threads=32, flags=flags, abort=0, lowered=lowered,
        control={0: torch.zeros(2 + isa.ERR_WIDTH, dtype=torch.int64)},
        ops=launch_ops(s, lowered, 16))
    p.program_words, p.sums = None, None
    p.output = torch.zeros(1024, dtype=torch.bfloat16)
    base, _ = p._program()
    moves = {(bases[(0, "output")], 1024 * 2): 3 << 40}
    moved_low = lower(s, {**bases, (0, "output"): 3 << 40}, p.flags.flags)[0]
    norm = (torch.zeros(1024, dtype=torch.bfloat16), torch.ones(512, dtype=torch.bfloat16), 1e-5)
    epilogue = p._epilogue(types.SimpleNamespace(data_ptr=lambda: 3 << 40), norm)
    assert epilogue_problem(moved_low, epilogue, 16, 32) is None
    with_norm, _ = p._program(moves, epilogue)
    assert base.numel() == with_norm.numel() == p.program_words
    ops = int(with_norm[isa.F_NOPS])
    assert int(with_norm[isa.F_HEAD + (ops - 1) * isa.OP_WIDTH]) == isa.F_OP_NORM
    params = int(with_norm[isa.F_HEAD + (ops - 1) * isa.OP_WIDTH + 5])
    assert with_norm[params: params + 4].tolist() == [norm[0].data_ptr(), norm[1].data_ptr(),
                                                      p.sums.data_ptr(), 512]
