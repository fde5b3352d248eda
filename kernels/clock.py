"""A flag ping-pong between two GPUs that reads ``%globaltimer`` on both sides, so measured
timelines from several GPUs can be put on one clock (see purlin.trace.offset_from_samples).

Round i: the initiator stamps t_send and adds 1 to the responder's flag; the responder, on
seeing it, stamps t_remote and adds 1 to the initiator's flag; the initiator stamps t_back.
Each GPU writes its stamps into its own int64 buffer (3 per round; unused slots stay 0).
"""

from __future__ import annotations

from numba import cuda

from purlin.kernels.intrinsics import (globaltimer, load_acquire, red_release_add,
                                       store_i64)


@cuda.jit
def pingpong(my_flag, peer_flag, stamps, rounds, initiator):
    """One thread per GPU; both launches must run at the same time."""
    if cuda.threadIdx.x != 0 or cuda.blockIdx.x != 0:
        return
    for i in range(rounds):
        if initiator:
            store_i64(stamps + (3 * i) * 8, globaltimer())
            red_release_add(peer_flag, 1)
            while load_acquire(my_flag) < i + 1:
                pass
            store_i64(stamps + (3 * i + 2) * 8, globaltimer())
        else:
            while load_acquire(my_flag) < i + 1:
                pass
            store_i64(stamps + (3 * i + 1) * 8, globaltimer())
            red_release_add(peer_flag, 1)
