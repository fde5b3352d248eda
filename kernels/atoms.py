"""Atom device functions: copy and reduce over raw addresses, split over cooperating threads.

Every function takes ``(tid, nthreads)``: the caller's index among ``nthreads`` threads that
share the work (a lane's blocks times their threads). Thread ``tid`` handles units
``tid, tid + nthreads, ...``, so neighbouring threads touch neighbouring 16-byte words.

* ``copy_bytes`` is dtype-agnostic: 16-byte vectors where source and destination can be
  aligned together (after a short byte head), else the widest unit their offset allows, and a
  byte tail.
* ``reduce_row`` reduces ``nsrc`` sources into one destination in one pass (each destination
  word is written once): sum, max, min, or avg (sum, then divide by ``divisor``). bfloat16
  and float16 are reduced in float32 and rounded to nearest even; int32 sums wrap like int32
  (avg divides the exact sum, truncating toward zero); float32 and float64 stay in their type.
  Vectors are used where every address has the same offset modulo 16 (after a scalar head);
  otherwise, and for the tail, one element at a time. Addresses must be aligned to the element
  size. FP8 (one byte an element) is reduced four elements to a 32-bit word (one at a time
  where the addresses' offsets modulo 4 differ, and for heads and tails): decoded to float32,
  accumulated in the sources' order, rounded once on the store (:mod:`purlin.kernels.fp8`).
"""

from __future__ import annotations

import numpy as np

from purlin.kernels.intrinsics import (bits_to_f32, device, f16x2_to_f32, f32x2_to_bf16x2,
                                       f32x2_to_f16x2, globaltimer, load_acquire, load_f32,
                                       load_f64, load_i32, load_i64, load_u8, load_u16, load_u32,
                                       load_v2_f64, load_v4_f32, load_v4_i32, load_v4_u32,
                                       load_volatile_v4_u32, store_f32, store_f64, store_i64,
                                       store_u8, store_u16, store_u32, store_v2_f64, store_v4_f32,
                                       store_v4_i32, store_v4_u32, store_volatile_v4_u32)
from purlin.kernels.isa import (AVG, BF16, ERR_ABORTED, ERR_TIMEOUT, F16, F32, F64, I32,
                                LL_DATA, LL_TAG_MOD, LL_UNIT, MAX, MIN)
from purlin.kernels.isa import E4M3, E5M2
from purlin.kernels.fp8 import f32_to_fp8, fp8_to_f32

# ---------------------------------------------------------------------------------------- copy


@device
def copy_v16(dst, src, nvec, tid, nthreads):
    """16-byte words, four in flight per thread before their stores. A round where a thread
    has fewer than four left loads an item it has instead (its loads never wait on a branch)
    and skips those stores: a warp whose threads hold three and four words does one round,
    not a round per path."""
    i = tid
    while i < nvec:
        i1 = i + nthreads
        i2 = i1 + nthreads
        i3 = i2 + nthreads
        a = load_v4_u32(src + i * 16)
        b = load_v4_u32(src + (i1 if i1 < nvec else i) * 16)
        c = load_v4_u32(src + (i2 if i2 < nvec else i) * 16)
        d = load_v4_u32(src + (i3 if i3 < nvec else i) * 16)
        store_v4_u32(dst + i * 16, a)
        if i1 < nvec:
            store_v4_u32(dst + i1 * 16, b)
        if i2 < nvec:
            store_v4_u32(dst + i2 * 16, c)
        if i3 < nvec:
            store_v4_u32(dst + i3 * 16, d)
        i = i3 + nthreads


