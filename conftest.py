"""pytest setup shared by tests/, the doctests in purlin/ and README.md.

* ``@pytest.mark.gpu`` tests are skipped, with the reason, where no CUDA GPU is visible.
* The top-level ``kernels/`` folder is ``purlin.kernels`` (pyproject's package-dir), so it is
  not collected by path; tests/test_layout.py runs its doctests under that name.
"""

from __future__ import annotations

import importlib.util
import os
from functools import lru_cache

import pytest

collect_ignore = ["kernels"]

# The GPU check below starts CUDA before any test builds a cluster, so ask here for the 32
# hardware queues per device a copy-engine cluster needs (ARCHITECTURE.md, "Knobs")
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")


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
