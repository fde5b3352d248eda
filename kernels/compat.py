"""Work-arounds for the library versions the kernels run with (no Numba import here)."""

from __future__ import annotations

import contextlib


def ensure_numpy_compat() -> None:
    """Restore ``np.row_stack`` where NumPy (>= 2.5) removed it.

    numba-cuda 0.30.4 registers an overload for ``np.row_stack`` on its first kernel compile,
    which fails with ``AttributeError`` on NumPy 2.5. The alias is the function it always was.
    Call this before anything compiles; calling it twice is harmless.
    """
    import numpy as np

    if not hasattr(np, "row_stack"):
        np.row_stack = np.vstack


def compile_ptx(pyfunc, sig, cc=(9, 0), **options) -> str:
    """``numba.cuda.compile_ptx`` that also works on a machine without a GPU.

    numba-cuda compiles the device functions a kernel calls for the *current device*, so with
    no driver it fails before it reaches libNVVM. For the length of this call the current
    device is presented as one of compute capability ``cc``; only PTX is produced.
    """
    ensure_numpy_compat()
    from types import SimpleNamespace

    from numba import cuda
    from numba.cuda import dispatcher

    real = dispatcher.get_current_device
    dispatcher.get_current_device = lambda: SimpleNamespace(compute_capability=tuple(cc))
    try:
        ptx, _ = cuda.compile_ptx(pyfunc, sig, cc=tuple(cc), **options)
    finally:
        dispatcher.get_current_device = real
    return ptx


@contextlib.contextmanager
def small_grids():
    """Launches inside take small grids on purpose: Numba's low-occupancy warning is not
    shown. numba-cuda raises its own ``NumbaPerformanceWarning`` (``numba.cuda.core.errors``),
    not a subclass of numba's (``numba.core.errors``), so both are ignored.

    >>> import warnings
    >>> from numba.cuda.core.errors import NumbaPerformanceWarning
    >>> with warnings.catch_warnings():
    ...     warnings.simplefilter("error")
    ...     with small_grids():
    ...         warnings.warn(NumbaPerformanceWarning("Grid size 1 ..."))
    """
    import warnings

    from numba.core.errors import NumbaPerformanceWarning

    kinds = [NumbaPerformanceWarning]
    try:
        from numba.cuda.core.errors import NumbaPerformanceWarning as CudaPerformanceWarning
        kinds.append(CudaPerformanceWarning)
    except ImportError:  # (numba-cuda before it kept its own errors)
        pass
    with warnings.catch_warnings():
        for kind in kinds:
            warnings.simplefilter("ignore", kind)
        yield


__test__ = {"small_grids": small_grids}  # (doctest skips a function wrapped in another module)
