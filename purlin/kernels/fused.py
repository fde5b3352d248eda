"""The fused LL kernel: a rank's LL rows and the rows that consume them in one pass.

``fused(desc_ptr, nranks_in_launch, blocks_per_rank, timeout_ns, stride_words)``, all int64,
runs the programs ``purlin.atom.fused`` builds (layout in ``isa``: header, per-block call
counters, puts, sinks, sources). Rank slot ``s`` of a launch reads its program at
``desc_ptr + s * stride_words * 8``; its ``blocks_per_rank`` blocks share the work.

Every thread of the rank takes items (16 data bytes) ``g, g + stride, ...`` of every row,
where ``g`` is its index in the rank's grid:

1. each put sends its items as LL units ({data, tag, data, tag} per 8 bytes, tag = this
   call's ``epoch % LL_TAG_MOD + 1``) into a peer's LL area -- no fence, no flag: the tags are
   the flag;
2. each sink writes its items from its sources in order (a copy for one source, else the
   reduction): a plain source is loaded, an LL source is polled until both tags of its two
   units are this call's tag.

A thread only ever meets its own items, so no barrier separates receiving from reducing and
nothing passes through scratch. The interpreter (``executor``) runs the same rows with a lane
barrier and a scratch round trip in between; the reduction order -- sources in row order,
bfloat16 / float16 accumulated in float32 -- is the same, and so are the results, bit for bit.

Calls alternate between two parities of the LL area (even and odd addresses). A poll that
times out writes the rank's error record (the unit's address as the flag, the tag expected
and seen, the step and peer of the row that received it) and raises ABORT; the others then
leave too. Block ``b`` counts its calls in its own word, so no atomics are needed at the end.
"""

from __future__ import annotations

import numpy as np
from numba import cuda

from purlin.kernels.atoms import avg_float, avg_int, combine, ll_tag, pack_half2, unpack_half2
from purlin.kernels.intrinsics import (SIMULATOR, atomic_cas, bits_to_f32, device, f32_to_bits,
                                       fence_system, globaltimer, griddep_launch_dependents,
                                       griddep_wait, load_acquire, load_i64, load_v4_u32,
                                       load_volatile_v4_u32, red_release_add, store_i64,
                                       store_v4_u32, store_volatile_v4_u32)
from purlin.kernels.isa import (BF16, E_BLOCK, E_CODE, E_EXPECTED, E_FLAG, E_LANE, E_PEER,
                                E_RANK, E_SEEN, E_STEP, ERR_ABORTED, ERR_TIMEOUT, F16, F32,
                                F_ABORT, F_DIVISOR, F_DTYPE, F_EPOCHS, F_ERROR, F_NPUTS,
                                F_NSINKS, F_PUTS, F_RANK, F_REDOP, F_SINKS, PUT_WIDTH,
                                SINK_WIDTH, SOURCE_WIDTH)

SIGNATURE = "void(int64, int64, int64, int64, int64)"  # the executor's, so one Launcher serves
MAX_THREADS = 512
SPINS_PER_CHECK = 64
SOURCE_BYTES = SOURCE_WIDTH * 8


@device
def _poll(unit, tag, timeout_ns, abort):
    """Spin on one LL unit: (0 | ERR_TIMEOUT | ERR_ABORTED, tag seen, data lo, data hi)."""
    v = load_volatile_v4_u32(unit)
    if v[1] == tag and v[3] == tag:
        return 0, np.int64(tag), np.int64(v[0]), np.int64(v[2])
    deadline = globaltimer() + timeout_ns
    spins = 0
    while v[1] != tag or v[3] != tag:
        spins += 1
        if spins % SPINS_PER_CHECK == 0:
            if load_acquire(abort) != 0:
                return ERR_ABORTED, np.int64(v[1]), np.int64(0), np.int64(0)
            if globaltimer() > deadline:
                return ERR_TIMEOUT, np.int64(v[1]), np.int64(0), np.int64(0)
        v = load_volatile_v4_u32(unit)
    return 0, np.int64(tag), np.int64(v[0]), np.int64(v[2])


