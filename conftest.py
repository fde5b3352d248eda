"""pytest setup shared by tests/, the doctests in purlin/ and README.md.

* ``@pytest.mark.gpu`` tests are skipped, with the reason, where no CUDA GPU is visible.
* Modules of purlin/kernels that import Numba CUDA are left out of doctest collection where
  numba-cuda is not installed (``pip install -e .`` without the test or gpu extra).
"""

from __future__ import annotations

import importlib.util
import os
from functools import lru_cache
from pathlib import Path

import pytest

_HERE = Path(__file__).parent
_PURE_KERNEL_MODULES = {"__init__.py", "isa.py"}  # no Numba import: always collected

collect_ignore_glob: list[str] = []
if importlib.util.find_spec("numba_cuda") is None:
    collect_ignore_glob += [
        str(p.relative_to(_HERE)) for p in sorted((_HERE / "purlin" / "kernels").glob("*.py"))
        if p.name not in _PURE_KERNEL_MODULES
    ]


@lru_cache(maxsize=None)
def no_gpu_reason() -> str | None:
    """Why GPU tests cannot run here, or None where a real CUDA GPU is visible."""
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        return "NUMBA_ENABLE_CUDASIM=1: the CUDA simulator is not a GPU"
    if importlib.util.find_spec("numba_cuda") is None:
        return "numba-cuda is not installed (pip install -e .[gpu])"
    from numba import cuda

    try:
        if cuda.is_available():
            return None
    except Exception as exc:  # a broken driver install reads as "no GPU", with its message
        return f"no usable CUDA GPU: {exc}"
    return "no CUDA GPU visible"


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items:
        return
    reason = no_gpu_reason()
    if reason is not None:
        for item in gpu_items:
            item.add_marker(pytest.mark.skip(reason=f"gpu test: {reason}"))
