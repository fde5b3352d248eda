"""User-written epilogues: the one-shot epilogue kernel (an LL all-reduce's PUTs, then each
item's sum kept in registers) specialised, per epilogue, to call the user's Numba CUDA device
functions on the reduced values before they are written.

A :class:`Form` says what the kernel does after each item's sum (an 8-byte LL unit: four 16-bit
or two float32 elements, summed over the ranks and rounded to the element type):

1. ``residual``: ``v = round(x + residual)``, stored back into the residual (else ``v = x``);
2. ``stat`` (the per-row form): ``stat(v, *e)`` per element -- a float summed over the row, or a
   pair (summed, maximised) -- then ``finish(total, peak) -> (p, q)`` once per row;
3. ``fn(v, *e) -> y`` (per element) or ``fn(v, p, q, *e) -> y`` (per row) into the output
   (``out_fp8``: as float8_e4m3fn bytes), and per row ``q`` into a float32 ``row_out``.

A ``prologue(x, *e) -> x'`` runs first on the rank's input, rewritten in place (rounded to the
element type) before anything is sent: each thread rewrites the items it then puts and sums.

With a ``wire`` (isa ``E4M3`` / ``E5M2``, per element only) the prologue's float32 result is
encoded to FP8 instead (:mod:`purlin.kernels.fp8`: e4m3fn saturating at 448) and the input is
left as it is: an LL unit then carries eight elements, so a rank sends half the units of
bfloat16 (a quarter of float32's) -- the first ones of the same LL areas, on the same
program. Each thread decodes every rank's unit and adds them in rank order in float32, the
same sum on every rank, before ``residual`` and ``fn`` (its own unit it encodes again where it
is not the first it sent).

``e`` are the extra tensors' elements at the same place (``per_column[k]``: element ``i % hidden``,
a weight or a bias; else element ``i``), as float32. Every name of the form is a compile-time
constant of the kernel: :func:`kernels` compiles one per form (cached), and code the form
leaves out is not in it. The program is the one-shot program ending with the NORM op
(``purlin.atom.fused.oneshot_problem``); its parameter entry holds residual (or 0), -, row sums,
hidden, -, and the words after it the output, row_out and the extras' addresses.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from typing import NamedTuple

import numpy as np
from numba import cuda

from purlin.kernels.atoms import ll_tag, pack_half2, unpack_half2
from purlin.kernels.fp8 import f32_to_fp8, fp8_to_f32
from purlin.kernels.fused import (LL_ITEM, META, SIGNATURE, _begin, _kernel, _norm_item,
                                  _owned, _poll, _record, _sum_block, _unit_result, _word)
from purlin.kernels.intrinsics import (SIMULATOR, bits_to_f32, device, f32_to_bits,
                                       griddep_launch_dependents, load_i64, load_u32,
                                       store_i64, store_u32, store_u8, store_volatile_v4_u32)
from purlin.kernels.intrinsics import griddep_wait
from purlin.kernels.isa import (BF16, F16, F32, F_ABORT, F_DIVISOR, F_DTYPE, F_HEAD, F_NOPS,
                                F_REDOP, MAX_THREADS, NORM_CHUNKS, NORM_HIDDEN, NORM_PARAMS,
                                NORM_RESIDUAL, NORM_ROW_CHUNKS, NORM_SUMS, OP_WIDTH, PUT_DST,
                                PUT_SRC, SOURCE_PEER, SOURCE_STEP, SOURCE_WIDTH)
from purlin.kernels.isa import (F_RANK, MOVE_BYTES, MOVE_NSRC, MOVE_SOURCES,  # the wire's
                                SOURCE_ADDR, SOURCE_LL)

EXTRA_OUT, EXTRA_ROW_OUT, EXTRA_FIRST = 0, 1, 2  # words after the NORM parameter entry
E4M3_MAX = 448.0


class Form(NamedTuple):
    """What one specialised kernel does (every field a compile-time constant)."""

    fn: object  # device function: (v, *e) or (v, p, q, *e) -> y
    dtype: int  # isa code: BF16, F16, F32
    per_column: tuple = ()  # per extra: indexed by the column (True) or the element
    residual: bool = False
    stat: object = None  # device function (v, *e) -> s or (s, m); None: the per-element form
    stats: int = 1  # what stat returns: 1 float (summed) or 2 (summed, maximised)
    finish: object = None  # device function (total, peak) -> (p, q); None: (total, peak)
    out_fp8: bool = False
    row_out: bool = False
    prologue: object = None  # device function (x, *e) -> x' on the rank's input, before sending
    wire: int = 0  # isa E4M3 / E5M2: the prologue's values sent as FP8 (0: the element type)


@device
def f32_to_e4m3(x):
    """``x`` as float8_e4m3fn bits (round to nearest even; beyond 448 saturated to 448, NaN
    kept)."""
    bits = f32_to_bits(x)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    if mag > 0x7F800000:
        return sign | 0x7F
    a = bits_to_f32(mag)
    if a >= np.float32(2.0 ** -6):  # a normal e4m3
        e = (mag >> 23) - 120  # the biased e4m3 exponent (bias 7)
        m = (mag >> 20) & 7
        rest = mag & 0xFFFFF
        code = (e << 3) | m
        if rest > 0x80000 or (rest == 0x80000 and (m & 1) == 1):
            code += 1
        return sign | min(code, 0x7E)
    t = a * np.float32(512.0)  # subnormal: multiples of 2^-9, exact scaling
    f = math.floor(t)
    r = t - f
    q = np.int64(f)
    if r > 0.5 or (r == 0.5 and (q & 1) == 1):
        q += 1
    return sign | q


@device
def _warp_max(x, lane, width):
    mask = np.uint32(0xFFFFFFFF) if width >= 32 else np.uint32((1 << width) - 1)
    offset = 16
    while offset > 0:
        other = cuda.shfl_down_sync(mask, x, offset)
        if lane + offset < width:
            x = max(x, other)
        offset //= 2
    return x


@device
def _max_block(x, tid, nthreads):
    """The largest ``x`` over the block's threads; every thread gets it (as ``_sum_block``)."""
    red = cuda.shared.array(MAX_THREADS, np.float32)
    if SIMULATOR:
        red[tid] = x
        cuda.syncthreads()
        best = red[0]
        for t in range(1, nthreads):
            best = max(best, red[t])
        cuda.syncthreads()
        return best
    lane = tid % 32
    warp = tid // 32
    x = _warp_max(x, lane, min(32, nthreads - warp * 32))
    if lane == 0:
        red[warp] = x
    cuda.syncthreads()
    if warp == 0:
        nwarps = (nthreads + 31) // 32
        x = _warp_max(red[lane] if lane < nwarps else red[0], lane, min(32, nthreads))
        if lane == 0:
            red[MAX_THREADS - 1] = x
    cuda.syncthreads()
    return red[MAX_THREADS - 1]


