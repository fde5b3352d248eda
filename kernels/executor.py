"""The executor kernel: interprets the per-rank instruction table of ``isa.py``.

Details: the notes after the imports; the design: ARCHITECTURE.md, "Atom datapaths".
"""

from __future__ import annotations

import numpy as np
from numba import cuda

from purlin.kernels.atoms import copy_bytes, itemsize, ll_get, ll_put, ll_tag, reduce_row
from purlin.kernels.intrinsics import (atomic_add, atomic_cas, device, fence_system,
                                       globaltimer, griddep_launch_dependents, griddep_wait,
                                       launch_bounded, load_acquire, load_i64, red_release_add,
                                       store_i64)
from purlin.kernels.isa import (COPY, COUNT, D_ABORT, D_DONE, D_EPOCH, D_ERROR, D_LANES,
                                D_NLANES, D_RANK, D_SRCS, D_TABLE, D_TABLE_ODD, D_TRACE,
                                D_TRACE_ROWS, DESC_WIDTH, DIVISOR, DST, DTYPE, E_BLOCK, E_CODE,
                                E_EXPECTED, E_FLAG, E_LANE, E_PEER, E_RANK, E_SEEN, E_STEP,
                                E4M3, E5M2, EPOCH_OFFSET, ERR_ABORTED, ERR_TIMEOUT, FLAG, LL_GET,
                                LL_PUT, MAX_THREADS, NOTIFY, NSRC, OP,
                                PEER, PER_CALL, REDOP, REDUCE, ROW_WIDTH, SRC, STEP, TRACE_WIDTH,
                                VALUE, WAIT)

# How the executor runs a table:
#
# ``executor(desc_ptr, nranks_in_launch, blocks_per_lane, timeout_ns)``, all int64:
#
# * ``desc_ptr`` -- address of ``nranks_in_launch`` descriptors of ``DESC_WIDTH`` int64 each;
# * the grid is split evenly by rank: block ``b`` serves rank slot ``b // blocks_per_rank``,
#   lane ``(b % blocks_per_rank) // blocks_per_lane`` and sub-block ``b % blocks_per_lane``
#   (``blocks_per_rank = gridDim.x // nranks_in_launch``; every rank of a launch has the same
#   lane count, padded with empty lanes). Blocks whose lane has no rows only check in at the end;
# * ``timeout_ns`` -- how long one WAIT may spin before it records a timeout (must be > 0);
# * ``head_words`` -- for a one-rank launch whose descriptor starts a contiguous block of at least
#   that many int64 words (``purlin.atom.lowering.build_blob``), read them all at block start to
#   warm the L1; 0 for none.
#
# Thread 0 reads the rank's EPOCH once at block start; on odd epochs the rows come from
# ``D_TABLE_ODD`` (same lane offsets and source pool; 0 means "use D_TABLE"). Each block walks
# its lane's rows in order, with a ``syncthreads`` after every row. COPY and REDUCE split the
# elements over the lane's blocks x threads. NOTIFY: after that barrier, thread 0
# adds VALUE with a system-scope release, which is cumulative over the block's
# writes (each block of the lane adds separately). WAIT: thread 0 spins with acquire loads; on
# expiry it writes the error record, raises the shared ABORT word and the block leaves its
# rows; a block that sees ABORT while waiting leaves too, recording ``ERR_ABORTED`` if its rank
# has no record yet.
#
# LL_PUT / LL_GET (``isa``: flags inside the data): every thread of the lane stores, or polls
# and unpacks, its own 16-byte units; the tag is this call's ``epoch % LL_TAG_MOD + 1``; an LL_GET
# that times out records the units' address, the tag expected and the tag seen.
#
# Every block, finished or aborted, then adds one to DONE; the block that brings it to
# ``blocks_per_rank`` resets DONE to 0 and bumps EPOCH. After an error the host must reset the
# flags, EPOCH, ABORT and the error record before the next call (the flags no longer match).

SIGNATURE = "void(int64, int64, int64, int64, int64)"
SPINS_PER_CHECK = 64  # acquire loads between two looks at the clock and the ABORT word
WINDOW = 32           # table rows a block keeps in shared memory at a time (4 KiB)
WINDOW_WORDS = WINDOW * ROW_WIDTH
EPOCH_SLOT = 2  # shared-memory slot holding the epoch thread 0 read at block start


@device
def _get(addr, column):
    return load_i64(addr + column * 8)


@device
def _wait(flag, target, timeout_ns, abort):
    """Spin until the flag reaches ``target``: returns (0 | ERR_TIMEOUT | ERR_ABORTED, seen)."""
    seen = load_acquire(flag)
    if seen >= target:
        return 0, seen
    deadline = globaltimer() + timeout_ns
    spins = 0
    while True:
        seen = load_acquire(flag)
        if seen >= target:
            return 0, seen
        spins += 1
        if spins % SPINS_PER_CHECK == 0:
            if load_acquire(abort) != 0:
                return ERR_ABORTED, seen
            if globaltimer() > deadline:
                return ERR_TIMEOUT, seen


