"""The fused kernel: a rank's one-lane program (built by :mod:`purlin.atom.fused`; layout in
``isa``) run block-matched -- every thread takes the same items of every row on every rank, and
each flag has a slot per block, so a block waits only for the same block of its peers.

``fused`` / ``fused_pdl`` run WAIT, NOTIFY, PUT (LL) and MOVE ops; ``fused_norm`` / ``_pdl`` add
the NORM epilogue (residual add and RMSNorm); ``fused_copy`` / ``_pdl`` run only programs whose
data ops copy plain memory in 16-byte items (a third of the code: no LL units, no reductions);
``fused_narrow`` / ``_pdl`` also copy, PUT and sum 8- or 4-byte units at addresses of any
alignment;
the one-shot epilogue programs that
``purlin.atom.fused.oneshot_problem`` accepts run on the kernels :mod:`purlin.kernels.epilogue`
builds from these functions. How it works: ARCHITECTURE.md, "The fused kernel".
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda

from purlin.kernels.atoms import (avg_float, avg_int, combine, copy_v16, copy_words, ll_tag,
                                  pack_half2, unpack_half2)
from purlin.kernels.intrinsics import (atomic_cas, bits_to_f32, device, f32_to_bits,
                                       fence_system, globaltimer, griddep_launch_dependents,
                                       griddep_wait, launch_bounded, load_acquire, load_i64,
                                       load_u32, load_v4_u32, load_volatile_v4_u32,
                                       red_release_add, red_relaxed_add, SIMULATOR,
                                       store_i64, store_u16, store_u32, store_v4_u32,
                                       store_volatile_v2_u32, store_volatile_v4_u32)
from purlin.kernels.isa import (BF16, E_BLOCK, E_CODE, E_EXPECTED, E_FLAG, E_LANE, E_PEER,
                                E_RANK, E_SEEN, E_STEP, ERR_ABORTED, ERR_TIMEOUT, F16, F32,
                                F_ABORT, F_DIVISOR, F_DTYPE, F_ERROR, F_HEAD, F_MAX_BLOCKS,
                                F_NOPS, F_OP_NORM, F_OP_NOTIFY, F_OP_PUT, F_OP_WAIT, F_RANK,
                                F_REDOP, F_UNIT, MAX_THREADS, MOVE_BYTES, MOVE_DST, MOVE_NSRC,
                                MOVE_SOURCES, NORM_CHUNKS, NORM_EPS, NORM_HIDDEN, NORM_PARAMS,
                                NORM_RESIDUAL, NORM_ROW_CHUNKS, NORM_SUMS, NORM_TARGET,
                                NORM_WEIGHT, NOTIFY_SLOT, NOTIFY_VALUE, OP_KIND, OP_WIDTH,
                                PUT_BYTES, PUT_DST, PUT_SRC, SOURCE_ADDR, SOURCE_LL, SOURCE_PEER,
                                SOURCE_STEP, SOURCE_WIDTH, WAIT_EPOCH_OFFSET, WAIT_FLAG,
                                WAIT_PEER, WAIT_PER_CALL, WAIT_SLOT, WAIT_STEP, WAIT_VALUE)
from purlin.kernels.intrinsics import store_u8  # FP8 rows end on any byte
from purlin.kernels.atoms import fp8_pack, fp8_word  # FP8 sums (the narrow builds)
from purlin.kernels.isa import E4M3, E5M2  # (FP8 sums)
from purlin.kernels.intrinsics import load_u8, load_u16  # (_copy_narrow, _load4)
from purlin.kernels.isa import MOVE_NARROW, NARROW_SHIFT  # (odd-aligned copies)
from purlin.kernels.isa import MOVE_ROTATE  # (a MOVE's rotation: _rotated)
from purlin.kernels.isa import PUT_ROTATE  # (a PUT's rotation: _rotated)
from purlin.kernels.isa import TRACE_WIDTH  # the traced kernels' records
from purlin.kernels.isa import (F_OP_MOVES, F_OP_PUTS, SEG_COUNT, SEG_CUT,  # fused_seg
                                SEG_INDEX, SEG_ITEMS, SEG_ROTATE, SEG_SHIFT, SEG_TABLE)

SPINS_PER_CHECK = 64
WARPS = MAX_THREADS // 32
RED = MAX_THREADS if SIMULATOR else WARPS + 1  # a block sum's shared floats


@device
def _ready(v, tag, half):
    """Does LL unit ``v`` carry ``tag`` in both halves (``half`` -1), or in half 0 / 1?"""
    if half < 0:
        return v[1] == tag and v[3] == tag
    if half == 0:
        return v[1] == tag
    return v[3] == tag


@device
def _poll(unit, tag, timeout_ns, abort, half):
    """Spin on one LL unit until :func:`_ready`: (0 | ERR_TIMEOUT | ERR_ABORTED, tag seen, data
    lo, data hi)."""
    v = load_volatile_v4_u32(unit)
    deadline = np.int64(0)  # the clock is first read at the first check, not on a miss
    spins = 0
    while not _ready(v, tag, half):
        spins += 1
        if spins % SPINS_PER_CHECK == 0:
            seen = np.int64(v[3] if half == 1 else v[1])
            if load_acquire(abort) != 0:
                return ERR_ABORTED, seen, np.int64(0), np.int64(0)
            now = globaltimer()
            if deadline == 0:
                deadline = now + timeout_ns
            elif now > deadline:
                return ERR_TIMEOUT, seen, np.int64(0), np.int64(0)
        v = load_volatile_v4_u32(unit)
    return 0, np.int64(tag), np.int64(v[0]), np.int64(v[2])


@device
def _fold_half(a, w, dt, op):
    """Combine four words of eight 16-bit floats into the float32 accumulators ``a``."""
    b0, b1 = unpack_half2(w[0], dt)
    b2, b3 = unpack_half2(w[1], dt)
    b4, b5 = unpack_half2(w[2], dt)
    b6, b7 = unpack_half2(w[3], dt)
    return (combine(a[0], b0, op), combine(a[1], b1, op), combine(a[2], b2, op),
            combine(a[3], b3, op), combine(a[4], b4, op), combine(a[5], b5, op),
            combine(a[6], b6, op), combine(a[7], b7, op))


META = 1024  # program words a block keeps in shared memory (8 KiB)


@device
def _word(meta, head, k):
    """Word ``k`` of the program (counted from its header), from shared memory if it is
    there."""
    if k < META:
        return meta[k]
    return load_i64(head + k * 8)


@device
def _source(meta, head, at, item, odd, tag, timeout_ns, abort):
    """Item ``item`` (16 bytes) of the source whose entry starts at word ``at``, as four
    uint32 words in int64: (code, tag seen, address polled, w0, w1, w2, w3)."""
    addr = _word(meta, head, at + SOURCE_ADDR + odd)
    if _word(meta, head, at + SOURCE_LL) == 0:
        w = load_v4_u32(addr + item * 16)
        return (0, np.int64(0), addr, np.int64(w[0]), np.int64(w[1]), np.int64(w[2]),
                np.int64(w[3]))
    unit = addr + item * 32
    code, seen, w0, w1 = _poll(unit, tag, timeout_ns, abort, -1)
    if code != 0:
        return code, seen, unit, w0, w1, w0, w1
    code, seen, w2, w3 = _poll(unit + 16, tag, timeout_ns, abort, -1)
    return code, seen, unit + 16, w0, w1, w2, w3


@device
def _move_item(meta, head, op_at, item, odd, tag, dt, redop, divisor, timeout_ns, abort,
               valid):
    """Write item ``item`` of a MOVE (its first ``valid`` bytes: 16, or fewer for a row's
    scalar tail; every element type's result goes through the one store). Returns (code,
    tag seen, address polled, word of the source entry) -- code 0 when written."""
    dst = _word(meta, head, op_at + MOVE_DST + odd) + item * 16
    nsrc = _word(meta, head, op_at + MOVE_NSRC)
    at = _word(meta, head, op_at + MOVE_SOURCES)
    code, seen, unit, w0, w1, w2, w3 = _source(meta, head, at, item, odd, tag, timeout_ns,
                                               abort)
    if code != 0:
        return code, seen, unit, at
    out = (w0, w1, w2, w3)
    if nsrc == 1:
        pass
    elif dt == BF16 or dt == F16:
        acc = _half8((w0, w1, w2, w3), dt)
        for s in range(1, nsrc):
            entry = at + s * SOURCE_WIDTH
            code, seen, unit, v0, v1, v2, v3 = _source(meta, head, entry, item, odd, tag,
                                                       timeout_ns, abort)
            if code != 0:
                return code, seen, unit, entry
            acc = _fold_half(acc, (v0, v1, v2, v3), dt, redop)
        out = _pack_half8(acc, dt, redop, np.float32(divisor))
    elif dt == F32:
        f = (bits_to_f32(w0), bits_to_f32(w1), bits_to_f32(w2), bits_to_f32(w3))
        for s in range(1, nsrc):
            entry = at + s * SOURCE_WIDTH
            code, seen, unit, v0, v1, v2, v3 = _source(meta, head, entry, item, odd, tag,
                                                       timeout_ns, abort)
            if code != 0:
                return code, seen, unit, entry
            f = _fold4(f, (bits_to_f32(v0), bits_to_f32(v1), bits_to_f32(v2),
                           bits_to_f32(v3)), redop)
        div = np.float32(divisor)
        out = (np.int64(f32_to_bits(avg_float(f[0], redop, div))),
               np.int64(f32_to_bits(avg_float(f[1], redop, div))),
               np.int64(f32_to_bits(avg_float(f[2], redop, div))),
               np.int64(f32_to_bits(avg_float(f[3], redop, div))))
    else:  # I32: exact in int64, wrapped to 32 bits by the store
        n = (_signed(w0), _signed(w1), _signed(w2), _signed(w3))
        for s in range(1, nsrc):
            entry = at + s * SOURCE_WIDTH
            code, seen, unit, v0, v1, v2, v3 = _source(meta, head, entry, item, odd, tag,
                                                       timeout_ns, abort)
            if code != 0:
                return code, seen, unit, entry
            n = _fold4(n, (_signed(v0), _signed(v1), _signed(v2), _signed(v3)), redop)
        out = (np.int64(avg_int(n[0], redop, divisor)), np.int64(avg_int(n[1], redop, divisor)),
               np.int64(avg_int(n[2], redop, divisor)), np.int64(avg_int(n[3], redop, divisor)))
    _store16(dst, out, valid)
    return 0, seen, unit, at


@device
def _plain_words(meta, head, at, item, odd):
    """Item ``item`` of the plain source whose entry starts at word ``at``: four uint32."""
    return load_v4_u32(_word(meta, head, at + SOURCE_ADDR + odd) + item * 16)


@device
def _half8(w, dt):
    a0, a1 = unpack_half2(w[0], dt)
    a2, a3 = unpack_half2(w[1], dt)
    a4, a5 = unpack_half2(w[2], dt)
    a6, a7 = unpack_half2(w[3], dt)
    return a0, a1, a2, a3, a4, a5, a6, a7


@device
def _pack_half8(acc, dt, redop, div):
    """Eight 16-bit results (accumulated in float32) as four uint32 words in int64."""
    return (np.int64(pack_half2(avg_float(acc[0], redop, div), avg_float(acc[1], redop, div),
                                dt)),
            np.int64(pack_half2(avg_float(acc[2], redop, div), avg_float(acc[3], redop, div),
                                dt)),
            np.int64(pack_half2(avg_float(acc[4], redop, div), avg_float(acc[5], redop, div),
                                dt)),
            np.int64(pack_half2(avg_float(acc[6], redop, div), avg_float(acc[7], redop, div),
                                dt)))


@device
def _store4(dst, w, valid):
    """The first ``valid`` bytes (4, 3, 2 or 1: FP8 rows end on any byte) of word ``w``."""
    if valid >= 4:
        store_u32(dst, w)
    elif valid >= 2:
        store_u16(dst, w & 0xFFFF)
        if valid == 3:
            store_u8(dst + 2, (w >> 16) & 0xFF)
    else:
        store_u8(dst, w & 0xFF)


@device
def _store16(dst, w, valid):
    """The first ``valid`` bytes of a 16-byte item (four uint32 words): one vector store
    for a whole item, else a row's scalar tail in 4-, 2- and 1-byte stores, never past the
    row."""
    if valid >= 16:
        store_v4_u32(dst, w)
        return
    _store4(dst, w[0], valid)
    if valid > 4:
        _store4(dst + 4, w[1], valid - 4)
    if valid > 8:
        _store4(dst + 8, w[2], valid - 8)
    if valid > 12:
        _store4(dst + 12, w[3], valid - 12)


@device
def _load4(addr, valid):
    """Word ``addr`` of a row (a uint32 in int64) at an address of any alignment (a piece of
    odd size inside a user's buffer; the narrow builds): one 4-byte load where it is 4-byte
    aligned, else its first ``valid`` bytes (at most 4, none past the row; the rest 0) cut
    from the aligned words holding its first and its last byte, both loads issued before
    either is used (one memory latency: loads in a loop would wait one for another, and the
    thread holding a row's odd edge would finish its op a few latencies after the others)."""
    if (addr & 3) == 0:
        return np.int64(load_u32(addr))
    n = min(valid, 4)
    if n <= 0:
        return np.int64(0)
    lo = np.int64(load_u32(addr & -4))
    hi = np.int64(load_u32((addr + n - 1) & -4))
    return ((lo | (hi << 32)) >> ((addr & 3) * 8)) & ((np.int64(1) << (8 * n)) - 1)


@device
def _store4n(dst, w, valid, narrow):
    """:func:`_store4`; with ``narrow`` (the narrow builds) at an address of any alignment:
    2- or 1-byte stores where it is not 4-byte aligned."""
    if not narrow or (dst & 3) == 0:
        _store4(dst, w, valid)
        return
    n = min(valid, 4)
    k = 0
    while k < n:
        if ((dst + k) & 1) == 0 and n - k >= 2:
            store_u16(dst + k, (w >> (8 * k)) & 0xFFFF)
            k += 2
        else:
            store_u8(dst + k, (w >> (8 * k)) & 0xFF)
            k += 1


@device
def _reduce_pairs_half(meta, head, at, nsrc, dst, items, nbytes, g, stride, odd, dt, redop,
                       divisor):
    """A plain bfloat16 / float16 reduction of ``nbytes``, two items per thread at a time
    (each source's two loads in flight together; either may be a row's partial last item,
    stored in part). A thread with one item left loads it twice and stores it once, so a
    warp whose threads hold odd and even counts does one round, not a round per path.
    Returns the first item past this thread's (none left for the one-item path)."""
    div = np.float32(divisor)
    i = g
    while i < items:
        j = i + stride
        jj = j if j < items else i
        x = _half8(_plain_words(meta, head, at, i, odd), dt)
        y = _half8(_plain_words(meta, head, at, jj, odd), dt)
        for s in range(1, nsrc):
            entry = at + s * SOURCE_WIDTH
            u = _plain_words(meta, head, entry, i, odd)
            v = _plain_words(meta, head, entry, jj, odd)
            x = _fold_half(x, u, dt, redop)
            y = _fold_half(y, v, dt, redop)
        _store16(dst + i * 16, _pack_half8(x, dt, redop, div), min(16, nbytes - i * 16))
        if j < items:
            _store16(dst + j * 16, _pack_half8(y, dt, redop, div), min(16, nbytes - j * 16))
        i += 2 * stride
    return i


@device
def _source8(meta, head, at, unit_i, odd, tag, timeout_ns, abort, valid, narrow):
    """8-byte unit ``unit_i`` of a source: (code, tag seen, address polled, w0, w1);
    ``narrow`` (the narrow builds): plain memory at any alignment, read up to ``valid``
    bytes (:func:`_load4`)."""
    addr = _word(meta, head, at + SOURCE_ADDR + odd)
    if narrow and _word(meta, head, at + SOURCE_LL) == 0:
        return (0, np.int64(0), addr, _load4(addr + unit_i * 8, valid),
                _load4(addr + unit_i * 8 + 4, valid - 4))
    if _word(meta, head, at + SOURCE_LL) == 0:
        return (0, np.int64(0), addr, np.int64(load_u32(addr + unit_i * 8)),
                np.int64(load_u32(addr + unit_i * 8 + 4)))
    unit = addr + unit_i * 16
    code, seen, w0, w1 = _poll(unit, tag, timeout_ns, abort, -1)
    return code, seen, unit, w0, w1


@device
def _source4(meta, head, at, i, odd, tag, timeout_ns, abort, valid, narrow):
    """4-byte item ``i`` of a source (half of an LL unit): (code, tag seen, address polled,
    word); ``narrow``: as :func:`_source8`'s."""
    addr = _word(meta, head, at + SOURCE_ADDR + odd)
    if narrow and _word(meta, head, at + SOURCE_LL) == 0:
        return 0, np.int64(0), addr, _load4(addr + i * 4, valid)
    if _word(meta, head, at + SOURCE_LL) == 0:
        return 0, np.int64(0), addr, np.int64(load_u32(addr + i * 4))
    unit = addr + (i >> 1) * 16
    code, seen, lo, hi = _poll(unit, tag, timeout_ns, abort, i & 1)
    return code, seen, unit, hi if i & 1 else lo


@device
def _move_four(meta, head, op_at, i, odd, tag, dt, redop, divisor, timeout_ns, abort, valid,
               narrow):
    """:func:`_move_unit` for 4 bytes (half an LL unit: rows of 4-byte multiples): two
    16-bit or one 32-bit element (``valid``: 2 for a tail of one 16-bit element)."""
    dst = _word(meta, head, op_at + MOVE_DST + odd) + i * 4
    nsrc = _word(meta, head, op_at + MOVE_NSRC)
    at = _word(meta, head, op_at + MOVE_SOURCES)
    code, seen, unit, w = _source4(meta, head, at, i, odd, tag, timeout_ns, abort, valid, narrow)
    if code != 0:
        return code, seen, unit, at
    if nsrc == 1:
        _store4n(dst, w, valid, narrow)
        return 0, seen, unit, at
    div = np.float32(divisor)
    if dt == BF16 or dt == F16:
        a0, a1 = unpack_half2(w, dt)
        for s in range(1, nsrc):
            entry = at + s * SOURCE_WIDTH
            code, seen, unit, v = _source4(meta, head, entry, i, odd, tag, timeout_ns, abort,
                                           valid, narrow)
            if code != 0:
                return code, seen, unit, entry
            b0, b1 = unpack_half2(v, dt)
            a0, a1 = combine(a0, b0, redop), combine(a1, b1, redop)
        _store4n(dst, pack_half2(avg_float(a0, redop, div), avg_float(a1, redop, div), dt),
                 valid, narrow)
    elif dt == F32:
        f = bits_to_f32(w)
        for s in range(1, nsrc):
            entry = at + s * SOURCE_WIDTH
            code, seen, unit, v = _source4(meta, head, entry, i, odd, tag, timeout_ns, abort,
                                           valid, narrow)
            if code != 0:
                return code, seen, unit, entry
            f = combine(f, bits_to_f32(v), redop)
        store_u32(dst, f32_to_bits(avg_float(f, redop, div)))
    else:  # I32
        n = _signed(w)
        for s in range(1, nsrc):
            entry = at + s * SOURCE_WIDTH
            code, seen, unit, v = _source4(meta, head, entry, i, odd, tag, timeout_ns, abort,
                                           valid, narrow)
            if code != 0:
                return code, seen, unit, entry
            n = combine(n, _signed(v), redop)
        store_u32(dst, avg_int(n, redop, divisor))
    return 0, seen, unit, at


@device
def _move_unit(meta, head, op_at, unit_i, odd, tag, dt, redop, divisor, timeout_ns, abort,
               valid, narrow, fp8):
    """:func:`_move_item` for 8 bytes (one LL unit): four 16-bit or two 32-bit elements, or
    eight FP8 ones with ``fp8`` (``valid`` of its bytes: fewer than 8 for a row's scalar
    tail); ``narrow``: the narrow builds, whose plain sources and destinations lie at
    addresses of any alignment."""
    code, seen, unit, entry, w0, w1 = _unit_result(meta, head, op_at, unit_i, odd, tag, dt,
                                                   redop, divisor, timeout_ns, abort, valid,
                                                   narrow, fp8)
    if code == 0:
        dst = _word(meta, head, op_at + MOVE_DST + odd) + unit_i * 8
        _store4n(dst, w0, valid, narrow)
        if valid > 4:
            _store4n(dst + 4, w1, valid - 4, narrow)
    return code, seen, unit, entry


@device
def _unit_result(meta, head, op_at, unit_i, odd, tag, dt, redop, divisor, timeout_ns, abort,
                 valid, narrow, fp8):
    """8-byte unit ``unit_i`` of a MOVE's result, accumulated as the interpreter does (each
    element type in its own loop, so no tuple ever changes type): (code, tag seen, address
    polled, word of the source entry, w0, w1) -- code 0 when every source was there.
    ``fp8``: FP8 sums too (the narrow build without segmented ops: FP8 sums never join
    one)."""
    nsrc = _word(meta, head, op_at + MOVE_NSRC)
    at = _word(meta, head, op_at + MOVE_SOURCES)
    code, seen, unit, w0, w1 = _source8(meta, head, at, unit_i, odd, tag, timeout_ns, abort,
                                        valid, narrow)
    if code != 0 or nsrc == 1:
        return code, seen, unit, at, w0, w1
    div = np.float32(divisor)
    if dt == BF16 or dt == F16:
        a0, a1 = unpack_half2(w0, dt)
        a2, a3 = unpack_half2(w1, dt)
        h = (a0, a1, a2, a3)
        for s in range(1, nsrc):
            entry = at + s * SOURCE_WIDTH
            code, seen, unit, v0, v1 = _source8(meta, head, entry, unit_i, odd, tag,
                                                timeout_ns, abort, valid, narrow)
            if code != 0:
                return code, seen, unit, entry, w0, w1
            b0, b1 = unpack_half2(v0, dt)
            b2, b3 = unpack_half2(v1, dt)
            h = _fold4(h, (b0, b1, b2, b3), redop)
        w0 = np.int64(pack_half2(avg_float(h[0], redop, div), avg_float(h[1], redop, div), dt))
        w1 = np.int64(pack_half2(avg_float(h[2], redop, div), avg_float(h[3], redop, div), dt))
    elif dt == F32:
        f0, f1 = bits_to_f32(w0), bits_to_f32(w1)
        for s in range(1, nsrc):
            entry = at + s * SOURCE_WIDTH
            code, seen, unit, v0, v1 = _source8(meta, head, entry, unit_i, odd, tag,
                                                timeout_ns, abort, valid, narrow)
            if code != 0:
                return code, seen, unit, entry, w0, w1
            f0 = combine(f0, bits_to_f32(v0), redop)
            f1 = combine(f1, bits_to_f32(v1), redop)
        w0 = np.int64(f32_to_bits(avg_float(f0, redop, div)))
        w1 = np.int64(f32_to_bits(avg_float(f1, redop, div)))
    elif fp8 and (dt == E4M3 or dt == E5M2):
        lo, hi = fp8_word(w0, dt), fp8_word(w1, dt)
        for s in range(1, nsrc):
            entry = at + s * SOURCE_WIDTH
            code, seen, unit, v0, v1 = _source8(meta, head, entry, unit_i, odd, tag,
                                                timeout_ns, abort, valid, narrow)
            if code != 0:
                return code, seen, unit, entry, w0, w1
            lo = _fold4(lo, fp8_word(v0, dt), redop)
            hi = _fold4(hi, fp8_word(v1, dt), redop)
        w0 = np.int64(fp8_pack(lo, dt, redop, div))
        w1 = np.int64(fp8_pack(hi, dt, redop, div))
    else:  # I32
        n0, n1 = _signed(w0), _signed(w1)
        for s in range(1, nsrc):
            entry = at + s * SOURCE_WIDTH
            code, seen, unit, v0, v1 = _source8(meta, head, entry, unit_i, odd, tag,
                                                timeout_ns, abort, valid, narrow)
            if code != 0:
                return code, seen, unit, entry, w0, w1
            n0 = combine(n0, _signed(v0), redop)
            n1 = combine(n1, _signed(v1), redop)
        w0 = np.int64(avg_int(n0, redop, divisor))
        w1 = np.int64(avg_int(n1, redop, divisor))
    return 0, seen, unit, at, w0, w1


@device
def _fold4(a, b, op):
    return combine(a[0], b[0], op), combine(a[1], b[1], op), combine(a[2], b[2], op), \
        combine(a[3], b[3], op)


@device
def _signed(word):
    """A uint32 word held in int64 as the int32 it encodes."""
    return word - 0x100000000 if word >= 0x80000000 else word


@device
def _record(meta, head, code, step, flag, expected, seen, peer, block):
    """Claim the rank's error record (first writer wins); raise ABORT on a timeout."""
    err = _word(meta, head, F_ERROR)
    if atomic_cas(err + E_CODE * 8, 0, code) == 0:
        store_i64(err + E_RANK * 8, _word(meta, head, F_RANK))
        store_i64(err + E_STEP * 8, step)
        store_i64(err + E_FLAG * 8, flag)
        store_i64(err + E_EXPECTED * 8, expected)
        store_i64(err + E_SEEN * 8, seen)
        store_i64(err + E_LANE * 8, 0)
        store_i64(err + E_BLOCK * 8, block)
        store_i64(err + E_PEER * 8, peer)
    if code == ERR_TIMEOUT:
        fence_system()
        red_release_add(_word(meta, head, F_ABORT), 1)


@device
def _wait(meta, head, at, epoch, block, timeout_ns, abort):
    """Thread 0: a WAIT op on this block's slot; returns a nonzero code when it gave up."""
    target = ((epoch + _word(meta, head, at + WAIT_EPOCH_OFFSET))
              * _word(meta, head, at + WAIT_PER_CALL) + _word(meta, head, at + WAIT_VALUE))
    if target <= 0:
        return 0
    flag = _word(meta, head, at + WAIT_SLOT) + block * 8
    seen = load_acquire(flag)
    deadline = np.int64(0)  # the clock is first read at the first check, not on a miss
    spins = 0
    while seen < target:
        spins += 1
        if spins % SPINS_PER_CHECK == 0:
            code = 0
            now = globaltimer()
            if load_acquire(abort) != 0:
                code = ERR_ABORTED
            elif deadline == 0:
                deadline = now + timeout_ns
            elif now > deadline:
                code = ERR_TIMEOUT
            if code != 0:
                _record(meta, head, code, _word(meta, head, at + WAIT_STEP),
                        _word(meta, head, at + WAIT_FLAG),
                        target, seen, _word(meta, head, at + WAIT_PEER), block)
                return code
        seen = load_acquire(flag)
    return 0


@device
def _warp_sum(x, lane, width):
    """The sum of ``x`` over lanes ``[0, width)`` of the warp, in a fixed order (a shuffle
    tree); lane 0 gets it."""
    mask = np.uint32(0xFFFFFFFF) if width >= 32 else np.uint32((1 << width) - 1)
    offset = 16
    while offset > 0:
        other = cuda.shfl_down_sync(mask, x, offset)
        if lane + offset < width:
            x += other
        offset //= 2
    return x


@device
def _sum_block(x, tid, nthreads):
    """The sum of ``x`` over the block's threads, in a fixed order: each warp's by shuffles,
    then warp 0 sums the warps'; every thread gets it. Two barriers. (The simulator has no
    shuffles: there a tree in shared memory.)"""
    red = cuda.shared.array(RED, np.float32)
    if SIMULATOR:
        red[tid] = x
        cuda.syncthreads()
        half = 1
        while half * 2 < nthreads:
            half *= 2
        while half > 0:
            if tid < half and tid + half < nthreads:
                red[tid] = red[tid] + red[tid + half]
            cuda.syncthreads()
            half //= 2
        total = red[0]
        cuda.syncthreads()  # red is free again
        return total
    lane = tid % 32
    warp = tid // 32
    x = _warp_sum(x, lane, min(32, nthreads - warp * 32))
    if lane == 0:
        red[warp] = x
    cuda.syncthreads()
    if warp == 0:
        nwarps = (nthreads + 31) // 32
        x = _warp_sum(red[lane] if lane < nwarps else np.float32(0), lane,
                      min(32, nthreads))  # every lane of warp 0 takes part: + 0 is exact
        if lane == 0:
            red[WARPS] = x
    cuda.syncthreads()
    return red[WARPS]  # (the next call writes red[WARPS] only after its first barrier)


@device
def _load_item(addr, unit):
    """The ``unit`` bytes (4, 8 or 16) at ``addr`` as four words (those past it 0), every
    load issued before any is used."""
    if unit == 16:
        w = load_v4_u32(addr)
        return np.int64(w[0]), np.int64(w[1]), np.int64(w[2]), np.int64(w[3])
    if unit == 8:
        return load_u32(addr), load_u32(addr + 4), np.int64(0), np.int64(0)
    return load_u32(addr), np.int64(0), np.int64(0), np.int64(0)


@device
def _store_item(addr, w, unit):
    if unit == 16:
        store_v4_u32(addr, (w[0], w[1], w[2], w[3]))
    elif unit == 8:
        store_u32(addr, w[0])
        store_u32(addr + 4, w[1])
    else:
        store_u32(addr, w[0])


@device
def _add_word(a, b, dt):
    """One word of ``a + b`` rounded to the element type, and its elements' squares summed."""
    if dt == F32:
        f = bits_to_f32(a) + bits_to_f32(b)
        return np.int64(f32_to_bits(f)), f * f
    a0, a1 = unpack_half2(a, dt)
    b0, b1 = unpack_half2(b, dt)
    r = pack_half2(a0 + b0, a1 + b1, dt)
    r0, r1 = unpack_half2(r, dt)
    return np.int64(r), r0 * r0 + r1 * r1


@device
def _scale_word(r, w, inv, dt):
    """One word of ``r * inv * w`` (one rounding)."""
    if dt == F32:
        return np.int64(f32_to_bits(bits_to_f32(r) * inv * bits_to_f32(w)))
    r0, r1 = unpack_half2(r, dt)
    w0, w1 = unpack_half2(w, dt)
    return np.int64(pack_half2(r0 * inv * w0, r1 * inv * w1, dt))


@device
def _norm_item(meta, head, at, c, unit):
    """(residual address, weight address) of this thread's item of chunk ``c`` of a NORM
    (an item never spans two rows: rows are whole chunks; no 64-bit division)."""
    prm = _word(meta, head, at + NORM_PARAMS)
    per_row = _word(meta, head, at + NORM_ROW_CHUNKS)
    chunk = cuda.blockDim.x * unit
    within = np.int64(0) if per_row == 1 else np.int64(np.uint32(c) % np.uint32(per_row))
    off = cuda.threadIdx.x * unit
    return (_word(meta, head, prm + NORM_RESIDUAL) + c * chunk + off,
            _word(meta, head, prm + NORM_WEIGHT) + within * chunk + off)


@device
def _owned(chunks, per_row, blocks):
    """Does each block of a NORM own every chunk of its rows (then its row sums stay in
    shared memory, the block's k-th chunk's in ``parts[k]``)?"""
    return (per_row == 1 and chunks <= blocks * MAX_THREADS) or \
        (blocks == 1 and chunks <= MAX_THREADS)


@device
def _chunk_sum(a, b, res_at, dt, unit, parts, sums, c, k, owned, tag):
    """Pass 1 of a NORM for chunk ``c`` (the block's ``k``-th): the residual item ``b`` plus
    the result ``a`` (rounded to the element type) stored at ``res_at``; the chunk's sum of
    squares into ``parts[k]`` (``owned``) or its row sums slot. Returns the new residual."""
    x0, s0 = _add_word(a[0], b[0], dt)
    x1, s1 = _add_word(a[1], b[1], dt)  # words past the item: 0 + 0, squares 0
    x2, s2 = _add_word(a[2], b[2], dt)
    x3, s3 = _add_word(a[3], b[3], dt)
    r = (x0, x1, x2, x3)
    _store_item(res_at, r, unit)
    total = _sum_block((s0 + s1) + (s2 + s3), cuda.threadIdx.x, cuda.blockDim.x)
    if cuda.threadIdx.x == 0:
        if owned:
            parts[k] = total
        else:
            store_volatile_v2_u32(sums + c * 16, (f32_to_bits(total), tag))
    return r


@device
def _norm(meta, head, at, status, block, blocks, odd, tag, dt, unit, timeout_ns, abort, res0):
    """A NORM op (ARCHITECTURE.md, "The fused kernel"); ``res0``: this thread's residual item of the
    block's first chunk, read at block start (its weight item is read with the result, and
    waited for only after the row sums). Returns when the block is done or gave up."""
    parts = cuda.shared.array(MAX_THREADS, np.float32)  # a row's sums
    nthreads = cuda.blockDim.x
    target = _word(meta, head, at + NORM_TARGET + odd)
    chunks = _word(meta, head, at + NORM_CHUNKS)
    sums = _word(meta, head, _word(meta, head, at + NORM_PARAMS) + NORM_SUMS)
    owned = _owned(chunks, _word(meta, head, at + NORM_ROW_CHUNKS), blocks)
    r0 = (np.int64(0), np.int64(0), np.int64(0), np.int64(0))  # the first chunk's result
    w0 = r0  # and its weight
    c = block
    k = 0
    while c < chunks:  # residual += result; each chunk's sum of squares into its slot
        res_at, wgt_at = _norm_item(meta, head, at, c, unit)
        if c == block:
            w0 = _load_item(wgt_at, unit)
        a = _load_item(target + (c * nthreads + cuda.threadIdx.x) * unit, unit)
        r = _chunk_sum(a, res0 if c == block else _load_item(res_at, unit), res_at, dt, unit,
                       parts, sums, c, k, owned, tag)
        if c == block:
            r0 = r
        c += blocks
        k += 1
    _normalize(meta, head, at, parts, status, block, blocks, odd, tag, dt, unit, timeout_ns,
               abort, r0, w0, owned)


@device
def _normalize(meta, head, at, parts, status, block, blocks, odd, tag, dt, unit, timeout_ns,
               abort, r0, w0, owned):
    """Pass 2 of a NORM: each of the block's chunks' row sums (every chunk's slot of the
    row, in order; or ``parts``), then ``result = residual * inv * weight`` into the target;
    ``r0`` / ``w0``: the block's first chunk's residual and weight items."""
    tid = cuda.threadIdx.x
    nthreads = cuda.blockDim.x
    target = _word(meta, head, at + NORM_TARGET + odd)
    chunks = _word(meta, head, at + NORM_CHUNKS)
    per_row = _word(meta, head, at + NORM_ROW_CHUNKS)  # chunks per row
    prm = _word(meta, head, at + NORM_PARAMS)
    sums = _word(meta, head, prm + NORM_SUMS)
    hidden = _word(meta, head, prm + NORM_HIDDEN)
    eps = bits_to_f32(_word(meta, head, prm + NORM_EPS))
    c = block
    k = 0
    while c < chunks:  # the row's sums (every chunk's slot, in order), then the norm
        first = c if per_row == 1 else np.int64(np.uint32(c) // np.uint32(per_row)) * per_row
        if not owned:  # a thread per slot of the row, then every thread reads them
            if tid < per_row:
                slot = sums + (first + tid) * 16
                code, seen, lo, _ = _poll(slot, tag, timeout_ns, abort, 0)
                if code != 0:
                    _record(meta, head, code, -1, slot, tag, seen, -1, block)
                    status[0] = 1
                parts[tid] = bits_to_f32(lo)
            cuda.syncthreads()
            if status[0] != 0:
                return
        elif k == 0:  # thread 0's sums of pass 1
            cuda.syncthreads()
        s = np.float32(0)
        for t in range(per_row):  # one block's chunks of a row: k (a row a chunk) or first + t
            s += parts[(k if per_row == 1 else first + t) if owned else t]
        inv = np.float32(1) / np.float32(math.sqrt(s / np.float32(hidden) + eps))
        res_at, wgt_at = _norm_item(meta, head, at, c, unit)
        r, w = r0, w0
        if c != block:
            r, w = _load_item(res_at, unit), _load_item(wgt_at, unit)
        _store_item(target + (c * nthreads + tid) * unit,
                    (_scale_word(r[0], w[0], inv, dt), _scale_word(r[1], w[1], inv, dt),
                     _scale_word(r[2], w[2], inv, dt), _scale_word(r[3], w[3], inv, dt)),
                    unit)
        if not owned and c + blocks < chunks:
            cuda.syncthreads()  # parts is free again for the next row's sums
        c += blocks
        k += 1


@device
def _begin(desc_ptr, slot, blocks_per_rank, stride_words, counters, meta, status, pdl):
    """A block's start in rank slot ``slot`` of the launch: its program into ``meta`` (with
    PDL before waiting for the kernel before it: programs are nobody's output), ``status``
    cleared; returns (block within the rank, program address, call counter address)."""
    block = cuda.blockIdx.x - slot * blocks_per_rank
    head = desc_ptr + slot * stride_words * 8
    for k in range(cuda.threadIdx.x, min(META, stride_words), cuda.blockDim.x):
        meta[k] = load_i64(head + k * 8)
    if cuda.threadIdx.x == 0:
        status[0] = 0
    cuda.syncthreads()
    if pdl:
        griddep_wait()
    return block, head, counters + (slot * F_MAX_BLOCKS + block) * 8


@device
def _rotated(g, rotation, stride):
    """The first item of a MOVE that thread ``g`` of ``stride`` takes when item i is thread
    (i + ``rotation``) mod ``stride``'s (``isa.MOVE_ROTATE``; 0: item g)."""
    first = g - rotation  # (rotations are small: a few strides at most, no division)
    while first < 0:
        first += stride
    return first


@device
def _run(desc_ptr, nranks_in_launch, blocks_per_rank, timeout_ns, stride_words, counters, pdl,
         norm, segs=False, copies=False, narrow=False, trace=0, trace_rows=0):
    # (no 64-bit division on the way to the first store: one rank per launch is the
    # common case, and units are powers of two)
    slot = 0 if nranks_in_launch == 1 else cuda.blockIdx.x // blocks_per_rank
    if slot >= nranks_in_launch:
        return
    meta = cuda.shared.array(META, np.int64)
    status = cuda.shared.array(1, np.int64)  # give up
    block, head, counter = _begin(desc_ptr, slot, blocks_per_rank, stride_words, counters, meta,
                                  status, pdl)
    tid = cuda.threadIdx.x
    g = block * cuda.blockDim.x + tid
    unit_bytes = meta[F_UNIT]
    shift = 4 if unit_bytes == 16 else 3 if unit_bytes == 8 else 2  # log2(unit_bytes)
    # a first PUT's first item is read with the call counter: one memory round trip, not two,
    # before the first store (every thread reads its block's counter: no barrier for it)
    p0, p1, p2, p3 = np.int64(0), np.int64(0), np.int64(0), np.int64(0)
    # (``copies``: the fused_copy kernels, whose programs have no PUT and no reduction)
    first_put = not copies and meta[F_NOPS] > 0 and meta[F_HEAD + OP_KIND] == F_OP_PUT
    stride = blocks_per_rank * cuda.blockDim.x
    gp = g  # this thread's first item of the first PUT (rotated: isa.PUT_ROTATE)
    if first_put:
        gp = _rotated(g, meta[F_HEAD + PUT_ROTATE], stride)
    if first_put and gp < (meta[F_HEAD + PUT_BYTES] + unit_bytes - 1) >> shift:
        src = meta[F_HEAD + PUT_SRC]
        if narrow and unit_bytes != 16:  # (loads that stop at the row's end)
            p0, p1 = _put_words_narrow(src, gp, unit_bytes, meta[F_HEAD + PUT_BYTES])
        elif unit_bytes == 4:
            p0 = load_u32(src + gp * 4)
        elif unit_bytes == 8:
            p0, p1 = load_u32(src + gp * 8), load_u32(src + gp * 8 + 4)
        else:
            w = load_v4_u32(src + gp * 16)
            p0, p1, p2, p3 = np.int64(w[0]), np.int64(w[1]), np.int64(w[2]), np.int64(w[3])
    if segs and not copies and meta[F_NOPS] > 0 and meta[F_HEAD + OP_KIND] == F_OP_PUTS:
        p0, p1, p2, p3 = _first_segment_item(meta, head, g, stride, unit_bytes, shift,
                                             narrow)
    # a NORM (last op): this thread's residual item of its block's first chunk, read now so
    # that its latency hides behind the all-reduce's
    # (``norm``: the fused_norm kernels; the others leave this code and its registers out)
    res0 = (np.int64(0), np.int64(0), np.int64(0), np.int64(0))
    last = F_HEAD + (meta[F_NOPS] - 1) * OP_WIDTH
    if norm and meta[F_NOPS] > 0 and _word(meta, head, last) == F_OP_NORM and \
            block < _word(meta, head, last + NORM_CHUNKS):
        res_at, _ = _norm_item(meta, head, last, block, unit_bytes)
        res0 = _load_item(res_at, unit_bytes)
    epoch = load_i64(counter)
    tag = ll_tag(epoch)
    odd = epoch & 1
    dt = meta[F_DTYPE]
    redop = meta[F_REDOP]
    divisor = meta[F_DIVISOR]
    abort = meta[F_ABORT]
    t_op = np.int64(0)  # (``trace``: the fused_trace kernels; the others compile it out)
    nops = meta[F_NOPS]
    polled = np.int64(0)  # ops before this one that a run of waits already polled
    notified = False  # the op before was a NOTIFY: the run's barrier and fence are done
    for k in range(nops):
        at = F_HEAD + k * OP_WIDTH
        kind = _word(meta, head, at + OP_KIND)
        if trace != 0 and tid == 0:
            t_op = globaltimer()
        if kind == F_OP_WAIT:
            if k >= polled:  # a run of waits: thread i polls the run's i-th flag, all at once
                polled = k + 1
                while polled < nops and \
                        _word(meta, head, F_HEAD + polled * OP_WIDTH + OP_KIND) == F_OP_WAIT:
                    polled += 1
                j = k + tid
                while j < polled:
                    if _wait(meta, head, F_HEAD + j * OP_WIDTH, epoch, block, timeout_ns,
                             abort) != 0:
                        status[0] = 1
                    j += cuda.blockDim.x
                cuda.syncthreads()
        elif kind == F_OP_NOTIFY:
            # a run of notifies: one barrier and one system fence, then an add per flag that
            # does not wait for the add before it (a release add fences each time, ~0.7 us)
            if not notified:
                cuda.syncthreads()
                if tid == 0:
                    fence_system()
            if tid == 0:
                red_relaxed_add(_word(meta, head, at + NOTIFY_SLOT) + block * 8,
                                _word(meta, head, at + NOTIFY_VALUE))
        elif norm and kind == F_OP_NORM:
            _norm(meta, head, at, status, block, blocks_per_rank, odd, tag, dt, unit_bytes,
                  timeout_ns, abort, res0)
        elif segs and (kind == F_OP_PUTS or kind == F_OP_MOVES):  # (the fused_seg kernels)
            _segments(meta, head, at, kind, status, block, g, stride, odd, tag, dt, redop,
                      divisor, unit_bytes, shift, timeout_ns, abort, k == 0, p0, p1, p2, p3,
                      copies, narrow)
        elif not copies and kind == F_OP_PUT:
            src = _word(meta, head, at + PUT_SRC)
            dst = _word(meta, head, at + PUT_DST + odd)
            # a partial last item (a scalar tail) goes whole: its LL units' bytes past the
            # row are read from the aligned item and never used
            items = (_word(meta, head, at + PUT_BYTES) + unit_bytes - 1) >> shift
            i = _rotated(g, _word(meta, head, at + PUT_ROTATE), stride)
            if k == 0 and i < items:  # the item read with the counter (gp)
                if unit_bytes == 4:
                    store_volatile_v2_u32(dst + i * 8, (p0, tag))
                elif unit_bytes == 8:
                    store_volatile_v4_u32(dst + i * 16, (p0, tag, p1, tag))
                else:
                    store_volatile_v4_u32(dst + i * 32, (p0, tag, p1, tag))
                    store_volatile_v4_u32(dst + i * 32 + 16, (p2, tag, p3, tag))
                i += stride
            while i < items:
                if narrow and unit_bytes != 16:
                    w0, w1 = _put_words_narrow(src, i, unit_bytes,
                                               _word(meta, head, at + PUT_BYTES))
                    _put_words(dst, i, unit_bytes, tag, w0, w1, np.int64(0), np.int64(0))
                elif unit_bytes == 4:
                    store_volatile_v2_u32(dst + i * 8, (load_u32(src + i * 4), tag))
                elif unit_bytes == 8:
                    store_volatile_v4_u32(dst + i * 16, (load_u32(src + i * 8), tag,
                                                         load_u32(src + i * 8 + 4), tag))
                else:
                    w = load_v4_u32(src + i * 16)
                    store_volatile_v4_u32(dst + i * 32, (w[0], tag, w[1], tag))
                    store_volatile_v4_u32(dst + i * 32 + 16, (w[2], tag, w[3], tag))
                i += stride
        else:
            nbytes = _word(meta, head, at + MOVE_BYTES)
            items = (nbytes + unit_bytes - 1) >> shift  # with a partial last item: a tail
            nsrc = _word(meta, head, at + MOVE_NSRC)
            first = _word(meta, head, at + MOVE_SOURCES)
            plain = copies or _plain_sources(meta, head, first, nsrc, unit_bytes)
            gm = _rotated(g, _word(meta, head, at + MOVE_ROTATE), stride)
            i = gm
            # (odd-aligned pieces: only copy-only programs hold them, atom.fused checks)
            narrow_word = _word(meta, head, at + MOVE_NARROW) if copies else 0
            if narrow_word & NARROW_SHIFT:
                _copy_shifted(_word(meta, head, at + MOVE_DST + odd),
                              _word(meta, head, first + SOURCE_ADDR + odd), nbytes, gm,
                              stride)
                i = items
            elif narrow_word != 0:
                _copy_narrow(_word(meta, head, at + MOVE_DST + odd),
                             _word(meta, head, first + SOURCE_ADDR + odd), nbytes, gm, stride,
                             narrow_word)
                i = items
            elif copies or (plain and nsrc == 1):
                _copy_row(_word(meta, head, at + MOVE_DST + odd),
                          _word(meta, head, first + SOURCE_ADDR + odd), nbytes, gm, stride)
                i = items
            elif plain and (dt == BF16 or dt == F16):
                i = _reduce_pairs_half(meta, head, first, nsrc,
                                       _word(meta, head, at + MOVE_DST + odd), items, nbytes, gm,
                                       stride, odd, dt, redop, divisor)
            while not copies and i < items:
                if _move_one(meta, head, at, i, odd, tag, dt, redop, divisor, timeout_ns, abort,
                             min(unit_bytes, nbytes - (i << shift)), unit_bytes, status, block,
                             narrow, narrow and not segs):
                    break
                i += stride
        if trace != 0 and tid == 0:
            _trace_op(trace, trace_rows, slot, blocks_per_rank, block, k, t_op)
        notified = kind == F_OP_NOTIFY
        if status[0] != 0:  # read by every thread after a barrier, or by the thread that set it
            break
    cuda.syncthreads()
    if tid == 0:
        store_i64(counter, epoch + 1)


@device
def _plain_sources(meta, head, first, nsrc, unit_bytes):
    """Do the ``nsrc`` source entries from word ``first`` all read plain memory in 16-byte
    items (no LL units)?"""
    plain = unit_bytes == 16
    for k in range(nsrc):
        if _word(meta, head, first + k * SOURCE_WIDTH + SOURCE_LL) != 0:
            plain = False
    return plain


@device
def _copy_row(dst, src, nbytes, first, stride):
    """A plain copy of ``nbytes`` in 16-byte items, this thread's from item ``first`` on,
    four in flight (``copy_v16``). A partial last item is loaded by its thread (the aligned
    16 bytes holding it) before its whole items, so that it is in flight with them, and
    stored only as far as the row goes."""
    whole = nbytes >> 4
    tail = whole < (nbytes + 15) >> 4 and (whole - first) % stride == 0
    if tail:
        w = load_v4_u32(src + whole * 16)
    copy_v16(dst, src, whole, first, stride)
    if tail:
        _store16(dst + whole * 16, w, nbytes - whole * 16)


@device
def _copy_narrow(dst, src, nbytes, first, stride, width):
    """A copy of ``nbytes`` at addresses aligned only to ``width`` bytes (8, 4, 2 or 1: a
    piece of odd size inside a user's buffer): this thread's 16-byte items of the row from
    item ``first`` on, as an aligned row's fall to threads, each in words of that width --
    a whole item's loads all issued before its stores (raw addresses: the compiler may not
    move a load past a store), the last item's bytes only."""
    items = (nbytes + 15) >> 4
    whole = nbytes >> 4
    i = first
    while i < items:
        s = src + (i << 4)
        d = dst + (i << 4)
        if i < whole and width == 8:
            a0, a1 = load_i64(s), load_i64(s + 8)
            store_i64(d, a0)
            store_i64(d + 8, a1)
        elif i < whole and width == 4:
            w0, w1, w2, w3 = load_u32(s), load_u32(s + 4), load_u32(s + 8), load_u32(s + 12)
            store_u32(d, w0)
            store_u32(d + 4, w1)
            store_u32(d + 8, w2)
            store_u32(d + 12, w3)
        elif i < whole and width == 2:
            h0, h1, h2, h3 = load_u16(s), load_u16(s + 2), load_u16(s + 4), load_u16(s + 6)
            h4, h5, h6, h7 = load_u16(s + 8), load_u16(s + 10), load_u16(s + 12), \
                load_u16(s + 14)
            store_u16(d, h0)
            store_u16(d + 2, h1)
            store_u16(d + 4, h2)
            store_u16(d + 6, h3)
            store_u16(d + 8, h4)
            store_u16(d + 10, h5)
            store_u16(d + 12, h6)
            store_u16(d + 14, h7)
        else:  # 1-byte words, or the row's last, partial item
            _copy_edge(d, s, min(16, nbytes - (i << 4)))
        i += stride


@device
def _copy_shifted(dst, src, nbytes, first, stride):
    """A copy of ``nbytes`` at addresses of any alignment, cut at the destination's 16-byte
    boundaries (``isa.NARROW_SHIFT``: the destination is aligned, so the cut is the items',
    or nothing else in the launch touches it). Its items are the destination's 16-byte slots
    from ``dst & -16`` (``purlin.atom.fused.row_items``): this thread takes slots ``first``,
    ``first + stride``, ..., the whole ones four in flight (``copy_words``), a partial first
    or last slot on its own (:func:`_slot_edge`), so the rounds carry no byte ranges."""
    if nbytes <= 0:
        return
    base = dst & -16
    end = dst + nbytes
    slots = (end - base + 15) >> 4
    diff = src - dst
    lo = 1 if (dst & 15) != 0 else 0  # the first whole slot
    hi = slots - 1 if (end & 15) != 0 else slots  # past the last whole slot
    if lo == 1 and first == 0:
        _slot_edge(dst, diff, nbytes, base)
    j = first if first >= lo else first + stride
    while j < hi:
        j1 = j + stride
        j2 = j1 + stride
        j3 = j2 + stride
        n = 4 if j3 < hi else (3 if j2 < hi else (2 if j1 < hi else 1))
        d0 = base + (j << 4)
        d1 = base + (j1 << 4)
        d2 = base + (j2 << 4)
        d3 = base + (j3 << 4)
        copy_words(n, d0 + diff, d1 + diff, d2 + diff, d3 + diff, d0, d1, d2, d3)
        j += n * stride
    # j: this thread's first slot at or past hi, so it owns a partial last slot where j == hi
    # (a one-slot row starting inside its slot: the first edge above)
    if hi < slots and j == hi and (hi != 0 or lo == 0):
        _slot_edge(dst, diff, nbytes, base + (hi << 4))


@device
def _slot_edge(dst, diff, nbytes, d):
    """The bytes of a row (``nbytes`` at ``dst``, its source ``diff`` bytes on) in the
    destination's 16-byte slot at ``d``: a partial first or last slot."""
    lo = max(d, dst)
    _copy_edge(lo, lo + diff, min(d + 16, dst + nbytes) - lo)


@device
def _copy_edge(dst, src, nbytes):
    """At most 16 bytes at any alignment, every load issued before the first store (one
    memory latency, not one a word)."""
    if nbytes <= 0:
        return
    w0 = _load4(src, nbytes)
    w1 = _load4(src + 4, nbytes - 4) if nbytes > 4 else np.int64(0)
    w2 = _load4(src + 8, nbytes - 8) if nbytes > 8 else np.int64(0)
    w3 = _load4(src + 12, nbytes - 12) if nbytes > 12 else np.int64(0)
    _store4n(dst, w0, nbytes, True)
    if nbytes > 4:
        _store4n(dst + 4, w1, nbytes - 4, True)
    if nbytes > 8:
        _store4n(dst + 8, w2, nbytes - 8, True)
    if nbytes > 12:
        _store4n(dst + 12, w3, nbytes - 12, True)


@device
def _move_one(meta, head, at, i, odd, tag, dt, redop, divisor, timeout_ns, abort, valid,
              unit_bytes, status, block, narrow, fp8):
    """Item ``i`` of MOVE ``at`` (its first ``valid`` bytes) in units of ``unit_bytes``; where
    a poll gave up, the error record written and ``status`` set: returns whether it did.
    (``narrow``: the narrow builds, whose 8- and 4-byte units take any address; ``fp8``:
    FP8 sums in 8-byte units.)"""
    if unit_bytes == 4:
        code, seen, unit, entry = _move_four(meta, head, at, i, odd, tag, dt, redop, divisor,
                                             timeout_ns, abort, valid, narrow)
    elif unit_bytes == 8:
        code, seen, unit, entry = _move_unit(meta, head, at, i, odd, tag, dt, redop, divisor,
                                             timeout_ns, abort, valid, narrow, fp8)
    else:
        code, seen, unit, entry = _move_item(meta, head, at, i, odd, tag, dt, redop, divisor,
                                             timeout_ns, abort, valid)
    if code == 0:
        return False
    _record(meta, head, code, _word(meta, head, entry + SOURCE_STEP), unit, tag, seen,
            _word(meta, head, entry + SOURCE_PEER), block)
    status[0] = 1
    return True


@device
def _trace_op(trace, trace_rows, slot, blocks_per_rank, block, k, start):
    """Thread 0 of a block: op ``k``'s record (op index, block, start, end in
    ``%globaltimer`` ns) into the launch's trace, ``trace_rows`` records per block of each
    rank slot (ops past them are not recorded)."""
    end = globaltimer()
    if k < trace_rows:
        rec = trace + ((slot * blocks_per_rank + block) * trace_rows + k) * (TRACE_WIDTH * 8)
        store_i64(rec, k)
        store_i64(rec + 8, block)
        store_i64(rec + 16, start)
        store_i64(rec + 24, end)


@device
def _put_item(src, dst, i, unit_bytes, tag):
    """Item ``i`` of a PUT's source as LL units at ``dst`` (the PUT loop's store, for
    segmented PUTs)."""
    if unit_bytes == 4:
        store_volatile_v2_u32(dst + i * 8, (load_u32(src + i * 4), tag))
    elif unit_bytes == 8:
        store_volatile_v4_u32(dst + i * 16, (load_u32(src + i * 8), tag,
                                             load_u32(src + i * 8 + 4), tag))
    else:
        w = load_v4_u32(src + i * 16)
        store_volatile_v4_u32(dst + i * 32, (w[0], tag, w[1], tag))
        store_volatile_v4_u32(dst + i * 32 + 16, (w[2], tag, w[3], tag))


@device
def _put_words_narrow(src, i, unit_bytes, nbytes):
    """Item ``i`` of a PUT's source of ``nbytes`` in 8- or 4-byte units at an address of any
    alignment (the narrow builds): its two words (the second 0 for 4-byte units), loaded by
    :func:`_load4` up to the row's end."""
    left = nbytes - i * unit_bytes
    w0 = _load4(src + i * unit_bytes, left)
    if unit_bytes == 4:
        return w0, np.int64(0)
    return w0, _load4(src + i * unit_bytes + 4, left - 4)


@device
def _put_words(dst, i, unit_bytes, tag, p0, p1, p2, p3):
    """Item ``i`` of a PUT, read before (``p0`` .. ``p3``: its words), as LL units."""
    if unit_bytes == 4:
        store_volatile_v2_u32(dst + i * 8, (p0, tag))
    elif unit_bytes == 8:
        store_volatile_v4_u32(dst + i * 16, (p0, tag, p1, tag))
    else:
        store_volatile_v4_u32(dst + i * 32, (p0, tag, p1, tag))
        store_volatile_v4_u32(dst + i * 32 + 16, (p2, tag, p3, tag))


@device
def _segment_of(meta, head, at, i, first_word, bytes_word, unit_bytes, shift, copies):
    """(record word, first item, bytes, end item) of the segment holding item ``i`` of
    segmented op ``at``'s union (``i`` below its items): from the record its bucket index
    names for ``i`` (``isa.SEG_INDEX``), forward."""
    rec = _word(meta, head, _word(meta, head, at + SEG_INDEX) +
                (i >> _word(meta, head, at + SEG_SHIFT)))
    start = _word(meta, head, rec + first_word)
    nbytes = _word(meta, head, rec + bytes_word)
    end = start + _record_items(meta, head, rec, nbytes, unit_bytes, shift, copies)
    while i >= end:
        rec += OP_WIDTH
        start = _word(meta, head, rec + first_word)
        nbytes = _word(meta, head, rec + bytes_word)
        end = start + _record_items(meta, head, rec, nbytes, unit_bytes, shift, copies)
    return rec, start, nbytes, end


@device
def _record_items(meta, head, rec, nbytes, unit_bytes, shift, copies):
    """Items of a segment record of ``nbytes``: whole or partial units; a copy cut at its
    destination's 16-byte boundaries (``copies`` builds): the destination's slots
    (``purlin.atom.fused.row_items``)."""
    if copies and _word(meta, head, rec + MOVE_NARROW) & NARROW_SHIFT:
        nbytes += _word(meta, head, rec + MOVE_DST) & 15
    return (nbytes + unit_bytes - 1) >> shift


@device
def _first_segment_item(meta, head, g, stride, unit_bytes, shift, narrow):
    """A first segmented PUT's first item of thread ``g`` (four words; 0 where it has none),
    read with the call counter as a first PUT's is."""
    z = np.int64(0)
    i = _rotated(g, meta[F_HEAD + SEG_ROTATE], stride)
    if i >= meta[F_HEAD + SEG_ITEMS]:
        return z, z, z, z
    rec, start, _, _ = _segment_of(meta, head, F_HEAD, i, PUT_ROTATE, PUT_BYTES, unit_bytes,
                                   shift, False)
    if narrow and unit_bytes != 16:
        w0, w1 = _put_words_narrow(_word(meta, head, rec + PUT_SRC), i - start, unit_bytes,
                                   _word(meta, head, rec + PUT_BYTES))
        return w0, w1, z, z
    src = _word(meta, head, rec + PUT_SRC) + (i - start) * unit_bytes
    if unit_bytes == 4:
        return load_u32(src), z, z, z
    if unit_bytes == 8:
        return load_u32(src), load_u32(src + 4), z, z
    w = load_v4_u32(src)
    return np.int64(w[0]), np.int64(w[1]), np.int64(w[2]), np.int64(w[3])


@device
def _segments(meta, head, at, kind, status, block, g, stride, odd, tag, dt, redop, divisor,
              unit_bytes, shift, timeout_ns, abort, read, p0, p1, p2, p3, copies, narrow):
    """A segmented PUT or MOVE (``isa.F_OP_PUTS``, ``F_OP_MOVES``): this thread's items of
    the union of its segments, in order (item u is thread (u + rotation) mod ``stride``'s),
    each done as its segment's row would do it -- a plain 16-byte copy's whole items four in
    flight, as a MOVE's (``copy_v16``); ``read``: this thread's first PUT item is ``p0`` ..
    ``p3``, read at block start; ``copies``: every segment is a plain copy (the fused_copy
    kernels carry no other code); with ``narrow`` too (``fused_seg_copy_narrow``) the
    partial slots of those cut at unaligned destinations first. Sets ``status`` when a poll
    gave up."""
    total = _word(meta, head, at + SEG_ITEMS)
    first_word = PUT_ROTATE if kind == F_OP_PUTS else MOVE_ROTATE
    bytes_word = PUT_BYTES if kind == F_OP_PUTS else MOVE_BYTES
    if copies and narrow:
        # the partial first and last slots of the segments cut at unaligned destinations,
        # one a thread, first: their owners in the union are a few threads, several slots
        # each, one memory round trip apiece (the segments' boundaries fall at nearly the
        # same place modulo ``stride``: GQA's pieces). Edge e (segment e >> 1's first slot,
        # its last where e is odd) is thread e * spacing's, spacing the largest power of two
        # with edges * spacing <= ``stride``, else 1 (thread g: edges g, g + ``stride``, ..).
        # Such a segment was cut because no other row of the launch touches its bytes: any
        # block may copy them. (Here, not in a function of its own: the other builds' PTX
        # would declare its environment.)
        edges = 2 * _word(meta, head, at + SEG_COUNT) if _word(meta, head, at + SEG_CUT) != 0 \
            else 0  # (none cut: no thread reads a record here)
        log = 0  # (a power of two: a thread finds its edge by shifts, no 64-bit division)
        while edges != 0 and edges << (log + 1) <= stride:
            log += 1
        e = g >> log if (g & ((1 << log) - 1)) == 0 else edges
        while e < edges:
            rec = _word(meta, head, at + SEG_TABLE) + (e >> 1) * OP_WIDTH
            nbytes = _word(meta, head, rec + MOVE_BYTES)
            dst0 = _word(meta, head, rec + MOVE_DST + odd)
            if nbytes > 0 and (dst0 & 15) != 0 and \
                    (_word(meta, head, rec + MOVE_NARROW) & NARROW_SHIFT) != 0:
                first = dst0 & -16  # (partial: the row starts inside it)
                d = first if (e & 1) == 0 else (dst0 + nbytes - 1) & -16
                # the last slot: where the row ends inside it, and not the first (a one-slot
                # row's is its first edge's)
                if (e & 1) == 0 or (d != first and ((dst0 + nbytes) & 15) != 0):
                    src0 = _word(meta, head, _word(meta, head, rec + MOVE_SOURCES) +
                                 SOURCE_ADDR + odd)
                    _slot_edge(dst0, src0 - dst0, nbytes, d)
            e += stride
    rec, start, nbytes, end = np.int64(0), np.int64(0), np.int64(0), np.int64(0)
    i = _rotated(g, _word(meta, head, at + SEG_ROTATE), stride)
    plain = cut = False
    src0, dst0 = np.int64(0), np.int64(0)
    # a plain copy's whole items go four at a time across segments (loads, then stores):
    # a thread holds only one or two items of each of GQA's pieces, and copied one after the
    # other each load would wait for the store before it
    n = 0
    s0, s1, s2, s3 = np.int64(0), np.int64(0), np.int64(0), np.int64(0)
    d0, d1, d2, d3 = np.int64(0), np.int64(0), np.int64(0), np.int64(0)
    while i < total:
        if i >= end:  # (segments in union order: a thread's items only move forward)
            rec, start, nbytes, end = _segment_of(meta, head, at, i, first_word, bytes_word,
                                                  unit_bytes, shift, copies)
            plain = copies or (kind == F_OP_MOVES and _plain_copy(meta, head, rec, unit_bytes))
            # (odd-aligned copies: in 16-byte items at any alignment, copy_words; cut at
            # their destination's boundaries, the destination's 16-byte slots instead)
            cut = copies and (_word(meta, head, rec + MOVE_NARROW) & NARROW_SHIFT) != 0
            if plain:  # (a plain copy's addresses once a segment, not once an item)
                src0 = _word(meta, head, _word(meta, head, rec + MOVE_SOURCES) + SOURCE_ADDR +
                             odd)
                dst0 = _word(meta, head, rec + MOVE_DST + odd)
        j = i - start
        whole = plain and j < nbytes >> shift
        src = src0 + j * 16
        dst = dst0 + j * 16
        if cut:
            dst = (dst0 & -16) + j * 16
            src = dst + (src0 - dst0)
            whole = dst >= dst0 and dst + 16 <= dst0 + nbytes
            if not whole:  # the row's partial first or last slot
                # (by its item's thread; in the narrow build only at an aligned destination
                # -- its last --, since the launch's rows touching those bytes wait for that
                # block's flag slot alone: at others no row does, and it went before the loop)
                if not narrow or (dst0 & 15) == 0:
                    _slot_edge(dst0, src0 - dst0, nbytes, dst)
                i += stride
                continue
        if whole:
            if n == 0:
                s0, d0 = src, dst
            elif n == 1:
                s1, d1 = src, dst
            elif n == 2:
                s2, d2 = src, dst
            else:
                s3, d3 = src, dst
            n += 1
            if copies and n == 4 and ((s0 | s1 | s2 | s3 | d0 | d1 | d2 | d3) & 15) == 0:
                # (aligned: one load each, where copy_words loads each source's two words;
                # the copy-only builds alone: it takes fused_seg from 126 to 128 registers)
                w0, w1, w2, w3 = load_v4_u32(s0), load_v4_u32(s1), load_v4_u32(s2), \
                    load_v4_u32(s3)
                store_v4_u32(d0, w0)
                store_v4_u32(d1, w1)
                store_v4_u32(d2, w2)
                store_v4_u32(d3, w3)
                n = 0
            elif n == 4:
                copy_words(n, s0, s1, s2, s3, d0, d1, d2, d3)
                n = 0
            i += stride
            continue
        if n != 0:
            copy_words(n, s0, s1, s2, s3, d0, d1, d2, d3)
            n = 0
        if copies:  # a copy's partial last item, at any alignment (the others: _move_one)
            _copy_edge(dst, src, nbytes - (j << shift))
        elif kind == F_OP_PUTS and read:
            _put_words(_word(meta, head, rec + PUT_DST + odd), j, unit_bytes, tag, p0, p1, p2,
                       p3)
            read = False
        elif kind == F_OP_PUTS and narrow and unit_bytes != 16:
            w0, w1 = _put_words_narrow(_word(meta, head, rec + PUT_SRC), j, unit_bytes, nbytes)
            _put_words(_word(meta, head, rec + PUT_DST + odd), j, unit_bytes, tag, w0, w1,
                       np.int64(0), np.int64(0))
        elif kind == F_OP_PUTS:
            _put_item(_word(meta, head, rec + PUT_SRC), _word(meta, head, rec + PUT_DST + odd),
                      j, unit_bytes, tag)
        elif _move_one(meta, head, rec, j, odd, tag, dt, redop, divisor, timeout_ns, abort,
                       min(unit_bytes, nbytes - (j << shift)), unit_bytes, status, block,
                       narrow, False):
            return
        i += stride
    if n != 0:
        copy_words(n, s0, s1, s2, s3, d0, d1, d2, d3)


@device
def _plain_copy(meta, head, rec, unit_bytes):
    """Is the MOVE record at ``rec`` a copy of plain memory in 16-byte items?"""
    return _word(meta, head, rec + MOVE_NSRC) == 1 and \
        _plain_sources(meta, head, _word(meta, head, rec + MOVE_SOURCES), 1, unit_bytes)


SIGNATURE = "void(int64, int64, int64, int64, int64, int64)"
_kernel = launch_bounded(MAX_THREADS)


def _entry(name, doc, norm=False, segs=False, copies=False, narrow=False, traced=False,
           pdl=False):
    """The kernel ``name`` over :func:`_run` with its compile-time switches: ``norm`` (a NORM
    op may end the program), ``segs`` (segmented PUTs and MOVEs), ``copies`` (only plain
    16-byte copies: no PUT, no LL source, no reduction), ``narrow`` (8- and 4-byte units
    copied, sent and summed at addresses of any alignment; with ``segs`` and ``copies``: the
    partial slots of segments cut at unaligned destinations, one a thread, before the
    union), ``traced`` (two more
    arguments: the trace buffer and its records per block), ``pdl`` (programmatic dependent
    launch, as ``executor_pdl``: it reads its program before it waits for the kernel before
    it). Each switch is a constant of the kernel it builds, so a kernel without it carries
    none of its code."""
    if traced:
        def kernel(desc_ptr, nranks_in_launch, blocks_per_rank, timeout_ns, stride_words,
                   counters, trace, trace_rows):
            if pdl:
                griddep_launch_dependents()
            _run(desc_ptr, nranks_in_launch, blocks_per_rank, timeout_ns, stride_words,
                 counters, pdl, norm, segs, copies, narrow, trace, trace_rows)
    else:
        def kernel(desc_ptr, nranks_in_launch, blocks_per_rank, timeout_ns, stride_words,
                   counters):
            if pdl:
                griddep_launch_dependents()
            _run(desc_ptr, nranks_in_launch, blocks_per_rank, timeout_ns, stride_words,
                 counters, pdl, norm, segs, copies, narrow)
    kernel.__name__ = kernel.__qualname__ = name
    kernel.__doc__ = doc
    return _kernel(kernel)


def _pair(name, doc, **switches):
    """(kernel ``name``, its twin ``name_pdl`` for programmatic dependent launch)."""
    return (_entry(name, doc, **switches),
            _entry(f"{name}_pdl", f"``{name}`` for programmatic dependent launch.", pdl=True,
                   **switches))


fused, fused_pdl = _pair("fused", """Run the fused programs of this launch (no NORM op). Rank
    slot ``s`` reads its program at ``desc_ptr + s * stride_words * 8`` and counts calls in
    the ``F_MAX_BLOCKS`` words at ``counters + s * F_MAX_BLOCKS * 8`` (block b's in word b;
    zero before the first call); its ``blocks_per_rank`` blocks share the work.""")
fused_norm, fused_norm_pdl = _pair("fused_norm", """``fused`` for programs that may end with
    a NORM op.""", norm=True)
fused_seg, fused_seg_pdl = _pair("fused_seg", """``fused`` that also runs segmented PUTs and
    MOVEs (``isa.F_OP_PUTS``, ``F_OP_MOVES``: one peer's rows of several pieces as one op); a
    separate kernel, so ``fused`` carries none of their code.""", segs=True)
fused_copy, fused_copy_pdl = _pair("fused_copy", """``fused`` for programs whose data ops are
    all plain copies in 16-byte items (``purlin.atom.fused.copies_only``): built without PUTs,
    LL sources and reductions, a third of the code and fewer registers.""", copies=True)
fused_seg_copy, fused_seg_copy_pdl = _pair("fused_seg_copy", """``fused_seg`` for programs
    whose data ops (segmented ones too) are all plain copies, as ``fused_copy``.""", segs=True,
                                           copies=True)
fused_seg_copy_narrow, fused_seg_copy_narrow_pdl = _pair("fused_seg_copy_narrow", """
    ``fused_seg_copy`` for programs whose segmented ops hold pieces cut at unaligned
    destinations (``isa.SEG_CUT``): their partial first and last slots are copied one a thread
    before the union; a separate kernel, so aligned programs keep ``fused_seg_copy``'s code.""",
                                                         segs=True, copies=True, narrow=True)
fused_narrow, fused_narrow_pdl = _pair("fused_narrow", """``fused`` for programs in 8- or
    4-byte units that move pieces at addresses of any alignment (pieces of odd size
    inside a user's buffer) or sum FP8 (``purlin.atom.fused.narrow_program``); a separate
    kernel, so the others keep their code.""", narrow=True)
fused_seg_narrow, fused_seg_narrow_pdl = _pair("fused_seg_narrow", """``fused_seg`` for such
    programs, as ``fused_narrow`` (FP8 sums aside: they never join a segmented op).""",
                                               segs=True, narrow=True)

# ---- the traced kernels: the same ops, thread 0 of each block stamping each one
TRACE_SIGNATURE = "void(int64, int64, int64, int64, int64, int64, int64, int64)"
fused_trace, fused_trace_pdl = _pair("fused_trace", """``fused`` that records every op of
    every block (:func:`_trace_op`): ``trace`` is the address of ``nranks_in_launch *
    blocks_per_rank * trace_rows`` records of ``isa.TRACE_WIDTH`` int64 (slot-major, then
    block, then op). A separate kernel, so the untraced ones carry none of its code.""",
                                     traced=True)
fused_norm_trace, fused_norm_trace_pdl = _pair("fused_norm_trace", """``fused_norm`` that
    records every op (a NORM too) as ``fused_trace`` does.""", norm=True, traced=True)
fused_seg_trace, fused_seg_trace_pdl = _pair("fused_seg_trace", """``fused_seg`` that records
    every op (a segmented one as one record) as ``fused_trace`` does: the traced twin of the
    kernel that runs segmented programs.""", segs=True, traced=True)
fused_copy_trace, fused_copy_trace_pdl = _pair("fused_copy_trace", """``fused_copy`` that records
    every op as ``fused_trace`` does.""", copies=True, traced=True)
fused_seg_copy_trace, fused_seg_copy_trace_pdl = _pair("fused_seg_copy_trace", """``fused_seg_copy``
    that records every op as ``fused_trace`` does.""", segs=True, copies=True, traced=True)
fused_seg_copy_narrow_trace, fused_seg_copy_narrow_trace_pdl = _pair(
    "fused_seg_copy_narrow_trace", """``fused_seg_copy_narrow`` that records every op as
    ``fused_trace`` does.""", segs=True, copies=True, narrow=True, traced=True)
fused_narrow_trace, fused_narrow_trace_pdl = _pair("fused_narrow_trace", """``fused_narrow``
    that records every op as ``fused_trace`` does.""", narrow=True, traced=True)
fused_seg_narrow_trace, fused_seg_narrow_trace_pdl = _pair("fused_seg_narrow_trace", """
    ``fused_seg_narrow`` that records every op as ``fused_trace`` does.""", segs=True,
                                                           narrow=True, traced=True)


LL_ITEM = 8  # bytes of a thread's item in the one-shot epilogue kernels: one LL unit's data
