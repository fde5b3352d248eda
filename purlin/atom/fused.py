"""Fuse a rank's lowered LL rows into one pass: the program of :mod:`purlin.kernels.fused`.

Pure numpy, like :mod:`purlin.atom.lowering`, whose tables it reads. A rank fuses when its
table (every lane, even and odd calls) holds only LL_PUT, LL_GET, COPY and REDUCE rows, and
running them item by item cannot go wrong:

* every row moves a multiple of 16 bytes between 16-byte aligned addresses;
* every LL_GET's destination is read only whole, by COPY / REDUCE rows of the same size --
  those rows then read the LL units directly (the LL_GET and its scratch disappear);
* no row writes what another row reads or writes (puts read only buffers nobody writes);
* plain addresses are the same on even and odd calls (only LL areas alternate);
* every peer the rank puts to also puts to it in the same call: a peer cannot then run two
  calls ahead and overwrite LL units of the area parity still being read.

Direct-push all-reduce, reduce-scatter, all-gather and all-to-all with ``protocol="ll"``
qualify at any rank count; broadcast and reduce keep a flag for the scratch they reuse and
run on the interpreter, as do sizes that are not whole 16-byte items.

>>> import numpy as np
>>> from purlin.spec import collectives
>>> from purlin.snac import plan
>>> from purlin.atom.lowering import lower
>>> s = plan(collectives.all_reduce(2), "direct-push", count=64, dtype="bfloat16")
>>> bases = {(r, b): (1 + 4 * r + i) << 20 for r in range(2)
...          for i, b in enumerate(("input", "output", "scratch", "ll"))}
>>> low = lower(s, bases, {r: (9 + r) << 20 for r in range(2)},
...             ll_bases={r: bases[(r, "ll")] for r in range(2)})
>>> program(low[0], error=0, abort=0).sinks
1
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from purlin.errors import CapabilityError
from purlin.kernels.isa import (COPY, COUNT, DIVISOR, DST, DTYPE, F_ABORT, F_DIVISOR, F_DTYPE,
                                F_EPOCHS, F_ERROR, F_MAX_BLOCKS, F_NPUTS, F_NSINKS, F_PUTS,
                                F_RANK, F_REDOP, F_SINKS, ITEMSIZE, LL_GET, LL_PUT, NSRC, OP,
                                OPCODE_NAMES, PEER, PUT_WIDTH, REDOP, REDUCE, SINK_WIDTH,
                                SOURCE_WIDTH, SRC, STEP)
from purlin.atom.lowering import LoweredRank

__all__ = ["FusedProgram", "fuse_problem", "grid", "program"]

ITEM = 16
FUSED_DTYPES = (0, 1, 2, 3)  # bfloat16, float16, float32, int32 (isa codes)


@dataclass(frozen=True)
class FusedProgram:
    """One rank's fused program: ``words`` (int64, call counters zero), its puts and sinks,
    and ``items``, the largest row in 16-byte items (what the grid is sized for)."""

    words: np.ndarray
    puts: int
    sinks: int
    items: int


def _rows(low: LoweredRank):
    """(even row, odd row) pairs of every lane, with the pool address of each source."""
    even, odd = low.tables[0], low.tables[-1]
    for a, b in zip(even, odd):
        srcs_a = [int(x) for x in low.srcs[a[SRC]: a[SRC] + max(1, a[NSRC])]]
        srcs_b = [int(x) for x in low.srcs[b[SRC]: b[SRC] + max(1, b[NSRC])]]
        yield a, b, srcs_a, srcs_b


def _analyse(low: LoweredRank):
    """(puts, sinks, dtype, redop, divisor) or a string saying why the rank cannot fuse."""
    if not len(low.tables[0]):
        return f"rank {low.rank} has no rows"
    puts, gets, sinks, put_peers = [], {}, [], set()
    dtypes, redops = set(), set()
    for k, (a, b, sa, sb) in enumerate(_rows(low)):
        op = int(a[OP])
        if op not in (LL_PUT, LL_GET, COPY, REDUCE) or int(b[OP]) != op:
            return f"rank {low.rank} row {k} is a {OPCODE_NAMES[op]}"
        dt = int(a[DTYPE])
        dtypes.add(dt)
        nbytes = int(a[COUNT]) * ITEMSIZE[dt]
        if nbytes % ITEM:
            return (f"rank {low.rank} row {k} ({OPCODE_NAMES[op]}) moves {nbytes} bytes, "
                    "not whole 16-byte items")
        if op == LL_PUT:
            if sa != sb:
                return f"rank {low.rank} row {k} puts from a buffer that alternates per call"
            puts.append((sa[0], int(a[DST]), int(b[DST]), nbytes))
            put_peers.add(int(a[PEER]))
        elif op == LL_GET:
            gets[(int(a[DST]), int(b[DST]))] = (sa[0], sb[0], nbytes, int(a[PEER]), int(a[STEP]))
        else:
            if op == REDUCE:
                redops.add((int(a[REDOP]), int(a[DIVISOR])))
            sinks.append((int(a[DST]), int(b[DST]), nbytes, list(zip(sa, sb))))
    if len(dtypes) != 1 or len(redops) > 1:
        return f"rank {low.rank} mixes element types or reductions"
    dt = dtypes.pop()
    if dt not in FUSED_DTYPES:
        return f"rank {low.rank}: the fused kernel does not move dtype code {dt}"
    if not puts and not gets:
        return f"rank {low.rank} has no LL rows"
    # LL areas alternate between two parities: a peer two calls ahead must have waited for
    # this rank's data of the call between, so every peer written to is also heard from
    silent = put_peers - {peer for *_, peer, _ in gets.values()}
    if silent:
        return (f"rank {low.rank} puts to rank {min(silent)} without receiving from it in the "
                "same call")
    get_spans = [(e, n) for (e, _), (_, _, n, _, _) in gets.items()]
    used = set()
    out_sinks, plain = [], []
    for dst_a, dst_b, nbytes, sources in sinks:
        if dst_a != dst_b:
            return f"rank {low.rank} writes a buffer that alternates per call"
        entries = []
        for s_a, s_b in sources:
            got = gets.get((s_a, s_b))
            if got is not None and got[2] == nbytes:
                used.add((s_a, s_b))
                entries.append((1, got[0], got[1], got[3], got[4]))
                continue
            if s_a != s_b or any(_overlap(s_a, nbytes, e, n) for e, n in get_spans):
                return (f"rank {low.rank} reads part of an LL transfer's destination (or "
                        "scratch that alternates per call)")
            entries.append((0, s_a, s_a, -1, -1))
            plain.append((s_a, nbytes))
        out_sinks.append((dst_a, nbytes, entries))
    if len(used) != len(gets):
        return f"rank {low.rank} keeps an LL transfer's data for a later row"
    writes = [(d, n) for d, n, _ in out_sinks]
    reads = plain + [(src, n) for src, _, _, n in puts]
    for i, (d, n) in enumerate(writes):
        if any(_overlap(d, n, d2, n2) for d2, n2 in writes[i + 1:]) or \
                any(_overlap(d, n, s, m) for s, m in reads):
            return f"rank {low.rank} writes a buffer another of its rows reads or writes"
    addresses = [d for d, _ in writes] + [s for s, _ in reads]
    if any(a % ITEM for a in addresses):
        return f"rank {low.rank} moves data at addresses not 16-byte aligned"
    redop, divisor = redops.pop() if redops else (0, 1)
    return puts, out_sinks, dt, redop, divisor


def _overlap(a: int, n: int, b: int, m: int) -> bool:
    return a < b + m and b < a + n


def fuse_problem(low: LoweredRank) -> str | None:
    """Why ``low`` cannot run as a fused program (a sentence naming the rank), or None."""
    found = _analyse(low)
    return found if isinstance(found, str) else None


def program(low: LoweredRank, error: int, abort: int) -> FusedProgram:
    """The fused program of ``low``: ``error`` is the address of the rank's error record
    (``isa.ERR_WIDTH`` words), ``abort`` that of the cluster's abort word."""
    found = _analyse(low)
    if isinstance(found, str):
        raise CapabilityError(f"cannot fuse: {found}")
    puts, sinks, dt, redop, divisor = found
    head = F_EPOCHS + F_MAX_BLOCKS
    sinks_at = head + PUT_WIDTH * len(puts)
    sources_at = sinks_at + SINK_WIDTH * len(sinks)
    nsources = sum(len(e) for _, _, e in sinks)
    words = np.zeros(sources_at + SOURCE_WIDTH * nsources, dtype=np.int64)
    words[[F_RANK, F_NPUTS, F_NSINKS, F_DTYPE, F_REDOP, F_DIVISOR, F_ERROR, F_ABORT, F_PUTS,
           F_SINKS]] = [low.rank, len(puts), len(sinks), dt, redop, divisor, error, abort,
                        head, sinks_at]
    for k, put in enumerate(puts):
        words[head + PUT_WIDTH * k: head + PUT_WIDTH * (k + 1)] = put
    at = sources_at
    for k, (dst, nbytes, entries) in enumerate(sinks):
        words[sinks_at + SINK_WIDTH * k: sinks_at + SINK_WIDTH * (k + 1)] = \
            (dst, nbytes, len(entries), at)
        for entry in entries:
            words[at: at + SOURCE_WIDTH] = entry
            at += SOURCE_WIDTH
    items = max([n for *_, n in puts] + [n for _, n, _ in sinks]) // ITEM
    return FusedProgram(words, len(puts), len(sinks), items)


def grid(items: int, ranks_in_launch: int = 1, sms: int = 132) -> tuple[int, int]:
    """(blocks per rank, threads) for a fused program of ``items`` 16-byte items: about one
    item per thread, 128 threads per block up to 16 KiB, 256 up to 128 KiB, else 512, at most
    32 blocks per rank, and few enough for every rank of the launch to be resident (counting
    128 registers per thread, the launch bound's limit).

    >>> grid(512), grid(4096), grid(1 << 16), grid(1 << 16, ranks_in_launch=8)
    ((4, 128), (16, 256), (32, 512), (16, 512))
    """
    nbytes = items * ITEM
    threads = 128 if nbytes <= 16 << 10 else 256 if nbytes <= 128 << 10 else 512
    blocks = max(1, min(32, -(-items // threads)))
    per_sm = max(1, 65536 // (threads * 128))
    return max(1, min(blocks, sms * per_sm // ranks_in_launch)), threads