@device
def _floats(w0, w1, dt):
    """An 8-byte unit's elements as four float32 (float32: two, then zeros)."""
    if dt == F32:
        return bits_to_f32(w0), bits_to_f32(w1), np.float32(0), np.float32(0)
    a0, a1 = unpack_half2(w0, dt)
    a2, a3 = unpack_half2(w1, dt)
    return a0, a1, a2, a3


@device
def _words(v, dt):
    """Four float32 (float32: the first two) as an 8-byte unit of the element type."""
    if dt == F32:
        return np.int64(f32_to_bits(v[0])), np.int64(f32_to_bits(v[1]))
    return np.int64(pack_half2(v[0], v[1], dt)), np.int64(pack_half2(v[2], v[3], dt))


@device
def _extra_at(meta, head, prm, k, c, per_row, per_column):
    """This thread's item of extra ``k`` in chunk ``c``: by column (a ``hidden``-long tensor)
    or by element."""
    chunk = cuda.blockDim.x * LL_ITEM
    base = _word(meta, head, prm + SOURCE_WIDTH + EXTRA_FIRST + k)
    row = c
    if per_column:
        row = np.int64(0) if per_row == 1 else np.int64(np.uint32(c) % np.uint32(per_row))
    return base + row * chunk + cuda.threadIdx.x * LL_ITEM


# The per-form code: how extras are read and the user's functions called, unrolled over the
# four elements of an item (the extras' count is the form's).
_TEMPLATE = '''
@device
def _extras(meta, head, prm, c, per_row):
{load}
    return ({names})


@device
def _stat4(v, e):
    s = (np.float32(0), np.float32(0), np.float32(0), np.float32(0))
    m = (np.float32(-math.inf), np.float32(-math.inf), np.float32(-math.inf),
         np.float32(-math.inf))
{stat}
    return (s[0] + s[1]) + (s[2] + s[3]), max(max(m[0], m[1]), max(m[2], m[3]))


@device
def _apply4(v, p, q, e):
{apply}
    return y


@device
def _prologue4(v, e):
{prologue}
    return y
'''


def _source(form: Form) -> str:
    n = len(form.per_column)
    load = "\n".join(
        f"    u{k} = _extra_at(meta, head, prm, {k}, c, per_row, {bool(col)})\n"
        f"    e{k} = _floats(load_u32(u{k}), load_u32(u{k} + 4), DT)"
        for k, col in enumerate(form.per_column)) or "    pass"
    names = "".join(f"e{k}, " for k in range(n))
    width = 2 if form.dtype == F32 else 4

    def args(j):
        return "".join(f", e[{k}][{j}]" for k in range(n))

    if form.stat is None:
        stat = "    pass"
    elif form.stats == 1:
        stat = "    s = (" + ", ".join(f"STAT(v[{j}]{args(j)})" if j < width else "np.float32(0)"
                                       for j in range(4)) + ")"
    else:
        stat = "\n".join(f"    t{j} = STAT(v[{j}]{args(j)})" for j in range(width)) + "\n"
        stat += "    s = (" + ", ".join(f"t{j}[0]" if j < width else "np.float32(0)"
                                        for j in range(4)) + ")\n"
        stat += "    m = (" + ", ".join(f"t{j}[1]" if j < width else "m[0]"
                                        for j in range(4)) + ")"
    pq = ", p, q" if form.stat is not None else ""
    apply = "    y = (" + ", ".join(f"np.float32(FN(v[{j}]{pq}{args(j)}))" if j < width
                                    else "np.float32(0)" for j in range(4)) + ")"
    prologue = "    y = (" + ", ".join(f"np.float32(PRO(v[{j}]{args(j)}))" if j < width
                                       else "np.float32(0)" for j in range(4)) + ")"
    if form.prologue is None:
        prologue = "    y = v"
    return _TEMPLATE.format(load=load, names=names, stat=stat, apply=apply, prologue=prologue)


