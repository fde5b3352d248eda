"""Atom: datapaths that move bytes with copy, reduce, notify and wait (ARCHITECTURE.md).

Datapaths are registered by name and imported lazily, so ``import purlin`` works on a machine
without CUDA.

>>> sorted(DATAPATHS)
['ce', 'cpu', 'sm']
>>> capabilities("cpu").can_reduce
True
"""

from __future__ import annotations

import importlib

from purlin.errors import CapabilityError

DATAPATHS = {
    "cpu": "purlin.atom.cpu",
    "sm": "purlin.atom.sm",
    "ce": "purlin.atom.ce",
}


def load(name: str):
    """The module of datapath ``name`` (imported on first use)."""
    if name not in DATAPATHS:
        raise CapabilityError(f"unknown datapath {name!r}; registered: {', '.join(DATAPATHS)}")
    try:
        return importlib.import_module(DATAPATHS[name])
    except ModuleNotFoundError as exc:
        raise CapabilityError(f"datapath {name!r} is not available here: {exc}") from None


def capabilities(name: str):
    """What datapath ``name`` can do (a :class:`purlin.snac.Capabilities`)."""
    return load(name).CAPABILITIES