@device
def _words(source, item, odd, tag, timeout_ns, abort):
    """Item ``item`` (16 bytes) of a source entry as four uint32 words in int64:
    (code, tag seen, address polled, w0, w1, w2, w3)."""
    addr = load_i64(source + 8 + odd * 8)
    if load_i64(source) == 0:
        w = load_v4_u32(addr + item * 16)
        return (0, np.int64(0), addr, np.int64(w[0]), np.int64(w[1]), np.int64(w[2]),
                np.int64(w[3]))
    unit = addr + item * 32
    code, seen, w0, w1 = _poll(unit, tag, timeout_ns, abort)
    if code != 0:
        return code, seen, unit, w0, w1, w0, w1
    code, seen, w2, w3 = _poll(unit + 16, tag, timeout_ns, abort)
    return code, seen, unit + 16, w0, w1, w2, w3


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


@device
def _sink_item(prog, sink, item, odd, tag, dt, op, divisor, timeout_ns, abort):
    """Write item ``item`` of one sink. Returns (code, tag seen, address polled, source
    entry) -- code 0 when written."""
    dst = load_i64(sink) + item * 16
    nsrc = load_i64(sink + 16)
    source = prog + load_i64(sink + 24) * 8
    code, seen, unit, w0, w1, w2, w3 = _words(source, item, odd, tag, timeout_ns, abort)
    if code != 0:
        return code, seen, unit, source
    if nsrc == 1:
        store_v4_u32(dst, (w0, w1, w2, w3))
        return 0, seen, unit, source
    if dt == BF16 or dt == F16:
        a0, a1 = unpack_half2(w0, dt)
        a2, a3 = unpack_half2(w1, dt)
        a4, a5 = unpack_half2(w2, dt)
        a6, a7 = unpack_half2(w3, dt)
        acc = (a0, a1, a2, a3, a4, a5, a6, a7)
        for s in range(1, nsrc):
            entry = source + s * SOURCE_BYTES
            code, seen, unit, v0, v1, v2, v3 = _words(entry, item, odd, tag, timeout_ns, abort)
            if code != 0:
                return code, seen, unit, entry
            acc = _fold_half(acc, (v0, v1, v2, v3), dt, op)
        div = np.float32(divisor)
        store_v4_u32(dst, (
            pack_half2(avg_float(acc[0], op, div), avg_float(acc[1], op, div), dt),
            pack_half2(avg_float(acc[2], op, div), avg_float(acc[3], op, div), dt),
            pack_half2(avg_float(acc[4], op, div), avg_float(acc[5], op, div), dt),
            pack_half2(avg_float(acc[6], op, div), avg_float(acc[7], op, div), dt)))
    elif dt == F32:
        f0, f1 = bits_to_f32(w0), bits_to_f32(w1)
        f2, f3 = bits_to_f32(w2), bits_to_f32(w3)
        for s in range(1, nsrc):
            entry = source + s * SOURCE_BYTES
            code, seen, unit, v0, v1, v2, v3 = _words(entry, item, odd, tag, timeout_ns, abort)
            if code != 0:
                return code, seen, unit, entry
            f0 = combine(f0, bits_to_f32(v0), op)
            f1 = combine(f1, bits_to_f32(v1), op)
            f2 = combine(f2, bits_to_f32(v2), op)
            f3 = combine(f3, bits_to_f32(v3), op)
        div = np.float32(divisor)
        store_v4_u32(dst, (f32_to_bits(avg_float(f0, op, div)),
                           f32_to_bits(avg_float(f1, op, div)),
                           f32_to_bits(avg_float(f2, op, div)),
                           f32_to_bits(avg_float(f3, op, div))))
    else:  # I32: exact in int64, wrapped to 32 bits by the store
        n0, n1, n2, n3 = _signed(w0), _signed(w1), _signed(w2), _signed(w3)
        for s in range(1, nsrc):
            entry = source + s * SOURCE_BYTES
            code, seen, unit, v0, v1, v2, v3 = _words(entry, item, odd, tag, timeout_ns, abort)
            if code != 0:
                return code, seen, unit, entry
            n0 = combine(n0, _signed(v0), op)
            n1 = combine(n1, _signed(v1), op)
            n2 = combine(n2, _signed(v2), op)
            n3 = combine(n3, _signed(v3), op)
        store_v4_u32(dst, (avg_int(n0, op, divisor) & 0xFFFFFFFF,
                           avg_int(n1, op, divisor) & 0xFFFFFFFF,
                           avg_int(n2, op, divisor) & 0xFFFFFFFF,
                           avg_int(n3, op, divisor) & 0xFFFFFFFF))
    return 0, seen, unit, source