@contextmanager
def _simulated_helpers(fake_cuda):
    """In the simulator: the kernel's ``cuda`` (the simulated one) also in the modules whose
    plain-function helpers it calls (the simulator swaps only the kernel's own globals)."""
    from numba.cuda.simulator.kernelapi import swapped_cuda_module

    from purlin.kernels import fused

    with swapped_cuda_module(fused._begin, fake_cuda), swapped_cuda_module(_floats, fake_cuda):
        yield


def _build(form: Form):
    """The two kernels (plain, PDL) of ``form``."""
    space = dict(globals(), DT=form.dtype, FN=form.fn, STAT=form.stat, FINISH=form.finish,
                 RESIDUAL=form.residual, ROW=form.stat is not None, STATS=form.stats,
                 OUT_FP8=form.out_fp8, ROW_OUT=form.row_out, PRO=form.prologue,
                 PROLOGUE=form.prologue is not None, WIRE=form.wire)
    kernels = _SIM_KERNELS if SIMULATOR else _KERNELS
    if form.wire:  # the same kernels, running _run_wire
        kernels = _wire_source(form) + _RUN_WIRE + kernels.replace("_run(", "_run_wire(")
    exec(compile(_source(form) + _RUN + kernels, f"<epilogue {getattr(form.fn, '__name__', 'fn')}>",
                 "exec"), space)
    return space["epilogue_oneshot"], space["epilogue_oneshot_pdl"]


