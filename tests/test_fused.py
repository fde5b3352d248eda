"""Fused programs (purlin.atom.fused): which lowered tables fuse, what a program holds, the
programs run end to end by host threads (a thread per rank and block, ranks drifting apart, a
slow block), and the kernel's PTX. The kernel itself runs in tests/test_kernels_sim.py
(simulator) and tests/test_gpu_sm.py (GPUs)."""

from __future__ import annotations

import numpy as np
import pytest

from purlin.atom.fused import fuse_problem, fused_unit, grid, kernel_name, program, rank_ops
from purlin.atom.lowering import lower
from purlin.errors import CapabilityError
from purlin.kernels import isa
from purlin.atom.host import (HostBuffers, bf16_bits, bf16_floats, fused_programs,
                                 run_fused_calls)
from purlin.snac import plan
from purlin.spec import STANDARD, collectives, reference, standard

BUFFERS = ("input", "output", "scratch", "ll")
STRATEGIES = ("direct-push", "direct-pull", "two-phase", "ring")


def lowered(collective, strategy="direct-push", count=None, dtype="bfloat16", ll=True, **kw):
    n = collective.nranks
    s = plan(collective, strategy, count=count or 64 * n, dtype=dtype, **kw)
    bases = {(r, b): (1 + 4 * r + i) << 28 for r in range(n) for i, b in enumerate(BUFFERS)}
    return lower(s, bases, {r: (100 + r) << 28 for r in range(n)},
                 ll_bases={r: bases[(r, "ll")] for r in range(n)} if ll else None)


CASES = [(c, s) for c in STANDARD for s in STRATEGIES
         if not (s == "two-phase" and c not in ("all-reduce", "reduce-scatter", "reduce"))]


@pytest.mark.parametrize("ll,unit", [(True, 16), (True, 8), (True, 4), (False, 16)])
@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("name,strategy", CASES)
def test_fused_programs_run_every_standard_plan_on_host_threads(name, strategy, n, ll, unit):
    """Every standard collective x strategy, LL (16-, 8- or 4-byte items) or flags, 1 and 2
    chunks: the fused programs, run by a thread per (rank, block) with rank 0's last block
    slow, give the reference on three calls (both parities). The only plans refused forward
    LL data they received (a relay reads the LL_GET's scratch, which the fused kernel never
    writes)."""
    coll = standard(name, n, root=n - 1)
    widest = max(max(len(r) for r in coll.input), max(len(r) for r in coll.output))
    for chunks in (1, 2):
        s = plan(coll, strategy, count=4 * widest * chunks * 3, dtype="float32", chunks=chunks)
        bufs = HostBuffers(s, ll=ll)
        low = bufs.lower()
        problem = fuse_problem(low, unit)
        if problem is not None:
            assert ll and "touches an LL transfer's destination" in problem, problem
            with pytest.raises(CapabilityError, match="LL transfer's destination"):
                for one in low:
                    rank_ops(one, unit)
            continue
        programs = fused_programs(low, bufs, unit)
        rng = np.random.default_rng(n + chunks)
        xs = [[rng.integers(-50, 50, s.sizing.input_count(r)).astype(np.float64)
               for r in range(n)] for _ in range(3)]
        outs = run_fused_calls(programs, bufs, xs, blocks=3, slow_block_delay=0.001)
        for k in range(3):
            want = reference(s.sizing, xs[k])
            for r in range(n):
                assert np.array_equal(outs[k][r], want[r]), (chunks, k, r)