@device
def _record(desc, code, row, target, seen, lane, sub):
    """Claim the rank's error record (first writer wins) and fill it; raise ABORT on timeout."""
    err = _get(desc, D_ERROR)
    if atomic_cas(err + E_CODE * 8, 0, code) == 0:
        store_i64(err + E_RANK * 8, _get(desc, D_RANK))
        store_i64(err + E_STEP * 8, _get(row, STEP))
        store_i64(err + E_FLAG * 8, _get(row, FLAG))
        store_i64(err + E_EXPECTED * 8, target)
        store_i64(err + E_SEEN * 8, seen)
        store_i64(err + E_LANE * 8, lane)
        store_i64(err + E_BLOCK * 8, sub)
        store_i64(err + E_PEER * 8, _get(row, PEER))
    if code == ERR_TIMEOUT:
        fence_system()
        red_release_add(_get(desc, D_ABORT), 1)


@device
def _one_source(desc, rows, base):
    """(bytes, source address) of a one-source row (COPY, LL_PUT, LL_GET)."""
    nbytes = rows[base + COUNT] * itemsize(rows[base + DTYPE])
    return nbytes, load_i64(_get(desc, D_SRCS) + rows[base + SRC] * 8)


@device
def _run_row(desc, row, rows, base, epoch, lane, sub, tid, lane_tid, lane_threads, timeout_ns,
             fp8):
    """Execute one row, read from the block's shared copy ``rows[base:base + ROW_WIDTH]``
    (``row`` is its global address, for error records); returns a nonzero error code when the
    block must leave."""
    op = rows[base + OP]
    if op == COPY:
        nbytes, src = _one_source(desc, rows, base)
        copy_bytes(rows[base + DST], src, nbytes, lane_tid, lane_threads)
    elif op == REDUCE:
        pool = _get(desc, D_SRCS) + rows[base + SRC] * 8
        reduce_row(rows[base + DST], pool, rows[base + NSRC], rows[base + COUNT],
                   rows[base + DTYPE], rows[base + REDOP], rows[base + DIVISOR], lane_tid,
                   lane_threads, fp8)
    elif op == LL_PUT:
        nbytes, src = _one_source(desc, rows, base)
        ll_put(rows[base + DST], src, nbytes, ll_tag(epoch), lane_tid, lane_threads)
    elif op == LL_GET:
        nbytes, src = _one_source(desc, rows, base)
        tag = ll_tag(epoch)
        code, seen = ll_get(rows[base + DST], src, nbytes, tag, lane_tid, lane_threads,
                            timeout_ns, _get(desc, D_ABORT))
        if code != 0:
            _record(desc, code, row, tag, seen, lane, sub)
            return code
    elif op == NOTIFY:
        # the barrier after the previous row ordered every thread's writes before this
        # release, and a release at system scope is cumulative: no separate fence is needed
        if tid == 0:
            red_release_add(rows[base + FLAG], rows[base + VALUE])
    elif op == WAIT:
        if tid == 0:
            target = ((epoch + rows[base + EPOCH_OFFSET]) * rows[base + PER_CALL]
                      + rows[base + VALUE])
            if target > 0:
                code, seen = _wait(rows[base + FLAG], target, timeout_ns, _get(desc, D_ABORT))
                if code != 0:
                    _record(desc, code, row, target, seen, lane, sub)
                    return code
    return 0


@device
def _run_lane(desc, lane, sub, block_in_rank, blocks_per_lane, timeout_ns, shared, rows, fp8):
    tid = cuda.threadIdx.x
    lane_tid = sub * cuda.blockDim.x + tid
    lane_threads = blocks_per_lane * cuda.blockDim.x
    epoch = shared[EPOCH_SLOT]
    table = _get(desc, D_TABLE)
    if epoch & 1:
        odd = _get(desc, D_TABLE_ODD)
        if odd != 0:
            table = odd
    begin = load_i64(_get(desc, D_LANES) + lane * 8)
    end = load_i64(_get(desc, D_LANES) + lane * 8 + 8)
    trace = _get(desc, D_TRACE)
    trace_rows = _get(desc, D_TRACE_ROWS)
    for w in range(begin, end, WINDOW):
        # the block copies the next window of rows into shared memory in one coalesced pass:
        # every later field read is a shared-memory load, not an L2 round trip
        n = min(WINDOW, end - w)
        for k in range(tid, n * ROW_WIDTH, cuda.blockDim.x):
            rows[k] = load_i64(table + (w * ROW_WIDTH + k) * 8)
        cuda.syncthreads()
        for j in range(n):
            r = w + j
            i = r - begin
            t_start = 0
            if trace != 0 and tid == 0:
                t_start = globaltimer()
            row = table + r * (ROW_WIDTH * 8)
            code = _run_row(desc, row, rows, j * ROW_WIDTH, epoch, lane, sub, tid, lane_tid,
                            lane_threads, timeout_ns, fp8)
            if code != 0:
                shared[i & 1] = code  # two status slots: nobody can still be reading this one
            cuda.syncthreads()
            if trace != 0 and tid == 0 and i < trace_rows:
                rec = trace + (block_in_rank * trace_rows + i) * (TRACE_WIDTH * 8)
                store_i64(rec, r)
                store_i64(rec + 8, sub)
                store_i64(rec + 16, t_start)
                store_i64(rec + 24, globaltimer())
            if shared[i & 1] != 0:
                return