# The kernel: the one-shot exchange, then the form's work. Read from the same module
# namespace as the template (its constants are the form's).
_RUN = '''
@device
def _finish(total, peak):
    if FINISH is None:
        return total, peak
    return FINISH(total, peak)


@device
def _store_out(meta, head, prm, target, c, y):
    """The item's results: into the target, or as e4m3 bytes into the output tensor."""
    i = c * cuda.blockDim.x + cuda.threadIdx.x
    out = target
    if OUT_FP8:
        out = _word(meta, head, prm + SOURCE_WIDTH + EXTRA_OUT)
    _store_item(out, i, y)


@device
def _store_item(out, i, y):
    """Item ``i``'s results ``y`` at ``out``: as e4m3 bytes (``OUT_FP8``) or the element type."""
    if OUT_FP8:
        n = 2 if DT == F32 else 4
        if n == 4:
            store_u32(out + i * 4, f32_to_e4m3(y[0]) | (f32_to_e4m3(y[1]) << 8)
                      | (f32_to_e4m3(y[2]) << 16) | (f32_to_e4m3(y[3]) << 24))
        else:
            store_u8(out + i * 2, f32_to_e4m3(y[0]))
            store_u8(out + i * 2 + 1, f32_to_e4m3(y[1]))
    else:
        w0, w1 = _words(y, DT)
        dst = out + i * LL_ITEM
        store_u32(dst, w0)
        store_u32(dst + 4, w1)


@device
def _run(desc_ptr, nranks_in_launch, blocks_per_rank, timeout_ns, stride_words, counters, pdl):
    slot = 0 if nranks_in_launch == 1 else cuda.blockIdx.x // blocks_per_rank
    if slot >= nranks_in_launch:
        return
    meta = cuda.shared.array(META, np.int64)
    status = cuda.shared.array(1, np.int64)
    parts = cuda.shared.array(MAX_THREADS, np.float32)  # a row's sums
    peaks = cuda.shared.array(MAX_THREADS, np.float32)  # and maxima
    block, head, counter = _begin(desc_ptr, slot, blocks_per_rank, stride_words, counters, meta,
                                  status, pdl)
    tid = cuda.threadIdx.x
    nthreads = cuda.blockDim.x
    norm = F_HEAD + (meta[F_NOPS] - 1) * OP_WIDTH
    move = norm - OP_WIDTH
    chunks = _word(meta, head, norm + NORM_CHUNKS)
    per_row = _word(meta, head, norm + NORM_ROW_CHUNKS)
    prm = _word(meta, head, norm + NORM_PARAMS)
    src = _word(meta, head, F_HEAD + PUT_SRC)
    g = block * nthreads + tid
    # read together: this thread's input item, the residual's and the
    # extras' items of the block's first chunk, and the call counter
    residual = _word(meta, head, prm + NORM_RESIDUAL)
    x0, x1 = np.int64(0), np.int64(0)
    r0w0, r0w1 = np.int64(0), np.int64(0)
    if block < chunks:
        x0, x1 = load_u32(src + g * LL_ITEM), load_u32(src + g * LL_ITEM + 4)
        if RESIDUAL:
            r0w0, r0w1 = load_u32(residual + g * LL_ITEM), load_u32(residual + g * LL_ITEM + 4)
    e0 = _extras(meta, head, prm, block if block < chunks else 0, per_row)  # (a valid item)
    if PROLOGUE:  # the input rewritten in place, each thread its own items, before any put
        c = block
        while c < chunks:
            at = src + (c * nthreads + tid) * LL_ITEM
            w0, w1 = x0, x1
            e = e0
            if c != block:
                w0, w1 = load_u32(at), load_u32(at + 4)
                e = _extras(meta, head, prm, c, per_row)
            n0, n1 = _words(_prologue4(_floats(w0, w1, DT), e), DT)
            store_u32(at, n0)
            store_u32(at + 4, n1)
            if c == block:
                x0, x1 = n0, n1
            c += blocks_per_rank
    epoch = load_i64(counter)
    tag = ll_tag(epoch)
    odd = epoch & 1
    stride = blocks_per_rank * nthreads
    for k in range(meta[F_NOPS] - 2):  # the PUTs: the input to every peer as LL units
        dst = _word(meta, head, F_HEAD + k * OP_WIDTH + PUT_DST + odd)
        i = g
        if block < chunks:
            store_volatile_v4_u32(dst + i * 16, (x0, tag, x1, tag))
            i += stride
        while i < chunks * nthreads:
            store_volatile_v4_u32(dst + i * 16, (load_u32(src + i * LL_ITEM), tag,
                                                 load_u32(src + i * LL_ITEM + 4), tag))
            i += stride
    abort = meta[F_ABORT]
    target = _word(meta, head, norm + 1 + odd)
    sums = _word(meta, head, prm + NORM_SUMS)
    owned = _owned(chunks, per_row, blocks_per_rank)
    v0 = (np.float32(0), np.float32(0), np.float32(0), np.float32(0))  # first chunk's values
    c = block
    k = 0
    while c < chunks:
        i = c * nthreads + tid
        code, seen, unit, entry, w0, w1 = _unit_result(meta, head, move, i, odd, tag, DT,
                                                       meta[F_REDOP], meta[F_DIVISOR],
                                                       timeout_ns, abort, 8, False, False)
        if code != 0:  # (every thread of the block passes the same barriers before leaving)
            _record(meta, head, code, _word(meta, head, entry + SOURCE_STEP), unit, tag, seen,
                    _word(meta, head, entry + SOURCE_PEER), block)
            status[0] = 1
        v = _floats(w0, w1, DT)
        if ROW and not RESIDUAL:  # the second pass reads it back
            store_u32(target + i * LL_ITEM, w0)
            store_u32(target + i * LL_ITEM + 4, w1)
        if RESIDUAL:  # residual += sum, rounded to the element type, and kept
            at = residual + i * LL_ITEM
            if c == block:
                r = _floats(r0w0, r0w1, DT)
            else:
                r = _floats(load_u32(at), load_u32(at + 4), DT)
            n0, n1 = _words((v[0] + r[0], v[1] + r[1], v[2] + r[2], v[3] + r[3]), DT)
            store_u32(at, n0)
            store_u32(at + 4, n1)
            v = _floats(n0, n1, DT)
        e = e0
        if c != block:
            e = _extras(meta, head, prm, c, per_row)
        if ROW:
            s, m = _stat4(v, e)
            total = _sum_block(s, tid, nthreads)
            peak = total
            if STATS == 2:
                peak = _max_block(m, tid, nthreads)
            if tid == 0:
                if owned:
                    parts[k] = total
                    peaks[k] = peak
                else:
                    store_volatile_v4_u32(sums + c * 16, (f32_to_bits(total), tag,
                                                          f32_to_bits(peak), tag))
            if c == block:
                v0 = v
        else:
            _store_out(meta, head, prm, target, c, _apply4(v, np.float32(0), np.float32(0), e))
        c += blocks_per_rank
        k += 1
    cuda.syncthreads()
    if ROW and status[0] == 0:
        _second_pass(meta, head, norm, prm, parts, peaks, status, block, blocks_per_rank, tag,
                     timeout_ns, abort, owned, target, v0, e0)
    cuda.syncthreads()
    if tid == 0:
        store_i64(counter, epoch + 1)


@device
def _second_pass(meta, head, norm, prm, parts, peaks, status, block, blocks, tag, timeout_ns,
                 abort, owned, target, v0, e0):
    """Each of the block's chunks: its row's totals (slots in order, or ``parts``), then the
    user's ``finish`` and ``fn`` (``fused._normalize``'s order of reads; ``v0`` / ``e0``: the
    block's first chunk's values and extras, kept from pass 1)."""
    tid = cuda.threadIdx.x
    nthreads = cuda.blockDim.x
    chunks = _word(meta, head, norm + NORM_CHUNKS)
    per_row = _word(meta, head, norm + NORM_ROW_CHUNKS)
    sums = _word(meta, head, prm + NORM_SUMS)
    residual = _word(meta, head, prm + NORM_RESIDUAL)
    c = block
    k = 0
    while c < chunks:
        first = c if per_row == 1 else np.int64(np.uint32(c) // np.uint32(per_row)) * per_row
        if not owned:
            if tid < per_row:
                slot = sums + (first + tid) * 16
                code, seen, lo, hi = _poll(slot, tag, timeout_ns, abort, -1)
                if code != 0:
                    _record(meta, head, code, -1, slot, tag, seen, -1, block)
                    status[0] = 1
                parts[tid] = bits_to_f32(lo)
                peaks[tid] = bits_to_f32(hi)
            cuda.syncthreads()
            if status[0] != 0:
                return
        elif k == 0:
            cuda.syncthreads()
        s = np.float32(0)
        m = np.float32(-math.inf)
        for t in range(per_row):
            at = (k if per_row == 1 else first + t) if owned else t
            s += parts[at]
            m = max(m, peaks[at])
        p, q = _finish(s, m)
        v, e = v0, e0
        if c != block:
            e = _extras(meta, head, prm, c, per_row)
            i = c * nthreads + tid
            if RESIDUAL:
                at = residual + i * LL_ITEM
            else:
                at = target + i * LL_ITEM
            v = _floats(load_u32(at), load_u32(at + 4), DT)
        y = _apply4(v, p, q, e)
        if ROW_OUT and tid == 0 and c == first:
            row_out = _word(meta, head, prm + SOURCE_WIDTH + EXTRA_ROW_OUT)
            store_u32(row_out + (np.int64(np.uint32(c) // np.uint32(per_row))
                                 if per_row != 1 else c) * 4, f32_to_bits(q))
        _store_out(meta, head, prm, target, c, y)
        if not owned and c + blocks < chunks:
            cuda.syncthreads()
        c += blocks
        k += 1


'''