@device
def copy_words(n, s0, s1, s2, s3, d0, d1, d2, d3):
    """The first ``n`` (1 to 4) 16 bytes at ``s0`` .. ``s3`` to ``d0`` .. ``d3``, any
    alignment: every load, then every store (in flight together). Each source is read as
    the two aligned words holding its first and its last byte (the same word twice where it
    is aligned) and funnel-shifted (:func:`funnel16`), all eight loads issued before any is
    used: a load behind a branch on the alignment would wait for the one before. An entry
    past ``n`` loads the first one's words again (no branch) and stores nothing."""
    s1 = s1 if n > 1 else s0
    s2 = s2 if n > 2 else s0
    s3 = s3 if n > 3 else s0
    a0, a1 = load_v4_u32(s0 & -16), load_v4_u32((s0 + 15) & -16)
    b0, b1 = load_v4_u32(s1 & -16), load_v4_u32((s1 + 15) & -16)
    c0, c1 = load_v4_u32(s2 & -16), load_v4_u32((s2 + 15) & -16)
    e0, e1 = load_v4_u32(s3 & -16), load_v4_u32((s3 + 15) & -16)
    store16(d0, funnel16(a0, a1, s0 & 15))
    if n > 1:
        store16(d1, funnel16(b0, b1, s1 & 15))
    if n > 2:
        store16(d2, funnel16(c0, c1, s2 & 15))
    if n > 3:
        store16(d3, funnel16(e0, e1, s3 & 15))


@device
def store16(d, w):
    """16 bytes (four uint32) at ``d``: one vector store where it is aligned, else words of
    the widest width its address allows (a piece of odd size inside a user's buffer)."""
    if (d & 15) == 0:
        store_v4_u32(d, w)
        return
    _store4_at(d, w[0])
    _store4_at(d + 4, w[1])
    _store4_at(d + 8, w[2])
    _store4_at(d + 12, w[3])


@device
def _store4_at(d, x):
    """4 bytes (a uint32) at ``d``, any alignment: one, two or four stores."""
    if (d & 3) == 0:
        store_u32(d, x)
    elif (d & 1) == 0:
        store_u16(d, x & 0xFFFF)
        store_u16(d + 2, x >> 16)
    else:
        store_u8(d, x & 0xFF)
        store_u8(d + 1, (x >> 8) & 0xFF)
        store_u8(d + 2, (x >> 16) & 0xFF)
        store_u8(d + 3, x >> 24)


@device
def funnel16(a, b, shift):
    """The 16 bytes from byte ``shift`` (0..15) of the 32 bytes ``a`` then ``b`` (16-byte
    words as 4-tuples of uint32)."""
    q = shift >> 2
    if q == 0:
        w0, w1, w2, w3, w4 = a[0], a[1], a[2], a[3], b[0]
    elif q == 1:
        w0, w1, w2, w3, w4 = a[1], a[2], a[3], b[0], b[1]
    elif q == 2:
        w0, w1, w2, w3, w4 = a[2], a[3], b[0], b[1], b[2]
    else:
        w0, w1, w2, w3, w4 = a[3], b[0], b[1], b[2], b[3]
    bits = (shift & 3) << 3
    return (funnel4(w0, w1, bits), funnel4(w1, w2, bits), funnel4(w2, w3, bits),
            funnel4(w3, w4, bits))


@device
def funnel4(lo, hi, bits):
    """The 4 bytes from bit ``bits`` (0, 8, 16 or 24) of the 8 bytes ``lo`` then ``hi``."""
    x = (np.uint64(hi) << np.uint64(32)) | np.uint64(lo)
    return np.uint32((x >> np.uint64(bits)) & np.uint64(0xFFFFFFFF))


@device
def _copy_units(dst, src, nunits, width, tid, nthreads):
    """Units of 8, 4, 2 or 1 bytes (both addresses aligned to ``width``)."""
    i = tid
    while i < nunits:
        at = i * width
        if width == 8:
            store_i64(dst + at, load_i64(src + at))
        elif width == 4:
            store_u32(dst + at, load_u32(src + at))
        elif width == 2:
            store_u16(dst + at, load_u16(src + at))
        else:
            store_u8(dst + at, load_u8(src + at))
        i += nthreads


