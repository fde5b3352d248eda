"""Any element count on the fused kernel, checked without a GPU: the host interpreter runs the
fused programs (``purlin.atom.host.run_fused_calls``: a thread per rank and block, the
kernel's item rules, a last partial item -- a scalar tail -- stored only up to the row's end)
and must give what ``purlin.reference`` gives, for every tail length, element type,
reduction and 2..4 ranks."""

from __future__ import annotations

import numpy as np
import pytest

from purlin.atom.fused import fused_unit
from purlin.atom.host import HostBuffers, fused_programs, run_fused_calls
from purlin.kernels import isa
from purlin.snac import plan
from purlin.spec import collectives, reference, standard

ITEM = {"bfloat16": 2, "float16": 2, "float32": 4, "int32": 4}
TOL = {"bfloat16": 2e-2, "float16": 2e-3, "float32": 1e-6, "int32": 0}


def odd_sizing(coll, tail: int, dtype: str, whole_items: int = 1):
    """Chunk sizes whose rows start 16-byte aligned: every chunk but the last ``whole_items``
    16-byte items, the last ``tail`` elements (any count: the scalar tail)."""
    names = coll.input.names()
    each = whole_items * 16 // ITEM[dtype]
    sizes = {k: each for k in names}
    sizes[names[-1]] = tail
    return coll.sized(chunk_sizes=sizes, dtype=dtype)


def _inputs(sizing, rng, calls=2):
    dt = sizing.dtype.name
    out = []
    for _ in range(calls):
        xs = []
        for r in range(sizing.collective.nranks):
            x = rng.integers(-40, 40, sizing.input_count(r)).astype(np.float64)
            x[x == 0] = 3  # never zero: avg / min / max see every rank
            xs.append(x)
        out.append(xs)
    return out


def _check_fused(sizing, strategy, protocol, blocks=2, threads=2, split=False):
    """Run the fused programs on host threads against the reference; ``split``: the plan
    may cut a piece at an unaligned element (two-phase, ring: parts of a piece per rank),
    which only the interpreter runs -- then the refusal must say so."""
    s = plan(sizing.collective, strategy, sizing=sizing)
    bufs = HostBuffers(s, ll=protocol == "fused-ll")
    low = bufs.lower()
    unit, problem = fused_unit(low, protocol)
    if split and problem is not None:
        assert "aligned addresses" in problem, problem
        return None
    assert problem is None, (sizing.chunks, strategy, protocol, problem)
    programs = fused_programs(low, bufs, unit)
    xs = _inputs(sizing, np.random.default_rng(sizing.message_bytes))
    outs = run_fused_calls(programs, bufs, xs, blocks=blocks, threads=threads)
    dt = sizing.dtype.name
    for k, call in enumerate(xs):
        for r, want in enumerate(reference(sizing, call)):
            got = np.asarray(outs[k][r], np.float64)
            tol = TOL[dt] * max(1.0, float(np.abs(want).max(initial=0)))
            bad = np.abs(got - want) > tol
            assert not bad.any(), (f"{strategy} {protocol} {dt} {sizing.chunks} call {k} rank "
                                   f"{r}: {int(bad.sum())} wrong, first at "
                                   f"{int(np.argmax(bad))}: {got[bad][:4]} vs {want[bad][:4]}")
    return unit


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("protocol", ["fused", "fused-ll"])
def test_every_tail_length_of_a_bf16_all_reduce_fuses_and_is_right(n, protocol):
    """The all-reduce one element (or 2..70) past a 16-byte multiple: fused, and right."""
    for tail in range(1, 71):
        sizing = odd_sizing(collectives.all_reduce(n), tail, "bfloat16")
        _check_fused(sizing, "direct-push", protocol)


KINDS = [(d, op) for d in ("bfloat16", "float16", "float32", "int32")
         for op in ("sum", "max", "min", "avg") if not (d == "int32" and op == "avg")]


@pytest.mark.parametrize("dtype,op", KINDS)  # (an integer avg is refused by the spec)
@pytest.mark.parametrize("n", [2, 3, 4])
def test_tails_of_every_dtype_and_reduction(dtype, op, n):
    for tail in (1, 2, 3, 5, 7, 9, 15, 17, 33):
        for protocol in ("fused", "fused-ll"):
            sizing = odd_sizing(collectives.all_reduce(n, op=op), tail, dtype)
            _check_fused(sizing, "direct-push", protocol)