@pytest.mark.parametrize("unit,ll", [(8, True), (16, False)])
@pytest.mark.parametrize("in_place", [False, True])
def test_relocated_programs_run_on_the_callers_memory(unit, ll, in_place):
    """Process mode's zero-copy calls: an all-reduce whose local buffers moved to fresh
    memory (``relocate``) still fuses, and its programs put the reference there -- also in
    place, every rank's output written over its input (the row-parallel product's tensor)."""
    from purlin.atom.lowering import local_buffers, relocate

    n = 2
    s = plan(collectives.all_reduce(n), "direct-push", count=64 * n, dtype="float32")
    bufs = HostBuffers(s, ll=ll)
    low = bufs.lower()
    assert local_buffers(s, 0) == {"input", "output"}
    for r in range(n):
        new_in = np.zeros_like(bufs.inputs[r])
        new_out = new_in if in_place else np.zeros_like(bufs.outputs[r])
        moves = {(bufs.inputs[r].ctypes.data, bufs.inputs[r].nbytes): new_in.ctypes.data,
                 (bufs.outputs[r].ctypes.data, bufs.outputs[r].nbytes): new_out.ctypes.data}
        for old in (bufs.inputs[r], bufs.outputs[r]):
            old[:] = np.nan  # the old regions are never read
        bufs.inputs[r], bufs.outputs[r] = new_in, new_out
        low[r] = relocate(low[r], moves)
    assert fuse_problem(low, unit) is None
    programs = fused_programs(low, bufs, unit)
    rng = np.random.default_rng(5)
    xs = [[rng.integers(-50, 50, s.sizing.input_count(r)).astype(np.float32)
           for r in range(n)] for _ in range(3)]
    outs = run_fused_calls(programs, bufs, xs, blocks=2, threads=3)
    for k in range(3):
        for r, want in enumerate(reference(s.sizing, xs[k])):
            np.testing.assert_array_equal(outs[k][r], want, err_msg=f"call {k} rank {r}")


@pytest.mark.parametrize("n", [2, 3, 8])
def test_an_all_reduce_program_puts_to_every_peer_and_reduces_in_row_order(n):
    lows = lowered(collectives.all_reduce(n), count=64 * n)
    for low in lows:
        prog = program(low, error=7 << 40, abort=9 << 40, flag_slot=lambda a: a)
        head = prog.words
        assert (head[isa.F_RANK], head[isa.F_NOPS]) == (low.rank, n)  # n-1 puts, 1 move
        assert (head[isa.F_ERROR], head[isa.F_ABORT], head[isa.F_DTYPE]) == \
            (7 << 40, 9 << 40, isa.BF16)
        ops = head[isa.F_HEAD: isa.F_HEAD + n * isa.OP_WIDTH].reshape(n, isa.OP_WIDTH)
        assert list(ops[:, 0]) == [isa.F_OP_PUT] * (n - 1) + [isa.F_OP_MOVE]
        _, dst, dst_odd, nbytes, nsrc, first = ops[-1][:6]
        assert (dst == dst_odd, nbytes, nsrc) == (True, 64 * n * 2, n)
        sources = head[first: first + n * isa.SOURCE_WIDTH].reshape(n, isa.SOURCE_WIDTH)
        reduce_row = next(r for r in low.tables[0] if r[isa.OP] == isa.REDUCE)
        assert dst == reduce_row[isa.DST]
        assert sources[:, 0].sum() == n - 1  # the peers' LL areas, alternating per call
        assert all((src[1] != src[2]) == bool(src[0]) for src in sources)
        peers = sorted(int(p) for p in sources[sources[:, 0] == 1][:, 3])
        assert peers == sorted(set(range(n)) - {low.rank})
        assert prog.items == 64 * n * 2 // 16


def test_flags_map_to_block_slots():
    low = lowered(collectives.all_reduce(2), ll=False)
    ops = rank_ops(low[0])
    assert [op.kind for op in ops] == ["move", "notify", "wait", "move"]
    slots = {}
    prog = program(low[0], 0, 0, flag_slot=lambda a: slots.setdefault(a, (1 + len(slots)) << 32))
    head = prog.words
    notify = head[isa.F_HEAD + isa.OP_WIDTH: isa.F_HEAD + 2 * isa.OP_WIDTH]
    wait = head[isa.F_HEAD + 2 * isa.OP_WIDTH: isa.F_HEAD + 3 * isa.OP_WIDTH]
    assert notify[isa.NOTIFY_SLOT] == slots[ops[1].flag]
    assert wait[isa.WAIT_SLOT] == slots[ops[2].flag]
    assert wait[isa.WAIT_FLAG] == ops[2].flag  # the lowered flag, for error messages
    assert (wait[isa.WAIT_PER_CALL], wait[isa.WAIT_VALUE], wait[isa.WAIT_EPOCH_OFFSET]) == \
        (ops[2].per_call, ops[2].value, ops[2].epoch_offset) == (1, 1, 0)  # this call
    move = head[isa.F_HEAD + 3 * isa.OP_WIDTH:][:isa.OP_WIDTH]
    assert (move[isa.MOVE_DST], move[isa.MOVE_BYTES], move[isa.MOVE_NSRC]) == \
        (ops[3].dst_even, ops[3].nbytes, len(ops[3].sources))
    first = head[move[isa.MOVE_SOURCES]:][:isa.SOURCE_WIDTH]
    assert (first[isa.SOURCE_LL], first[isa.SOURCE_ADDR]) == \
        (ops[3].sources[0].is_ll, ops[3].sources[0].even)


