"""Purlin: GPU collective communication inside a node, as layouts, schedules and atoms.

>>> import purlin
>>> purlin.collectives.all_reduce(4).nranks
4
"""

import os as _os
import sys as _sys


def _checkout_kernels() -> None:
    """A source checkout keeps the Numba CUDA code in the top-level ``kernels/`` folder, which an
    install (regular or editable) maps to ``purlin.kernels``; a checkout on ``PYTHONPATH`` gets
    the same name here. Only the folder's light ``__init__`` runs; its modules load on use."""
    import importlib.util

    here = _os.path.dirname(_os.path.abspath(__file__))
    init = _os.path.join(_os.path.dirname(here), "kernels", "__init__.py")
    # an installed package has purlin/kernels/__init__.py; a folder there without one (say,
    # __pycache__ left from before kernels/ moved up) would import as an empty namespace
    if ("purlin.kernels" in _sys.modules or not _os.path.isfile(init)
            or _os.path.isfile(_os.path.join(here, "kernels", "__init__.py"))):
        return
    spec = importlib.util.spec_from_file_location(
        "purlin.kernels", init, submodule_search_locations=[_os.path.dirname(init)])
    module = importlib.util.module_from_spec(spec)
    _sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    globals()["kernels"] = module


_checkout_kernels()


def _more_hardware_queues() -> None:
    """Ask CUDA for 32 hardware queues per device (its default is 8) unless the user chose a
    number or CUDA has already started: the ce datapath's stream waits hung under CUDA graphs
    with 8 on 2 x H200 and ran with 32. Streams beyond the queue count share queues, and a
    stream waiting on a counter then holds up the one behind it."""
    torch = _sys.modules.get("torch")
    started = torch is not None and torch.cuda.is_initialized()
    if not started and "CUDA_DEVICE_MAX_CONNECTIONS" not in _os.environ:
        _os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "32"


_more_hardware_queues()

from purlin.errors import (CapabilityError, ExecutionError, PlanError, PurlinError,
                           PurlinTimeoutError, SpecError, VerificationError)
from purlin.spec import (Collective, Layout, Op, collectives, copy, dtype, reduce, reference,
                         standard)

from purlin.runtime import Cluster, run
from purlin.snac import Schedule, plan, verify
import purlin.trace  # noqa: E402,F401  (registers the cost model with strategy="auto")

__version__ = "0.1.0"

__all__ = [
    "CapabilityError", "Collective", "ExecutionError", "Layout", "Op", "PlanError",
    "PurlinError", "PurlinTimeoutError", "SpecError", "VerificationError", "collectives", "copy",
    "dtype", "reduce", "reference", "standard", "Cluster", "Schedule", "plan", "run", "verify",
]
