"""Purlin for PyTorch applications: collectives on a ``torch.distributed`` process group.

:class:`Communicator` is the whole API; ``init()`` makes a default one that the module-level
functions use, for code that wants ``purlin.torch.all_reduce(x)`` next to
``torch.distributed.all_reduce(x)``.
"""

from purlin.torch.comm import Communicator

__all__ = ["Communicator", "all_gather_into_tensor", "all_reduce", "all_to_all_single",
           "broadcast", "default", "init", "reduce", "reduce_scatter_tensor"]

_default: Communicator | None = None


def init(group=None, **options) -> Communicator:
    """Make the default communicator (see :class:`Communicator` for the options)."""
    global _default
    _default = Communicator(group, **options)
    return _default


def default() -> Communicator:
    if _default is None:
        raise RuntimeError("purlin.torch.init() has not been called in this process")
    return _default


def all_reduce(tensor, op="sum"):
    return default().all_reduce(tensor, op)


def all_gather_into_tensor(output, input):
    return default().all_gather_into_tensor(output, input)


def reduce_scatter_tensor(output, input, op="sum"):
    return default().reduce_scatter_tensor(output, input, op)


def all_to_all_single(output, input):
    return default().all_to_all_single(output, input)


def broadcast(tensor, src):
    return default().broadcast(tensor, src)


def reduce(tensor, dst, op="sum"):
    return default().reduce(tensor, dst, op)