def test_rows_that_start_unaligned_stay_on_the_interpreter():
    """(A last partial item is fine -- a scalar tail, tests/test_fast_path_properties.py --
    but chunk 1 of this 120-byte all-reduce starts at byte 60.)"""
    low = lowered(collectives.all_reduce(2), count=60)  # 120 bytes
    assert "not at 16-byte aligned addresses" in fuse_problem(low)
    with pytest.raises(CapabilityError,
                       match=r"cannot fuse: rank 0 row \d+ .*not at 16-byte aligned"):
        program(low[0], 0, 0, flag_slot=lambda a: a)


def test_eight_byte_items_take_what_sixteen_byte_ones_cannot():
    low = lowered(collectives.all_reduce(2), count=4)  # 8 bytes: one LL unit
    assert "not at 16-byte aligned addresses" in fuse_problem(low)
    assert fuse_problem(low, unit=8) is None
    prog = program(low[0], 0, 0, flag_slot=lambda a: a, unit=8)
    assert prog.words[isa.F_UNIT] == 8 and prog.items == 1
    with pytest.raises(CapabilityError, match="16, 8 or 4 bytes"):
        program(low[0], 0, 0, flag_slot=lambda a: a, unit=2)


@pytest.mark.parametrize("name", ["all-gather", "reduce-scatter", "all-to-all"])
def test_eight_byte_messages_fuse_in_four_byte_halves_of_ll_units(name):
    """An 8-byte message's chunks are 4 bytes here: fused-ll takes half an LL unit per thread,
    and the programs give the reference on host threads (an 8-byte all-reduce moves whole
    8-byte units; 16-byte items fit none of them: the plain protocol takes 8-byte items at
    their addresses, on the narrow build)."""
    coll = standard(name, 2)
    s = plan(coll, "direct-push", nbytes=8, dtype="bfloat16")
    bufs = HostBuffers(s, ll=True)
    low = bufs.lower()
    assert fused_unit(low, "fused-ll") == (4, None)
    assert "not at 8-byte aligned addresses" in fuse_problem(low, 8, narrow=False)
    assert "not at 16-byte aligned addresses" in fuse_problem(low, 16)
    assert fused_unit(low, "fused") == (8, None)
    assert kernel_name(fused_programs(low, bufs, 8)).endswith("-narrow")
    ar = plan(standard("all-reduce", 2), "direct-push", nbytes=8, dtype="bfloat16")
    assert fused_unit(HostBuffers(ar, ll=True).lower(), "fused-ll") == (8, None)
    programs = fused_programs(low, bufs, 4)
    rng = np.random.default_rng(3)
    xs = [[rng.integers(-50, 50, s.sizing.input_count(r)).astype(np.float32)
           for r in range(2)] for _ in range(3)]
    outs = run_fused_calls(programs, bufs, xs, blocks=2, threads=1, slow_block_delay=0.001)
    for k in range(3):
        for r, want in enumerate(reference(s.sizing, xs[k])):
            np.testing.assert_array_equal(np.asarray(outs[k][r], np.float32),
                                          np.asarray(want, np.float32),
                                          err_msg=f"{name} call {k} rank {r}")


def test_several_lanes_fuse_a_program_each():
    low = lowered(collectives.all_reduce(2), chunks=2, lanes=2)
    assert fuse_problem(low) is None  # (purlin.atom.fused_lanes: a program a lane)
    with pytest.raises(CapabilityError, match="rank 0 runs 2 lanes in one program"):
        program(low[0], 0, 0, int)