@device
def copy_bytes(dst, src, nbytes, tid, nthreads):
    """Copy ``nbytes`` from ``src`` to ``dst`` (non-overlapping), shared by ``nthreads``."""
    width = 16
    while width > 1 and ((dst - src) & (width - 1)) != 0:
        width >>= 1
    head = min((width - (dst & (width - 1))) & (width - 1), nbytes)
    nunits = (nbytes - head) // width
    _copy_units(dst, src, head, 1, tid, nthreads)
    if width == 16:
        copy_v16(dst + head, src + head, nunits, tid, nthreads)
    else:
        _copy_units(dst + head, src + head, nunits, width, tid, nthreads)
    done = head + nunits * width
    _copy_units(dst + done, src + done, nbytes - done, 1, tid, nthreads)


# -------------------------------------------------------------------------------------- reduce


@device
def combine(a, b, op):
    """One step of the reduction; max and min let a NaN through, as numpy does."""
    if op == MAX:
        return a if (a >= b or a != a) else b
    if op == MIN:
        return a if (a <= b or a != a) else b
    return a + b


@device
def avg_float(a, op, divisor):
    if op == AVG:
        return a / divisor
    return a


@device
def avg_int(a, op, divisor):
    """Integer average truncated toward zero (like C and NCCL)."""
    if op == AVG:
        q = abs(a) // divisor
        return -q if a < 0 else q
    return a


@device
def unpack_half2(word, dt):
    """Two 16-bit floats in a 32-bit word to (low, high) float32."""
    if dt == BF16:
        return bits_to_f32((word & 0xFFFF) << 16), bits_to_f32(word & 0xFFFF0000)
    return f16x2_to_f32(word)


@device
def pack_half2(lo, hi, dt):
    if dt == BF16:
        return f32x2_to_bf16x2(lo, hi)
    return f32x2_to_f16x2(lo, hi)


@device
def _reduce_v16_half(dst, pool, nsrc, base, nvec, dt, op, divisor, tid, nthreads):
    """bfloat16 / float16: eight elements per 16-byte word, accumulated in float32."""
    first = load_i64(pool)
    div = np.float32(divisor)
    i = tid
    while i < nvec:
        at = base + i * 16
        w = load_v4_u32(first + at)
        a0, a1 = unpack_half2(w[0], dt)
        a2, a3 = unpack_half2(w[1], dt)
        a4, a5 = unpack_half2(w[2], dt)
        a6, a7 = unpack_half2(w[3], dt)
        for s in range(1, nsrc):
            v = load_v4_u32(load_i64(pool + s * 8) + at)
            b0, b1 = unpack_half2(v[0], dt)
            b2, b3 = unpack_half2(v[1], dt)
            b4, b5 = unpack_half2(v[2], dt)
            b6, b7 = unpack_half2(v[3], dt)
            a0 = combine(a0, b0, op)
            a1 = combine(a1, b1, op)
            a2 = combine(a2, b2, op)
            a3 = combine(a3, b3, op)
            a4 = combine(a4, b4, op)
            a5 = combine(a5, b5, op)
            a6 = combine(a6, b6, op)
            a7 = combine(a7, b7, op)
        store_v4_u32(dst + at, (
            pack_half2(avg_float(a0, op, div), avg_float(a1, op, div), dt),
            pack_half2(avg_float(a2, op, div), avg_float(a3, op, div), dt),
            pack_half2(avg_float(a4, op, div), avg_float(a5, op, div), dt),
            pack_half2(avg_float(a6, op, div), avg_float(a7, op, div), dt)))
        i += nthreads


@device
def _reduce_v16_f32(dst, pool, nsrc, base, nvec, op, divisor, tid, nthreads):
    first = load_i64(pool)
    div = np.float32(divisor)
    i = tid
    while i < nvec:
        at = base + i * 16
        a0, a1, a2, a3 = load_v4_f32(first + at)
        for s in range(1, nsrc):
            b0, b1, b2, b3 = load_v4_f32(load_i64(pool + s * 8) + at)
            a0 = combine(a0, b0, op)
            a1 = combine(a1, b1, op)
            a2 = combine(a2, b2, op)
            a3 = combine(a3, b3, op)
        store_v4_f32(dst + at, (avg_float(a0, op, div), avg_float(a1, op, div),
                                avg_float(a2, op, div), avg_float(a3, op, div)))
        i += nthreads


