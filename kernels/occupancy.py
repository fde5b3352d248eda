"""How many blocks of the executor or the fused kernel are resident on a GPU at once, and the
shared memory that keeps a launch's blocks on as many SMs as it has (``spread_shared_bytes``).

Every block of a launch must be, or a wait could starve the block it waits for; the sm
datapath sizes its launches with :func:`resident_blocks` (``purlin.atom.sm.size_launch``) and
refuses explicit requests beyond it. Plain Python: no CUDA needed to size a launch.
"""

from __future__ import annotations

from purlin.kernels.isa import MAX_THREADS

# One SM of sm_80..sm_90 (H100/H200 included): what limits how many blocks are resident at once
REGISTERS_PER_SM = 65536
THREADS_PER_SM = 2048
BLOCKS_PER_SM = 32
BOUND_REGISTERS = REGISTERS_PER_SM // MAX_THREADS  # per thread: what the launch bound allows


def blocks_per_sm(threads: int, registers: int | None = None) -> int:
    """Blocks of ``threads`` threads one SM holds at once when each thread uses ``registers``
    registers (default: the launch bound's limit, so any build of the kernels fits); the
    kernels use no dynamic shared memory and little static, so registers and threads decide.

    >>> blocks_per_sm(512), blocks_per_sm(256), blocks_per_sm(128), blocks_per_sm(512, 64)
    (1, 2, 4, 2)
    """
    registers = max(1, int(registers or BOUND_REGISTERS))
    # registers are allocated per warp in units of 256
    per_warp = -(-registers * 32 // 256) * 256
    warps = -(-int(threads) // 32)
    return max(0, min(REGISTERS_PER_SM // (per_warp * warps), THREADS_PER_SM // (warps * 32),
                      BLOCKS_PER_SM))


def resident_blocks(sms: int, threads: int, registers: int | None = None) -> int:
    """Blocks of ``threads`` threads resident at once on ``sms`` SMs: every block of a launch of
    the executor or the fused kernel must be, or a wait could starve the block it waits for.

    >>> resident_blocks(132, 512), resident_blocks(132, 128)
    (132, 528)
    """
    return int(sms) * blocks_per_sm(threads, registers)


def spread_shared_bytes(grid: int, threads: int, registers: int, static: int, *, sms: int,
                        per_sm: int, reserved: int, per_block: int) -> int:
    """Dynamic shared memory for a launch of ``grid`` blocks of ``threads`` threads (each
    ``registers`` registers, ``static`` bytes of static shared memory) such that an SM can
    hold the blocks the grid needs of it (``ceil(grid / sms)``) and no more; 0 where
    registers and threads already allow no more, or shared memory cannot (``per_sm``: an
    SM's shared memory, ``reserved``: what the system keeps per block, ``per_block``: the
    most one block may ask for).

    >>> h = dict(sms=132, per_sm=233472, reserved=1024, per_block=232448)
    >>> spread_shared_bytes(128, 512, 64, 9224, **h)  # two would fit: one an SM
    106489
    >>> spread_shared_bytes(128, 512, 118, 9224, **h)  # one fits already
    0
    >>> spread_shared_bytes(256, 256, 64, 9224, **h)  # two an SM, not four
    67577
    """
    need = max(1, -(-int(grid) // int(sms)))
    if blocks_per_sm(threads, registers) <= need:
        return 0
    shared = per_sm // (need + 1) + 1 - reserved - static  # need + 1 blocks do not fit
    if shared <= 0 or need * (shared + static + reserved) > per_sm or \
            shared + static > per_block:
        return 0
    return shared
