"""Purlin for PyTorch applications: collectives on a ``torch.distributed`` process group.

:class:`Communicator` is the API (its knobs in :class:`CommOptions`); ``init(group)`` makes the
communicator of a group that the module-level functions, which take ``torch.distributed``'s
signatures, use for that group, so ``dist.all_reduce(x)`` becomes ``purlin.torch.all_reduce(x)``.
What runs where and what falls back: ARCHITECTURE.md, "Runtime" (process mode).
"""

import warnings

import torch.distributed as dist

from purlin.torch.comm import CommOptions, Communicator
from purlin.torch.common import Work, gather_into, scatter_into

__all__ = ["CommOptions", "Communicator", "Work", "all_gather", "all_gather_into_tensor",
           "all_gather_single", "all_reduce", "all_to_all_single", "all_to_all_v", "broadcast",
           "default", "init",
           "reduce", "reduce_scatter", "reduce_scatter_single", "reduce_scatter_tensor"]

SUM = dist.ReduceOp.SUM
_default: Communicator | None = None
_by_group: dict = {}
_warned: set = set()


def init(group=None, datapath: str = "auto", *, options: CommOptions | None = None,
         **kwargs) -> Communicator:
    """Make the communicator of ``group`` (default: the world) that the module-level
    functions use for it (see :class:`Communicator` for the arguments)."""
    global _default
    comm = Communicator(group, datapath, options=options, **kwargs)
    _by_group[group if group is not None else dist.group.WORLD] = comm
    _default = comm
    return comm


def default() -> Communicator:
    """The communicator ``init`` made last."""
    if _default is None:
        raise RuntimeError("purlin.torch.init() has not been called in this process")
    return _default


def _for(fn: str, group):
    """The communicator of ``group`` (None: the world), or None -- with a one-time warning --
    where ``init`` made none for it: the call then runs on torch.distributed."""
    default()  # none made at all: say so
    comm = _by_group.get(group if group is not None else dist.group.WORLD)
    if comm is not None and not comm.closed:
        return comm
    if fn not in _warned:
        _warned.add(fn)
        warnings.warn(f"purlin.torch: {fn} falls back to torch.distributed: no purlin.torch "
                      "communicator for this group (call purlin.torch.init(group))",
                      RuntimeWarning, stacklevel=3)
    return None


def all_reduce(tensor, op=SUM, group=None, async_op=False):
    comm = _for("all_reduce", group)
    if comm is None:
        return dist.all_reduce(tensor, op, group, async_op)
    return comm.all_reduce(tensor, op, None, async_op)


def all_gather(tensor_list, tensor, group=None, async_op=False):
    comm = _for("all_gather", group)
    if comm is None:
        return dist.all_gather(tensor_list, tensor, group, async_op)
    return comm.all_gather(tensor_list, tensor, None, async_op)


def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False):
    comm = _for("all_gather_into_tensor", group)
    if comm is None:
        return gather_into(output_tensor, input_tensor, group, async_op)
    return comm.all_gather_into_tensor(output_tensor, input_tensor, None, async_op)


def reduce_scatter(output, input_list, op=SUM, group=None, async_op=False):
    comm = _for("reduce_scatter", group)
    if comm is None:
        return dist.reduce_scatter(output, input_list, op, group, async_op)
    return comm.reduce_scatter(output, input_list, op, None, async_op)


def reduce_scatter_tensor(output, input, op=SUM, group=None, async_op=False):
    comm = _for("reduce_scatter_tensor", group)
    if comm is None:
        return scatter_into(output, input, op, group, async_op)
    return comm.reduce_scatter_tensor(output, input, op, None, async_op)


all_gather_single = all_gather_into_tensor
reduce_scatter_single = reduce_scatter_tensor


def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None,
                      group=None, async_op=False):
    comm = _for("all_to_all_single", group)
    if comm is None:
        return dist.all_to_all_single(output, input, output_split_sizes, input_split_sizes,
                                      group, async_op)
    return comm.all_to_all_single(output, input, output_split_sizes, input_split_sizes, None,
                                  async_op)


def all_to_all_v(output, input, input_splits, capacity=None, group=None, check=True):
    """The all-to-all with the splits in a tensor on the device (never read by the host):
    :meth:`Communicator.all_to_all_v`; returns the rows received from each rank. Without a
    communicator for ``group``, torch.distributed runs it (the splits then go through the
    host)."""
    comm = _for("all_to_all_v", group)
    if comm is not None:
        return comm.all_to_all_v(output, input, input_splits, capacity, None, check)
    import torch

    send = input_splits.reshape(-1).to(torch.int64)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    rows = int(recv.sum())
    dist.all_to_all_single(output[:rows], input[:int(send.sum())], recv.tolist(),
                           send.tolist(), group=group)
    return recv


def broadcast(tensor, src=None, group=None, async_op=False, group_src=None):
    comm = _for("broadcast", group)
    if comm is None:
        return dist.broadcast(tensor, src, group, async_op, group_src)
    return comm.broadcast(tensor, src, None, async_op, group_src)


def reduce(tensor, dst=None, op=SUM, group=None, async_op=False, group_dst=None):
    comm = _for("reduce", group)
    if comm is None:
        return dist.reduce(tensor, dst, op, group, async_op, group_dst)
    return comm.reduce(tensor, dst, op, None, async_op, group_dst)
