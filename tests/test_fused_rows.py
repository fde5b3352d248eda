"""Layouts of several pieces per rank on the fused kernel (``purlin.atom.fused_rows``): merged
flags and rotated rows, checked against ``purlin.reference`` without a GPU on the host
interpreter of fused programs (a thread per rank and block, the kernel's item rules with
rotations), over the GQA all-gather (q, k, v of 4:1:1 per rank, delivered interleaved) and
seeded random layouts x sizes x strategies x dtypes; the same cases on a GPU (virtual ranks)
with ``-m gpu``. The kernel itself runs these programs on the CUDA simulator in
``tests/test_kernels_sim.py`` (``fused_rotated_rows_of_a_gqa_all_gather``,
``fused_random_layouts_of_unequal_rows``)."""

from __future__ import annotations

import numpy as np
import pytest

from purlin.atom.fused import fused_unit, rank_ops
from purlin.atom.fused_rows import regroup, regrouped, rotations
from purlin.atom.host import HostBuffers, fused_programs, run_fused_calls
from purlin.kernels.isa import F_HEAD, F_NOPS, F_OP_MOVE, MOVE_NARROW, NARROW_SHIFT, OP_WIDTH
from purlin.snac import plan
from purlin.spec import Collective, reference

ITEM = {"bfloat16": 2, "float16": 2, "float32": 4, "int32": 4}
TOL = {"bfloat16": 2e-2, "float16": 2e-3, "float32": 1e-6, "int32": 0}


def gqa(n: int):
    """The all-gather of q, k, v per rank delivered as q0..q{n-1}, k0.., v0.. (as
    ``bench/custom_vs_standard.py`` builds it)."""
    return Collective([[(r, "q"), (r, "k"), (r, "v")] for r in range(n)],
                      [[(r, t) for t in ("q", "k", "v") for r in range(n)]] * n, "copy",
                      name="gqa all-gather")


def gqa_sizes(n: int, unit: int, extra: int = 0) -> dict:
    """q four times k and v; ``extra`` elements on the last v (an odd size)."""
    sizes = {(r, t): unit * (4 if t == "q" else 1) for r in range(n) for t in "qkv"}
    sizes[(n - 1, "v")] += extra
    return sizes


def random_layout(rng, n: int, dtype: str, odd_pieces: bool = False, copies: float = 0.7):
    """A copy collective of 1..3 pieces per rank of unequal sizes (whole 16-byte items or,
    for the last piece, any count; ``odd_pieces``: any count for every piece), each output
    rank receiving a random selection of the pieces in a random order -- or (a ``1 -
    copies`` chance) a reduction of pieces every rank holds, each delivered to one or two
    ranks."""
    e = 16 // ITEM[dtype]
    if rng.random() < copies:
        pieces = [(r, t) for r in range(n) for t in range(int(rng.integers(1, 4)))]
        outs = []
        for _ in range(n):
            pick = [pieces[i] for i in rng.permutation(len(pieces))]
            outs.append(pick[:int(rng.integers(1, len(pick) + 1))])
        coll = Collective([[p for p in pieces if p[0] == r] for r in range(n)], outs, "copy",
                          name="random copy layout")
    else:
        op = str(rng.choice(["sum", "max"]))
        pieces = list(range(int(rng.integers(n, 2 * n + 1))))
        outs = [[] for _ in range(n)]
        for p in pieces:
            for r in rng.choice(n, size=int(rng.integers(1, 3)), replace=False):
                outs[int(r)].append(p)
        coll = Collective([pieces] * n, outs, op, name=f"random {op} layout")
    sizes = {p: e * int(rng.integers(1, 40)) for p in coll.input.names()}
    if odd_pieces:
        sizes = {p: k + int(rng.integers(0, e)) for p, k in sizes.items()}
    elif rng.random() < 0.5:
        sizes[coll.input.names()[-1]] += int(rng.integers(1, e))  # a scalar tail
    return coll, sizes


def _inputs(sizing, rng, calls=2):
    out = []
    for _ in range(calls):
        xs = []
        for r in range(sizing.collective.nranks):
            x = rng.integers(-40, 40, sizing.input_count(r)).astype(np.float64)
            x[x == 0] = 3
            xs.append(x)
        out.append(xs)
    return out


def _compare(sizing, outs_per_call, xs, label):
    dt = sizing.dtype.name
    for k, call in enumerate(xs):
        for r, want in enumerate(reference(sizing, call)):
            got = np.asarray(outs_per_call[k][r], np.float64)[:len(want)]
            tol = TOL[dt] * max(1.0, float(np.abs(want).max(initial=0)))
            bad = np.abs(got - want) > tol
            assert not bad.any(), (f"{label} call {k} rank {r}: {int(bad.sum())} wrong, first "
                                   f"at {int(np.argmax(bad))}: {got[bad][:4]} vs {want[bad][:4]}")


def check_on_host(coll, sizes, dtype, strategy, protocol, blocks=2, threads=3, seed=0):
    """Run the sm datapath's fused programs on host threads; None where the plan cannot fuse
    (a refusal naming the rank: those run on the interpreter), else the regrouped ops."""
    s = plan(coll, strategy, chunk_sizes=sizes, dtype=dtype)
    bufs = HostBuffers(s, ll=protocol == "fused-ll")
    low = bufs.lower()
    unit, problem = fused_unit(low, protocol)
    if problem is not None:  # (refused before and after regrouping: the interpreter's)
        assert problem.startswith("rank "), problem
        return None
    programs = fused_programs(low, bufs, unit)
    xs = _inputs(s.sizing, np.random.default_rng(seed))
    outs = run_fused_calls(programs, bufs, xs, blocks=blocks, threads=threads)
    _compare(s.sizing, outs, xs, f"{coll.name} {strategy} {protocol} {dtype}")
    return regrouped(low, unit)