@device
def _check_out(desc, blocks_per_rank, epoch):
    """Thread 0: count this block done; the rank's last block resets DONE and bumps EPOCH.

    Both words are private to this GPU and only read by the next launch on the stream, which
    starts after this kernel has finished: plain stores suffice for the last block, and a rank
    of one block needs no counting at all (one atomic less on every small collective)."""
    if blocks_per_rank == 1:
        store_i64(_get(desc, D_EPOCH), epoch + 1)
        return
    done = _get(desc, D_DONE)
    if atomic_add(done, 1) == blocks_per_rank - 1:
        store_i64(done, 0)
        store_i64(_get(desc, D_EPOCH), epoch + 1)


_kernel = launch_bounded(MAX_THREADS)


@_kernel
def executor(desc_ptr, nranks_in_launch, blocks_per_lane, timeout_ns, head_words):
    """Run every rank's table of this launch (the notes after the imports); FP8 reduce rows
    need ``executor_fp8`` (:func:`kernel_for`)."""
    _execute(desc_ptr, nranks_in_launch, blocks_per_lane, timeout_ns, head_words, False)


@_kernel
def executor_pdl(desc_ptr, nranks_in_launch, blocks_per_lane, timeout_ns, head_words):
    """The executor for programmatic dependent launch (sm_90 and newer): the next kernel on
    the stream may be scheduled as soon as every block of this one runs, and this one starts
    only once the previous kernel's writes are visible -- the launch gap overlaps the tail of
    the call before. Launch it with the programmatic-stream-serialization attribute."""
    griddep_launch_dependents()
    griddep_wait()  # before anything is read: even the prefetch may touch the last call's words
    _execute(desc_ptr, nranks_in_launch, blocks_per_lane, timeout_ns, head_words, False)


@_kernel
def executor_fp8(desc_ptr, nranks_in_launch, blocks_per_lane, timeout_ns, head_words):
    """``executor`` that also reduces FP8 rows."""
    _execute(desc_ptr, nranks_in_launch, blocks_per_lane, timeout_ns, head_words, True)


@_kernel
def executor_fp8_pdl(desc_ptr, nranks_in_launch, blocks_per_lane, timeout_ns, head_words):
    """``executor_fp8`` for programmatic dependent launch (as ``executor_pdl``)."""
    griddep_launch_dependents()
    griddep_wait()
    _execute(desc_ptr, nranks_in_launch, blocks_per_lane, timeout_ns, head_words, True)


def kernel_for(tables) -> str:
    """The Launcher kernel name for these instruction tables (int64 arrays): "executor-fp8"
    where a REDUCE row reduces FP8, else "executor".

    >>> kernel_for([np.zeros((1, ROW_WIDTH), np.int64)])
    'executor'
    """
    for t in tables:
        t = np.asarray(t).reshape(-1, ROW_WIDTH)
        if np.any((t[:, OP] == REDUCE) & np.isin(t[:, DTYPE], (E4M3, E5M2))):
            return "executor-fp8"
    return "executor"


@device
def _execute(desc_ptr, nranks_in_launch, blocks_per_lane, timeout_ns, head_words, fp8):
    blocks_per_rank = cuda.gridDim.x // nranks_in_launch
    slot = cuda.blockIdx.x // blocks_per_rank
    if slot >= nranks_in_launch:
        return
    block_in_rank = cuda.blockIdx.x - slot * blocks_per_rank
    lane = block_in_rank // blocks_per_lane
    sub = block_in_rank - lane * blocks_per_lane
    desc = desc_ptr + slot * (DESC_WIDTH * 8)

    # [status of even rows, status of odd rows, this call's epoch (read once)]
    shared = cuda.shared.array(3, np.int64)
    rows = cuda.shared.array(WINDOW_WORDS, np.int64)
    # A rank laid out as one contiguous block (descriptor, control words, lane offsets,
    # tables, source pool: purlin.atom.lowering.build_blob) is read in one coalesced pass, so
    # every later look-up of this launch hits this SM's L1 instead of walking a chain of
    # dependent L2 round trips. The words land in ``rows``, reloaded before any row runs.
    if nranks_in_launch == 1 and head_words > 0:
        for k in range(cuda.threadIdx.x, min(head_words, WINDOW_WORDS), cuda.blockDim.x):
            rows[k] = load_i64(desc + k * 8)
    if cuda.threadIdx.x == 0:
        shared[0] = 0
        shared[1] = 0
        shared[EPOCH_SLOT] = load_i64(_get(desc, D_EPOCH))  # written by an earlier launch
    cuda.syncthreads()
    if lane < _get(desc, D_NLANES):
        _run_lane(desc, lane, sub, block_in_rank, blocks_per_lane, timeout_ns, shared, rows,
                  fp8)
    if cuda.threadIdx.x == 0:
        _check_out(desc, blocks_per_rank, shared[EPOCH_SLOT])
