"""The shared-memory cpu datapath (purlin.runtime.shm) and the staging allocator, in one process.

Every rank is a ShmRun over the same ShmArena, run in a thread of its own: the same code that
runs one rank per process, without spawning. Outputs must equal the float64 reference over
back-to-back calls (scratch copies alternate, flags keep growing); a rank that never runs makes
the others time out naming it, through the chain of waiting ranks.
"""

import threading
import time

import numpy as np
import pytest

from purlin.errors import ExecutionError, PurlinTimeoutError
from purlin.runtime.shm import HEADER, ShmArena, ShmRun, layout, open_arena
from purlin.snac import plan
from purlin.spec import STANDARD, reference, standard
from purlin.torch.staging import Staging

STRATEGIES = ["direct-push", "direct-pull", "two-phase", "ring"]


def _arena_runs(schedule, timeout=5.0, base_gap=0):
    lay = layout(schedule)
    arena = ShmArena.create(schedule.nranks, HEADER + base_gap + lay.size)
    runs = [ShmRun(schedule, r, arena, lay, base=HEADER + base_gap, timeout=timeout)
            for r in range(schedule.nranks)]
    return arena, runs


def _call_all(runs, ranks=None):
    errors = {}

    def one(r):
        try:
            runs[r]()
        except Exception as exc:  # noqa: BLE001
            errors[r] = exc

    ranks = range(len(runs)) if ranks is None else ranks
    threads = [threading.Thread(target=one, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads), "a rank thread hangs"
    return errors


def _cases():
    for name in STANDARD:
        for strategy in STRATEGIES:
            if strategy == "two-phase" and not standard(name, 2).op.is_reduce:
                continue
            for n, chunks, lanes in ((2, 1, 1), (3, 2, 2), (4, 3, 1)):
                yield pytest.param(name, strategy, n, chunks, lanes,
                                   id=f"{name}-{strategy}-n{n}-{chunks}x{lanes}")


@pytest.mark.parametrize("name,strategy,n,chunks,lanes", list(_cases()))
def test_every_collective_matches_reference(name, strategy, n, chunks, lanes):
    coll = standard(name, n, root=n - 1)
    dtype = "int32" if name == "all-to-all" else "float64"
    sched = plan(coll, strategy, count=5 * n, dtype=dtype, chunks=chunks, lanes=lanes)
    arena, runs = _arena_runs(sched)
    rng = np.random.default_rng(n)
    try:
        for _ in range(3):  # back to back: scratch copies alternate, flags keep growing
            xs = [rng.integers(-50, 50, size=run.input.size).astype(dtype) for run in runs]
            for run, x in zip(runs, xs):
                run.input[:] = x
                run.output[:] = -7
            assert _call_all(runs) == {}
            for run, want in zip(runs, reference(sched.sizing, xs)):
                np.testing.assert_array_equal(run.output, want.astype(dtype))
            for run, x in zip(runs, xs):
                np.testing.assert_array_equal(run.input, x)  # inputs are left alone
    finally:
        del runs
        arena.close()


def test_a_rank_that_never_comes_is_named_through_the_chain():
    # ring: rank 0 waits on rank 3, rank 1 on rank 0, ...: everybody must name rank 3
    sched = plan(standard("all-gather", 4), "ring", count=8, dtype="float32")
    arena, runs = _arena_runs(sched, timeout=1.0)
    try:
        t0 = time.monotonic()
        errors = _call_all(runs, ranks=[0, 1, 2])
        elapsed = time.monotonic() - t0
        assert set(errors) == {0, 1, 2}
        assert elapsed < 1.0 + 2.0
        for rank, exc in errors.items():
            assert isinstance(exc, PurlinTimeoutError)
            assert "is rank 3 alive?" in str(exc), str(exc)
            assert exc.missing == 3
        first = [e for e in errors.values() if "timed out after" in str(e)]
        assert first and "flag(r" in str(first[0]) and f"rank {first[0].missing}" in str(first[0])
        # a failed collective refuses to run again: its flags are out of step
        with pytest.raises(ExecutionError, match="failed earlier"):
            runs[0]()
    finally:
        del runs
        arena.close()


def test_the_chain_passes_a_rank_that_timed_out_itself_to_the_rank_it_named():
    """Rank 2 waits on rank 1, which waits on rank 0; rank 0 has just timed out waiting on
    rank 3 (failure record written, no longer waiting) and the abort word is not up yet: rank
    2 must name rank 3, not rank 0 (seen once under load in the 4-process test)."""
    from purlin.runtime import shm

    sched = plan(standard("all-gather", 4), "ring", count=8, dtype="float32")
    arena, runs = _arena_runs(sched, timeout=1.0)
    try:
        h = runs[2].headers
        h[1][shm.H_STATE], h[1][shm.H_PEER] = shm.WAITING, 0
        h[0][shm.H_F_SRC], h[0][shm.H_F_BLAME] = 3, 3
        h[0][shm.H_FAILED], h[0][shm.H_STATE] = 1, shm.IDLE
        missing, chain = runs[2]._blame(1)
        assert missing == 3, chain
        assert chain.startswith("rank 1 is itself waiting on rank 0; rank 0 timed out itself "
                                "waiting on rank 3; is rank 3 alive?"), chain
    finally:
        del runs
        arena.close()


def test_timeout_message_names_rank_step_flag_and_peer():
    sched = plan(standard("all-reduce", 2), "direct-push", count=4, dtype="float32")
    arena, runs = _arena_runs(sched, timeout=0.3)
    try:
        with pytest.raises(PurlinTimeoutError) as info:
            runs[0]()
        text = str(info.value)
        assert text.startswith("rank 0 step ")
        assert "waiting on flag(r0<-r1.l0) >= 1 from rank 1: saw 0" in text
        assert text.endswith("is rank 1 alive?")
    finally:
        del runs
        arena.close()


def test_open_arena_unlinks_names_after_everyone_attached(tmp_path):
    import os

    box = {}
    barrier = threading.Barrier(2)

    def share(obj):  # a two-thread stand-in for broadcast_object_list
        if obj is not None:
            box["v"] = obj
        barrier.wait()
        value = box.get("v")
        barrier.wait()
        return value

    arenas = {}
    threads = [threading.Thread(target=lambda r=r: arenas.__setitem__(
        r, open_arena(r, 2, HEADER + 1024, share))) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    names = arenas[0].names
    assert arenas[1].names == names
    assert not any(os.path.exists(f"/dev/shm/{n.lstrip('/')}") for n in names)
    arenas[0].array(1, HEADER, 4, np.int64)[:] = 5   # rank 0 writes rank 1's block ...
    assert arenas[1].array(1, HEADER, 4, np.int64).tolist() == [5] * 4  # ... rank 1 sees it
    assert arenas[0].headers[0][0] == os.getpid()
    for a in arenas.values():
        a.close()


def test_regions_outside_the_block_are_refused():
    arena = ShmArena.create(1, HEADER + 64)
    try:
        with pytest.raises(ExecutionError, match="outside"):
            arena.array(0, HEADER, 100, np.float64)
    finally:
        arena.close()


def test_layout_is_symmetric_and_aligned():
    sched = plan(standard("gather", 3, root=1), "direct-push", count=9, dtype="float32")
    lay = layout(sched)
    for r in range(3):
        offs = lay.offsets[r]
        assert all(o % 256 == 0 for o in offs)
        assert offs[0] >= lay.abort + 128 and offs[0] < offs[1] <= offs[2] <= lay.size
    assert lay.size % 256 == 0
    assert lay.flag_count == 3 * 1 + 1


def test_staging_first_fit_lru_and_pins():
    area = Staging(4096)
    assert area.place("a", 1000) == 0
    assert area.place("b", 1000) == 1024
    assert area.place("c", 2000) == 2048
    assert area.place("d", 1) is None
    area.pin("a")
    area.touch("b")                       # b is now the most recently used
    assert area.victims(1024) == ["c"]    # a is pinned, c is the least recently used
    assert area.victims(4096) is None     # a stays pinned whatever happens
    area.free("b")
    assert area.place("e", 512) == 1024   # first fit, in the hole b left


def test_a_rank_that_sees_the_abort_of_a_mismatch_reports_the_mismatch(monkeypatch):
    """Rank 2 announces another call and rank 0 aborts on it between rank 1's reading of the
    calls and of the abort word: rank 1 still says how the calls differ (CallMismatchError),
    not that it gave up waiting."""
    from purlin.errors import CallMismatchError
    from purlin.runtime import shm
    from purlin.runtime.fingerprint import Call

    arena = ShmArena.create(3, HEADER + 64)
    try:
        mine = Call(1, "all_reduce", "float32", 64, "sum")
        for r in (0, 1):
            shm.announce(arena, r, mine)
        real, read = shm.calls, []

        def calls_then_others_move(a):
            seen = real(a)
            if not read:  # rank 2 and rank 0 act right after this first read
                shm.announce(arena, 2, Call(1, "all_reduce", "bfloat16", 64, "sum",
                                            fallback=True))
                arena.headers[0][shm.H_ABORT] = 1
            read.append(seen)
            return seen

        monkeypatch.setattr(shm, "calls", calls_then_others_move)
        with pytest.raises(CallMismatchError, match="bfloat16"):
            shm.agree(arena, 1, mine, timeout=5.0)
    finally:
        arena.close()


def test_a_rank_that_announces_another_call_between_two_reads_is_still_seen(monkeypatch):
    """Ranks 0 and 2 announce another call and say they are ready right after rank 1 read the
    calls: rank 1's next round sees every rank ready and still compares their calls
    (CallMismatchError), instead of returning on readiness read after stale calls."""
    from purlin.errors import CallMismatchError
    from purlin.runtime import shm
    from purlin.runtime.fingerprint import Call

    arena = ShmArena.create(3, HEADER + 64)
    try:
        mine = Call(1, "broadcast", "float32", 64, "sum")
        other = Call(1, "broadcast", "float32", 64, "sum", fallback=True)
        shm.announce(arena, 1, mine)
        real, read = shm.calls, []

        def calls_then_others_move(a):
            seen = real(a)
            if not read:  # the others announce and get ready right after this first read
                for r in (0, 2):
                    shm.announce(arena, r, other)
                    arena.headers[r][shm.H_READY] = 1
            read.append(seen)
            return seen

        monkeypatch.setattr(shm, "calls", calls_then_others_move)
        with pytest.raises(CallMismatchError):
            shm.agree(arena, 1, mine, timeout=5.0)
        assert len(read) >= 2 and read[0][0] is None  # (the race the test plants happened)
    finally:
        arena.close()
