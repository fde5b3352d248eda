"""Segmented PUTs and MOVEs (``purlin.atom.fused_rows.segmented``) on the ``fused_seg`` kernel
in the Numba CUDA simulator: after the host emulation ran every rank's call 0 (its pushes,
flags and LL units landed), each rank's program run again by the kernel -- its PUTs' LL
units first wiped -- writes the same LL units and gives the reference. The GQA all-gather
(q, k, v of 4:1:1 per rank, delivered interleaved), standard copies on LL (their LL rows
joined) and seeded random layouts. Programs that only copy plain memory run on the kernel a
launch runs them on (``fused_seg_copy``, ``fused_copy``: ``purlin.atom.fused.kernel_name``)
and on the general one."""

from __future__ import annotations

import ctypes
import sys

import numpy as np
from simulator import run_cases, simulator_tests

from purlin.atom.host import bf16_floats

CASES = {}
ITEM = {"bfloat16": 2, "float16": 2, "float32": 4, "int32": 4}


def case(fn):
    CASES[fn.__name__] = fn
    return fn


def _puts(w, unit):
    """Every segment record of the program's segmented PUTs: (LL units on even calls, their
    bytes, the row's data bytes)."""
    from purlin.kernels import isa

    out = []
    for k in range(int(w[isa.F_NOPS])):
        at = isa.F_HEAD + k * isa.OP_WIDTH
        if w[at + isa.OP_KIND] == isa.F_OP_PUTS:
            for s in range(int(w[at + isa.SEG_COUNT])):
                rec = int(w[at + isa.SEG_TABLE]) + s * isa.OP_WIDTH
                nbytes = int(w[rec + isa.PUT_BYTES])
                out.append((int(w[rec + isa.PUT_DST]), 2 * unit * -(-nbytes // unit), nbytes))
    return out


def _sent(at: int, size: int, nbytes: int) -> bytes:
    """The LL units at ``at`` (``size`` bytes) carrying a row of ``nbytes``: every tag, and
    the row's data bytes -- not those past its end, which a last partial unit carries as
    whatever its aligned load read (the interpreter pads them with zeros)."""
    a = np.frombuffer(ctypes.string_at(at, size), np.uint8).copy()
    off = np.arange(size)
    a[(off % 8 < 4) & ((off // 8) * 4 + off % 8 >= nbytes)] = 0  # (4 data bytes, 4 tag bytes)
    return a.tobytes()


def _run_on_kernel(coll, sizes, dtype, strategy, protocol, blocks, threads, rng,
                   segments=True) -> set:
    """Run ``coll``'s programs (``segments``: where they hold segmented ops; "bind": as a
    bind builds them, whatever they hold) on the kernel a launch would, and on the general
    one where that differs: the kernels' names (none where it did not run)."""
    from purlin.atom.fused import fused_unit, kernel_name, narrow_program, segmented_program
    from purlin.atom.host import HostBuffers, fused_programs, run_fused_calls
    from purlin.kernels import isa
    from purlin.kernels.launch import KERNELS
    from purlin.snac import plan
    from purlin.spec import reference

    n = coll.nranks
    s = plan(coll, strategy, chunk_sizes=sizes, dtype=dtype)
    bufs = HostBuffers(s, ll=protocol == "fused-ll")
    low = bufs.lower()
    unit, problem = fused_unit(low, protocol)
    if problem is not None:
        return set()
    programs = [w.copy() for w in fused_programs(low, bufs, unit, segments=bool(segments))]
    if segments is True and not any(segmented_program(w) for w in programs):
        return set()
    names = {kernel_name(programs), "fused-seg" if segments is True else "fused"}
    if any(narrow_program(w) for w in programs):  # (only the copy-only kernels run those)
        names = {kernel_name(programs)}
    xs = [[rng.integers(-40, 40, s.sizing.input_count(r)).astype(np.float64) for r in range(n)]]
    for x in xs[0]:
        x[x == 0] = 3
    emulated = run_fused_calls(programs, bufs, xs, blocks=blocks, threads=threads)[0]
    want = reference(s.sizing, xs[0])
    fp8 = dtype.startswith("float8")  # (summed in float32, rounded once: the emulation's bits)
    sent = {p: _sent(*p) for w in programs for p in _puts(w, unit)}
    for r, name in ((r, name) for name in sorted(names) for r in range(n)):
        for at, size, _ in _puts(programs[r], unit):
            ctypes.memset(at, 0, size)
        bufs.outputs[r][:] = 0
        counters = np.zeros(isa.F_MAX_BLOCKS, dtype=np.int64)
        w = programs[r]
        KERNELS[name][0][blocks, threads](w.ctypes.data, 1, blocks, 10_000_000, w.size,
                                          counters.ctypes.data)
        assert bufs.fused_error[isa.E_CODE] == 0, (coll.name, name, r, bufs.fused_error)
        got = bufs.outputs[r][:len(want[r])]
        if fp8:
            from purlin.spec.dtypes import fp8_decode

            got = fp8_decode(got, dtype)
            assert np.array_equal(got, emulated[r][:len(got)]), (coll.name, name, r, got)
            want[r] = got  # (the emulation is the interpreter's rounding, checked elsewhere)
        got = bf16_floats(got) if dtype == "bfloat16" else \
            (got.view(np.float16) if dtype == "float16" else got).astype(np.float64)
        tol = 0.02 if dtype in ("bfloat16", "float16") else 0
        assert (np.abs(got - want[r]) <= tol * (1 + np.abs(want[r]))).all(), \
            (coll.name, name, strategy, protocol, dtype, r, got, want[r])
    for p, was in sent.items():
        assert _sent(*p) == was, (coll.name, "LL units differ from the emulation's")
    return names


@case
def segmented_gqa_all_gather():
    """GQA on 2..8 ranks, pushed and pulled, both protocols, odd sizes, four dtypes, 8-, 4-
    and 16-byte units, 1..3 blocks (and threads holding more than four items of a plain copy's
    segments, four in flight across segment boundaries)."""
    from test_fused_rows import gqa, gqa_sizes

    rng = np.random.default_rng(5)
    ran = 0
    for n, dt, m, extra, protocol, blocks, threads in (
            (2, "bfloat16", 1, 0, "fused-ll", 2, 3), (3, "float32", 3, 1, "fused-ll", 3, 2),
            (4, "float16", 2, 0, "fused", 1, 8), (4, "bfloat16", 1, 3, "fused", 2, 4),
            (5, "int32", 1, 2, "fused-ll", 2, 4), (8, "bfloat16", 1, 0, "fused-ll", 2, 4),
            (8, "float32", 1, 0, "fused", 2, 3), (3, "bfloat16", 4, 0, "fused", 3, 5),
            (4, "bfloat16", 6, 1, "fused", 1, 3), (3, "bfloat16", 8, 0, "fused", 1, 2),
            (4, "float32", 5, 0, "fused", 2, 2)):
        for strategy in ("direct-push", "direct-pull"):
            ran += bool(_run_on_kernel(gqa(n), gqa_sizes(n, 16 // ITEM[dt] * m, extra), dt,
                                       strategy, protocol, blocks, threads, rng))
    assert ran == 22, ran


@case
def joined_standard_copies_on_ll():
    """Standard copies on LL, their PUTs and LL copies joined across flags
    (``fused_rows.joined``): all-gather, all-to-all, broadcast, gather (4-byte rows: half LL
    units), 3..4 ranks; and a two-root broadcast (the roots' PUTs joined, each peer's copies
    rows rotated to where its piece lies in them: ``fused_rows.aligned``)."""
    from purlin.spec import Collective, collectives

    two = Collective([["a"], ["b"], [], []], [["a", "b"]] * 4, "copy", name="two roots")
    rng = np.random.default_rng(9)
    ran = 0
    for coll, each, blocks, threads in ((collectives.all_gather(3), 24, 2, 3),
                                        (collectives.all_to_all(4), 16, 1, 4),
                                        (collectives.broadcast(4), 40, 2, 2),
                                        (collectives.gather(4), 10, 2, 3), (two, 36, 2, 3)):
        sizes = {k: each for k in coll.input.names()}
        ran += bool(_run_on_kernel(coll, sizes, "bfloat16", "direct-push", "fused-ll", blocks,
                                   threads, rng))
    assert ran == 5, ran


@case
def plain_copies_on_the_copy_kernels():
    """Programs that only copy plain memory run on ``fused_copy`` / ``fused_seg_copy`` (and
    the same on ``fused`` / ``fused_seg``): standard copies and custom layouts, pushed and
    pulled, rows with a partial last item (an odd element count), 1..3 blocks of threads
    holding one to several items; GQA's segmented program names the segmented copy kernel."""
    from purlin.atom.fused import kernel_name
    from purlin.spec import Collective, collectives
    from test_fused_rows import gqa, gqa_sizes

    rng = np.random.default_rng(17)
    two = Collective([["a"], ["b"], [], []], [["a", "b"]] * 4, "copy", name="two roots")
    rev = Collective([[r] for r in range(3)], [[2, 1, 0]] * 3, "copy", name="reversed")
    ran = 0
    for coll, each, odd, dtype, blocks, threads in (
            (collectives.all_gather(3), 24, 0, "bfloat16", 2, 3),
            (collectives.all_gather(4), 16, 1, "bfloat16", 1, 4),
            (collectives.all_to_all(4), 8, 3, "float32", 3, 2),
            (collectives.broadcast(4), 41, 0, "bfloat16", 2, 2),
            (two, 24, 5, "float16", 2, 3), (rev, 16, 0, "int32", 1, 5)):
        sizes = {k: each for k in coll.input.names()}
        sizes[coll.input.names()[-1]] += odd  # (the last chunk's row ends on a partial item)
        for strategy in ("direct-push", "direct-pull"):
            names = _run_on_kernel(coll, sizes, dtype, strategy, "fused", blocks, threads,
                                   rng, segments=False)
            assert names == {"fused", "fused-copy"}, (coll.name, strategy, names)
            ran += 1
    from purlin.atom.host import HostBuffers, fused_programs
    from purlin.snac import plan

    s = plan(gqa(4), "direct-push", chunk_sizes=gqa_sizes(4, 8, 0), dtype="bfloat16")
    bufs = HostBuffers(s)
    assert kernel_name(fused_programs(bufs.lower(), bufs, 16)) == "fused-seg-copy"
    s = plan(collectives.all_reduce(4), "direct-push", count=64, dtype="bfloat16")
    bufs = HostBuffers(s)
    assert kernel_name(fused_programs(bufs.lower(), bufs, 16, segments=False)) == "fused"


@case
def pieces_of_odd_size_on_the_copy_kernels():
    """Pieces whose odd element counts leave the pieces after them off 16-byte boundaries
    (GQA's q, k, v; seeded random copy layouts), pushed and pulled, 2..6 ranks, 1..3 blocks:
    their odd-aligned copies (``isa.MOVE_NARROW``) on the copy-only kernel a launch picks,
    segmented or not."""
    from test_fused_rows import gqa, gqa_sizes, random_layout

    rng = np.random.default_rng(41)
    kernels = set()
    for n, dt, unit, blocks, threads in ((2, "bfloat16", 5, 2, 3), (4, "float32", 3, 1, 4),
                                         (3, "float16", 7, 3, 2)):
        for strategy in ("direct-push", "direct-pull"):
            for segments in (True, False):  # (segmented: where any of its rows gather)
                got = _run_on_kernel(gqa(n), gqa_sizes(n, unit), dt, strategy, "fused", blocks,
                                     threads, rng, segments=segments)
                assert got <= {"fused-copy", "fused-seg-copy", "fused-seg-copy-narrow"} and \
                    (got or segments), got
                kernels |= got
    ran = 0
    while ran < 4:
        coll, sizes = random_layout(rng, int(rng.integers(2, 7)), "bfloat16", odd_pieces=True,
                                    copies=1.0)
        got = _run_on_kernel(coll, sizes, "bfloat16", str(rng.choice(["direct-push",
                                                                      "direct-pull"])),
                             "fused", int(rng.integers(1, 4)), int(rng.integers(1, 5)), rng,
                             segments=False)
        assert len(got) == 1 and next(iter(got)).endswith(("-copy", "-copy-narrow")), got
        ran += 1
    # (segmented GQA pieces are cut at unaligned destinations: fused_seg_copy_narrow)
    assert kernels == {"fused-copy", "fused-seg-copy-narrow"}, kernels


@case
def pieces_of_odd_size_on_the_narrow_kernels():
    """Pieces whose odd element counts leave the pieces after them off 8- and 4-byte
    boundaries (GQA's q, k, v; seeded random copy layouts), on LL units, pushed and pulled,
    2..6 ranks, 1..3 blocks, segmented or not: their PUTs load and their LL copies store each
    unit's words as the addresses allow, on the narrow kernel a launch picks; the reference,
    and the LL units the interpreter writes. Then random reductions of such pieces (sum and
    max, four dtypes, both protocols: plain ones in 8-byte units)."""
    from test_fused_rows import gqa, gqa_sizes, random_layout

    rng = np.random.default_rng(3)
    kernels = set()
    for n, dt, unit, blocks, threads in ((2, "bfloat16", 3, 2, 3), (4, "float16", 5, 1, 4),
                                         (3, "bfloat16", 7, 3, 2)):
        for strategy in ("direct-push", "direct-pull"):
            for segments in (True, False):
                got = _run_on_kernel(gqa(n), gqa_sizes(n, unit), dt, strategy, "fused-ll",
                                     blocks, threads, rng, segments=segments)
                assert got == {"fused-seg-narrow" if segments else "fused-narrow"}, got
                kernels |= got
    ran = sums = 0  # (copies on LL, then sums on either protocol)
    while ran < 6 or sums < 8:
        n = int(rng.integers(2, 7))
        dt = str(rng.choice(list(ITEM)))
        copies = float(ran < 6)
        coll, sizes = random_layout(rng, n, dt, odd_pieces=True, copies=copies)
        protocol = "fused-ll" if copies else str(rng.choice(["fused", "fused-ll"]))
        got = _run_on_kernel(coll, sizes, dt, str(rng.choice(["direct-push", "direct-pull"])),
                             protocol, int(rng.integers(1, 4)), int(rng.integers(1, 5)), rng,
                             segments=False)
        assert len(got) == 1, got
        kernels |= got
        ran += bool(copies)
        sums += not copies and got == {"fused-narrow"}
    assert kernels >= {"fused-narrow", "fused-seg-narrow"}, kernels


@case
def fp8_sums_on_the_narrow_kernels():
    """FP8 sums (e4m3fn, e5m2; sum, avg, max; all-reduce, reduce-scatter, reduce at odd
    element counts, then random reductions of several pieces; direct-push and direct-pull on
    both protocols), programs built as a bind builds them: on the narrow kernel
    without segmented ops (no program summing FP8 holds one), in 8-byte units, each element
    summed in float32 and rounded once -- the emulation's bits, which are the
    interpreter's."""
    from purlin.spec.collectives import standard

    rng = np.random.default_rng(8)
    kernels = set()
    ran = 0
    for name in ("all-reduce", "reduce-scatter", "reduce"):
        for dt, op in (("float8_e4m3fn", "sum"), ("float8_e5m2", "avg"),
                       ("float8_e4m3fn", "max")):
            n = int(rng.integers(2, 6))
            coll = standard(name, n, root=n - 1, op=op)
            sizes = {x: int(rng.integers(5, 90)) for x in coll.input.names()}
            # (no two-phase: one rank's call run again cannot receive its peers' pushes)
            for strategy in ("direct-push", "direct-pull"):
                for protocol in ("fused", "fused-ll"):
                    got = _run_on_kernel(coll, sizes, dt, strategy, protocol,
                                         int(rng.integers(1, 4)), int(rng.integers(1, 5)),
                                         rng, segments="bind")
                    assert got == {"fused-narrow"}, (name, strategy, protocol, got)
                    kernels |= got
                    ran += 1
    assert ran == 36, ran
    from test_fused_rows import random_layout

    ran = 0  # random reductions of several pieces: no segmented op holds an FP8 sum
    for _ in range(12):
        n = int(rng.integers(2, 6))
        dt = str(rng.choice(["float8_e4m3fn", "float8_e5m2"]))
        coll, sizes = random_layout(rng, n, "bfloat16", odd_pieces=bool(rng.random() < 0.5),
                                    copies=0.0)
        how = (coll, sizes, dt, str(rng.choice(["direct-push", "direct-pull"])),
               str(rng.choice(["fused", "fused-ll"])), int(rng.integers(1, 4)),
               int(rng.integers(1, 5)), rng)
        got = _run_on_kernel(*how, segments="bind")  # (no segmented op: fused-narrow)
        assert got <= {"fused-narrow"}, got
        ran += bool(got)
    assert ran >= 8, ran


@case
def segmented_random_layouts():
    """Seeded random copy and reduction layouts (2..6 ranks, direct-push and direct-pull,
    both protocols) whose programs hold segmented ops."""
    from test_fused_rows import random_layout

    rng = np.random.default_rng(31)
    ran = tried = 0
    while ran < 6 and tried < 80:
        tried += 1
        n = int(rng.integers(2, 7))
        dt = str(rng.choice(list(ITEM)))
        coll, sizes = random_layout(rng, n, dt)
        strategy = str(rng.choice(["direct-push", "direct-pull"]))
        try:
            ran += bool(_run_on_kernel(coll, sizes, dt, strategy,
                                       str(rng.choice(["fused", "fused-ll"])),
                                       int(rng.integers(1, 4)), int(rng.integers(1, 5)), rng))
        except Exception as exc:
            from purlin.errors import PurlinError

            if isinstance(exc, PurlinError) and "cannot plan" in str(exc):
                continue
            raise
    assert ran >= 4, (ran, tried)


# ------------------------------------------------------------------------ pytest entry points


verdicts, test_in_simulator = simulator_tests(__file__, CASES)


if __name__ == "__main__":
    run_cases(CASES, sys.argv[1])