# ---- FP8 on the wire (Form.wire): the per-element form, an LL unit of eight FP8 elements


@device
def _extra_item_at(meta, head, prm, k, t, hidden, per_column, dt):
    """Extra ``k``'s 8-byte item under the tensor's item ``t``: by column (``hidden``-long,
    rows of whole items) or by element."""
    base = _word(meta, head, prm + SOURCE_WIDTH + EXTRA_FIRST + k)
    if per_column:
        width = 2 if dt == F32 else 4
        return base + np.int64(np.uint32(t * width) % np.uint32(hidden)) * (LL_ITEM // width)
    return base + t * LL_ITEM


@device
def _source_of(meta, head, first, nsrc, peer):
    """The move's LL source entry that ``peer`` sends (the move's first entry if none)."""
    for s in range(nsrc):
        entry = first + s * SOURCE_WIDTH
        if _word(meta, head, entry + SOURCE_LL) != 0 and \
                _word(meta, head, entry + SOURCE_PEER) == peer:
            return entry
    return first


_WIRE_TEMPLATE = '''
@device
def _extras_item(meta, head, prm, t, hidden):
{load}
    return ({names})
'''


def _wire_source(form: Form) -> str:
    """The per-form code of the wire kernel: the extras of one of the tensor's items."""
    load = "\n".join(
        f"    u{k} = _extra_item_at(meta, head, prm, {k}, t, hidden, {bool(col)}, DT)\n"
        f"    e{k} = _floats(load_u32(u{k}), load_u32(u{k} + 4), DT)"
        for k, col in enumerate(form.per_column)) or "    pass"
    names = "".join(f"e{k}, " for k in range(len(form.per_column)))
    return _WIRE_TEMPLATE.format(load=load, names=names)


# The wire kernel: each thread encodes its units of the rank's input and puts them to every
# peer, then sums every rank's decoded unit in rank order and runs residual and fn on each of
# the tensor's items under it. The rows of the program stay the tensor's (its bytes, its LL
# areas); the units are the first MOVE_BYTES / (8 * itemsize) of them.
_RUN_WIRE = '''
ITEMS = 4 if DT == F32 else 2  # the tensor's 8-byte items under one unit of eight elements
WIDTH = 2 if DT == F32 else 4  # elements of one of them


@device
def _fp8_bytes(y):
    """An item's WIDTH values as FP8 bytes of the wire, the first the lowest."""
    b = f32_to_fp8(y[0], WIRE) | (f32_to_fp8(y[1], WIRE) << 8)
    if WIDTH == 4:
        b |= (f32_to_fp8(y[2], WIRE) << 16) | (f32_to_fp8(y[3], WIRE) << 24)
    return np.int64(b)


@device
def _wire_unit(meta, head, prm, src, u, hidden):
    """Unit ``u`` of the rank's wire: the prologue on its eight input elements, encoded (two
    words, element 0 the lowest byte)."""
    lo = np.int64(0)
    hi = np.int64(0)
    for j in range(ITEMS):
        t = u * ITEMS + j
        at = src + t * LL_ITEM
        b = _fp8_bytes(_prologue4(_floats(load_u32(at), load_u32(at + 4), DT),
                                  _extras_item(meta, head, prm, t, hidden)))
        k = j * WIDTH  # the item's first byte in the unit
        if k < 4:
            lo |= b << (8 * k)
        else:
            hi |= b << (8 * (k - 4))
    return lo, hi


@device
def _decoded(lo, hi):
    """A unit's eight FP8 values as float32 (exact)."""
    return (fp8_to_f32(lo & 0xFF, WIRE), fp8_to_f32((lo >> 8) & 0xFF, WIRE),
            fp8_to_f32((lo >> 16) & 0xFF, WIRE), fp8_to_f32((lo >> 24) & 0xFF, WIRE),
            fp8_to_f32(hi & 0xFF, WIRE), fp8_to_f32((hi >> 8) & 0xFF, WIRE),
            fp8_to_f32((hi >> 16) & 0xFF, WIRE), fp8_to_f32((hi >> 24) & 0xFF, WIRE))


@device
def _added(v, lo, hi):
    d = _decoded(lo, hi)
    return (v[0] + d[0], v[1] + d[1], v[2] + d[2], v[3] + d[3], v[4] + d[4], v[5] + d[5],
            v[6] + d[6], v[7] + d[7])


@device
def _item_of(v, j):
    """Item ``j``'s values of a unit's eight, as four (float32: two, then zeros)."""
    if WIDTH == 4:
        return v[4 * j], v[4 * j + 1], v[4 * j + 2], v[4 * j + 3]
    return v[2 * j], v[2 * j + 1], np.float32(0), np.float32(0)


@device
def _run_wire(desc_ptr, nranks_in_launch, blocks_per_rank, timeout_ns, stride_words, counters,
              pdl):
    slot = 0 if nranks_in_launch == 1 else cuda.blockIdx.x // blocks_per_rank
    if slot >= nranks_in_launch:
        return
    meta = cuda.shared.array(META, np.int64)
    status = cuda.shared.array(1, np.int64)
    block, head, counter = _begin(desc_ptr, slot, blocks_per_rank, stride_words, counters, meta,
                                  status, pdl)
    tid = cuda.threadIdx.x
    norm = F_HEAD + (meta[F_NOPS] - 1) * OP_WIDTH
    move = norm - OP_WIDTH
    prm = _word(meta, head, norm + NORM_PARAMS)
    src = _word(meta, head, F_HEAD + PUT_SRC)
    hidden = _word(meta, head, prm + NORM_HIDDEN)
    residual = _word(meta, head, prm + NORM_RESIDUAL)
    units = _word(meta, head, move + MOVE_BYTES) // (ITEMS * LL_ITEM)
    g = block * cuda.blockDim.x + tid
    stride = blocks_per_rank * cuda.blockDim.x
    epoch = load_i64(counter)
    tag = ll_tag(epoch)
    odd = epoch & 1
    lo0, hi0 = np.int64(0), np.int64(0)  # the thread's first unit, kept for its sum
    u = g
    while u < units:
        lo, hi = _wire_unit(meta, head, prm, src, u, hidden)
        if u == g:
            lo0, hi0 = lo, hi
        for k in range(meta[F_NOPS] - 2):  # the PUTs, one per peer
            dst = _word(meta, head, F_HEAD + k * OP_WIDTH + PUT_DST + odd)
            store_volatile_v4_u32(dst + u * 16, (lo, tag, hi, tag))
        u += stride
    rank = meta[F_RANK]
    abort = meta[F_ABORT]
    out = _word(meta, head, norm + 1 + odd)  # the target, or the e4m3 output tensor
    if OUT_FP8:
        out = _word(meta, head, prm + SOURCE_WIDTH + EXTRA_OUT)
    nsrc = _word(meta, head, move + MOVE_NSRC)
    first = _word(meta, head, move + MOVE_SOURCES)
    u = g
    while u < units:
        mine0, mine1 = lo0, hi0
        if u != g:
            mine0, mine1 = _wire_unit(meta, head, prm, src, u, hidden)
        z = np.float32(0)
        v = (z, z, z, z, z, z, z, z)
        for q in range(nsrc):  # every rank's unit in rank order: one sum on every rank
            lo, hi = mine0, mine1
            if q != rank:
                entry = _source_of(meta, head, first, nsrc, q)
                unit = _word(meta, head, entry + SOURCE_ADDR + odd) + u * 16
                code, seen, lo, hi = _poll(unit, tag, timeout_ns, abort, -1)
                if code != 0:
                    _record(meta, head, code, _word(meta, head, entry + SOURCE_STEP), unit,
                            tag, seen, q, block)
                    status[0] = 1
            if q == 0:
                v = _decoded(lo, hi)
            else:
                v = _added(v, lo, hi)
        for j in range(ITEMS):
            t = u * ITEMS + j
            x = _item_of(v, j)
            if RESIDUAL:  # residual += sum, rounded to the element type, and kept
                at = residual + t * LL_ITEM
                r = _floats(load_u32(at), load_u32(at + 4), DT)
                n0, n1 = _words((x[0] + r[0], x[1] + r[1], x[2] + r[2], x[3] + r[3]), DT)
                store_u32(at, n0)
                store_u32(at + 4, n1)
                x = _floats(n0, n1, DT)
            _store_item(out, t, _apply4(x, np.float32(0), np.float32(0),
                                        _extras_item(meta, head, prm, t, hidden)))
        u += stride
    cuda.syncthreads()
    if tid == 0:
        store_i64(counter, epoch + 1)
'''


_RMS: dict = {}


def rms_norm_functions(hidden: int, eps: float) -> tuple:
    """(stat, finish, fn) of the built-in add + RMSNorm over rows of ``hidden`` (the residual
    add is the form's): the same float32 operations, in the same order, as
    ``fused._normalize``."""
    key = (int(hidden), float(np.float32(eps)))
    if key not in _RMS:
        h, e = np.float32(hidden), np.float32(eps)

        @cuda.jit(device=True)
        def square(v, w):
            return v * v

        @cuda.jit(device=True)
        def inverse_rms(total, peak):
            return np.float32(1) / np.float32(math.sqrt(total / h + e)), peak

        @cuda.jit(device=True)
        def scale(v, p, q, w):
            return v * p * w

        _RMS[key] = (square, inverse_rms, scale)
    return _RMS[key]


# the kernels; in the simulator each also hands the simulated ``cuda`` to the helpers' modules
_KERNELS = '''
@_kernel
def epilogue_oneshot(desc_ptr, nranks_in_launch, blocks_per_rank, timeout_ns, stride_words,
                     counters):
    _run(desc_ptr, nranks_in_launch, blocks_per_rank, timeout_ns, stride_words, counters, False)


@_kernel
def epilogue_oneshot_pdl(desc_ptr, nranks_in_launch, blocks_per_rank, timeout_ns,
                         stride_words, counters):
    griddep_launch_dependents()
    _run(desc_ptr, nranks_in_launch, blocks_per_rank, timeout_ns, stride_words, counters, True)
'''
_SIM_KERNELS = '''
@_kernel
def epilogue_oneshot(desc_ptr, nranks_in_launch, blocks_per_rank, timeout_ns, stride_words,
                     counters):
    with _simulated_helpers(cuda):
        _run(desc_ptr, nranks_in_launch, blocks_per_rank, timeout_ns, stride_words, counters,
             False)


@_kernel
def epilogue_oneshot_pdl(desc_ptr, nranks_in_launch, blocks_per_rank, timeout_ns,
                         stride_words, counters):
    with _simulated_helpers(cuda):
        griddep_launch_dependents()
        _run(desc_ptr, nranks_in_launch, blocks_per_rank, timeout_ns, stride_words, counters,
             True)
'''


_BUILT: dict = {}  # form key -> (kernel, PDL kernel, signature, name, form)
_BY_NAME: dict = {}


def _key(form: Form) -> tuple:
    return (id(form.fn), id(form.stat), id(form.finish), form.dtype, form.per_column,
            form.residual, form.stats, form.out_fp8, form.row_out, id(form.prologue), form.wire)


def kernels(form: Form) -> tuple:
    """(kernel, PDL kernel, signature) of ``form``, built once per form (its device functions
    compare by identity; the cache keeps them alive)."""
    key = _key(form)
    if key not in _BUILT:
        name = f"epilogue-{len(_BUILT)}"
        _BUILT[key] = (*_build(form), SIGNATURE, name, form)
        _BY_NAME[name] = _BUILT[key]
    return _BUILT[key][:3]


def kernel_name(form: Form) -> str:
    """The name a :class:`purlin.kernels.launch.Launcher` launches ``form``'s kernels by."""
    kernels(form)
    return _BUILT[_key(form)][3]


def by_name(name: str) -> tuple:
    """The (kernel, PDL kernel, signature) of :func:`kernel_name`'s ``name``."""
    return _BY_NAME[name][:3]


# ---- the standalone kernels: the same form on a tensor another kernel has already reduced
#
# Where the one-shot kernel does not run (a size beyond LL, a strategy that is not one shot,
# rows that are not whole chunks), the all-reduce runs on its own path and then one launch per
# device applies the form to each rank's output (``epilogue_apply``), or, before it, the
# prologue to each rank's input (``prologue_apply``). Rank slot ``s`` of a launch reads its
# table -- the words ``A_*`` -- at ``desc_ptr + s * stride_words * 8``. A row is one block's:
# pass 1 adds the residual and sums ``stat`` over the row's items, pass 2 reads them back and
# stores ``fn``'s results; per element, a grid-stride loop over the items.

A_TARGET = 0  # the values: the all-reduce's output (the prologue's: the rank's input)
A_RESIDUAL = 1  # residual address (or 0)
A_OUT = 2  # where y goes: the target, an output tensor, or e4m3 bytes (OUT_FP8)
A_ROW_OUT = 3  # float32 per row (or 0)
A_ITEMS = 4  # 8-byte items of the tensor
A_ROW_ITEMS = 5  # items per row
A_EXTRAS = 6  # then one address per extra tensor
APPLY_WORDS = A_EXTRAS  # + the extras


def _item_source(form: Form) -> str:
    """``_extras_items(head, i, j)``: the extras' items for item ``i`` (column item ``j``)."""
    load = "\n".join(
        f"    u{k} = load_i64(head + (A_EXTRAS + {k}) * 8) + {'j' if col else 'i'} * LL_ITEM\n"
        f"    e{k} = _floats(load_u32(u{k}), load_u32(u{k} + 4), DT)"
        for k, col in enumerate(form.per_column)) or "    pass"
    names = "".join(f"e{k}, " for k in range(len(form.per_column)))
    return f"""
@device
def _extras_items(head, i, j):
{load}
    return ({names})
"""


_APPLY = '''
@device
def _summed(target, residual, i):
    """Item ``i``'s values: the target's, plus the residual's (rounded and stored back)."""
    at = target + i * LL_ITEM
    v = _floats(load_u32(at), load_u32(at + 4), DT)
    if RESIDUAL:
        at = residual + i * LL_ITEM
        r = _floats(load_u32(at), load_u32(at + 4), DT)
        n0, n1 = _words((v[0] + r[0], v[1] + r[1], v[2] + r[2], v[3] + r[3]), DT)
        store_u32(at, n0)
        store_u32(at + 4, n1)
        v = _floats(n0, n1, DT)
    return v


@device
def _apply_run(desc_ptr, nranks_in_launch, blocks_per_rank, stride_words):
    slot = 0 if nranks_in_launch == 1 else cuda.blockIdx.x // blocks_per_rank
    if slot >= nranks_in_launch:
        return
    block = cuda.blockIdx.x - slot * blocks_per_rank
    head = desc_ptr + slot * stride_words * 8
    tid = cuda.threadIdx.x
    nthreads = cuda.blockDim.x
    target = load_i64(head + A_TARGET * 8)
    residual = load_i64(head + A_RESIDUAL * 8)
    out = load_i64(head + A_OUT * 8)
    items = load_i64(head + A_ITEMS * 8)
    row_items = load_i64(head + A_ROW_ITEMS * 8)
    if not ROW:
        i = block * nthreads + tid
        while i < items:
            e = _extras_items(head, i, np.int64(np.uint32(i) % np.uint32(row_items)))
            _store_item(out, i, _apply4(_summed(target, residual, i), np.float32(0),
                                        np.float32(0), e))
            i += blocks_per_rank * nthreads
        return
    row = np.int64(block)
    rows = items // row_items
    while row < rows:
        first = row * row_items
        s = np.float32(0)
        m = np.float32(-math.inf)
        j = np.int64(tid)
        while j < row_items:
            t, u = _stat4(_summed(target, residual, first + j),
                          _extras_items(head, first + j, j))
            s += t
            m = max(m, u)
            j += nthreads
        total = _sum_block(s, tid, nthreads)
        peak = total
        if STATS == 2:
            peak = _max_block(m, tid, nthreads)
        p, q = _finish(total, peak)
        if ROW_OUT and tid == 0:
            store_u32(load_i64(head + A_ROW_OUT * 8) + row * 4, f32_to_bits(q))
        values = residual if RESIDUAL else target
        j = np.int64(tid)
        while j < row_items:
            i = first + j
            at = values + i * LL_ITEM
            _store_item(out, i, _apply4(_floats(load_u32(at), load_u32(at + 4), DT), p, q,
                                        _extras_items(head, i, j)))
            j += nthreads
        row += blocks_per_rank


@device
def _prologue_run(desc_ptr, nranks_in_launch, blocks_per_rank, stride_words):
    slot = 0 if nranks_in_launch == 1 else cuda.blockIdx.x // blocks_per_rank
    if slot >= nranks_in_launch:
        return
    block = cuda.blockIdx.x - slot * blocks_per_rank
    head = desc_ptr + slot * stride_words * 8
    target = load_i64(head + A_TARGET * 8)
    items = load_i64(head + A_ITEMS * 8)
    row_items = load_i64(head + A_ROW_ITEMS * 8)
    i = block * cuda.blockDim.x + cuda.threadIdx.x
    while i < items:
        at = target + i * LL_ITEM
        y = _prologue4(_floats(load_u32(at), load_u32(at + 4), DT),
                       _extras_items(head, i, np.int64(np.uint32(i) % np.uint32(row_items))))
        n0, n1 = _words(y, DT)
        store_u32(at, n0)
        store_u32(at + 4, n1)
        i += blocks_per_rank * cuda.blockDim.x
'''

# (desc_ptr, nranks_in_launch, blocks_per_rank, timeout_ns, stride_words, counters): the
# fused kernels' signature, so one Launcher launches them; timeout and counters unused. PDL:
# the values are the kernel before's output, so the wait comes before any read.
_APPLY_KERNELS = '''
@_kernel
def epilogue_apply(desc_ptr, nranks_in_launch, blocks_per_rank, timeout_ns, stride_words,
                   counters):
    with _helpers(cuda):
        _apply_run(desc_ptr, nranks_in_launch, blocks_per_rank, stride_words)


@_kernel
def epilogue_apply_pdl(desc_ptr, nranks_in_launch, blocks_per_rank, timeout_ns, stride_words,
                       counters):
    griddep_launch_dependents()
    griddep_wait()
    with _helpers(cuda):
        _apply_run(desc_ptr, nranks_in_launch, blocks_per_rank, stride_words)


@_kernel
def prologue_apply(desc_ptr, nranks_in_launch, blocks_per_rank, timeout_ns, stride_words,
                   counters):
    with _helpers(cuda):
        _prologue_run(desc_ptr, nranks_in_launch, blocks_per_rank, stride_words)


@_kernel
def prologue_apply_pdl(desc_ptr, nranks_in_launch, blocks_per_rank, timeout_ns, stride_words,
                       counters):
    griddep_launch_dependents()
    griddep_wait()
    with _helpers(cuda):
        _prologue_run(desc_ptr, nranks_in_launch, blocks_per_rank, stride_words)
'''


def _build_apply(form: Form) -> dict:
    """The standalone kernels of ``form``: name -> (kernel, PDL kernel)."""
    space = dict(globals(), DT=form.dtype, FN=form.fn, STAT=form.stat, FINISH=form.finish,
                 RESIDUAL=form.residual, ROW=form.stat is not None, STATS=form.stats,
                 OUT_FP8=form.out_fp8, ROW_OUT=form.row_out, PRO=form.prologue,
                 PROLOGUE=form.prologue is not None)
    source = _APPLY_KERNELS
    if not SIMULATOR:  # (the ``with`` is the simulator's: see _simulated_helpers)
        source = source.replace("    with _helpers(cuda):\n        ", "    ")
    space["_helpers"] = _simulated_helpers
    exec(compile(_source(form) + _item_source(form) + _RUN + _APPLY + source,
                 f"<epilogue apply {getattr(form.fn, '__name__', 'fn')}>", "exec"), space)
    return {"apply": (space["epilogue_apply"], space["epilogue_apply_pdl"]),
            "prologue": (space["prologue_apply"], space["prologue_apply_pdl"])}


_APPLIED: dict = {}  # form key -> {"apply": ..., "prologue": ...}


def apply_kernels(form: Form, prologue: bool = False) -> tuple:
    """(kernel, PDL kernel, signature) of ``form``'s standalone epilogue (``prologue``: its
    prologue) on an already reduced tensor, built once per form."""
    key = _key(form)
    if key not in _APPLIED:
        _APPLIED[key] = _build_apply(form)
    return (*_APPLIED[key]["prologue" if prologue else "apply"], SIGNATURE)


def apply_kernel_name(form: Form, prologue: bool = False) -> str:
    """The Launcher name of :func:`apply_kernels` (``by_name`` finds it)."""
    name = f"{kernel_name(form)}-{'prologue' if prologue else 'apply'}"
    if name not in _BY_NAME:
        _BY_NAME[name] = (*apply_kernels(form, prologue), name, form)
    return name


__all__ = ["A_EXTRAS", "A_ITEMS", "A_OUT", "A_RESIDUAL", "A_ROW_ITEMS", "A_ROW_OUT", "A_TARGET",
           "E4M3_MAX", "Form", "apply_kernel_name", "apply_kernels", "by_name", "f32_to_e4m3",
           "kernel_name", "kernels"]
_codes = (BF16, F16, F_DTYPE, NORM_HIDDEN)  # (isa codes the forms' dtypes are)
