"""Pack and unpack kernels of the variable-length collectives (``purlin.spec.varlen``).

The collective itself runs padded, one fixed *slot* per chunk; these kernels move a rank's
packed rows (concatenated by the actual counts) into its slots and back, with the counts in a
device array -- never read by the host, so a call stays capturable into a CUDA graph.

* :func:`pack`: block row ``p`` of the grid fills input slot ``p``: its offset in the packed
  input is the prefix sum of the earlier positions' counts, computed on the device. A count
  below 0 or over the capacity is clamped (no write leaves its slot) and recorded in the
  rank's error record (``isa`` layout, code ``ERR_COUNT``); counts that run past the packed
  input are cut there and recorded as ``ERR_PACKED``. A copy collective's slot starts with a
  header holding the count it carries.
* :func:`unpack`: block row ``q`` copies output slot ``q``'s rows to the packed output, at the
  prefix sum of the earlier slots' counts, read from the slot headers (or, for a reducing
  collective, from the counts array) and written to ``out_counts``.

Buffers are passed as integer views of their element size (bits move unchanged, whatever the
dtype) plus an int64 view of the slot buffer for the headers. ``meta`` is int64[positions,
isa.VL_META_WIDTH] per rank: the chunk's index in the counts, its slot's first unit, and the
int64 word of its header.
"""

from __future__ import annotations

from purlin.kernels.compat import ensure_numpy_compat

ensure_numpy_compat()

from numba import cuda  # noqa: E402

from purlin.kernels.isa import (E_CODE, E_EXPECTED, E_FLAG, E_RANK, E_SEEN,  # noqa: E402
                                E_STEP, ERR_COUNT, ERR_PACKED, VL_HEADER as M_HEADER,
                                VL_INDEX as M_INDEX, VL_META_WIDTH as META_WIDTH,
                                VL_SLOT as M_SLOT)
THREADS = 256


@cuda.jit(device=True)
def _clamp(c, capacity):
    if c < 0:
        return 0
    if c > capacity:
        return capacity
    return c


@cuda.jit(device=True)
def _record(err, code, rank, pos, index, seen, expected):
    """The first error of a rank wins, as a timed-out wait's does."""
    if cuda.atomic.compare_and_swap(err, 0, code) == 0:
        err[E_RANK] = rank
        err[E_STEP] = pos
        err[E_FLAG] = index
        err[E_SEEN] = seen
        err[E_EXPECTED] = expected
    return err[E_CODE]


@cuda.jit
def pack(src, src_len, dst, dst64, counts, meta, head, row, capacity, err, rank):
    p = cuda.blockIdx.y
    raw = counts[meta[p, M_INDEX]]
    rows = _clamp(raw, capacity)
    start = 0
    for q in range(p):
        start += _clamp(counts[meta[q, M_INDEX]], capacity) * row
    n = rows * row
    short = start + n > src_len
    if short:
        left = src_len - start
        n = left // row * row if left > 0 else 0
    base = meta[p, M_SLOT] + head
    tid = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    stride = cuda.gridDim.x * cuda.blockDim.x
    for i in range(tid, n, stride):
        dst[base + i] = src[start + i]
    if tid == 0:
        if head > 0:
            dst64[meta[p, M_HEADER]] = n // row
        if raw != rows:
            _record(err, ERR_COUNT, rank, p, meta[p, M_INDEX], raw, capacity)
        elif short:
            _record(err, ERR_PACKED, rank, p, meta[p, M_INDEX], (start // row) + rows,
                    src_len // row)


@cuda.jit
def unpack(src, src64, dst, counts, meta, head, row, capacity, out_counts):
    q = cuda.blockIdx.y
    start = 0
    for k in range(q):
        c = src64[meta[k, M_HEADER]] if head > 0 else counts[meta[k, M_INDEX]]
        start += _clamp(c, capacity) * row
    c = src64[meta[q, M_HEADER]] if head > 0 else counts[meta[q, M_INDEX]]
    rows = _clamp(c, capacity)
    base = meta[q, M_SLOT] + head
    tid = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    stride = cuda.gridDim.x * cuda.blockDim.x
    for i in range(tid, rows * row, stride):
        dst[start + i] = src[base + i]
    if tid == 0:
        out_counts[q] = rows


def grid(positions: int, elements: int, threads: int = THREADS, most: int = 128):
    """(blocks per position, positions): enough blocks for one slot's elements, at most
    ``most``."""
    return (max(1, min(most, -(-elements // threads))), max(positions, 1))