@device
def _reduce_v16_i32(dst, pool, nsrc, base, nvec, op, divisor, tid, nthreads):
    """int32 in int64 registers: exact sums, wrapped to 32 bits by the store."""
    first = load_i64(pool)
    i = tid
    while i < nvec:
        at = base + i * 16
        x = load_v4_i32(first + at)
        a0, a1, a2, a3 = np.int64(x[0]), np.int64(x[1]), np.int64(x[2]), np.int64(x[3])
        for s in range(1, nsrc):
            b0, b1, b2, b3 = load_v4_i32(load_i64(pool + s * 8) + at)
            a0 = combine(a0, np.int64(b0), op)
            a1 = combine(a1, np.int64(b1), op)
            a2 = combine(a2, np.int64(b2), op)
            a3 = combine(a3, np.int64(b3), op)
        store_v4_i32(dst + at, (avg_int(a0, op, divisor), avg_int(a1, op, divisor),
                                avg_int(a2, op, divisor), avg_int(a3, op, divisor)))
        i += nthreads


@device
def _reduce_v16_f64(dst, pool, nsrc, base, nvec, op, divisor, tid, nthreads):
    first = load_i64(pool)
    div = np.float64(divisor)
    i = tid
    while i < nvec:
        at = base + i * 16
        a0, a1 = load_v2_f64(first + at)
        for s in range(1, nsrc):
            b0, b1 = load_v2_f64(load_i64(pool + s * 8) + at)
            a0 = combine(a0, b0, op)
            a1 = combine(a1, b1, op)
        store_v2_f64(dst + at, (avg_float(a0, op, div), avg_float(a1, op, div)))
        i += nthreads


@device
def _load_as_f32(addr, dt):
    if dt == BF16:
        return bits_to_f32(load_u16(addr) << 16)
    if dt == F16:
        return f16x2_to_f32(load_u16(addr))[0]
    return load_f32(addr)


@device
def _store_from_f32(addr, x, dt):
    if dt == BF16:
        store_u16(addr, f32x2_to_bf16x2(x, x))
    elif dt == F16:
        store_u16(addr, f32x2_to_f16x2(x, x))
    else:
        store_f32(addr, x)


@device
def _reduce_scalar(dst, pool, nsrc, first, count, dt, op, divisor, tid, nthreads):
    """Elements ``[first, first + count)`` one at a time (heads, tails, misaligned rows)."""
    size = itemsize(dt)
    e = first + tid
    end = first + count
    while e < end:
        at = e * size
        if dt == F64:
            a = load_f64(load_i64(pool) + at)
            for s in range(1, nsrc):
                a = combine(a, load_f64(load_i64(pool + s * 8) + at), op)
            store_f64(dst + at, avg_float(a, op, np.float64(divisor)))
        elif dt == I32:
            n = np.int64(load_i32(load_i64(pool) + at))
            for s in range(1, nsrc):
                n = combine(n, np.int64(load_i32(load_i64(pool + s * 8) + at)), op)
            store_u32(dst + at, avg_int(n, op, divisor))
        elif dt == E4M3 or dt == E5M2:
            q = fp8_to_f32(load_u8(load_i64(pool) + at), dt)
            for s in range(1, nsrc):
                q = combine(q, fp8_to_f32(load_u8(load_i64(pool + s * 8) + at), dt), op)
            store_u8(dst + at, f32_to_fp8(avg_float(q, op, np.float32(divisor)), dt))
        else:
            x = _load_as_f32(load_i64(pool) + at, dt)
            for s in range(1, nsrc):
                x = combine(x, _load_as_f32(load_i64(pool + s * 8) + at, dt), op)
            _store_from_f32(dst + at, avg_float(x, op, np.float32(divisor)), dt)
        e += nthreads