def test_a_rank_that_only_puts_to_a_peer_is_refused():
    """Without data back from the peer, nothing stops it from running two calls ahead."""
    low = lowered(collectives.all_reduce(2))
    r0 = low[0]
    keep = [k for k, row in enumerate(r0.tables[0]) if row[isa.OP] == isa.LL_PUT]
    one_way = type(r0)(r0.rank, [t[keep] for t in r0.tables], np.array([0, len(keep)]),
                       r0.srcs, r0.lane_barriers)
    assert fuse_problem([one_way, low[1]]) == ("rank 0 puts to rank 1 without hearing from "
                                               "it in the same call")


def test_spans_that_overlap_without_matching_are_refused():
    """A reduce reading half of what a peer pushed would take its items from other blocks."""
    low = lowered(collectives.all_reduce(2), ll=False)
    r1 = low[1]
    tables = [t.copy() for t in r1.tables]
    for t in tables:
        move = next(k for k, row in enumerate(t) if row[isa.OP] == isa.REDUCE)
        t[move, isa.COUNT] //= 2
    half = type(r1)(r1.rank, tables, r1.lane_offsets, r1.srcs, r1.lane_barriers)
    assert "overlapping but different bytes" in fuse_problem([low[0], half])


def test_grid_gives_about_one_item_per_thread_within_residency():
    assert grid(512) == (4, 128)
    assert grid(4096) == (16, 256)
    assert grid(1 << 16) == (32, 512)
    blocks, threads = grid(1 << 16, ranks_in_launch=8)
    assert blocks * 8 <= 132 and threads == 512
    assert grid(1) == (1, 128)
    assert grid(1 << 24) == (132, 512)


@pytest.fixture(scope="module", params=["fused", "fused_pdl", "fused_norm", "fused_norm_pdl"])
def fused_ptx(request):
    from purlin.kernels import executor, fused
    from purlin.kernels.compat import compile_ptx

    kernel = getattr(fused, request.param)
    return compile_ptx(kernel.py_func, fused.SIGNATURE, cc=(9, 0),
                       launch_bounds=executor.MAX_THREADS), request.param


def test_the_fused_kernel_compiles_to_the_intended_ptx(fused_ptx):
    ptx, name = fused_ptx
    assert "st.volatile.global.v4.u32" in ptx          # LL puts: data and tag in one store
    assert "ld.volatile.global.v4.u32" in ptx          # LL polls
    assert "ld.global.v4.u32" in ptx                   # 16-byte plain loads
    assert "ld.acquire.sys.global.u64" in ptx          # flag waits
    assert "red.release.sys.global.add.u64" in ptx     # ABORT after a timeout
    assert "fence.acq_rel.sys" in ptx                  # a run of notifies: one fence, then
    assert "red.relaxed.sys.global.add.u64" in ptx     # an add per flag that does not fence
    assert "%globaltimer" in ptx                       # time-limited waits and polls
    assert ".local" not in ptx                         # no spills to local memory
    assert "bar.sync" in ptx                           # around flags, before the counter
    assert ("griddepcontrol.wait" in ptx) == name.endswith("_pdl")
    # the RMSNorm epilogue (its square root) only where compiled in: the plain kernels keep
    # their code and registers
    assert ("sqrt" in ptx) == ("norm" in name)


@pytest.mark.parametrize("dtype,ll,unit", [("bfloat16", True, 8), ("bfloat16", True, 4),
                                           ("float32", False, 16)])
