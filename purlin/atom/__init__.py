"""Atom: datapaths that move bytes with copy, reduce, notify and wait (ARCHITECTURE.md, "Atom
datapaths").

Datapaths are registered by name here, and only here, and imported lazily, so ``import purlin``
works on a machine without CUDA. Each datapath module has ``CAPABILITIES`` (what the planner
may give it), ``RUNS_ON`` (the cluster kinds it binds for) and ``bind(cluster, schedule, *,
timeout, **options)``; the runtime dispatches every bind through :func:`load`.

>>> sorted(DATAPATHS)
['ce', 'cpu', 'sm']
>>> capabilities("cpu").can_reduce
True
>>> runs_on("cpu")
('cpu', 'ce')
"""

from __future__ import annotations

import importlib
import sys

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


def runs_on(kind: str) -> tuple[str, ...]:
    """The datapaths a bind may name on a cluster of ``kind`` ("cpu", "local", "virtual")."""
    return tuple(name for name in DATAPATHS if kind in load(name).RUNS_ON)


def auto_datapath(collective, **size) -> str:
    """The datapath ``datapath="auto"`` picks on a GPU cluster for ``collective`` at ``size``
    (``count``, ``nbytes``, ``dtype``, ``chunk_sizes`` or ``sizing``)."""
    return load("ce").auto_datapath(collective, **size)


def refuse_stuck(devices) -> None:
    """Raise ExecutionError if a datapath left one of ``devices`` stuck in this process (then
    anything that waits for that GPU would wait for ever). Only a datapath already loaded can
    have left one stuck, so none is imported for this.

    >>> refuse_stuck([0, 1])  # nothing stuck
    """
    if not devices:
        return
    for module in DATAPATHS.values():
        loaded = sys.modules.get(module)
        if loaded is not None and hasattr(loaded, "refuse_stuck"):
            loaded.refuse_stuck(devices)
