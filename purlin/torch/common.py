"""Small helpers shared by the communicator and its hierarchical runner."""

from __future__ import annotations

import torch
import torch.distributed as dist

from purlin.errors import OpError
from purlin.spec.ops import REDUCE_OPS


class Shape:
    """What :mod:`purlin.runtime.auto` needs to know about where a plan runs."""

    def __init__(self, datapath: str):
        self.datapath = datapath


def op_name(op) -> str | None:
    """The Purlin name (sum, max, min, avg) of a torch ReduceOp or a Purlin op name; None for
    the other ReduceOps (they run on torch.distributed). Anything else is refused, as
    torch.distributed refuses it, with a TypeError (:class:`purlin.errors.OpError`) -- before
    anything runs.

    >>> op_name(dist.ReduceOp.MAX), op_name("avg"), op_name(dist.ReduceOp.PRODUCT)
    ('max', 'avg', None)
    >>> op_name("bogus")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    purlin.errors.OpError: op must be a torch.distributed.ReduceOp (or one of ... got 'bogus'
    """
    if isinstance(op, str) and op.lower() in REDUCE_OPS:
        return op.lower()
    if isinstance(op, str) or not isinstance(op, dist.ReduceOp):
        raise OpError("op must be a torch.distributed.ReduceOp (or one of 'sum', 'max', 'min', "
                      f"'avg'), got {op!r}")
    for name in ("SUM", "MAX", "MIN", "AVG"):
        if op == getattr(dist.ReduceOp, name):
            return name.lower()
    return None


def op_label(op) -> str:
    """A ReduceOp's name for messages (``PRODUCT``), or a Purlin op name as given."""
    if isinstance(op, str):
        return op
    for name, value in dist.ReduceOp.RedOpType.__members__.items():
        if op == value:
            return name
    return str(op)


def torch_op(op):
    """The torch ReduceOp for a Purlin op name (a ReduceOp passes through)."""
    return getattr(dist.ReduceOp, op.upper()) if isinstance(op, str) else op


# torch 2.13 renames all_gather_into_tensor / reduce_scatter_tensor (the old names warn)
gather_into = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
scatter_into = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


def capturing() -> bool:
    """Is the current CUDA stream capturing a graph?"""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Do the bytes of ``a`` and ``b`` (from the first element, as if contiguous) meet?"""
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


class Work:
    """What a call with ``async_op=True`` returns, as ``torch.distributed`` does: here the
    collective has already run when the call returns (on GPUs it is queued on the current
    stream, where a ``torch.distributed`` work's ``wait()`` would leave it), so ``wait()``
    returns at once.

    >>> w = Work([torch.ones(2)])
    >>> w.wait(), w.is_completed(), w.get_future().value()
    (True, True, [tensor([1., 1.])])
    """

    def __init__(self, tensors, event=None):
        self.tensors, self.event = list(tensors), event

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return self.event.query() if self.event is not None else True

    def is_success(self) -> bool:
        return self.is_completed()

    def exception(self):
        return None

    def synchronize(self) -> None:
        if self.event is not None:
            self.event.synchronize()

    def result(self) -> list:
        return list(self.tensors)

    def get_future(self):
        future = torch.futures.Future()
        future.set_result(self.result())
        return future

    def __repr__(self) -> str:
        return f"<purlin.torch.Work of {len(self.tensors)} tensor(s), done>"
