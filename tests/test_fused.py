"""Fused LL programs (purlin.atom.fused): which lowered tables fuse, what the program holds,
and the kernel's PTX. The kernel itself runs in tests/test_kernels_sim.py (simulator) and
tests/test_gpu_sm.py (GPUs)."""

from __future__ import annotations

import pytest

from purlin.atom.fused import fuse_problem, grid, program
from purlin.atom.lowering import lower
from purlin.errors import CapabilityError
from purlin.kernels import isa
from purlin.snac import plan
from purlin.spec import collectives

BUFFERS = ("input", "output", "scratch", "ll")


def lowered(collective, strategy="direct-push", count=None, dtype="bfloat16", ll=True, **kw):
    n = collective.nranks
    s = plan(collective, strategy, count=count or 64 * n, dtype=dtype, **kw)
    bases = {(r, b): (1 + 4 * r + i) << 28 for r in range(n) for i, b in enumerate(BUFFERS)}
    return lower(s, bases, {r: (100 + r) << 28 for r in range(n)},
                 ll_bases={r: bases[(r, "ll")] for r in range(n)} if ll else None)


@pytest.mark.parametrize("n", [2, 3, 4, 8])
@pytest.mark.parametrize("name", ["all_reduce", "reduce_scatter", "all_gather", "all_to_all"])
def test_direct_push_collectives_fuse_at_every_rank_count(name, n):
    for low in lowered(getattr(collectives, name)(n)):
        assert fuse_problem(low) is None


@pytest.mark.parametrize("n", [2, 3, 8])
def test_an_all_reduce_program_puts_to_every_peer_and_reduces_in_row_order(n):
    lows = lowered(collectives.all_reduce(n), count=64 * n)
    for low in lows:
        prog = program(low, error=7 << 40, abort=9 << 40)
        w = prog.words
        assert (prog.puts, prog.sinks) == (n - 1, 1)
        assert (w[isa.F_RANK], w[isa.F_NPUTS], w[isa.F_NSINKS]) == (low.rank, n - 1, 1)
        assert (w[isa.F_ERROR], w[isa.F_ABORT], w[isa.F_DTYPE]) == (7 << 40, 9 << 40, isa.BF16)
        assert not w[isa.F_EPOCHS: isa.F_EPOCHS + isa.F_MAX_BLOCKS].any()
        sink = int(w[isa.F_SINKS])
        dst, nbytes, nsrc, first = w[sink: sink + isa.SINK_WIDTH]
        assert (nbytes, nsrc) == (64 * n * 2, n)
        sources = w[first: first + n * isa.SOURCE_WIDTH].reshape(n, isa.SOURCE_WIDTH)
        # the REDUCE row's sources in its order: n-1 LL areas (alternating per call), 1 input
        reduce_row = next(r for r in low.tables[0] if r[isa.OP] == isa.REDUCE)
        assert dst == reduce_row[isa.DST]
        assert sources[:, 0].sum() == n - 1
        assert all((src[1] != src[2]) == bool(src[0]) for src in sources)
        peers = sorted(int(p) for p in sources[sources[:, 0] == 1][:, 3])
        assert peers == sorted(set(range(n)) - {low.rank})
        assert prog.items == 64 * n * 2 // 16


def test_a_two_rank_all_gather_program_copies_both_pieces():
    low = lowered(collectives.all_gather(2))[1]
    prog = program(low, error=0, abort=0)
    assert (prog.puts, prog.sinks) == (1, 2)  # the own piece, and the peer's from LL units


@pytest.mark.parametrize("name,why", [("broadcast", "is a wait"), ("reduce", "is a notify")])
def test_collectives_that_ack_their_scratch_stay_on_the_interpreter(name, why):
    lows = lowered(getattr(collectives, name)(2, 0))
    problems = [fuse_problem(low) for low in lows]
    assert any(p and why in p for p in problems), problems
    bad = next(low for low, p in zip(lows, problems) if p)
    with pytest.raises(CapabilityError, match=f"cannot fuse: rank {bad.rank} row"):
        program(bad, error=0, abort=0)


def test_sizes_that_are_not_whole_16_byte_items_stay_on_the_interpreter():
    low = lowered(collectives.all_reduce(2), count=60)[0]  # 120 bytes
    assert "not whole 16-byte items" in fuse_problem(low)


def test_ring_all_reduce_and_plain_tables_do_not_fuse():
    assert "notify" in fuse_problem(lowered(collectives.all_reduce(2), "ring")[0])
    assert "row 1 is a notify" in fuse_problem(lowered(collectives.all_reduce(2), ll=False)[0])


def test_a_rank_that_only_puts_to_a_peer_is_refused():
    """Without data back from the peer, nothing stops it from running two calls ahead."""
    low = lowered(collectives.all_reduce(2))[0]
    keep = [k for k, row in enumerate(low.tables[0]) if row[isa.OP] != isa.LL_GET]
    one_way = type(low)(low.rank, [t[keep] for t in low.tables], low.lane_offsets, low.srcs,
                        low.lane_barriers)
    assert fuse_problem(one_way) == ("rank 0 puts to rank 1 without receiving from it in the "
                                     "same call")


def test_grid_gives_about_one_item_per_thread_within_residency():
    assert grid(512) == (4, 128)
    assert grid(4096) == (16, 256)
    assert grid(1 << 16) == (32, 512)
    blocks, threads = grid(1 << 16, ranks_in_launch=8)
    assert blocks * 8 <= 132 and threads == 512
    assert grid(1) == (1, 128)


@pytest.fixture(scope="module", params=["fused", "fused_pdl"])
def fused_ptx(request) -> str:
    from purlin.kernels import fused
    from purlin.kernels.compat import compile_ptx

    kernel = getattr(fused, request.param)
    return compile_ptx(kernel.py_func, fused.SIGNATURE, cc=(9, 0),
                       launch_bounds=fused.MAX_THREADS), request.param


def test_the_fused_kernel_compiles_to_the_intended_ptx(fused_ptx):
    ptx, name = fused_ptx
    assert "st.volatile.global.v4.u32" in ptx          # LL puts: data and tag in one store
    assert "ld.volatile.global.v4.u32" in ptx          # LL polls
    assert "ld.global.v4.u32" in ptx                   # 16-byte plain loads
    assert "red.release.sys.global.add.u64" in ptx     # ABORT after a timeout
    assert "%globaltimer" in ptx                       # time-limited polls
    assert ".local" not in ptx                         # no spills to local memory
    assert ("griddepcontrol.wait" in ptx) == (name == "fused_pdl")
    assert "bar.sync" in ptx                           # the block's counter after its items
