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

* :func:`pack_group` / :func:`unpack_group`: the same for every rank of one device in one
  launch (``blockIdx.z`` picks the rank; its buffers, tables and error record are the
  rank's entries in tuples), sized by :func:`group_grid`: one launch each per call, whatever
  the number of virtual ranks.

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
# Registers per thread a copy loop needs, for sizing a group launch's grid only (its blocks
# never wait on each other, so they need not all be resident).
COPY_REGISTERS = 32
# Ranks in one pack_group / unpack_group launch at most: every rank adds ~330 bytes of kernel
# parameters (its arrays' descriptors), and 8 keep a launch inside CUDA's 4 KiB of them.
MAX_GROUP = 8


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


@cuda.jit(device=True)
def _pack_slot(src, src_len, dst, dst64, counts, meta, p, head, row, capacity, err, rank):
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


@cuda.jit(device=True)
def _unpack_slot(src, src64, dst, counts, meta, q, head, row, capacity, out_counts):
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


@cuda.jit
def pack(src, src_len, dst, dst64, counts, meta, head, row, capacity, err, rank):
    _pack_slot(src, src_len, dst, dst64, counts, meta, cuda.blockIdx.y, head, row, capacity,
               err, rank)


@cuda.jit
def unpack(src, src64, dst, counts, meta, head, row, capacity, out_counts):
    _unpack_slot(src, src64, dst, counts, meta, cuda.blockIdx.y, head, row, capacity,
                 out_counts)


@cuda.jit
def pack_group(srcs, src_lens, dsts, dst64s, counts, metas, positions, head, row, capacity,
               errs, ranks):
    """:func:`pack` for several ranks of one device in one launch: ``blockIdx.z`` picks the
    rank (its entry in each tuple), ``blockIdx.y`` the position (past the rank's
    ``positions``: nothing to do)."""
    g = cuda.blockIdx.z
    p = cuda.blockIdx.y
    if p >= positions[g]:
        return
    _pack_slot(srcs[g], src_lens[g], dsts[g], dst64s[g], counts, metas[g], p, head, row,
               capacity, errs[g], ranks[g])


@cuda.jit
def unpack_group(srcs, src64s, dsts, counts, metas, positions, head, row, capacity,
                 out_counts):
    """:func:`unpack` for several ranks of one device in one launch (as :func:`pack_group`)."""
    g = cuda.blockIdx.z
    q = cuda.blockIdx.y
    if q >= positions[g]:
        return
    _unpack_slot(srcs[g], src64s[g], dsts[g], counts, metas[g], q, head, row, capacity,
                 out_counts[g])


def grid(positions: int, elements: int, threads: int = THREADS, most: int = 128):
    """(blocks per position, positions): enough blocks for one slot's elements, at most
    ``most``."""
    return (max(1, min(most, -(-elements // threads))), max(positions, 1))


def group_grid(positions: int, ranks: int, elements: int, sms: int,
               threads: int = THREADS) -> tuple[int, int, int]:
    """(blocks per slot, positions, ranks) of a :func:`pack_group` / :func:`unpack_group`
    launch: the blocks a slot's ``elements`` need, at most the slot's share of twice what
    ``sms`` SMs hold at once (grid-stride loops cover the rest), so a large call fills the GPU
    and a small one launches few blocks.

    >>> group_grid(8, 8, 1 << 20, 132)
    (33, 8, 8)
    >>> group_grid(4, 4, 100, 132)
    (1, 4, 4)
    """
    from purlin.kernels.occupancy import resident_blocks

    slots = max(positions, 1) * max(ranks, 1)
    share = max(1, 2 * resident_blocks(sms, threads, COPY_REGISTERS) // slots)
    return (max(1, min(share, -(-elements // threads))), max(positions, 1), max(ranks, 1))
