"""The instruction table the executor kernel interprets (pure Python: no Numba import).

A lowered schedule is, per rank, an int64 table of ``ROW_WIDTH`` columns, sorted by lane; one
row per Atom operation. Addresses are raw device addresses (unified virtual addressing), so a
table for a new custom collective needs no recompilation.

Flags are uint64 counters that only grow. A NOTIFY adds ``VALUE`` to the flag at ``FLAG`` with
release semantics at system scope; each thread block of the notifying lane adds separately. A
WAIT spins (acquire, system scope) until the flag reaches::

    target = (epoch + EPOCH_OFFSET) * PER_CALL + VALUE        (satisfied at once if <= 0)

where ``epoch`` is the number of earlier calls of this rank (a device counter the kernel bumps
when its last block finishes), ``PER_CALL`` is the total the flag grows by in one call, and
``EPOCH_OFFSET`` is 0 for this call or -1 / -2 to wait on an earlier call (acknowledgements).
"""

# opcodes (column OP)
NOP, COPY, REDUCE, NOTIFY, WAIT, LL_PUT, LL_GET = 0, 1, 2, 3, 4, 5, 6
OPCODE_NAMES = {NOP: "nop", COPY: "copy", REDUCE: "reduce", NOTIFY: "notify", WAIT: "wait",
                LL_PUT: "ll_put", LL_GET: "ll_get"}

# LL ("low latency") transfers carry their flag inside the data: LL_PUT writes COUNT elements
# from the source as 16-byte units {4 data bytes, tag, 4 data bytes, tag} at DST (a peer's LL
# area), where tag = epoch % LL_TAG_MOD + 1 identifies the call; LL_GET polls the units at its
# source until both tags of each equal this call's tag, then writes the data bytes to DST.
# Only 8-byte single-copy atomicity is relied on: each (data, tag) half arrives whole.
LL_UNIT, LL_DATA = 16, 8     # bytes of a unit, data bytes in it
LL_TAG_MOD = 0xFFFFFFFF      # tags run 1 .. 2**32 - 1 (0 is what fresh memory holds)

# dtype codes (column DTYPE)
BF16, F16, F32, I32, F64 = 0, 1, 2, 3, 4
DTYPE_CODES = {"bfloat16": BF16, "float16": F16, "float32": F32, "int32": I32, "float64": F64}
ITEMSIZE = {BF16: 2, F16: 2, F32: 4, I32: 4, F64: 8}
# FP8 (one byte an element): copies move the bytes; reductions decode to float32, accumulate
# in the row's source order and round once on the store (purlin.kernels.fp8)
E4M3, E5M2 = 5, 6
DTYPE_CODES.update({"float8_e4m3fn": E4M3, "float8_e5m2": E5M2})
ITEMSIZE.update({E4M3: 1, E5M2: 1})

# reduce op codes (column REDOP); AVG sums then divides by DIVISOR
SUM, MAX, MIN, AVG = 0, 1, 2, 3
REDOP_CODES = {"sum": SUM, "max": MAX, "min": MIN, "avg": AVG}

# columns
OP = 0            # opcode
LANE = 1          # lane that runs the row
DTYPE = 2         # dtype code
REDOP = 3         # reduce op code
DST = 4           # destination address (COPY, REDUCE)
COUNT = 5         # elements (COPY, REDUCE)
NSRC = 6          # number of sources (REDUCE; COPY uses 1)
SRC = 7           # index of the first source address in the rank's source pool
FLAG = 8          # flag address (NOTIFY: usually a peer's; WAIT: this rank's; LL_GET: its units)
VALUE = 9         # NOTIFY: amount added per block; WAIT: target within the call
PER_CALL = 10     # WAIT: how much the flag grows per call
EPOCH_OFFSET = 11 # WAIT: 0 this call, -1 previous call, ...
STEP = 12         # schedule step index (errors, traces)
PEER = 13         # the other rank of the step (errors, traces); -1 if none
DIVISOR = 14      # AVG: number of contributions
RESERVED = 15
ROW_WIDTH = 16

# per-rank descriptor the kernel reads first (int64 each), DESC_WIDTH columns
D_RANK = 0          # rank id (for error records)
D_TABLE = 1         # address of the int64 table
D_LANES = 2         # address of int64[nlanes + 1] row offsets: lane l runs rows [L[l], L[l+1])
D_NLANES = 3
D_SRCS = 4          # address of the int64 source-address pool
D_EPOCH = 5         # address of a uint64 call counter (starts at 0)
D_DONE = 6          # address of a uint64 finished-blocks counter (starts at 0)
D_ERROR = 7         # address of int64[ERR_WIDTH] error record (code 0 = none)
D_ABORT = 8         # address of a uint64 abort word shared by every rank of a cluster
D_TRACE = 9         # address of int64 trace records, or 0 for no tracing
D_TRACE_ROWS = 10   # rows per block in the trace buffer
D_TABLE_ODD = 11    # address of the table used on odd calls (two scratch copies), else = D_TABLE
DESC_WIDTH = 12

# error record written by a timed-out wait (int64 each)
E_CODE, E_RANK, E_STEP, E_FLAG, E_EXPECTED, E_SEEN, E_LANE, E_BLOCK, E_PEER = range(9)
ERR_WIDTH = 9
ERR_NONE, ERR_TIMEOUT, ERR_ABORTED = 0, 1, 2
# written by the variable-length pack kernel (kernels/varlen.py): E_STEP holds the chunk's
# input position, E_FLAG its index in the counts, E_SEEN the count, E_EXPECTED the capacity
# (ERR_COUNT) or the packed input's elements (ERR_PACKED)
ERR_COUNT, ERR_PACKED = 3, 4
# the variable-length kernels' table, int64[positions, VL_META_WIDTH] per rank: the chunk's
# index in the counts, its slot's first unit, its header's int64 word
VL_INDEX, VL_SLOT, VL_HEADER = 0, 1, 2
VL_META_WIDTH = 3