@device
def fp8_word(word, dt):
    """Four FP8 elements of a 32-bit word as float32, lowest byte first."""
    return (fp8_to_f32(word & 0xFF, dt), fp8_to_f32((word >> 8) & 0xFF, dt),
            fp8_to_f32((word >> 16) & 0xFF, dt), fp8_to_f32((word >> 24) & 0xFF, dt))


@device
def fp8_pack(a, dt, op, div):
    """Four float32 sums (:func:`fp8_word`'s, folded) as one word of FP8, each rounded once
    (``div``: the average's divisor, a float32)."""
    return (f32_to_fp8(avg_float(a[0], op, div), dt)
            | (f32_to_fp8(avg_float(a[1], op, div), dt) << 8)
            | (f32_to_fp8(avg_float(a[2], op, div), dt) << 16)
            | (f32_to_fp8(avg_float(a[3], op, div), dt) << 24))


@device
def _reduce_w4_fp8(dst, pool, nsrc, base, nwords, dt, op, divisor, tid, nthreads):
    """FP8: four elements per 32-bit word, accumulated in float32 in source order, each
    rounded once into the stored word."""
    first = load_i64(pool)
    div = np.float32(divisor)
    i = tid
    while i < nwords:
        at = base + i * 4
        a0, a1, a2, a3 = fp8_word(load_u32(first + at), dt)
        for s in range(1, nsrc):
            b0, b1, b2, b3 = fp8_word(load_u32(load_i64(pool + s * 8) + at), dt)
            a0 = combine(a0, b0, op)
            a1 = combine(a1, b1, op)
            a2 = combine(a2, b2, op)
            a3 = combine(a3, b3, op)
        store_u32(dst + at, fp8_pack((a0, a1, a2, a3), dt, op, div))
        i += nthreads


@device
def _reduce_fp8(dst, pool, nsrc, count, dt, op, divisor, tid, nthreads):
    """FP8 rows: 32-bit words where every address has the same offset modulo 4 (after a
    scalar head), else and for the tail one element at a time."""
    phase = dst & 3
    aligned = True
    for s in range(nsrc):
        if (load_i64(pool + s * 8) & 3) != phase:
            aligned = False
    head = count
    nwords = 0
    if aligned:
        head = min(count, (4 - phase) & 3)
        nwords = (count - head) // 4
    _reduce_scalar(dst, pool, nsrc, 0, head, dt, op, divisor, tid, nthreads)
    if nwords > 0:
        _reduce_w4_fp8(dst, pool, nsrc, head, nwords, dt, op, divisor, tid, nthreads)
    tail = head + nwords * 4
    _reduce_scalar(dst, pool, nsrc, tail, count - tail, dt, op, divisor, tid, nthreads)


@device
def itemsize(dt):
    """Bytes per element of a dtype code."""
    if dt == BF16 or dt == F16:
        return 2
    if dt == F64:
        return 8
    if dt == E4M3 or dt == E5M2:
        return 1
    return 4


@device
def _reduce_vectors(dst, pool, nsrc, base, nvec, dt, op, divisor, tid, nthreads):
    """16-byte words ``[0, nvec)`` starting ``base`` bytes into every buffer."""
    if dt == BF16 or dt == F16:
        _reduce_v16_half(dst, pool, nsrc, base, nvec, dt, op, divisor, tid, nthreads)
    elif dt == F32:
        _reduce_v16_f32(dst, pool, nsrc, base, nvec, op, divisor, tid, nthreads)
    elif dt == I32:
        _reduce_v16_i32(dst, pool, nsrc, base, nvec, op, divisor, tid, nthreads)
    else:
        _reduce_v16_f64(dst, pool, nsrc, base, nvec, op, divisor, tid, nthreads)