@device
def _signed(word):
    """A uint32 word held in int64 as the int32 it encodes."""
    return word - 0x100000000 if word >= 0x80000000 else word


@device
def _record(prog, code, seen, unit, source, tag, block):
    """Claim the rank's error record (first writer wins); raise ABORT on a timeout."""
    err = load_i64(prog + F_ERROR * 8)
    if atomic_cas(err + E_CODE * 8, 0, code) == 0:
        store_i64(err + E_RANK * 8, load_i64(prog + F_RANK * 8))
        store_i64(err + E_STEP * 8, load_i64(source + 32))
        store_i64(err + E_FLAG * 8, unit)
        store_i64(err + E_EXPECTED * 8, tag)
        store_i64(err + E_SEEN * 8, seen)
        store_i64(err + E_LANE * 8, 0)
        store_i64(err + E_BLOCK * 8, block)
        store_i64(err + E_PEER * 8, load_i64(source + 24))
    if code == ERR_TIMEOUT:
        fence_system()
        red_release_add(load_i64(prog + F_ABORT * 8), 1)


@device
def _run(desc_ptr, nranks_in_launch, blocks_per_rank, timeout_ns, stride_words):
    slot = cuda.blockIdx.x // blocks_per_rank
    if slot >= nranks_in_launch:
        return
    block = cuda.blockIdx.x - slot * blocks_per_rank
    prog = desc_ptr + slot * stride_words * 8
    counter = prog + (F_EPOCHS + block) * 8
    shared = cuda.shared.array(1, np.int64)
    if cuda.threadIdx.x == 0:
        shared[0] = load_i64(counter)
    cuda.syncthreads()
    epoch = shared[0]
    tag = ll_tag(epoch)
    odd = epoch & 1
    g = block * cuda.blockDim.x + cuda.threadIdx.x
    stride = blocks_per_rank * cuda.blockDim.x

    puts = prog + load_i64(prog + F_PUTS * 8) * 8
    for p in range(load_i64(prog + F_NPUTS * 8)):
        put = puts + p * PUT_WIDTH * 8
        src = load_i64(put)
        dst = load_i64(put + 8 + odd * 8)
        items = load_i64(put + 24) // 16
        i = g
        while i < items:
            w = load_v4_u32(src + i * 16)
            store_volatile_v4_u32(dst + i * 32, (w[0], tag, w[1], tag))
            store_volatile_v4_u32(dst + i * 32 + 16, (w[2], tag, w[3], tag))
            i += stride

    dt = load_i64(prog + F_DTYPE * 8)
    op = load_i64(prog + F_REDOP * 8)
    divisor = load_i64(prog + F_DIVISOR * 8)
    abort = load_i64(prog + F_ABORT * 8)
    sinks = prog + load_i64(prog + F_SINKS * 8) * 8
    failed = False
    for k in range(load_i64(prog + F_NSINKS * 8)):
        if failed:
            break
        sink = sinks + k * SINK_WIDTH * 8
        items = load_i64(sink + 8) // 16
        i = g
        while i < items:
            code, seen, unit, source = _sink_item(prog, sink, i, odd, tag, dt, op, divisor,
                                                  timeout_ns, abort)
            if code != 0:
                _record(prog, code, seen, unit, source, tag, block)
                failed = True
                break
            i += stride
    cuda.syncthreads()
    if cuda.threadIdx.x == 0:
        store_i64(counter, epoch + 1)


def _kernel(fn):
    return cuda.jit(fn) if SIMULATOR else cuda.jit(launch_bounds=MAX_THREADS)(fn)


@_kernel
def fused(desc_ptr, nranks_in_launch, blocks_per_rank, timeout_ns, stride_words):
    """Run the fused LL programs of this launch (see the module docstring)."""
    _run(desc_ptr, nranks_in_launch, blocks_per_rank, timeout_ns, stride_words)


@_kernel
def fused_pdl(desc_ptr, nranks_in_launch, blocks_per_rank, timeout_ns, stride_words):
    """``fused`` for programmatic dependent launch (as ``executor_pdl``)."""
    griddep_launch_dependents()
    griddep_wait()
    _run(desc_ptr, nranks_in_launch, blocks_per_rank, timeout_ns, stride_words)