@pytest.mark.parametrize("tail", [1001, 4097])
def test_large_odd_counts_over_many_blocks(tail):
    for n in (2, 4):
        sizing = odd_sizing(collectives.all_reduce(n), tail, "bfloat16", whole_items=64)
        for protocol in ("fused", "fused-ll"):
            _check_fused(sizing, "direct-push", protocol, blocks=3, threads=4)


@pytest.mark.parametrize("strategy", ["direct-pull", "two-phase", "ring"])
def test_tails_on_the_other_strategies(strategy):
    """Direct-pull fuses every tail; two-phase and ring split pieces into parts per rank at
    element boundaries, which puts the parts after an odd one off alignment: those plans
    are fused where every part starts aligned, else refused (for the interpreter) naming
    the alignment."""
    ran = 0
    for n in (2, 3):
        for tail in (1, 7, 9, 8 * n * 8 + 1):
            sizing = odd_sizing(collectives.all_reduce(n), tail, "bfloat16",
                                whole_items=2 * n)
            ran += _check_fused(sizing, strategy, "fused", split=strategy != "direct-pull") \
                is not None
    if strategy == "direct-pull":
        assert ran == 8


@pytest.mark.parametrize("name", ["all-gather", "reduce-scatter", "all-to-all", "broadcast"])
def test_tails_of_the_other_collectives(name):
    for n in (2, 3):
        coll = standard(name, n, root=n - 1)
        for tail in (1, 3, 9):
            sizing = odd_sizing(coll, tail, "bfloat16", whole_items=2)
            for protocol in ("fused", "fused-ll"):
                _check_fused(sizing, "direct-push", protocol)


def test_a_tail_never_writes_past_its_row():
    """The bytes after a row's last element (another tensor's, in the caller's memory)
    stay as they were: the tail's thread stores element by element."""
    sizing = odd_sizing(collectives.all_reduce(2), 3, "bfloat16")
    s = plan(sizing.collective, "direct-push", sizing=sizing)
    bufs = HostBuffers(s, ll=True)
    # room after the output that a whole 16-byte store of the tail item would overwrite
    for r in range(2):
        bufs.outputs[r] = np.full(sizing.output_count(r) + 8, 0xABCD, np.uint16)
    low = bufs.lower()
    unit, problem = fused_unit(low, "fused-ll")
    assert problem is None
    xs = _inputs(sizing, np.random.default_rng(1), calls=1)
    run_fused_calls(fused_programs(low, bufs, unit), bufs, xs)
    for r in range(2):
        assert (bufs.outputs[r][sizing.output_count(r):] == 0xABCD).all()


def test_programs_count_a_partial_item():
    from purlin.atom.fused import program

    sizing = odd_sizing(collectives.all_reduce(2), 1, "float32")
    s = plan(sizing.collective, "direct-push", sizing=sizing)
    bufs = HostBuffers(s, ll=False)
    low = bufs.lower()
    prog = program(low[1], 0, 0, flag_slot=lambda a: a, unit=16)
    assert prog.words[isa.F_UNIT] == 16
    rows = [int(r[isa.COUNT]) * 4 for r in low[1].tables[0] if r[isa.OP] == isa.COPY]
    assert max(rows) == 20  # the whole input staged at a peer: one item and a 4-byte tail
    assert prog.items == 2


@pytest.mark.parametrize("n", [2, 3, 4])
def test_an_odd_piece_keeps_ll_for_every_peer(n):
    """Scratch slots start aligned, so the copies staged after an odd-sized one still travel
    as LL units: every rank of an odd direct-push all-reduce puts to each of its peers."""
    sizing = odd_sizing(collectives.all_reduce(n), 1, "bfloat16")
    s = plan(sizing.collective, "direct-push", sizing=sizing)
    low = HostBuffers(s, ll=True).lower()
    for one in low:
        puts = [r for r in one.tables[0] if r[isa.OP] == isa.LL_PUT]
        assert len(puts) == n - 1, (one.rank, len(puts))
        assert not any(r[isa.OP] == isa.NOTIFY for r in one.tables[0])