@device
def reduce_row(dst, pool, nsrc, count, dt, op, divisor, tid, nthreads, fp8):
    """``dst[i] = op(src_0[i], ..., src_{nsrc-1}[i])`` for ``count`` elements of dtype ``dt``.

    ``pool`` is the address of ``nsrc`` consecutive int64 source addresses. ``fp8`` (a
    constant of the kernel) compiles the FP8 path in: its code made the whole interpreter
    slower on every dtype, so only ``executor_fp8`` carries it.
    """
    if fp8 and (dt == E4M3 or dt == E5M2):
        _reduce_fp8(dst, pool, nsrc, count, dt, op, divisor, tid, nthreads)
        return
    size = itemsize(dt)
    phase = dst & 15
    aligned = phase % size == 0
    for s in range(nsrc):
        if (load_i64(pool + s * 8) & 15) != phase:
            aligned = False
    head = count
    nvec = 0
    if aligned:
        head = min(count, ((16 - phase) & 15) // size)
        nvec = (count - head) * size // 16
    _reduce_scalar(dst, pool, nsrc, 0, head, dt, op, divisor, tid, nthreads)
    if nvec > 0:
        _reduce_vectors(dst, pool, nsrc, head * size, nvec, dt, op, divisor, tid, nthreads)
    tail = head + nvec * (16 // size)
    _reduce_scalar(dst, pool, nsrc, tail, count - tail, dt, op, divisor, tid, nthreads)


# ------------------------------------------------------------------------------------------ LL
@device
def ll_tag(epoch):
    """The tag of call ``epoch`` (never 0, the value of fresh memory)."""
    return epoch % LL_TAG_MOD + 1


@device
def _data_word(src, at, nbytes):
    """The 8 data bytes at ``src + at`` as two uint32 (zeros past ``nbytes``): two 4-byte
    loads where ``src + at`` is 4-byte aligned, else byte by byte (a piece of odd size
    inside a user's buffer)."""
    if at + LL_DATA <= nbytes and ((src + at) & 3) == 0:
        return load_u32(src + at), load_u32(src + at + 4)
    lo = 0
    hi = 0
    for k in range(min(LL_DATA, nbytes - at)):
        b = load_u8(src + at + k)
        if k < 4:
            lo |= b << (8 * k)
        else:
            hi |= b << (8 * (k - 4))
    return lo, hi


@device
def ll_put(dst, src, nbytes, tag, tid, nthreads):
    """Send ``nbytes`` from ``src`` as LL units to ``dst``: one 16-byte volatile store of
    {data, tag, data, tag} per 8 data bytes. No fence or flag follows: the tags are the flag."""
    nunits = (nbytes + LL_DATA - 1) // LL_DATA
    i = tid
    while i < nunits:
        lo, hi = _data_word(src, i * LL_DATA, nbytes)
        store_volatile_v4_u32(dst + i * LL_UNIT, (lo, tag, hi, tag))
        i += nthreads


@device
def ll_get(dst, src, nbytes, tag, tid, nthreads, timeout_ns, abort):
    """Receive ``nbytes`` of LL units at ``src`` into ``dst`` (8-byte aligned): each thread
    polls its own units until both tags equal ``tag``. Returns (0 | ERR_TIMEOUT | ERR_ABORTED,
    the tag last seen)."""
    nunits = (nbytes + LL_DATA - 1) // LL_DATA
    i = tid
    while i < nunits:
        unit = src + i * LL_UNIT
        v = load_volatile_v4_u32(unit)
        if v[1] != tag or v[3] != tag:
            deadline = globaltimer() + timeout_ns
            spins = 0
            while v[1] != tag or v[3] != tag:
                spins += 1
                if spins % 64 == 0:
                    if load_acquire(abort) != 0:
                        return ERR_ABORTED, int(v[1])
                    if globaltimer() > deadline:
                        return ERR_TIMEOUT, int(v[1])
                v = load_volatile_v4_u32(unit)
        at = i * LL_DATA
        if at + LL_DATA <= nbytes:
            store_u32(dst + at, v[0])
            store_u32(dst + at + 4, v[2])
        else:
            for k in range(nbytes - at):
                word = v[0] if k < 4 else v[2]
                store_u8(dst + at + k, (word >> (8 * (k & 3))) & 0xFF)
        i += nthreads
    return 0, int(tag)