def test_the_rmsnorm_epilogue_trades_row_sums_between_blocks(dtype, ll, unit):
    """A 2-rank all-reduce ending with the epilogue, on host threads: three blocks of three
    threads, every row three chunks (one per block), one block slow, two calls -- each
    rank's residual becomes residual + sum (rounded) and its output rms_norm(residual) *
    weight, within a rounding of float64 arithmetic and the same on both ranks."""
    from purlin.atom.fused import Epilogue, epilogue_problem, row_sums_bytes

    n, blocks, threads, rows, eps = 2, 3, 3, 4, 1e-5
    bf16 = dtype == "bfloat16"
    item = 2 if bf16 else 4
    hidden = 3 * threads * unit // item
    s = plan(collectives.all_reduce(n), "direct-push", count=rows * hidden, dtype=dtype)
    bufs = HostBuffers(s, ll=ll)
    low = bufs.lower()
    rng = np.random.default_rng(11)
    enc, dec = (bf16_bits, bf16_floats) if bf16 else ((lambda x: np.asarray(x, np.float32)),
                                              (lambda x: x))
    start = enc(rng.standard_normal(rows * hidden))
    residual = [start.copy() for _ in range(n)]  # replicated, as a layer's residual stream
    weight = enc(rng.random(hidden) + 0.5)
    weights = [weight.copy() for _ in range(n)]
    nbytes = rows * hidden * item
    sums = [np.zeros(row_sums_bytes(nbytes, unit, threads) // 8, np.int64) for _ in range(n)]
    epilogues = {r: Epilogue(bufs.outputs[r].ctypes.data, residual[r].ctypes.data,
                             weights[r].ctypes.data, sums[r].ctypes.data, hidden, eps)
                 for r in range(n)}
    assert [epilogue_problem(low[r], epilogues[r], unit, threads) for r in range(n)] == [None] * n
    programs = fused_programs(low, bufs, unit, epilogues, threads)
    xs = [[rng.integers(-8, 9, rows * hidden).astype(np.float32) for _ in range(n)]
          for _ in range(2)]
    outs = run_fused_calls(programs, bufs, xs, blocks=blocks, threads=threads,
                           slow_block_delay=0.001)
    res = dec(start).astype(np.float64)
    w = dec(weight).astype(np.float64)
    for k in range(2):
        res = dec(enc(res + sum(xs[k]))).astype(np.float64)  # rounded like the kernel's add
        x = res.reshape(rows, hidden)
        want = (x / np.sqrt((x ** 2).mean(axis=1, keepdims=True) + eps) * w).ravel()
        for r in range(n):
            tol = 1e-2 if bf16 else 1e-5
            np.testing.assert_allclose(outs[k][r], want, rtol=tol, atol=tol,
                                       err_msg=f"call {k} rank {r}")
        np.testing.assert_array_equal(outs[k][0], outs[k][1])
    for r in range(n):
        np.testing.assert_array_equal(dec(residual[r]), res.astype(np.float32))


def test_the_epilogue_is_refused_where_the_kernel_cannot_end_with_it():
    """Each refusal names the rank and why: a two-phase plan (its last op is no move into the
    whole output), integers, rows that are not whole, rows of chunks the blocks do not divide
    or of more chunks than a block has threads; and a program asked to end with one raises."""
    from purlin.atom.fused import Epilogue, epilogue_problem

    def problem(strategy="direct-push", dtype="bfloat16", count=4096, hidden=1024, unit=16,
                threads=64):
        s = plan(collectives.all_reduce(2), strategy, count=count, dtype=dtype)
        bufs = HostBuffers(s, ll=False)
        low = bufs.lower()
        e = Epilogue(bufs.outputs[0].ctypes.data, 1 << 40, 2 << 40, 3 << 40, hidden, 1e-5)
        return epilogue_problem(low[0], e, unit, threads)

    assert problem() is None
    assert "last op is not the move" in problem("two-phase")
    assert "float sum" in problem(dtype="int32")
    assert "not whole rows of 1000" in problem(hidden=1000)
    assert "not whole chunks of 96 threads" in problem(threads=96)
    assert "16 chunks of 8 threads x 16 bytes, more than 8" in problem(threads=8)
    s = plan(collectives.all_reduce(2), "two-phase", count=4096, dtype="bfloat16")
    bufs = HostBuffers(s, ll=False)
    e = Epilogue(bufs.outputs[0].ctypes.data, 1 << 40, 2 << 40, 3 << 40, 1024, 1e-5)
    with pytest.raises(CapabilityError, match="rank 0: its last op"):
        fused_programs(bufs.lower(), bufs, 16, {0: e}, threads=64)
