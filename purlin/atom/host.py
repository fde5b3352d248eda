"""The instruction tables run on host memory by Python threads: lowering checked end to end.

The CUDA simulator runs one block after another, so it cannot run two ranks that wait on each
other. This interpreter can: one thread per (rank, lane) runs the rows of ``isa.py`` --
COPY, REDUCE, NOTIFY, WAIT, LL_PUT, LL_GET -- on real host addresses (numpy buffers), each rank
driven call after call by its own thread, so ranks drift apart across calls as GPUs do. It
checks what the lowering computed (addresses, counts, flag targets, parities, LL tags), not
GPU memory ordering. One block per lane, or several (each its share of the data rows and its
own NOTIFY adds and WAITs, one of them made slow), which checks the lane barriers too.

>>> import numpy as np
>>> from purlin.snac import plan
>>> from purlin.spec import collectives, reference
>>> s = plan(collectives.all_reduce(2), "direct-push", count=8)
>>> bufs = HostBuffers(s, ll=True)
>>> xs = [[np.arange(8.0) + r for r in range(2)] for call in range(3)]
>>> outs = run_calls(bufs.lower(), bufs, xs)
>>> all(np.allclose(outs[c][r], reference(s.sizing, xs[c])[r]) for c in range(3) for r in range(2))
True
"""

from __future__ import annotations

import ctypes
import threading
import time

import numpy as np

from purlin.errors import PurlinTimeoutError
from purlin.kernels import isa

_NP = {isa.F32: np.float32, isa.F64: np.float64, isa.I32: np.int32, isa.F16: np.float16}
_FP8 = {isa.E4M3: "float8_e4m3fn", isa.E5M2: "float8_e5m2"}  # held as their bits
_NP.update({code: np.uint8 for code in _FP8})


def _bytes(addr: int, nbytes: int) -> np.ndarray:
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(addr)) if nbytes else \
        np.zeros(0, np.uint8)


def bf16_bits(x) -> np.ndarray:
    """Values as bfloat16 bits (uint16), rounded to nearest even as the GPU converts.

    >>> bf16_bits([1.0, 1.00390625, -2.0]).tolist()
    [16256, 16256, 49152]
    """
    b = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)