@pytest.mark.parametrize("n", [2, 3, 4, 8])
@pytest.mark.parametrize("protocol", ["fused", "fused-ll"])
def test_gqa_all_gather_is_right_with_one_notify_per_peer(n, protocol):
    """Simple flags: one notify and one wait per peer, rows side by side; LL: every piece
    its own LL transfer (no flag left), as the twin all-gather's one piece."""
    for unit, extra in ((8, 0), (24, 0), (40, 3)):
        ops, rot = check_on_host(gqa(n), gqa_sizes(n, unit, extra), "bfloat16", "direct-push",
                                 protocol)
        if protocol == "fused-ll" and extra == 0:
            for r in range(n):
                kinds = [op.kind for op in ops[r]]
                assert kinds.count("put") == 3 * (n - 1) and "notify" not in kinds and \
                    "wait" not in kinds, kinds
                # the pieces' PUTs (and LL moves) side by side: disjoint thread ranges
                for kind in ("put", "move"):
                    spans = sorted((rot[r].get(k, 0), -(-op.nbytes // 8)) for k, op in
                                   enumerate(ops[r]) if op.kind == kind)
                    assert all(a + m <= b for (a, m), (b, _) in zip(spans, spans[1:])), spans
            continue
        if protocol == "fused-ll":
            continue  # (a tail: the last piece's units still start aligned; either is right)
        for r in range(n):
            notifies = [op for op in ops[r] if op.kind == "notify"]
            assert len(notifies) == n - 1, [op.kind for op in ops[r]]  # one per peer
            assert {op.value for op in notifies} == {3}
            waits = [op for op in ops[r] if op.kind == "wait"]
            assert len(waits) == n - 1 and {w.value for w in waits} == {3}
        assert any(rot[r] for r in range(n))  # rows side by side


@pytest.mark.parametrize("dtype", ["float16", "float32", "int32"])
def test_gqa_all_gather_other_dtypes_and_grids(dtype):
    e = 16 // ITEM[dtype]
    for n, blocks, threads in ((3, 1, 4), (4, 3, 2), (5, 2, 8)):
        check_on_host(gqa(n), gqa_sizes(n, 3 * e, 1), dtype, "direct-push", "fused",
                      blocks=blocks, threads=threads)


def test_standard_collectives_keep_their_programs():
    """A layout of one piece per peer merges nothing: its ops and rows stay as they were."""
    from purlin.spec import collectives

    for coll in (collectives.all_gather(4), collectives.all_reduce(3),
                 collectives.reduce_scatter(4), collectives.all_to_all(3)):
        for strategy in ("direct-push", "direct-pull"):
            s = plan(coll, strategy, count=96, dtype="bfloat16")
            bufs = HostBuffers(s, ll=False)
            low = bufs.lower()
            ops, rot = regrouped(low, 16)
            assert ops == [rank_ops(x, 16) for x in low] and rot == [{}] * len(low)


def _local(part) -> bool:
    """A plain copy that pulls from no peer (the rank's own chunk, a push into scratch)?"""
    return part.kind == "move" and len(part.sources) == 1 and not part.sources[0].is_ll and \
        part.sources[0].peer < 0


def _joined_as_rows(joined_ops, plain_ops):
    """Are a rank's joined ops its plain ops with LL rows joined across flag operations:
    the same rows, in the same order but for plain copies that pull from no peer (which may
    only move later, past PUTs), the same flag operations, each segmented op only PUTs or
    copies of which at least one copies LL units and the rest are such plain copies?"""
    rows = [part for op in joined_ops for part in
            (op.parts if op.kind in ("puts", "moves") else (op,)) if part.kind != "wait" and
            part.kind != "notify"]
    plain_rows = [op for op in plain_ops if op.kind not in ("wait", "notify")]
    flags = sorted(repr(op) for op in joined_ops if op.kind in ("wait", "notify"))
    for op in joined_ops:
        if op.kind == "puts" and any(p.kind != "put" for p in op.parts):
            return False
        if op.kind == "moves" and not (
                any(p.sources[0].is_ll for p in op.parts) and
                all(p.sources[0].is_ll or _local(p) for p in op.parts)):
            return False
    if sorted(map(repr, rows)) != sorted(map(repr, plain_rows)) or \
            [r for r in rows if not _local(r)] != [r for r in plain_rows if not _local(r)]:
        return False
    for i, row in enumerate(plain_rows):  # a local copy still after what it came after
        if _local(row) and not {repr(r) for r in plain_rows[:i]} <= \
                {repr(r) for r in rows[:rows.index(row)]}:
            return False
        if _local(row) and any(r.kind != "put" for r in rows[:rows.index(row)]
                               if plain_rows.index(r) > i):  # (what it moved past: PUTs)
            return False
    return flags == sorted(repr(op) for op in plain_ops if op.kind in ("wait", "notify"))


def test_standard_collectives_keep_their_programs_every_strategy():
    """Every standard collective x strategy x chunks x protocol that fuses: no rank sends a
    peer two LL transfers (``ll_pieces``), so no PUT or LL move rotates but where joined
    rows put an acknowledged transfer's units on the threads that read them (``aligned``);
    unchunked, nothing merges and the programs' words are :func:`purlin.atom.fused.program`'s
    on the plain ops -- with LL rows joined across flag operations (``joined``) where that
    holds, never where a program reduces (chunked plans merge their chunks' flags, as
    ``regroup`` did before), and on plain programs their flags gathered around the copies
    (``gathered``) where that holds: the same ops, reordered."""
    from purlin.atom.fused import program
    from purlin.atom.fused_rows import aligned, cluster_programs, gathered, joined, ll_pieces
    from purlin.kernels import isa
    from purlin.snac import STRATEGIES
    from purlin.spec import collectives

    ran = joins = gathers = 0
    for name in ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast",
                 "reduce", "gather", "scatter"):
        for n in (2, 3, 4, 8):
            for strategy in STRATEGIES:
                for chunks in (1, 2):
                    try:
                        s = plan(getattr(collectives, name)(n), strategy, count=96 * n,
                                 dtype="bfloat16", chunks=chunks)
                    except Exception:  # noqa: BLE001 - a strategy that does not plan it
                        continue
                    for protocol in ("fused", "fused-ll"):
                        low = HostBuffers(s, ll=protocol == "fused-ll").lower()
                        unit, problem = fused_unit(low, protocol)
                        if problem is not None:
                            continue
                        plain = [rank_ops(x, unit) for x in low]
                        ops, rot = regrouped(low, unit)
                        assert not ll_pieces(plain), (name, n, strategy, chunks, protocol)
                        got = cluster_programs(low, lambda r: 0, 0, int, unit)
                        join = joined(plain, unit, [x.user for x in low]) if chunks == 1 \
                            else None
                        for p in got if join is None else ():  # (no PUT rotated)
                            w = p.words
                            assert not any(
                                w[at + isa.PUT_ROTATE] for at in
                                (isa.F_HEAD + k * isa.OP_WIDTH for k in range(p.ops))
                                if w[at + isa.OP_KIND] == isa.F_OP_PUT), (name, strategy)
                        ran += 1
                        if chunks > 1:  # (chunks' flags merge: regroup's, as before)
                            continue
                        assert ops == plain and rot == [{}] * n, (name, strategy, protocol)
                        if protocol == "fused" or name in ("reduce_scatter", "all_reduce",
                                                           "reduce"):
                            assert join is None, (name, strategy)
                        joins += join is not None
                        gather = gathered(plain if join is None else join, unit,
                                          [x.user for x in low])
                        gathers += gather is not None
                        final = gather if gather is not None else join
                        turn = [{}] * n if final is None else aligned(final, unit)
                        for r, (x, p) in enumerate(zip(low, got)):
                            want = program(x, 0, 0, int, unit,
                                           ops=None if final is None else final[r],
                                           rotation=turn[r])
                            assert np.array_equal(p.words, want.words)
                            assert join is None or _joined_as_rows(join[r], plain[r]), \
                                (name, strategy, r, join[r])
                            assert gather is None or sorted(map(repr, gather[r])) == sorted(
                                map(repr, plain[r] if join is None else join[r]))
    assert ran >= 400 and joins >= 30 and gathers >= 30, (ran, joins, gathers)


def test_rotations_keep_shared_bytes_on_one_thread():
    """Rows that touch bytes one of them writes (a sender's row into a peer's scratch and the
    peer's row out of it) share a rotation; rows that only read the same bytes need not;
    rows of one segment take disjoint threads."""
    s = plan(gqa(3), "direct-push", chunk_sizes=gqa_sizes(3, 16), dtype="bfloat16")
    low = HostBuffers(s, ll=False).lower()
    ops = [regroup(x.rank, rank_ops(x, 16)) for x in low]
    rot = rotations(ops, 16)
    where = {}
    for r, rank in enumerate(ops):
        for k, op in enumerate(rank):
            if op.kind == "move":
                for span in (op.dst_even, *(src.even for src in op.sources)):
                    where.setdefault(span, set()).add(rot[r].get(k, 0))
    written = {op.dst_even for rank in ops for op in rank if op.kind == "move"}
    assert all(len(v) == 1 for span, v in where.items() if span in written), where
    assert any(len(v) > 1 for v in where.values())  # (a piece read by several rows: free)
    for r, rank in enumerate(ops):
        seg = []
        for k, op in enumerate(rank + [None]):
            if op is None or op.kind != "move":
                ranges = [range(rot[r].get(j, 0), rot[r].get(j, 0) + -(-rank[j].nbytes // 16))
                          for j in seg]
                flat = [i for x in ranges for i in x]
                assert len(flat) == len(set(flat)), (r, ranges)
                seg = []
            else:
                seg.append(k)


def test_random_layouts_sizes_strategies_and_dtypes():
    """The property: any layout of unequal pieces, any size, strategy, dtype and 2..8 ranks
    runs right on the fused programs (or is refused for a reason the kernel gives)."""
    rng = np.random.default_rng(2025)
    ran = merged = 0
    for case in range(60):
        n = int(rng.integers(2, 9))
        dtype = str(rng.choice(list(ITEM)))
        coll, sizes = random_layout(rng, n, dtype)
        strategy = str(rng.choice(["direct-push", "direct-pull", "ring"]))
        protocol = str(rng.choice(["fused", "fused-ll"]))
        try:
            got = check_on_host(coll, sizes, dtype, strategy, protocol, seed=case,
                                blocks=int(rng.integers(1, 4)), threads=int(rng.integers(1, 5)))
        except Exception as exc:
            from purlin.errors import PurlinError

            if isinstance(exc, PurlinError) and "cannot plan" in str(exc):
                continue  # a strategy that does not plan this layout (say ring on a copy)
            raise
        ran += got is not None
        merged += got is not None and any(got[1])
    assert ran >= 30 and merged >= 10, (ran, merged)


def _narrow_rows(words: np.ndarray) -> np.ndarray:
    """The ``isa.MOVE_NARROW`` word of each odd-aligned MOVE of a fused program (segment
    records too)."""
    from purlin.atom.fused import _data_records

    rows = np.array([int(words[rec + MOVE_NARROW]) for kind, rec in _data_records(words)
                     if kind == F_OP_MOVE], dtype=np.int64)
    return rows[rows != 0]


def test_odd_aligned_copies_are_cut_at_the_destinations_boundaries_where_they_may():
    """``shifted_copies``: an odd-aligned copy takes ``isa.NARROW_SHIFT`` when its
    destination is aligned or no other row of the launch touches it (GQA pulled: every one,
    into the puller's own output) and keeps its items' narrow words otherwise (a ring
    forwards pieces from its outputs)."""
    from purlin.atom.fused_rows import _conflict, shifted_copies

    seen = set()
    for strategy in ("direct-pull", "direct-push", "ring"):
        s = plan(gqa(4), strategy, chunk_sizes=gqa_sizes(4, 21), dtype="bfloat16")
        ops, _ = regrouped(HostBuffers(s).lower(), 16)
        out = shifted_copies(ops)
        rows = [(r, k, op) for r, rank in enumerate(ops)
                for k, op in enumerate(rank) if op.kind in ("put", "move")]
        for r, rank in enumerate(out):
            for k, op in enumerate(rank):
                if op.kind != "move" or not op.narrow:
                    continue
                assert op.narrow & ~NARROW_SHIFT == ops[r][k].narrow in (1, 2, 4, 8)
                aligned = op.dst_even % 16 == 0 and op.dst_odd % 16 == 0
                touched = any(_conflict(op, other) for a, b, other in rows if (a, b) != (r, k))
                assert bool(op.narrow & NARROW_SHIFT) == (aligned or not touched), \
                    (strategy, r, k)
                seen.add((strategy, bool(op.narrow & NARROW_SHIFT)))
    assert {("direct-pull", True), ("ring", True), ("ring", False)} <= seen, seen
    assert ("direct-pull", False) not in seen


def test_pieces_of_odd_size_inside_a_buffer_fuse_and_are_right():
    """Pieces whose element counts leave the next piece off a 16-byte boundary, in every
    position (GQA's q, k, v of odd counts; random layouts of odd pieces): their copies fuse
    (``Move.narrow``: in narrow words, or aligned stores from shifted loads where the row
    may be cut at its destination's 16-byte boundaries), their reductions too (in 8-byte
    units on the narrow builds), and give the reference."""
    from purlin.atom.fused import narrow_program

    ran = narrow = 0
    shifted = [0, 0]  # (rows cut at the destination's boundaries, rows of items)
    for n, dtype, unit, blocks, threads in ((2, "bfloat16", 21, 2, 3), (4, "bfloat16", 5, 1, 4),
                                            (3, "float32", 7, 3, 2), (4, "float16", 3, 2, 5),
                                            (8, "bfloat16", 3, 2, 3)):
        for strategy in ("direct-push", "direct-pull"):
            s = plan(gqa(n), strategy, chunk_sizes=gqa_sizes(n, unit), dtype=dtype)
            bufs = HostBuffers(s)
            low = bufs.lower()
            assert fused_unit(low, "fused") == (16, None), (n, dtype, strategy)
            programs = fused_programs(low, bufs, 16)
            narrow += any(narrow_program(w) for w in programs)
            for w in programs:
                rows = _narrow_rows(w)
                shifted[0] += int((rows & NARROW_SHIFT != 0).sum())
                shifted[1] += int((rows & NARROW_SHIFT == 0).sum())
            ran += check_on_host(gqa(n), gqa_sizes(n, unit), dtype, strategy, "fused",
                                 blocks=blocks, threads=threads) is not None
    assert ran == 10 and narrow == 10, (ran, narrow)
    assert min(shifted) > 0, shifted
    rng = np.random.default_rng(77)
    ran = narrow = sums = 0
    for case in range(30):
        n = int(rng.integers(2, 7))
        dtype = str(rng.choice(list(ITEM)))
        coll, sizes = random_layout(rng, n, dtype, odd_pieces=True, copies=0.8)
        strategy = str(rng.choice(["direct-push", "direct-pull"]))
        blocks, threads = int(rng.integers(1, 4)), int(rng.integers(1, 5))
        s = plan(coll, strategy, chunk_sizes=sizes, dtype=dtype)
        bufs = HostBuffers(s)
        low = bufs.lower()
        assert check_on_host(coll, sizes, dtype, strategy, "fused", seed=case, blocks=blocks,
                             threads=threads) is not None, (coll, sizes, strategy)
        ran += 1
        unit, _ = fused_unit(low, "fused")
        narrow += any(narrow_program(w) for w in fused_programs(low, bufs, unit))
        sums += coll.op.is_reduce and unit == 8
    assert ran == 30 and narrow >= 20 and sums >= 1, (ran, narrow, sums)


# ---------------------------------------------------------------- the same on a GPU

def _with_ll(sizes):
    """(protocol, bytes) pairs: every size on plain fused, LL only where it runs."""
    from purlin.atom.sm import LL_MAX_BYTES

    return [("fused", b) for b in sizes] + [("fused-ll", b) for b in sizes if b <= LL_MAX_BYTES]


def _gpu_check(coll, sizes, dtype, strategy, protocol, calls=2, kernel=None):
    import torch

    from purlin.atom import sm
    from purlin.runtime import Cluster

    n = coll.nranks
    cluster = Cluster.virtual(n)
    s = plan(coll, strategy, chunk_sizes=sizes, dtype=dtype)
    try:
        bound = sm.bind(cluster, s, protocol=protocol)
    except Exception as exc:
        from purlin.errors import CapabilityError

        if isinstance(exc, CapabilityError) and "cannot run" in str(exc):
            return False  # (what fused_unit refuses: the interpreter's, checked elsewhere)
        raise
    rng = np.random.default_rng(7)
    tdt = getattr(torch, dtype)
    xs = _inputs(s.sizing, rng, calls)
    outs = [[o.double().cpu().numpy() for o in bound([torch.tensor(x).to(tdt) for x in call])]
            for call in xs]
    _compare(s.sizing, outs, xs, f"gpu {coll.name} {strategy} {protocol} {dtype}")
    if kernel is not None:  # (the kernel the launches run: segmented ops or not)
        assert {k.launcher.kernel for k in bound.launches} == {kernel}
    return True


@pytest.mark.gpu
@pytest.mark.parametrize("n", [4, 8])
@pytest.mark.parametrize("protocol,nbytes", _with_ll([8 << 10, 64 << 10, 1 << 20]))
@pytest.mark.parametrize("strategy", ["direct-push", "direct-pull"])
def test_gpu_gqa_all_gather(n, protocol, nbytes, strategy):
    e = 8  # bfloat16 elements per 16 bytes
    unit = max(e, nbytes // 2 // n // 6 // e * e)
    for extra in (0, 1):
        assert _gpu_check(gqa(n), gqa_sizes(n, unit, extra), "bfloat16", strategy, protocol,
                          calls=3)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [4, 8])
@pytest.mark.parametrize("nbytes", [8 << 10, 1 << 20])
@pytest.mark.parametrize("strategy", ["direct-push", "direct-pull"])
def test_gpu_pieces_of_odd_size_run_on_the_copy_kernels(n, nbytes, strategy):
    """GQA's q, k, v of odd element counts (every piece after the first off a 16-byte
    boundary) on the fused kernel: odd-aligned copies on a copy-only build, three calls,
    the reference; and a default bind takes the fused kernel for it (on LL units at 8 KiB:
    the narrow builds)."""
    import torch

    from purlin.runtime import Cluster

    unit = max(1, nbytes // 2 // n // 6) | 1  # odd
    sizes = gqa_sizes(n, unit)
    assert _gpu_check(gqa(n), sizes, "bfloat16", strategy, "fused", calls=3)
    bound = Cluster.virtual(n).bind(gqa(n), strategy, chunk_sizes=sizes, dtype="bfloat16")
    assert bound.kernel in ("fused kernel", "fused-ll kernel"), bound.kernel
    assert {k.launcher.kernel for k in bound.launches} <= {
        "fused-copy", "fused-seg-copy", "fused-seg-copy-narrow", "fused-narrow",
        "fused-seg-narrow"}
    xs = [torch.randn(bound.schedule.sizing.input_count(r)).bfloat16() for r in range(n)]
    outs = bound(xs)
    want = reference(bound.schedule.sizing, [x.double().numpy() for x in xs])
    for r in range(n):
        assert np.array_equal(outs[r].double().cpu().numpy()[:len(want[r])], want[r]), r


@pytest.mark.gpu
@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("nbytes", [8 << 10, 64 << 10])
@pytest.mark.parametrize("strategy", ["direct-push", "direct-pull"])
def test_gpu_pieces_of_odd_size_run_in_ll_units_on_the_narrow_kernels(n, nbytes, strategy):
    """GQA's q, k, v of odd element counts on LL units: a narrow build of the fused kernel
    (``fused-narrow``, or ``fused-seg-narrow`` where rows join), three calls, the
    reference."""
    from purlin.atom import sm
    from purlin.runtime import Cluster

    unit = max(1, nbytes // 2 // n // 6) | 1  # odd
    assert _gpu_check(gqa(n), gqa_sizes(n, unit), "bfloat16", strategy, "fused-ll", calls=3)
    s = plan(gqa(n), strategy, chunk_sizes=gqa_sizes(n, unit), dtype="bfloat16")
    bound = sm.bind(Cluster.virtual(n), s, protocol="fused-ll")
    assert {k.launcher.kernel for k in bound.launches} <= {"fused-narrow", "fused-seg-narrow"}


@pytest.mark.gpu
def test_gpu_sums_of_pieces_of_odd_size_run_on_the_narrow_kernels():
    """Seeded random reductions (sum, max) of pieces of odd element counts (2, 4, 8 ranks,
    four dtypes, pushed and pulled, both protocols, sizes up to ~200 KiB): the reference,
    two calls, most of them on a narrow build of the fused kernel."""
    from purlin.atom import sm
    from purlin.runtime import Cluster

    rng = np.random.default_rng(5)
    ran = narrow = 0
    for _ in range(12):
        n = int(rng.choice([2, 4, 8]))
        dtype = str(rng.choice(["bfloat16", "float16", "float32", "int32"]))
        coll, sizes = random_layout(rng, n, dtype, odd_pieces=True, copies=0.0)
        strategy = str(rng.choice(["direct-push", "direct-pull"]))
        protocol = str(rng.choice(["fused", "fused-ll"]))
        scale = int(rng.choice([1, 17] if protocol == "fused-ll" else [1, 17, 65]))  # (odd)
        sizes = {k: v * scale for k, v in sizes.items()}
        if not _gpu_check(coll, sizes, dtype, strategy, protocol):
            continue
        ran += 1
        s = plan(coll, strategy, chunk_sizes=sizes, dtype=dtype)
        bound = sm.bind(Cluster.virtual(n), s, protocol=protocol)
        narrow += any(k.launcher.kernel.endswith("-narrow") for k in bound.launches)
    assert ran >= 8 and narrow >= 4, (ran, narrow)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [4, 8])
@pytest.mark.parametrize("protocol,nbytes", _with_ll([8 << 10, 64 << 10, 1 << 20, 16 << 20]))
def test_gpu_gqa_runs_segmented_ops_and_its_twin_does_not(n, protocol, nbytes):
    """The GQA all-gather's direct-push programs hold segmented ops and run on the
    ``fused-seg`` kernel (``fused-seg-copy`` without LL: plain copies only), right (three
    calls, an odd size too); its twin runs ``fused-copy``, or on LL ``fused-seg`` too (its LL
    rows joined: ``fused_rows.joined``)."""
    e = 8
    unit = max(e, nbytes // 2 // n // 6 // e * e)
    for extra in (0, 1):
        sizes = gqa_sizes(n, unit, extra)
        ll = protocol == "fused-ll"
        assert _gpu_check(gqa(n), sizes, "bfloat16", "direct-push", protocol, calls=3,
                          kernel="fused-seg" if ll else "fused-seg-copy")
        if extra == 0:
            assert _gpu_check(*_twin(n, sizes), "bfloat16", "direct-push", protocol,
                              kernel="fused-seg" if ll else "fused-copy")


def test_odd_aligned_rows_join_segmented_ops_as_their_whole_sized_twins_do():
    """GQA's pieces one element longer each (every piece after the first off a 16-byte
    boundary): each rank's program has the op kinds, in order, of the same layout at whole
    sizes -- a peer's odd-aligned rows in one segmented op, as its aligned rows are --, on
    every strategy that segments, with rows cut at their destination's boundaries
    (``isa.NARROW_SHIFT``) and rows of 16-byte items at any alignment among them."""
    from purlin.atom.fused import kernel_name
    from purlin.kernels import isa

    def kinds(w):
        return [int(w[isa.F_HEAD + k * isa.OP_WIDTH]) for k in range(int(w[isa.F_NOPS]))]

    cut = [0, 0]  # (segment records cut at the destination's boundaries, of 16-byte items)
    for n in (4, 8):
        for strategy in ("direct-pull", "direct-push", "ring"):
            programs = []
            for unit in (41, 40):
                s = plan(gqa(n), strategy, chunk_sizes=gqa_sizes(n, unit), dtype="bfloat16")
                bufs = HostBuffers(s)
                programs.append(fused_programs(bufs.lower(), bufs, 16))
            odd, whole = programs
            assert kernel_name(whole) == "fused-seg-copy", (n, strategy)
            assert kernel_name(odd) == "fused-seg-copy-narrow", (n, strategy)  # (cut segments)
            assert [kinds(w) for w in odd] == [kinds(w) for w in whole], (n, strategy)
            for w in odd:
                rows = _narrow_rows(w)
                cut[0] += int((rows & NARROW_SHIFT != 0).sum())
                cut[1] += int((rows & NARROW_SHIFT == 0).sum())
    assert min(cut) > 0, cut


def test_large_odd_aligned_rows_stay_rows_of_their_own():
    """GQA's pieces one element longer each on 8 ranks, each above
    ``NARROW_SEGMENT_BYTES``: no segmented op holds an odd-aligned row (aligned ones still
    join), and the programs give the reference on the host."""
    from purlin.atom.fused import _data_records, narrow_program
    from purlin.atom.fused_rows import NARROW_SEGMENT_BYTES
    from purlin.kernels import isa

    unit = NARROW_SEGMENT_BYTES // 2 + 1  # bf16 elements of k and v (q: four times)
    for strategy in ("direct-pull", "direct-push"):
        s = plan(gqa(8), strategy, chunk_sizes=gqa_sizes(8, unit), dtype="bfloat16")
        bufs = HostBuffers(s)
        programs = fused_programs(bufs.lower(), bufs, 16)
        assert all(narrow_program(w) for w in programs)
        rows = 0
        for w in programs:
            for k in range(int(w[isa.F_NOPS])):
                at = isa.F_HEAD + k * isa.OP_WIDTH
                if w[at + isa.OP_KIND] == isa.F_OP_MOVES:
                    first = int(w[at + isa.SEG_TABLE])
                    assert not any(w[first + isa.OP_WIDTH * j + isa.MOVE_NARROW]
                                   for j in range(int(w[at + isa.SEG_COUNT]))), (strategy, k)
            rows += sum(1 for kind, rec in _data_records(w)
                        if kind == isa.F_OP_MOVE and w[rec + isa.MOVE_NARROW])
        assert rows >= 8 * 20, (strategy, rows)
    assert check_on_host(gqa(4), gqa_sizes(4, unit), "bfloat16", "direct-pull", "fused",
                         blocks=2, threads=3) is not None


def test_no_segmented_op_holds_a_row_touching_what_another_of_its_rows_writes():
    """The kernel's segment loop issues a later row's loads before an earlier row's stores
    (``copy_words``, four in flight across segments), so no segmented op may hold a row that
    reads or writes bytes another of its rows writes: seeded random layouts (copies and
    sums, odd pieces, every dtype) x direct-push, direct-pull and ring x plain and LL, every
    record of every segmented op of every rank's program."""
    from purlin.kernels import isa
    from purlin.snac.strategies import check_strategy

    def spans(w, rec, puts):  # (written (address, bytes), [read ones]) of a record
        if puts:
            return (w[rec + isa.PUT_DST], 2 * w[rec + isa.PUT_BYTES]), \
                [(w[rec + isa.PUT_SRC], w[rec + isa.PUT_BYTES])]
        n, first = w[rec + isa.MOVE_BYTES], w[rec + isa.MOVE_SOURCES]
        entries = [first + k * isa.SOURCE_WIDTH for k in range(w[rec + isa.MOVE_NSRC])]
        return (w[rec + isa.MOVE_DST], n), \
            [(w[e + isa.SOURCE_ADDR], 2 * n if w[e + isa.SOURCE_LL] else n) for e in entries]

    def meets(a, b):
        return a[0] < b[0] + b[1] and b[0] < a[0] + a[1]

    rng = np.random.default_rng(3)
    segmented = 0
    for _ in range(40):
        n, dtype = int(rng.integers(2, 7)), str(rng.choice(list(ITEM)))
        coll, sizes = random_layout(rng, n, dtype, odd_pieces=bool(rng.random() < 0.5),
                                    copies=0.8)
        for strategy in ("direct-push", "direct-pull", "ring"):
            try:
                check_strategy(strategy, coll)
            except Exception:  # (the strategy is not for this layout)
                continue
            for ll in (False, True):
                bufs = HostBuffers(plan(coll, strategy, chunk_sizes=sizes, dtype=dtype), ll=ll)
                low = bufs.lower()
                unit, problem = fused_unit(low, "fused-ll" if ll else "fused")
                if problem:
                    continue
                for w in fused_programs(low, bufs, unit):
                    for k in range(int(w[F_NOPS])):
                        at = F_HEAD + k * OP_WIDTH
                        if w[at] not in (isa.F_OP_PUTS, isa.F_OP_MOVES):
                            continue
                        segmented += 1
                        recs = [spans(w, int(w[at + isa.SEG_TABLE]) + j * OP_WIDTH,
                                      w[at] == isa.F_OP_PUTS)
                                for j in range(int(w[at + isa.SEG_COUNT]))]
                        for i, (wa, _) in enumerate(recs):
                            for j, (wb, rb) in enumerate(recs):
                                assert i == j or not (meets(wa, wb) or
                                                      any(meets(wa, x) for x in rb)), \
                                    (coll.name, strategy, ll, k, i, j)
    assert segmented >= 300, segmented


def test_verified_schedules_take_the_fast_path():
    """Seeded random layouts (copies and reductions, pieces of any size, 2..8 ranks) x every
    strategy that plans them x chunks and lanes x five dtypes: what a default bind runs
    (``fast_protocol``) is the fused kernel for every one -- sums of odd-aligned pieces and
    FP8 sums on the narrow builds."""
    from purlin.atom.fused import fused_problems
    from purlin.atom.sm import fast_protocol
    from purlin.snac.strategies import check_strategy

    rng = np.random.default_rng(11)
    fast = {"copy": 0, "reduce": 0, "fp8 sum": 0}
    while sum(fast.values()) < 150:
        n = int(rng.integers(2, 9))
        dtype = str(rng.choice(["bfloat16", "float16", "float32", "int32", "float8_e4m3fn"]))
        coll, sizes = random_layout(rng, n, "bfloat16" if dtype not in ITEM else dtype,
                                    odd_pieces=bool(rng.random() < 0.3))
        strategy = str(rng.choice(["direct-push", "direct-pull", "two-phase", "ring",
                                   "push-pull"]))
        try:
            check_strategy(strategy, coll)
        except Exception:  # (the strategy is not for this layout)
            continue
        s = plan(coll, strategy, chunk_sizes=sizes, dtype=dtype,
                 chunks=int(rng.choice([1, 2])), lanes=int(rng.choice([1, 2])))
        kind = "copy" if not coll.op.is_reduce else \
            "fp8 sum" if dtype.startswith("float8") else "reduce"
        assert fast_protocol(s).startswith("fused"), \
            (strategy, dtype, coll, sizes, fused_problems(s)["fused"])
        fast[kind] += 1
    assert fast["copy"] >= 60 and fast["reduce"] >= 20 and fast["fp8 sum"] >= 5, fast


@pytest.mark.gpu
def test_gpu_random_layouts():
    rng = np.random.default_rng(77)
    ran = 0
    for case in range(40):
        n = int(rng.choice([2, 4, 8]))
        dtype = str(rng.choice(["bfloat16", "float16", "float32", "int32"]))
        coll, sizes = random_layout(rng, n, dtype)
        scale = int(rng.choice([1, 16, 64]))
        sizes = {k: v * scale for k, v in sizes.items()}
        strategy = str(rng.choice(["direct-push", "direct-pull"]))
        ran += _gpu_check(coll, sizes, dtype, strategy, str(rng.choice(["fused", "fused-ll"])))
    assert ran >= 20, ran


# ---------------------------------------------------------------- odd sizes

@pytest.mark.parametrize("strategy", ["two-phase", "ring", "direct-push"])
@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_odd_sizes_cut_parts_on_16_byte_items_and_fuse(strategy, n):
    """An all-reduce one (or a few) elements past a size whose parts are whole 16-byte
    items: every part starts aligned (the last one takes the tail), so two-phase and ring
    fuse as the whole size does, chunked too, and give the reference."""
    from purlin.atom.fused import fused_problems
    from purlin.spec import collectives

    coll = collectives.all_reduce(n)
    for dtype, extra in (("bfloat16", 1), ("float32", 3), ("bfloat16", 7)):
        e = 16 // ITEM[dtype]
        each = 2 * n * e * 4
        names = coll.input.names()
        sizes = {k: each for k in names}
        sizes[names[-1]] += extra
        for chunks in (1, 2):
            s = plan(coll, strategy, chunk_sizes=sizes, dtype=dtype, chunks=chunks)
            whole = plan(coll, strategy, chunk_sizes={k: each for k in names}, dtype=dtype,
                         chunks=chunks)
            assert fused_problems(whole)["fused"] is None
            assert fused_problems(s)["fused"] is None, (dtype, extra, chunks)
        check_on_host(coll, sizes, dtype, strategy, "fused", blocks=2, threads=4)


def test_a_last_partial_round_gets_one_more_block():
    """One item past what the grid's threads take in a round: one more block (where it
    fits), not a second round for one thread."""
    from purlin.atom.sm import Gpu, fused_launch

    gpu = Gpu(0, 132)
    whole = fused_launch(gpu, 4096, 4, 16)
    assert fused_launch(gpu, 4096 + 1, 4, 16) == (whole[0] + 1, whole[1])
    assert fused_launch(gpu, 8192 + 1, 8, 8, wish=16) == (17, 256)
    assert fused_launch(gpu, 8192, 8, 8, wish=16) == (16, 256)


# ---------------------------------------------------------------- auto for custom layouts

def test_custom_copy_layouts_borrow_their_twins_table_entry():
    import types

    from purlin.runtime.auto import TuningTable, select, twin_name
    from purlin.spec import collectives

    table = TuningTable("NVIDIA H200", {}, virtual={4: [
        {"collective": "broadcast", "nbytes": 1 << 20, "strategy": "direct-pull",
         "chunks": 1, "lanes": 1, "protocol": "fused"},
        {"collective": "all-gather", "nbytes": 16 << 20, "strategy": "direct-pull",
         "chunks": 1, "lanes": 1, "protocol": "fused"}]})
    cluster = types.SimpleNamespace(datapath="sm", kind="virtual", nranks=4, devices=[0] * 4)
    two_root = Collective([["a"], ["b"], [], []], [["a", "b"]] * 4, "copy")
    assert twin_name(two_root) == "broadcast" and twin_name(gqa(4)) == "all-gather"
    assert twin_name(collectives.all_reduce(4)) == "all-reduce"  # its own: nothing borrowed
    got = select(two_root, cluster, chunk_sizes={"a": 1 << 18, "b": 1 << 18}, dtype="bfloat16",
                 table=table)
    assert (got.strategy, got.protocol) == ("direct-pull", "fused") and "twin broadcast" in \
        got.source, got
    got = select(gqa(4), cluster, chunk_sizes=gqa_sizes(4, 1 << 18), dtype="bfloat16",
                 table=table)
    assert got.strategy == "direct-pull" and "twin all-gather" in got.source, got
    small = select(two_root, cluster, chunk_sizes={"a": 4096, "b": 4096}, dtype="bfloat16",
                   table=table)
    assert "twin broadcast" in small.source, small  # every size borrows


def test_a_borrowed_copy_layout_on_virtual_ranks_pulls_where_its_twin_could_not_tell():
    import types

    from purlin.runtime.auto import TuningTable, select

    def table(pull_us, nbytes=1 << 20, virtual=True):
        row = {"collective": "all-gather", "nbytes": nbytes, "strategy": "direct-push",
               "chunks": 1, "lanes": 1, "protocol": "fused", "time_us": 10.0,
               "per_strategy": {"direct-pull": {"chunks": 1, "lanes": 1, "protocol": "fused",
                                                "time_us": pull_us}}}
        return TuningTable("x", {} if virtual else {4: [row]}, virtual={4: [row]} if virtual
                           else {})

    cluster = types.SimpleNamespace(datapath="sm", kind="virtual", nranks=4, devices=[0] * 4)
    sizes = gqa_sizes(4, (1 << 20) // 2 // 24 // 8 * 8)  # ~1 MiB of output: its entry 1 MiB
    pick = select(gqa(4), cluster, chunk_sizes=sizes, dtype="bfloat16", table=table(10.4))
    assert pick.strategy == "direct-pull" and "twin all-gather" in pick.source, pick
    # the twin's pull measured beyond the noise: its winner stands
    assert select(gqa(4), cluster, chunk_sizes=sizes, dtype="bfloat16",
                  table=table(11.0)).strategy == "direct-push"
    # below 1 MiB the twin's winner stands (a push's LL hop is the latency there)
    small = select(gqa(4), cluster, chunk_sizes=sizes, dtype="bfloat16",
                   table=table(10.4, nbytes=64 << 10))
    assert small.strategy == "direct-push", small
    # real GPUs: a push crosses NVLink once either way; the twin's winner stands
    real = types.SimpleNamespace(datapath="sm", kind="local", nranks=4, devices=[0, 1, 2, 3])
    assert select(gqa(4), real, chunk_sizes=sizes, dtype="bfloat16",
                  table=table(10.4, virtual=False)).strategy == "direct-push"


def test_a_borrowed_small_copy_with_more_senders_than_its_twin_pushes():
    import types

    from purlin.runtime.auto import TuningTable, select, senders_per_receiver
    from purlin.spec import collectives

    def table(nbytes):
        row = {"collective": "broadcast", "nbytes": nbytes, "strategy": "direct-pull",
               "chunks": 1, "lanes": 1, "protocol": "fused", "time_us": 5.0,
               "per_strategy": {"direct-push": {"chunks": 1, "lanes": 1,
                                                "protocol": "fused-ll", "time_us": 6.4}}}
        return TuningTable("x", {}, virtual={4: [row]})

    cluster = types.SimpleNamespace(datapath="sm", kind="virtual", nranks=4, devices=[0] * 4)
    two_root = Collective([["a"], ["b"], [], []], [["a", "b"]] * 4, "copy")
    assert senders_per_receiver(two_root) == 2
    assert senders_per_receiver(collectives.broadcast(4)) == 1
    small = select(two_root, cluster, chunk_sizes={"a": 1 << 14, "b": 1 << 14},
                   dtype="bfloat16", table=table(64 << 10))
    assert (small.strategy, small.protocol) == ("direct-push", "fused-ll"), small
    # the twin itself keeps its measured winner
    assert select(collectives.broadcast(4), cluster, nbytes=64 << 10, dtype="bfloat16",
                  table=table(64 << 10)).strategy == "direct-pull"
    # from 1 MiB the bytes decide: the pull's one copy stands
    big = select(two_root, cluster, chunk_sizes={"a": 1 << 19, "b": 1 << 19},
                 dtype="bfloat16", table=table(1 << 20))
    assert big.strategy == "direct-pull", big


# ---------------------------------------------------------------- segmented ops: the kernels

# the segmented-op hook in kernels/fused.py's op loop, exactly as written there
SEG_HOOK = (("norm, segs=False, copies=False, narrow=False, trace=0",
             "norm, copies=False, narrow=False, trace=0"),
            ("        elif segs and (kind == F_OP_PUTS or kind == F_OP_MOVES):  # (the fused_seg "
             "kernels)\n            _segments(meta, head, at, kind, status, block, g, stride, "
             "odd, tag, dt, redop,\n                      divisor, unit_bytes, shift, "
             "timeout_ns, abort, k == 0, p0, p1, p2, p3,\n                      copies, "
             "narrow)\n", ""),
            ("    if segs and not copies and meta[F_NOPS] > 0 and meta[F_HEAD + OP_KIND] == "
             "F_OP_PUTS:\n        p0, p1, p2, p3 = _first_segment_item(meta, head, g, stride, "
             "unit_bytes, shift,\n                                             narrow)\n", ""),
            ("narrow, narrow and not segs):", "narrow, narrow):"))  # (FP8 sums: not in fused_seg)


def test_the_standard_fused_kernels_compile_as_if_segments_were_not_there(tmp_path):
    """kernels/fused.py with the segmented-op hook cut out of ``_run`` compiles ``fused``,
    ``fused_pdl`` and ``fused_norm_pdl`` to the same PTX bodies (symbol names aside): only the
    ``fused_seg`` kernels carry the segments' code, so the standard collectives' programs run
    the kernel they ran before."""
    from ptx_bodies import SOURCE, body, fused_module, module_of

    fused = fused_module()
    text = SOURCE.read_text()
    for piece, instead in SEG_HOOK:
        assert text.count(piece) == 1, f"the segments hook changed: update SEG_HOOK ({piece!r})"
        text = text.replace(piece, instead)
    bare = module_of(text, tmp_path, "fused_without_segments")
    for name in ("fused", "fused_pdl", "fused_norm_pdl"):
        assert body(fused, name) == body(bare, name), name
    seg = body(fused, "fused_seg")
    assert seg != body(fused, "fused") and len(seg) > len(body(fused, "fused"))


def test_the_aligned_segmented_copy_build_carries_none_of_the_partial_slot_pass(tmp_path):
    """kernels/fused.py without ``_segments``' partial-slot pass (the ``copies and narrow``
    block before the union, and its test in the loop) compiles ``fused_seg_copy_pdl`` to the
    same PTX body (symbol names aside): only ``fused_seg_copy_narrow``, which launches of
    segments cut at unaligned destinations run, carries it, so aligned segmented copies (the
    GQA all-gather at whole sizes) run the code they ran before it existed."""
    from ptx_bodies import SOURCE, body, fused_module, module_of

    fused = fused_module()
    text = SOURCE.read_text()
    guard, after = "    if copies and narrow:\n", "    rec, start, nbytes, end = np.int64(0)"
    loop_test = "if not narrow or (dst0 & 15) == 0:"
    assert text.count(guard) == text.count(loop_test) == 1 and after in text, \
        "the partial-slot pass changed: update this test"
    start = text.index(guard)
    end = text.index(after, start)
    bare = module_of(text[:start] + text[end:].replace(loop_test, "if True:"), tmp_path,
                     "fused_without_pass")
    plain = body(fused, "fused_seg_copy_pdl")
    assert plain == body(bare, "fused_seg_copy_pdl")
    assert len(body(fused, "fused_seg_copy_narrow_pdl")) > len(plain)  # (the pass is there)


# ---------------------------------------------------------------- segmented ops: the programs

def _programs(coll, sizes, strategy, protocol, dtype="bfloat16", segments=True):
    """(the sm datapath's fused programs on host buffers, the buffers, the schedule), or
    None where the plan does not fuse."""
    from purlin.atom.fused_rows import cluster_programs, several_pieces

    s = plan(coll, strategy, chunk_sizes=sizes, dtype=dtype)
    bufs = HostBuffers(s, ll=protocol == "fused-ll")
    low = bufs.lower()
    unit, problem = fused_unit(low, protocol)
    if problem is not None:
        return None
    return cluster_programs(low, lambda r: 0, 0, int, unit,
                            segments=segments and several_pieces(s)), bufs, s


def test_fp8_sums_build_without_segmented_ops_for_the_narrow_kernel():
    """Programs that sum FP8 (only ``fused_narrow`` runs them) never hold a segmented op,
    whatever the layout (several pieces a peer, which bf16 sums segment), strategy or
    protocol: their kernel is "fused-narrow", bfloat16's the one it was."""
    from purlin.atom.fused import kernel_name, segmented_program

    rng = np.random.default_rng(5)
    ran = segmented_bf16 = 0
    for case in range(40):
        n = int(rng.integers(2, 7))
        coll, sizes = random_layout(rng, n, "bfloat16", odd_pieces=bool(rng.random() < 0.3),
                                    copies=0.0)
        strategy = str(rng.choice(["direct-push", "direct-pull", "two-phase"]))
        protocol = str(rng.choice(["fused", "fused-ll"]))
        try:
            fp8 = _programs(coll, sizes, strategy, protocol, "float8_e4m3fn")
            bf16 = _programs(coll, sizes, strategy, protocol)
        except Exception as exc:
            if "cannot plan" in str(exc):  # (a strategy that does not plan this layout)
                continue
            raise
        if fp8 is None:
            continue
        words = [p.words for p in fp8[0]]
        assert not any(segmented_program(w) for w in words), (coll, strategy, protocol)
        assert kernel_name(words) == "fused-narrow", kernel_name(words)
        ran += 1
        segmented_bf16 += bf16 is not None and any(segmented_program(p.words) for p in bf16[0])
    assert ran >= 20 and segmented_bf16 >= 3, (ran, segmented_bf16)


def _twin(n, sizes):
    """The all-gather moving the GQA layout's bytes: each rank's q + k + v as one piece."""
    from purlin.spec import collectives

    ag = collectives.all_gather(n)
    return ag, {r: sum(sizes[(r, t)] for t in "qkv") for r in ag.input.names()}


@pytest.mark.parametrize("n", [2, 3, 4, 8])
@pytest.mark.parametrize("protocol", ["fused", "fused-ll"])
def test_gqa_program_has_its_twins_op_count(n, protocol):
    """Segmented PUTs and MOVEs (a peer's q, k and v in one op): the GQA all-gather's
    direct-push program has exactly the ops of its standard twin's (4 ranks, flags: 13
    against 27 rows), with every segmented op on every rank; the twin holds none (it runs
    the ``fused`` kernel, as before). On LL every rank's PUTs are one op and its copies of
    LL units another with its copy of its own pieces (``joined``), the twin's too: 2 ops
    each (21 rows), with the rows-only program joined to the same."""
    for unit, extra in ((8, 0), (64, 0), (40, 3)):
        sizes = gqa_sizes(n, unit, extra)
        got = _programs(gqa(n), sizes, "direct-push", protocol)
        rows = _programs(gqa(n), sizes, "direct-push", protocol, segments=False)
        twin = _programs(*_twin(n, sizes), "direct-push", protocol)
        assert got is not None and twin is not None
        for p, t, q in zip(got[0], twin[0], rows[0]):
            assert p.ops == t.ops, (unit, extra, p.ops, t.ops)
            if protocol == "fused":
                assert p.segments > 0 and t.segments == 0 and q.segments == 0
                assert q.ops == 2 * t.ops + 1
            else:  # (one peer: the twin's PUT stays a row)
                assert p.ops == 2 and p.segments == 2 and q.ops >= p.ops
                assert t.segments == (1 if n == 2 else 2), t.segments
        if n == 4:
            assert [p.ops for p in got[0]] == [2 if protocol == "fused-ll" else 13] * 4
        # pulled (a ready flag and an acknowledgement per piece): merged across flags
        # (fused_rows.merged_flags), at most the twin's ops
        got = _programs(gqa(n), sizes, "direct-pull", protocol)
        twin = _programs(*_twin(n, sizes), "direct-pull", protocol)
        for p, t in zip(got[0], twin[0]):
            assert p.ops <= t.ops and p.segments > 0 and t.segments == 0, (p.ops, t.ops)


def _segment_walks(w, unit):
    """For every segmented op of program ``w`` and every item of its union: the records a
    thread steps over from its bucket's (``isa.SEG_INDEX``) to the one holding the item,
    checking on the way that the bucket's record starts at or before the item."""
    from purlin.kernels import isa

    walks = []
    for k in range(int(w[isa.F_NOPS])):
        at = isa.F_HEAD + k * isa.OP_WIDTH
        if w[at + isa.OP_KIND] not in (isa.F_OP_PUTS, isa.F_OP_MOVES):
            continue
        puts = w[at + isa.OP_KIND] == isa.F_OP_PUTS
        first_word = isa.PUT_ROTATE if puts else isa.MOVE_ROTATE
        bytes_word = isa.PUT_BYTES if puts else isa.MOVE_BYTES
        table, count = int(w[at + isa.SEG_TABLE]), int(w[at + isa.SEG_COUNT])
        records = [table + s * isa.OP_WIDTH for s in range(count)]
        spans = [(int(w[r + first_word]),
                  int(w[r + first_word]) - (-int(w[r + bytes_word]) // unit)) for r in records]
        for u in range(int(w[at + isa.SEG_ITEMS])):
            rec = int(w[int(w[at + isa.SEG_INDEX]) + (u >> int(w[at + isa.SEG_SHIFT]))])
            s = records.index(rec)
            assert spans[s][0] <= u, (k, u, spans[s])
            steps = 0
            while u >= spans[s][1]:
                s, steps = s + 1, steps + 1
            assert spans[s][0] <= u < spans[s][1]
            walks.append(steps)
    return walks


@pytest.mark.parametrize("n", [4, 8])
def test_segment_index_leaves_a_short_walk(n):
    """A segmented op's bucket index sends a thread to a record at or before its item and at
    most a few records short of it, where walking from the first record crossed up to every
    segment (GQA on 8 ranks: 21 in the joined LL PUT)."""
    from purlin.kernels import isa

    for protocol, unit in (("fused-ll", 8), ("fused", 64), ("fused", 40)):
        got = _programs(gqa(n), gqa_sizes(n, unit, 3 if unit == 40 else 0), "direct-push",
                        protocol)
        assert got is not None
        walks = [step for p in got[0] for step in _segment_walks(p.words, p.words[isa.F_UNIT])]
        assert walks and max(walks) <= 3, (protocol, unit, max(walks))


def _segmented_on_host(coll, sizes, dtype, strategy, protocol, blocks, threads, seed,
                       delay=0.0):
    """Run the programs on host threads (``delay``: the last block of rank ``seed`` mod n
    late before every move) against the reference; did they hold segmented ops?"""
    got = _programs(coll, sizes, strategy, protocol, dtype)
    if got is None:
        return False
    progs, bufs, s = got
    low = bufs.lower()
    unit = fused_unit(low, protocol)[0]
    programs = fused_programs(low, bufs, unit)
    xs = _inputs(s.sizing, np.random.default_rng(seed), calls=3)
    outs = run_fused_calls(programs, bufs, xs, blocks=blocks, threads=threads,
                           slow_block_delay=delay, slow_rank=seed % coll.nranks)
    _compare(s.sizing, outs, xs, f"{coll.name} {strategy} {protocol} {dtype} segmented")
    return any(p.segments for p in progs)


def test_segmented_gqa_is_right_on_host():
    """The GQA all-gather's segmented programs, three calls, 2..8 ranks, both protocols,
    odd sizes, four dtypes, grids of 1..3 blocks, a late block: the reference."""
    ran = 0
    for k, (n, dtype, m, extra, protocol, blocks, threads, delay) in enumerate((
            (2, "bfloat16", 1, 0, "fused-ll", 2, 3, 0.0),
            (3, "float32", 3, 1, "fused", 3, 2, 0.0),
            (4, "float16", 2, 0, "fused", 2, 4, 0.002),
            (4, "bfloat16", 5, 3, "fused-ll", 3, 3, 0.0),
            (5, "int32", 1, 2, "fused-ll", 2, 4, 0.0), (8, "bfloat16", 1, 0, "fused", 2, 3, 0.001),
            (8, "float32", 2, 1, "fused-ll", 1, 5, 0.0))):
        e = 16 // ITEM[dtype]
        for strategy in ("direct-push", "direct-pull"):
            ran += _segmented_on_host(gqa(n), gqa_sizes(n, e * m, extra), dtype, strategy,
                                      protocol, blocks, threads, k, delay)
    assert ran == 14, ran


def test_merged_flags_keep_progress():
    """A notify merged into a later one past the wait it answers deadlocks: refused
    (:func:`deadlock_free`); the merges made never lengthen the chain of waits
    (:func:`rounds`), and the merged programs of the pulled GQA all-gather run."""
    from purlin.atom.fused import Notify, Wait
    from purlin.atom.fused_rows import deadlock_free, merged_flags, rounds

    a, b = 0xA0, 0xB0  # (rank 1's flag a, rank 0's flag b)
    ping = [Notify("notify", a, 1), Wait("wait", b, 2, 1, 0, 1, 1),
            Notify("notify", a, 1), Wait("wait", b, 2, 2, 0, 1, 3)]
    pong = [Wait("wait", a, 2, 1, 0, 0, 0), Notify("notify", b, 1),
            Wait("wait", a, 2, 2, 0, 0, 2), Notify("notify", b, 1)]
    assert deadlock_free([ping, pong]) and rounds([ping, pong], calls=1) == 5  # a hop each
    late = [ping[1], Notify("notify", a, 2), ping[3]]  # the first notify merged past its wait
    assert not deadlock_free([late, pong]) and rounds([late, pong]) is None
    merged = merged_flags([ping, pong])
    assert merged is None or rounds(merged) <= rounds([ping, pong])
    s = plan(gqa(4), "direct-pull", chunk_sizes=gqa_sizes(4, 16), dtype="bfloat16")
    ops = regrouped(HostBuffers(s, ll=False).lower(), 16)[0]
    merged = merged_flags(ops)
    assert merged is not None and rounds(merged) <= rounds(ops)
    assert sum(map(len, merged)) < sum(map(len, ops))


def test_segmented_random_layouts_are_right_on_host():
    """Seeded random layouts x strategies x protocols x dtypes: every program runs right;
    enough of them hold segmented ops."""
    from purlin.errors import PurlinError

    rng = np.random.default_rng(4242)
    ran = segmented = 0
    for case in range(80):
        n = int(rng.integers(2, 9))
        dtype = str(rng.choice(list(ITEM)))
        coll, sizes = random_layout(rng, n, dtype)
        strategy = str(rng.choice(["direct-push", "direct-pull", "ring"]))
        protocol = str(rng.choice(["fused", "fused-ll"]))
        try:
            segmented += _segmented_on_host(coll, sizes, dtype, strategy, protocol,
                                            int(rng.integers(1, 4)), int(rng.integers(1, 5)),
                                            case, 0.001 if case % 7 == 0 else 0.0)
        except PurlinError as exc:
            if "cannot plan" in str(exc):
                continue
            raise
        ran += 1
    assert ran >= 50 and segmented >= 8, (ran, segmented)


def test_ll_rows_join_across_flags_up_to_merge_bytes():
    """An all-gather on LL: every rank's PUTs become one op and its copies of LL units
    another with its local copy (2 ops on 4 ranks against 7 rows), right on host threads
    with a late block; unions past ``MERGE_BYTES`` stay rows; programs that reduce are left
    as they are."""
    from purlin.atom.fused_rows import MERGE_BYTES, joined
    from purlin.kernels import isa
    from purlin.spec import collectives

    ag = collectives.all_gather(4)
    for piece, want in ((4096, 2), (64 << 10, 2), (MERGE_BYTES, 7)):  # (bytes a peer gets)
        s = plan(ag, "direct-push", count=4 * piece // 2, dtype="bfloat16")
        low = HostBuffers(s, ll=True).lower()
        ops = regrouped(low, 8)[0]
        got = joined(ops, 8, [x.user for x in low])
        assert [len(o) for o in (got or ops)] == [want] * 4, (piece, got)
        if got is not None:
            assert [op.kind for op in got[0]] == ["puts", "moves"], got[0]
            assert all(_joined_as_rows(j, o) for j, o in zip(got, ops))
    s = plan(ag, "direct-push", count=4 * 256, dtype="bfloat16")
    bufs = HostBuffers(s, ll=True)
    low = bufs.lower()
    programs = fused_programs(low, bufs, 8)
    assert all(w[isa.F_NOPS] == 2 for w in programs), [w[isa.F_NOPS] for w in programs]
    xs = _inputs(s.sizing, np.random.default_rng(3), calls=3)
    outs = run_fused_calls(programs, bufs, xs, blocks=2, threads=3, slow_block_delay=0.001)
    _compare(s.sizing, outs, xs, "joined all-gather")
    for coll in (collectives.all_reduce(4), collectives.reduce_scatter(4)):
        s = plan(coll, "direct-push", count=4 * 256, dtype="bfloat16")
        low = HostBuffers(s, ll=True).lower()
        assert joined(regrouped(low, 8)[0], 8, [x.user for x in low]) is None, coll.name


def test_joined_standard_copies_are_right_on_host():
    """Every standard copy collective x strategy on LL, 3, 4 and 8 ranks, their LL rows joined
    (``joined``): three calls on host threads, a late block, against the reference."""
    from purlin.snac import STRATEGIES
    from purlin.spec import collectives

    ran = joins = 0
    for name in ("all_gather", "all_to_all", "broadcast", "gather", "scatter"):
        for n in (3, 4, 8):
            coll = getattr(collectives, name)(n, n - 1) if name in (
                "broadcast", "gather", "scatter") else getattr(collectives, name)(n)
            for strategy in STRATEGIES:
                sizes = {k: 24 for k in coll.input.names()}
                try:
                    got = _programs(coll, sizes, strategy, "fused-ll")
                except Exception:  # noqa: BLE001 - a strategy that does not plan it
                    continue
                if got is None:
                    continue
                joins += _segmented_on_host(coll, sizes, "bfloat16", strategy, "fused-ll", 2,
                                            3, n, 0.0005)
                ran += 1
    assert ran >= 50 and joins >= 35, (ran, joins)


def test_acked_units_stay_on_the_blocks_that_read_them():
    """A broadcast's root hears nothing from its peers in a call: its acknowledgement waits
    (two calls back, a flag slot per block) are all that keep its PUTs from rewriting units
    a peer's block still polls, so every unit it writes must be read by the same block.
    Joined, the root's PUTs put peer p's piece at item (p - 1) * piece of the union: each
    peer's copy starts there (``aligned``); a two-root broadcast's peers join their two
    copies too, the second root's PUTs turned so that both pieces land where its peers'
    joined copies read them. On host threads with a
    peer's last block late, four calls: right (a peer's block used to poll units the root's
    next-but-one call had rewritten, and never returned)."""
    from purlin.atom.fused import Segments
    from purlin.atom.fused_rows import acked, aligned, joined
    from purlin.spec import Collective, collectives

    bc = collectives.broadcast(4)
    two = Collective([["a"], ["b"], [], []], [["a", "b"]] * 4, "copy", name="two roots")
    for coll, sizes, turned in ((bc, {"x": 4 * 100}, [2, 3]),
                                (two, {"a": 200, "b": 200}, [1, 2, 3])):
        s = plan(coll, "direct-push", chunk_sizes=sizes, dtype="bfloat16")
        bufs = HostBuffers(s, ll=True)
        low = bufs.lower()
        ops = regrouped(low, 8)[0]
        got = joined(ops, 8, [x.user for x in low])
        assert got is not None and acked(got)
        rot = aligned(got, 8)
        assert rot is not None and sorted(r for r, x in enumerate(rot) if x) == turned, rot
        roots = [r for r, rank in enumerate(got) if any(op.kind == "puts" for op in rank)]
        assert roots == [0] if coll is bc else roots == [0, 1], roots
        if coll is two:  # (each peer copies both roots' pieces in one op)
            assert all(sum(isinstance(op, Segments) and op.kind == "moves" for op in got[r]) == 1
                       and len(got[r]) == 3 for r in (2, 3)), got[2:]
        for slow in (2, 3):
            bufs = HostBuffers(s, ll=True)
            programs = fused_programs(bufs.lower(), bufs, 8)
            xs = _inputs(s.sizing, np.random.default_rng(slow), calls=4)
            outs = run_fused_calls(programs, bufs, xs, blocks=2, threads=3,
                                   slow_block_delay=0.004, slow_rank=slow)
            _compare(s.sizing, outs, xs, f"{coll.name} slow rank {slow}")


def test_standard_collectives_hold_no_segmented_ops():
    """Every standard collective x strategy x chunks x protocol that fuses, as the sm
    datapath builds its programs (segments only unchunked): no segmented op on plain
    transfers, so they run the ``fused`` kernel as before; on LL only the joined LL rows
    (``joined``)."""
    from purlin.atom.fused_rows import cluster_programs, joined, several_pieces
    from purlin.snac import STRATEGIES
    from purlin.spec import collectives

    ran = 0
    for name in ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast",
                 "reduce", "gather", "scatter"):
        for n in (2, 4, 8):
            for strategy in STRATEGIES:
                for chunks in (1, 2):
                    try:
                        s = plan(getattr(collectives, name)(n), strategy, count=96 * n,
                                 dtype="bfloat16", chunks=chunks)
                    except Exception:  # noqa: BLE001 - a strategy that does not plan it
                        continue
                    for protocol in ("fused", "fused-ll"):
                        low = HostBuffers(s, ll=protocol == "fused-ll").lower()
                        unit, problem = fused_unit(low, protocol)
                        if problem is not None:
                            continue
                        assert not several_pieces(s), (name, strategy, chunks)
                        got = cluster_programs(low, lambda r: 0, 0, int, unit,
                                               segments=several_pieces(s))
                        if protocol == "fused":
                            assert not any(p.segments for p in got), (name, strategy, chunks)
                        else:
                            plain = regrouped(low, unit)[0]
                            join = joined(plain, unit, [x.user for x in low])
                            assert [p.segments for p in got] == \
                                [0 if join is None else
                                 sum(op.kind in ("puts", "moves") for op in j)
                                 for j in (join or [None] * len(low))], (name, strategy)
                        ran += 1
    assert ran >= 300, ran


# ---------------------------------------------------------------- the race check

def _ops(coll, sizes, strategy, protocol, segments=True):
    """(each rank's fused ops as the sm datapath builds them, each rank's user spans)."""
    from purlin.atom.fused_rows import segmented_pieces, several_pieces

    s = plan(coll, strategy, chunk_sizes=sizes, dtype="bfloat16")
    low = HostBuffers(s, ll=protocol == "fused-ll").lower()
    unit, problem = fused_unit(low, protocol)
    if problem is not None:
        return None
    user = [x.user for x in low]
    ops = regrouped(low, unit)[0]
    if segments and several_pieces(s):
        ops = (segmented_pieces(ops, unit, user) or (ops,))[0]
    return ops, user


def _kinds(ops) -> list[str]:
    return [op.kind.rstrip("s") if op.kind in ("puts", "moves") else op.kind for op in ops]


def test_race_finds_none_in_the_programs_the_datapath_runs():
    """The standard collectives and the GQA all-gather, every strategy that fuses, both
    protocols, 2 and 4 ranks: no two ranks touch a byte unordered (the caller's writes of
    the input and reads of the output included)."""
    from purlin.atom.fused_rows import race
    from purlin.snac import STRATEGIES
    from purlin.spec import collectives

    checked = 0
    for n in (2, 4):
        layouts = [(gqa(n), gqa_sizes(n, 40, 3))] + [
            (c, {k: 48 for k in c.input.names()}) for c in (
                collectives.all_gather(n), collectives.reduce_scatter(n),
                collectives.all_reduce(n), collectives.broadcast(n),
                collectives.all_to_all(n))]
        for coll, sizes in layouts:
            for strategy in STRATEGIES:
                for protocol in ("fused", "fused-ll"):
                    try:
                        got = _ops(coll, sizes, strategy, protocol)
                    except Exception as exc:  # (a strategy that does not plan this layout)
                        if "cannot" in str(exc) or "does not" in str(exc):
                            continue
                        raise
                    if got is None:
                        continue
                    assert race(*got) is None, (coll.name, strategy, protocol, race(*got))
                    checked += 1
    assert checked >= 30, checked


def test_race_finds_a_missing_wait_and_a_pull_before_its_ready_flag():
    """Planted: rank 0's first wait cut from the pushed GQA program (it copies a peer's
    pieces before they land), and rank 1's first pull moved before its ready waits (it
    reads a peer's input before the caller wrote it): both found, named by rank and op."""
    from purlin.atom.fused_rows import race

    ops, user = _ops(gqa(4), gqa_sizes(4, 40), "direct-push", "fused")
    w = next(i for i, op in enumerate(ops[0]) if op.kind == "wait")
    cut = [ops[0][:w] + ops[0][w + 1:]] + ops[1:]
    assert race(cut, user) is not None and "unordered" in race(cut, user)
    ops, user = _ops(gqa(4), gqa_sizes(4, 40), "direct-pull", "fused")
    w = next(i for i, op in enumerate(ops[1]) if op.kind == "wait")
    m = next(i for i, op in enumerate(ops[1]) if i > w and op.kind in ("move", "moves"))
    early = ops[1][:w] + [ops[1][m]] + ops[1][w:m] + ops[1][m + 1:]
    got = race([ops[0], early] + ops[2:], user)
    assert got is not None and got.startswith("rank") and "unordered" in got, got


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("protocol", ["fused", "fused-ll"])
def test_gqa_pulls_say_ready_before_copying_their_own_pieces(n, protocol):
    """A pulling rank's "my input is ready" notifies (merged into the last of each flag's by
    ``regroup``, after the rank's copies of its own q and k) go first again, as its twin's
    do: each rank's program is its twin's flags around one segmented copy. The pushed
    program's notifies say that data landed: moved before its copies they race (plain
    copies), so ``notified_early`` leaves it."""
    from purlin.atom.fused_rows import notified_early, race

    sizes = gqa_sizes(n, 64)
    got, user = _ops(gqa(n), sizes, "direct-pull", protocol)
    for r in range(n):
        first = next(i for i, op in enumerate(got[r]) if op.kind == "wait")
        assert _kinds(got[r][:first]) == ["notify"] * (n - 1), (r, _kinds(got[r]))
    plain, _ = _ops(gqa(n), sizes, "direct-pull", protocol, segments=False)
    assert any(op.kind == "move" for op in plain[0][:plain[0].index(
        next(op for op in plain[0] if op.kind == "notify"))]), _kinds(plain[0])
    if protocol == "fused-ll":  # (an LL unit carries its call's tag: no notify guards it)
        return
    pushed, user = _ops(gqa(n), sizes, "direct-push", protocol, segments=False)
    assert notified_early(pushed, user) is None
    moved = [[op for op in ops if op.kind == "notify"] + [op for op in ops if op.kind != "notify"]
             for ops in pushed]
    assert race(moved, user) is not None


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("protocol", ["fused", "fused-ll"])
def test_gqa_pushes_copy_each_peer_after_its_wait(n, protocol):
    """The pushed GQA all-gather's segmented program keeps its twin's order op for op (a
    peer's q, k and v copied right after that peer's wait, the rank's own pieces after the
    notifies), not every wait first."""
    sizes = gqa_sizes(n, 64)
    got, _ = _ops(gqa(n), sizes, "direct-push", protocol)
    twin, _ = _ops(*_twin(n, sizes), "direct-push", protocol)
    for r in range(n):
        assert _kinds(got[r]) == _kinds(twin[r]), (r, _kinds(got[r]), _kinds(twin[r]))
    assert any(op.kind == "moves" for op in got[0])


@pytest.mark.parametrize("n", [4, 8])
def test_partial_all_reduce_on_ll_polls_its_acknowledgements_at_once(n):
    """A partial all-reduce's contributor on LL waits for each peer's acknowledgement and
    PUTs to it, peer after peer; ``gathered`` makes that one run of waits (one poll round in
    the fused kernel) and then the PUTs, and the result stays right over three calls."""
    from purlin.atom.fused_rows import cluster_programs

    k = n // 2
    partial = Collective([["x"] if r < k else [] for r in range(n)],
                         [[] if r < k else ["x"] for r in range(n)], "sum")
    sizes = {"x": 96}
    s = plan(partial, "direct-push", chunk_sizes=sizes, dtype="bfloat16")
    bufs = HostBuffers(s, ll=True)
    low = bufs.lower()
    unit, problem = fused_unit(low, "fused-ll")
    assert problem is None, problem
    plain = [rank_ops(x, unit) for x in low]
    got = cluster_programs(low, lambda r: 0, 0, int, unit)
    for r in range(k):
        before = [op.kind for op in plain[r]]
        assert before == ["wait", "put"] * (n - k), before
        assert [op.kind for op in got[r].op_list] == ["wait"] * (n - k) + ["put"] * (n - k)
    xs = _inputs(s.sizing, np.random.default_rng(1), calls=3)
    outs = run_fused_calls(fused_programs(low, bufs, unit), bufs, xs, blocks=2, threads=3)
    _compare(s.sizing, outs, xs, f"partial all-reduce {n}")


def test_touched_finds_the_conflicts_that_row_against_row_finds():
    """``shifted_copies`` asks ``_Touched`` (numpy, every span at once) which rows conflict
    with a narrow copy: the same answer as ``_accesses_conflict`` against each other row,
    on spans that meet, touch end to end and swap parities."""
    from purlin.atom.fused import Span
    from purlin.atom.fused_rows import _accesses_conflict, _Touched

    gen = np.random.default_rng(7)

    def span():
        even = int(gen.integers(0, 2048))
        odd = even if gen.random() < 0.5 else int(gen.integers(0, 2048))
        return Span(even, odd, int(gen.integers(1, 24)))

    seen = set()
    for _ in range(40):
        rows = [(int(gen.integers(0, 3)), k, (span(), tuple(span() for _ in range(
            int(gen.integers(0, 3)))))) for k in range(12)]
        touched = _Touched(rows)
        for r, k, acc in rows:
            want = any(_accesses_conflict(acc, acc2) for r2, k2, acc2 in rows
                       if (r2, k2) != (r, k))
            assert touched.conflict(r, k, acc) == want, (r, k, acc)
            seen.add(want)
    assert seen == {True, False}  # (about half of the rows conflict)
