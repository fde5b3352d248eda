"""Small helpers shared by the communicator and its hierarchical runner."""

from __future__ import annotations

import torch
import torch.distributed as dist

from purlin.spec.ops import REDUCE_OPS


class Shape:
    """What :mod:`purlin.runtime.auto` needs to know about where a plan runs."""

    def __init__(self, datapath: str):
        self.datapath = datapath


def op_name(op) -> str | None:
    """The Purlin name (sum, max, min, avg) of a torch ReduceOp or a name; None for others."""
    if isinstance(op, str):
        return op.lower() if op.lower() in REDUCE_OPS else None
    for name in ("SUM", "MAX", "MIN", "AVG"):
        if hasattr(dist.ReduceOp, name) and op == getattr(dist.ReduceOp, name):
            return name.lower()
    return None


def torch_op(op):
    """The torch ReduceOp for a Purlin op name (a ReduceOp passes through)."""
    return getattr(dist.ReduceOp, op.upper()) if isinstance(op, str) else op


def capturing() -> bool:
    """Is the current CUDA stream capturing a graph?"""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Do the bytes of ``a`` and ``b`` (from the first element, as if contiguous) meet?"""
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()
