"""One family of errors for everything Purlin rejects or fails at.

Every message states the rule that was broken and the values involved (rank, position, name,
step, flag), so a user can fix the input without reading Purlin's source.
"""

from __future__ import annotations


class PurlinError(Exception):
    """Base class of every error Purlin raises on purpose."""


class SpecError(PurlinError, ValueError):
    """An argument that does not make sense: a collective, layout, op, dtype, size, rank count
    or timeout."""


class OpError(SpecError, TypeError):
    """A reduce op that is neither a ``torch.distributed.ReduceOp`` nor a Purlin op name (a
    TypeError, as ``torch.distributed`` raises for it)."""


class OpDtypeError(SpecError, RuntimeError):
    """A reduce op that has no result in the tensors' dtype (AVG of integers): a RuntimeError,
    as ``torch.distributed`` raises for it -- but before anything is written."""


class PlanError(PurlinError):
    """The planner cannot build a schedule for this collective with these options."""


class VerificationError(PlanError):
    """A schedule that does not compute its collective, races, or can deadlock."""


class CapabilityError(PurlinError):
    """A datapath asked to do something it cannot do (reduce on copy engines, a dtype, ...)."""


class ExecutionError(PurlinError):
    """Running a schedule failed."""


class CallMismatchError(ExecutionError):
    """The ranks of a process group made different calls (function, size, dtype, op or root);
    the message names each rank and what it called."""


class CountError(ExecutionError, ValueError):
    """A variable-length chunk's count that its capacity cannot hold (negative, over capacity,
    more than the packed input holds, or a counts list of the wrong length); the message names
    the rank and the chunk. Caught on the host for host counts, by the pack kernel for device
    counts."""


class PurlinTimeoutError(ExecutionError, TimeoutError):
    """A wait on a flag ran past its time limit; the message names rank, step, flag and values."""