# trace record (int64 each): row index, block within the lane, start ns, end ns
TRACE_WIDTH = 4

# The fused program (``purlin.kernels.fused``, built by ``purlin.atom.fused``): a one-lane table
# run block-matched -- every thread moves the same 16-byte items of every row, and each flag has
# a slot per block, so block b of one rank waits only for block b of its peer. int64 words:
#   header (F_HEAD) | ops | sources
# where the word indices the header and ops hold (a move's first source) count from the header.
# Its call counters (F_MAX_BLOCKS per rank, block b's in word b) are not part of it: the launch
# passes their address, so programs of one collective that differ only in the addresses of the
# rank's own buffers (relocated for zero-copy calls) count calls together.
F_MAX_BLOCKS = 256          # blocks per rank a fused launch may run
MAX_THREADS = 512           # threads per block, every kernel (launch bound: <= 128 registers)
F_RANK, F_NOPS, F_DTYPE, F_REDOP, F_DIVISOR, F_ERROR, F_ABORT, F_UNIT = range(8)
F_HEAD = 8                   # F_UNIT: the bytes a thread takes at a time, 16 or 8 (one LL unit)
F_OP_WAIT, F_OP_NOTIFY, F_OP_PUT, F_OP_MOVE, F_OP_NORM = 1, 2, 3, 4, 5
OP_WIDTH = 8
# An op's words (offsets from its first word; "+ odd" picks the address of odd calls):
OP_KIND = 0                  # F_OP_* code, every op
# WAIT:   kind, flag slot of block 0, per call, value, epoch offset, peer, step, lowered flag
WAIT_SLOT, WAIT_PER_CALL, WAIT_VALUE, WAIT_EPOCH_OFFSET, WAIT_PEER, WAIT_STEP, WAIT_FLAG = \
    1, 2, 3, 4, 5, 6, 7
# NOTIFY: kind, flag slot of block 0 (on the peer), value
NOTIFY_SLOT, NOTIFY_VALUE = 1, 2
# PUT:    kind, source, LL units on even calls, on odd calls, bytes, peer, step (LL_PUT)
PUT_SRC, PUT_DST, PUT_BYTES, PUT_PEER, PUT_STEP = 1, 2, 4, 5, 6
# (and, word 7, a rotation as a MOVE's: the LL transfers of several pieces per peer run on
#  different threads at once; 0 for the standard collectives' programs)
PUT_ROTATE = 7
# MOVE:   kind, destination on even calls, on odd calls, bytes, sources, first source word
MOVE_DST, MOVE_BYTES, MOVE_NSRC, MOVE_SOURCES = 1, 3, 4, 5
# (and, word 6, a rotation: item i is thread (i + rotation) mod the rank's threads', so the
#  small rows of one segment run on different threads at once; 0 for most programs)
MOVE_ROTATE = 6
# (and, word 7, for a one-source copy whose addresses are not all 16-byte aligned -- pieces of
#  odd size inside a user's buffer --, the widest word, 8, 4, 2 or 1 bytes, that every one of
#  them is aligned to: each 16-byte item of the row moves in words of that width; 0 for rows
#  of aligned 16-byte items. Plus NARROW_SHIFT where the row may be cut at the destination's
#  16-byte boundaries -- the destination is aligned (the same cut), or no other row of the
#  launch, on any rank, touches it or writes the source --: aligned 16-byte stores from
#  shifted loads, _copy_shifted)
MOVE_NARROW = 7
NARROW_SHIFT = 16
# NORM:   kind, target on even calls, on odd calls, bytes, 1, first parameter word, chunks,
#         chunks per row -- the epilogue (residual add and RMSNorm) over a MOVE's
#         destination, in chunks of threads x unit bytes; its parameters take one source
#         entry: residual, weight, row sums area, row length, eps (f32 bits)
NORM_TARGET, NORM_BYTES, NORM_PARAMS, NORM_CHUNKS, NORM_ROW_CHUNKS = 1, 3, 5, 6, 7
NORM_RESIDUAL, NORM_WEIGHT, NORM_SUMS, NORM_HIDDEN, NORM_EPS = range(5)  # in its parameters
SOURCE_WIDTH = 5             # is LL, address on even calls, on odd calls, peer rank, step
SOURCE_LL, SOURCE_ADDR, SOURCE_PEER, SOURCE_STEP = 0, 1, 3, 4
# Segmented ops (purlin.atom.fused_rows): several PUT or several MOVE rows of one peer as one op,
# the block's threads striding over the union of the rows' items as over one row (item u of
# the union is thread (u + rotation) mod the rank's threads'):
#   kind, segments, word of the first segment record, items of the union, rotation,
#   word of its bucket index, log2 of a bucket's items, segments cut at unaligned destinations
#   (the fused_seg_copy_narrow kernels copy their partial slots before the union)
# A segment record is the row's own PUT / MOVE words (OP_WIDTH of them, its sources where the
# program keeps sources) with its rotation word (PUT_ROTATE, MOVE_ROTATE) holding the row's
# first item in the union; records follow each other in union order. The bucket index holds,
# for each run of 2**shift items of the union, the word of the record holding its first item:
# a thread finds an item's segment from there (a few records at most), not from the first.
# Only the fused_seg kernels run them: the others' code is the same as before segments existed.
F_OP_PUTS, F_OP_MOVES = 6, 7
SEG_COUNT, SEG_TABLE, SEG_ITEMS, SEG_ROTATE, SEG_INDEX, SEG_SHIFT, SEG_CUT = 1, 2, 3, 4, 5, 6, 7