def bf16_floats(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bits (uint16) as float32 values."""
    return (np.asarray(bits).astype(np.uint32) << 16).view(np.float32)


def _load(addr: int, count: int, code: int) -> np.ndarray:
    raw = _bytes(addr, count * isa.ITEMSIZE[code])
    if code == isa.BF16:
        return bf16_floats(raw.view(np.uint16))
    if code in _FP8:
        from purlin.spec.dtypes import fp8_decode

        return fp8_decode(raw, _FP8[code])  # float32, exact
    return raw.view(_NP[code]).astype(np.int64 if code == isa.I32 else np.float64)


def _store(addr: int, values: np.ndarray, code: int) -> None:
    raw = _bytes(addr, len(values) * isa.ITEMSIZE[code])
    if code == isa.BF16:
        raw.view(np.uint16)[:] = bf16_bits(values)
    elif code in _FP8:  # one rounding from the float32 sum, as purlin.kernels.fp8 does
        from purlin.spec.dtypes import fp8_encode

        fp8_encode(np.asarray(values, np.float32), _FP8[code], out=raw)
    elif code == isa.I32:
        raw.view(np.int32)[:] = (np.asarray(values, np.int64) & 0xFFFFFFFF).astype(
            np.uint32).view(np.int32)
    else:
        raw.view(_NP[code])[:] = values


class _Memory:
    """Flags and LL units shared by every thread: one lock, one condition."""

    def __init__(self, timeout: float):
        self.cond = threading.Condition()
        self.timeout = timeout

    def add(self, addr: int, value: int) -> None:
        with self.cond:
            cell = ctypes.c_int64.from_address(addr)
            cell.value += value
            self.cond.notify_all()

    def wait(self, addr: int, target: int, what: str) -> None:
        cell = ctypes.c_int64.from_address(addr)
        with self.cond:
            if not self.cond.wait_for(lambda: cell.value >= target, self.timeout):
                raise PurlinTimeoutError(f"{what}: waited for {target}, saw {cell.value}")

    def ll_put(self, dst: int, data: bytes, tag: int) -> None:
        from purlin.kernels.sim import ll_pack

        units = ll_pack(data, tag)
        with self.cond:
            _bytes(dst, units.nbytes)[:] = units.view(np.uint8).ravel()
            self.cond.notify_all()

    def ll_put_half(self, dst: int, data: bytes, tag: int) -> None:
        """4 data bytes as one 8-byte (data, tag) half of an LL unit (the other half is
        another item's)."""
        with self.cond:
            _bytes(dst, 8)[:] = np.array([int.from_bytes(data, "little"), tag],
                                         np.uint32).view(np.uint8)
            self.cond.notify_all()

    def ll_get_half(self, src: int, tag: int, what: str) -> bytes:
        view = _bytes(src, 8).view(np.uint32)
        with self.cond:
            if not self.cond.wait_for(lambda: bool(view[1] == tag), self.timeout):
                raise PurlinTimeoutError(f"{what}: an LL half never carried tag {tag}")
            return view[:1].tobytes()

    def ll_get(self, src: int, nbytes: int, tag: int, what: str) -> bytes:
        n = (nbytes + isa.LL_DATA - 1) // isa.LL_DATA
        view = _bytes(src, n * isa.LL_UNIT).view(np.uint32).reshape(n, 4)
        with self.cond:
            if not self.cond.wait_for(lambda: bool(((view[:, 1] == tag) & (view[:, 3] == tag))
                                                   .all()), self.timeout):
                raise PurlinTimeoutError(f"{what}: LL units never all carried tag {tag}")
            data = np.stack([view[:, 0], view[:, 2]], axis=1).astype(np.uint32)
        return data.view(np.uint8).ravel().tobytes()[:nbytes]


def _reduce(values, redop: int, divisor: int, code: int) -> np.ndarray:
    """The reduction of the loaded ``values`` as the kernels compute it: sources one after
    another in row (pool) order, bfloat16, float16 and float32 accumulated in float32, rounded
    once on the store; avg divides the sum, int32 truncating toward zero."""
    acc_type = np.float32 if code in (isa.BF16, isa.F16, isa.F32, *_FP8) else values[0].dtype
    out = np.array(values[0], dtype=acc_type)
    combine = np.maximum if redop == isa.MAX else np.minimum if redop == isa.MIN else np.add
    for v in values[1:]:
        combine(out, v.astype(acc_type, copy=False), out=out)
    if redop == isa.AVG:
        out = (np.where(out < 0, -(-out // divisor), out // divisor) if code == isa.I32
               else out / divisor)
    return out


def _mine(count: int, item: int, block: int, blocks: int) -> np.ndarray:
    """The element indices block ``block`` of ``blocks`` owns: those of every ``blocks``-th
    16-byte unit of the row (as the executor's grid-stride loops give a unit to one thread),
    so two rows over the same aligned region give each block the same elements."""
    per_unit = max(1, 16 // item)
    idx = np.arange(count)
    return idx[(idx // per_unit) % blocks == block]


def _ll_units(nbytes: int, block: int, blocks: int):
    """(first byte, bytes) of the LL units (LL_DATA bytes each) block ``block`` moves: all of
    them in one piece for one block, else every ``blocks``-th unit, as the lane's threads
    share them on the GPU."""
    if blocks == 1:
        return [(0, nbytes)] if nbytes else []
    return [(first, min(isa.LL_DATA, nbytes - first))
            for first in range(block * isa.LL_DATA, nbytes, blocks * isa.LL_DATA)]


def _run_lane(rows, pool, epoch, mem: _Memory, rank: int, block: int = 0, blocks: int = 1,
              delay: float = 0.0) -> None:
    """One block of a lane: its share of every COPY / REDUCE row, its own NOTIFY adds (a
    NOTIFY adds VALUE per block, as on the GPU) and its own WAITs; ``delay`` seconds of sleep
    before each data row make it a slow block."""
    tag = epoch % isa.LL_TAG_MOD + 1  # this call's LL tag (atoms.ll_tag on the GPU)
    for row in rows:
        op, code, count = int(row[isa.OP]), int(row[isa.DTYPE]), int(row[isa.COUNT])
        item = isa.ITEMSIZE.get(code, 1)
        nbytes = count * item
        what = f"rank {rank} step {int(row[isa.STEP])}"
        if op in (isa.COPY, isa.REDUCE) and delay:
            time.sleep(delay)
        if op == isa.COPY:
            if blocks == 1:
                ctypes.memmove(int(row[isa.DST]), int(pool[row[isa.SRC]]), nbytes)
            else:
                mine = _mine(count, item, block, blocks)
                src = _bytes(int(pool[row[isa.SRC]]), nbytes).reshape(count, item)
                dst = _bytes(int(row[isa.DST]), nbytes).reshape(count, item)
                dst[mine] = src[mine]
        elif op == isa.REDUCE:
            srcs = [int(a) for a in pool[row[isa.SRC]: row[isa.SRC] + row[isa.NSRC]]]
            out = _reduce([_load(a, count, code) for a in srcs], int(row[isa.REDOP]),
                          int(row[isa.DIVISOR]), code)
            if blocks == 1:
                _store(int(row[isa.DST]), out, code)
            else:  # encode all, write only this block's elements
                tmp = np.zeros(nbytes, np.uint8)
                _store(tmp.ctypes.data, out, code)
                mine = _mine(count, item, block, blocks)
                dst = _bytes(int(row[isa.DST]), nbytes).reshape(count, item)
                dst[mine] = tmp.reshape(count, item)[mine]
        elif op == isa.NOTIFY:
            mem.add(int(row[isa.FLAG]), int(row[isa.VALUE]))
        elif op == isa.WAIT:
            target = ((epoch + int(row[isa.EPOCH_OFFSET])) * int(row[isa.PER_CALL])
                      + int(row[isa.VALUE]))
            if target > 0:
                mem.wait(int(row[isa.FLAG]), target, what)
        elif op == isa.LL_PUT:  # this block's units: every ``blocks``-th one
            for first, size in _ll_units(nbytes, block, blocks):
                mem.ll_put(int(row[isa.DST]) + first // isa.LL_DATA * isa.LL_UNIT,
                           _bytes(int(pool[row[isa.SRC]]) + first, size).tobytes(), tag)
        elif op == isa.LL_GET:
            for first, size in _ll_units(nbytes, block, blocks):
                data = mem.ll_get(int(pool[row[isa.SRC]]) + first // isa.LL_DATA * isa.LL_UNIT,
                                  size, tag, what)
                _bytes(int(row[isa.DST]) + first, size)[:] = np.frombuffer(data, np.uint8)


class HostBuffers:
    """Every rank's input, output, scratch (+ LL area) and flags as numpy memory, sized for
    ``schedule``; :meth:`lower` lowers the schedule onto them."""

    def __init__(self, schedule, ll: bool = False):
        from purlin.atom.lowering import flag_slots, ll_area_bytes, scratch_copy_bytes

        self.schedule, self.ll = schedule, ll
        n = schedule.nranks
        self.code = isa.DTYPE_CODES[schedule.dtype]
        # the device representation: bfloat16 as its 16 raw bits
        self.np_dtype = np.dtype(np.uint16 if self.code == isa.BF16 else _NP[self.code])
        self.scratch_bytes = scratch_copy_bytes(schedule)  # as the sm datapath allocates
        self.inputs = [np.zeros(max(schedule.sizing.input_count(r), 1), self.np_dtype)
                       for r in range(n)]
        self.outputs = [np.zeros(max(schedule.sizing.output_count(r), 1), self.np_dtype)
                        for r in range(n)]
        self.scratch = [np.zeros(self.scratch_bytes[r] * schedule.scratch_copies + 16, np.uint8)
                        for r in range(n)]
        self.ll_areas = [np.zeros(ll_area_bytes(self.scratch_bytes[r])
                                  * schedule.scratch_copies if ll else 16, np.uint8)
                         for r in range(n)]
        self.flags = [np.zeros(flag_slots(n, schedule.lanes), np.int64) for r in range(n)]

    def lower(self, blocks_per_lane: int = 1):
        from purlin.atom.lowering import lower

        n = self.schedule.nranks
        bases = {}
        for r in range(n):
            bases[(r, "input")] = self.inputs[r].ctypes.data
            bases[(r, "output")] = self.outputs[r].ctypes.data
            bases[(r, "scratch")] = self.scratch[r].ctypes.data
        return lower(self.schedule, bases, {r: self.flags[r].ctypes.data for r in range(n)},
                     blocks_per_lane=blocks_per_lane, scratch_bytes=self.scratch_bytes,
                     ll_bases={r: self.ll_areas[r].ctypes.data for r in range(n)}
                     if self.ll else None)


def run_calls(lowered, buffers: HostBuffers, inputs_per_call, timeout: float = 10.0,
              blocks_per_lane: int = 1, slow_block_delay: float = 0.0):
    """Run ``len(inputs_per_call)`` calls: each rank's own thread writes its input of call k,
    runs the call (a thread per lane and block) and keeps a copy of its output, then goes on,
    so ranks drift apart as GPUs do. Returns outputs[call][rank]; raises the first error.

    ``blocks_per_lane`` must be what the tables were lowered for; with ``slow_block_delay``
    the last block of every lane of rank 0 sleeps that long before each data row, so its
    other blocks, and the ranks waiting for it, run ahead as far as the flags let them (what
    exposes a missing lane barrier)."""
    mem = _Memory(timeout)
    errors: list = []

    def delay(rank: int, block: int) -> float:  # rank 0's last block is the slow one
        slow = rank == 0 and block == blocks_per_lane - 1 and blocks_per_lane > 1
        return slow_block_delay if slow else 0.0

    def workers(rank: int, call: int) -> list:
        low = lowered[rank]
        table = low.tables[call % len(low.tables)]
        return [threading.Thread(target=_lane_guard, args=(
            table[low.lane_offsets[lane]: low.lane_offsets[lane + 1]], low.srcs, call, mem,
            rank, errors, b, blocks_per_lane, delay(rank, b)))
            for lane in range(len(low.lane_offsets) - 1) for b in range(blocks_per_lane)]

    return _run_ranks(buffers, inputs_per_call, workers, errors, timeout)


def _run_ranks(buffers: HostBuffers, inputs_per_call, workers, errors: list, timeout: float):
    """A thread per rank runs its calls in turn: writes its input of call k, starts and joins
    ``workers(rank, k)`` (threads), keeps its output; ranks drift apart as GPUs do. Returns
    outputs[call][rank]; raises the first error in ``errors``."""
    n = buffers.schedule.nranks
    calls = len(inputs_per_call)
    outputs = [[None] * n for _ in range(calls)]

    def rank_thread(rank: int) -> None:
        try:
            for call in range(calls):
                x = np.asarray(inputs_per_call[call][rank], dtype=np.float64)
                _store(buffers.inputs[rank].ctypes.data, x, buffers.code)
                threads = workers(rank, call)
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                if errors:
                    return
                outputs[call][rank] = _load(buffers.outputs[rank].ctypes.data,
                                            buffers.schedule.sizing.output_count(rank),
                                            buffers.code).astype(np.float64)
        except Exception as exc:  # noqa: BLE001 - reported to the caller
            errors.append(exc)

    threads = [threading.Thread(target=rank_thread, args=(r,)) for r in range(n)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 5 + (time.monotonic() - t0))
    if errors:
        raise errors[0]
    return outputs


def _lane_guard(rows, pool, epoch, mem, rank, errors, block=0, blocks=1, delay=0.0) -> None:
    try:
        _run_lane(rows, pool, epoch, mem, rank, block, blocks, delay)
    except Exception as exc:  # noqa: BLE001 - reported to the caller
        errors.append(exc)
        with mem.cond:
            mem.cond.notify_all()


# -- fused programs ---------------------------------------------------------------------------


def fused_programs(lowered, buffers: HostBuffers, unit: int = 16, epilogues=None,
                   threads: int = 1, segments: bool = True):
    """The fused programs (``purlin.atom.fused``, ``unit`` bytes per thread at a time) of
    ``lowered`` on ``buffers`` (one a rank, or one a (rank, lane) for several lanes, rank by
    rank), with a flag slot per block (``buffers.block_flags``) and a
    throw-away error record and abort word; ``epilogues[r]``: rank r's
    :class:`purlin.atom.fused.Epilogue` for blocks of ``threads`` threads, if any;
    segmented ops where the sm datapath makes them (``fused_rows.several_pieces``,
    ``fused_rows.joined``), unless ``segments=False``: then the rotated rows, none
    segmented (``fused_rows.cluster_programs``: what the ``fused`` kernel runs)."""
    from purlin.atom.fused import program

    buffers.block_flags = [np.zeros(f.size * isa.F_MAX_BLOCKS, np.int64) for f in buffers.flags]
    buffers.fused_error = np.zeros(isa.ERR_WIDTH, np.int64)
    buffers.fused_abort = np.zeros(1, np.int64)

    def flag_slot(address: int) -> int:
        for r, f in enumerate(buffers.flags):
            if 0 <= address - f.ctypes.data < f.nbytes:
                index = (address - f.ctypes.data) // 8
                return buffers.block_flags[r].ctypes.data + index * isa.F_MAX_BLOCKS * 8
        raise ValueError(f"0x{address:x} is no flag of these buffers")

    if not epilogues:  # (the programs the sm datapath runs: purlin.atom.fused_rows)
        from purlin.atom.fused_rows import cluster_programs, several_pieces

        return [p.words for p in cluster_programs(
            lowered, lambda r: buffers.fused_error.ctypes.data,
            buffers.fused_abort.ctypes.data, flag_slot, unit,
            segments=segments and several_pieces(buffers.schedule), join=segments)]
    return [program(low, buffers.fused_error.ctypes.data, buffers.fused_abort.ctypes.data,
                    flag_slot, unit, epilogue=(epilogues or {}).get(low.rank),
                    threads=threads).words for low in lowered]


def _items(count: int, block: int, blocks: int, threads: int, rotation: int = 0) -> list[int]:
    """Which of a row's ``count`` items (a MOVE's: :func:`_row_items`) block ``block`` takes:
    item i goes to thread ``(i + rotation) % (blocks * threads)`` of the rank's grid, as in
    the fused kernel."""
    return [i for i in range(count) if ((i + rotation) % (blocks * threads)) // threads == block]


def _tail(data: bytes, valid: int, unit: int) -> bytes:
    """An item's first ``valid`` bytes, padded to ``unit`` (the kernel reads the whole aligned
    item; its bytes past the row are never used)."""
    return bytes(data[:valid]) + bytes(unit - valid) if valid < unit else bytes(data)


def _run_fused_block(words, epoch, mem: _Memory, rank: int, block: int, blocks: int,
                     threads: int, delay: float) -> None:
    """One block of a fused program for call ``epoch``: its items of every PUT and MOVE, its
    own slot of every flag."""
    head = words
    tag = epoch % isa.LL_TAG_MOD + 1
    odd = epoch & 1
    code, redop, divisor = (int(head[isa.F_DTYPE]), int(head[isa.F_REDOP]),
                            int(head[isa.F_DIVISOR]))
    unit = int(head[isa.F_UNIT])  # bytes per item; an item's LL units start 2 * unit apart
    for k in range(int(head[isa.F_NOPS])):
        op = [int(x) for x in head[isa.F_HEAD + k * isa.OP_WIDTH:][:isa.OP_WIDTH]]
        what = f"rank {rank} block {block} op {k}"
        kind = op[isa.OP_KIND]
        if kind == isa.F_OP_WAIT:
            target = (epoch + op[isa.WAIT_EPOCH_OFFSET]) * op[isa.WAIT_PER_CALL] + \
                op[isa.WAIT_VALUE]
            if target > 0:
                mem.wait(op[isa.WAIT_SLOT] + 8 * block, target, what)
        elif kind == isa.F_OP_NOTIFY:
            mem.add(op[isa.NOTIFY_SLOT] + 8 * block, op[isa.NOTIFY_VALUE])
        elif kind == isa.F_OP_NORM:
            _norm_block(head, op, tag, mem, block, blocks, threads, unit, code, what)
        elif kind == isa.F_OP_PUT:
            _put_items(op, _items(-(-op[isa.PUT_BYTES] // unit), block, blocks, threads,
                                  op[isa.PUT_ROTATE]), mem, unit, odd, tag)
        elif kind in (isa.F_OP_PUTS, isa.F_OP_MOVES):
            if delay and kind == isa.F_OP_MOVES:
                time.sleep(delay)
            for rec, mine in _segment_items(head, op, unit, block, blocks, threads):
                if kind == isa.F_OP_PUTS:
                    _put_items(rec, mine, mem, unit, odd, tag)
                else:
                    _move_items(head, rec, mine, mem, unit, odd, tag, code, redop, divisor,
                                what)
        else:
            if delay:
                time.sleep(delay)
            _move_items(head, op, _items(_row_items(op, unit, odd), block, blocks, threads,
                                         op[isa.MOVE_ROTATE]), mem, unit, odd, tag, code, redop,
                        divisor, what)


def _segment_items(head, op, unit: int, block: int, blocks: int, threads: int) -> list:
    """[(segment record, its items block ``block`` takes)] of a segmented op: item u of the
    union goes to thread ``(u + rotation) % (blocks * threads)``, and segment s holds the
    union's items from its record's first item on (``isa.SEG_*``)."""
    kind = op[isa.OP_KIND]
    first_word = isa.PUT_ROTATE if kind == isa.F_OP_PUTS else isa.MOVE_ROTATE
    bytes_word = isa.PUT_BYTES if kind == isa.F_OP_PUTS else isa.MOVE_BYTES
    union = _items(op[isa.SEG_ITEMS], block, blocks, threads, op[isa.SEG_ROTATE])
    out = []
    for s in range(op[isa.SEG_COUNT]):
        at = op[isa.SEG_TABLE] + s * isa.OP_WIDTH
        rec = [int(x) for x in head[at: at + isa.OP_WIDTH]]
        start = rec[first_word]
        n = _row_items(rec, unit) if kind == isa.F_OP_MOVES else -(-rec[bytes_word] // unit)
        out.append((rec, [u - start for u in union if start <= u < start + n]))
    return out


def _row_items(op, unit: int, odd: int = 0) -> int:
    """Items of a MOVE's words on an even or ``odd`` call (``purlin.atom.fused.row_items``:
    a copy cut at its destination's 16-byte boundaries has the destination's slots)."""
    from purlin.atom.fused import row_items

    return row_items(op[isa.MOVE_BYTES], unit, op[isa.MOVE_NARROW], op[isa.MOVE_DST + odd])


def _slot(op, i: int, unit: int, odd: int) -> tuple[int, int]:
    """(first byte in the row, bytes) of item ``i`` of a MOVE's words: ``unit`` bytes from
    ``unit * i`` (the last item maybe partial), or the part of the row in its
    destination's 16-byte slot ``i`` for a copy cut at its boundaries."""
    nbytes = op[isa.MOVE_BYTES]
    if not op[isa.MOVE_NARROW] & isa.NARROW_SHIFT:
        return unit * i, min(unit, nbytes - unit * i)
    skew = op[isa.MOVE_DST + odd] & 15
    lo = max(0, 16 * i - skew)
    return lo, min(nbytes, 16 * (i + 1) - skew) - lo


def _put_items(op, items, mem: _Memory, unit: int, odd: int, tag: int) -> None:
    """A PUT's ``items`` as LL units (4 bytes: half an LL unit)."""
    put = mem.ll_put_half if unit == 4 else mem.ll_put
    src, dst, nbytes = op[isa.PUT_SRC], op[isa.PUT_DST + odd], op[isa.PUT_BYTES]
    for i in items:
        valid = min(unit, nbytes - unit * i)
        put(dst + 2 * unit * i, _tail(_bytes(src + unit * i, valid).tobytes(), valid, unit), tag)


def _move_items(head, op, items, mem: _Memory, unit: int, odd: int, tag: int, code: int,
                redop: int, divisor: int, what: str) -> None:
    """A MOVE's ``items``: each source's (LL units polled by their tag), combined."""
    dst, nbytes = op[isa.MOVE_DST + odd], op[isa.MOVE_BYTES]
    nsrc, first = op[isa.MOVE_NSRC], op[isa.MOVE_SOURCES]
    sources = [[int(x) for x in head[first + s * isa.SOURCE_WIDTH:]
                [:isa.SOURCE_WIDTH]] for s in range(nsrc)]
    count = unit // isa.ITEMSIZE[code]
    for i in items:
        if nsrc == 1 and not sources[0][0]:  # a plain copy: its item's bytes (_slot)
            at, valid = _slot(op, i, unit, odd)
            src = sources[0][2] if odd else sources[0][1]
            _bytes(dst + at, valid)[:] = _bytes(src + at, valid)
            continue
        valid = min(unit, nbytes - unit * i)  # a scalar tail: the row's bytes only
        raw = []
        for is_ll, even, odd_at, _, _ in sources:
            at = (odd_at if odd else even)
            if is_ll and unit == 4:
                raw.append(mem.ll_get_half(at + 8 * i, tag, what))
            elif is_ll:
                raw.append(mem.ll_get(at + 2 * unit * i, unit, tag, what))
            else:
                raw.append(_tail(_bytes(at + unit * i, valid).tobytes(), valid, unit))
        if nsrc == 1:
            _bytes(dst + unit * i, valid)[:] = np.frombuffer(raw[0], np.uint8)[:valid]
            continue
        held = [np.frombuffer(x, np.uint8).copy() for x in raw]
        out = _reduce([_load(h.ctypes.data, count, code) for h in held], redop,
                      divisor, code)
        _store(dst + unit * i, out[:valid // isa.ITEMSIZE[code]], code)


def _norm_block(head, op, tag, mem: _Memory, block: int, blocks: int, threads: int,
                unit: int, code: int, what: str) -> None:
    """One block's share of a NORM op (the epilogue; see ``purlin.kernels.fused``): its chunks
    of ``threads * unit`` bytes get ``residual += result`` (rounded), each chunk's sum of
    squares goes to its row sums slot as an LL half with the call's tag; then, once every
    slot of a chunk's row carries the tag, ``result = rms_norm(residual) * weight``."""
    params = [int(x) for x in head[op[isa.NORM_PARAMS]:][:isa.SOURCE_WIDTH]]
    residual, weight, sums, hidden, eps_bits = (
        params[isa.NORM_RESIDUAL], params[isa.NORM_WEIGHT], params[isa.NORM_SUMS],
        params[isa.NORM_HIDDEN], params[isa.NORM_EPS])
    eps = np.array([eps_bits], np.uint32).view(np.float32)[0]
    item = isa.ITEMSIZE[code]
    chunk = threads * unit
    count = chunk // item  # elements per chunk
    per_row = op[isa.NORM_ROW_CHUNKS]  # (and its chunks: the program's, as the kernel reads)
    mine = range(block, op[isa.NORM_CHUNKS], blocks)
    target = op[isa.NORM_TARGET]
    for c in mine:
        r = _load(target + c * chunk, count, code).astype(np.float32) + \
            _load(residual + c * chunk, count, code).astype(np.float32)
        _store(residual + c * chunk, r, code)
        r = _load(residual + c * chunk, count, code).astype(np.float32)  # as rounded
        total = np.float32(np.sum(r * r, dtype=np.float32))
        mem.ll_put_half(sums + 16 * c, total.tobytes(), tag)
    for c in mine:
        first = c // per_row * per_row
        parts = [np.frombuffer(mem.ll_get_half(sums + 16 * (first + t), tag,
                                               f"{what} row sum {first + t}"), np.float32)[0]
                 for t in range(per_row)]
        inv = np.float32(1) / np.sqrt(np.float32(sum(parts)) / np.float32(hidden) + eps)
        r = _load(residual + c * chunk, count, code).astype(np.float32)
        start = c * chunk % (hidden * item)
        w = _load(weight + start, count, code).astype(np.float32)
        _store(target + c * chunk, r * inv * w, code)


def run_fused_calls(programs, buffers: HostBuffers, inputs_per_call, blocks: int = 2,
                    threads: int = 1, timeout: float = 10.0, slow_block_delay: float = 0.0,
                    slow_rank: int = 0):
    """:func:`run_calls` for fused programs (a rank's: those whose header names it, one a
    lane): a thread per (program, block), each rank's calls in turn, so ranks drift apart;
    with ``slow_block_delay`` rank ``slow_rank``'s last block sleeps before each MOVE, so its
    other blocks and the ranks that wait for it run ahead as far as their own flag slots let
    them. Returns outputs[call][rank]; raises the first error."""
    mem = _Memory(timeout)
    errors: list = []
    mine = {r: [w for w in programs if int(w[isa.F_RANK]) == r]
            for r in range(buffers.schedule.nranks)}

    def block_guard(words, rank, call, block):
        slow = rank == slow_rank and block == blocks - 1 and blocks > 1
        try:
            _run_fused_block(words, call, mem, rank, block, blocks, threads,
                             slow_block_delay if slow else 0.0)
        except Exception as exc:  # noqa: BLE001 - reported to the caller
            errors.append(exc)
            with mem.cond:
                mem.cond.notify_all()

    def workers(rank: int, call: int) -> list:
        return [threading.Thread(target=block_guard, args=(w, rank, call, b))
                for w in mine[rank] for b in range(blocks)]

    return _run_ranks(buffers, inputs_per_call, workers, errors, timeout)
