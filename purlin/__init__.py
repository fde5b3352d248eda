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


from purlin.errors import (CapabilityError, ExecutionError, PlanError, PurlinError,
                           PurlinTimeoutError, SpecError, VerificationError)
from purlin.spec import (Collective, Layout, Op, collectives, copy, dtype, reduce, reference,
                         standard)

from purlin.runtime import Cluster, Epilogue, run
from purlin.runtime import auto as _auto
from purlin.snac import Schedule, plan, verify
from purlin.trace import predict_latency as _predict_latency

# strategy="auto" ranks strategies with the trace layer's cost model where no tuning table
# answers. The runtime sits below the trace layer and must not import it, so the package, which
# sees both, hands the model over here -- the one place the two meet.
_auto.set_latency_model(_predict_latency)

__version__ = "0.1.0"

__all__ = [
    "CapabilityError", "Collective", "ExecutionError", "Layout", "Op", "PlanError",
    "PurlinError", "PurlinTimeoutError", "SpecError", "VerificationError", "collectives", "copy",
    "dtype", "reduce", "reference", "standard", "Cluster", "Schedule", "plan", "run", "verify",
    "Epilogue",
]
