"""torch's CPU float32 -> float8_e4m3fn cast as it was before pytorch/pytorch#178817, for
tests: beyond 464 in magnitude (infinities too) it gave NaN instead of saturating to 448.

Purlin's codec (``purlin.spec.dtypes.fp8_encode``) must give the same bits under either rule:
the GPU kernels saturate, whatever torch the host has.
"""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np


@contextmanager
def older_torch_casts():
    """Within the block, ``purlin.spec.dtypes`` casts to e4m3fn with the older overflow rule."""
    import torch

    from purlin.spec import dtypes

    real = dtypes._fp8_torch

    class Older:
        def __getattr__(self, attr):
            return getattr(torch, attr)

        @staticmethod
        def from_numpy(array):
            if array.dtype == np.float32:  # what is about to be cast to e4m3fn
                with np.errstate(invalid="ignore"):
                    over = np.abs(array) > 464.0
                array = np.where(over, np.copysign(np.float32(np.nan), array),
                                 array).astype(np.float32)
            return torch.from_numpy(array)

    def fp8_torch(name):
        module, tdt = real(name)
        return (Older() if name == "float8_e4m3fn" else module), tdt

    dtypes._fp8_torch = fp8_torch
    try:
        yield
    finally:
        dtypes._fp8_torch = real
