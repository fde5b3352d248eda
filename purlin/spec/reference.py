"""The oracle: every rank's expected output, computed in float64 with numpy.

>>> import numpy as np
>>> from purlin.spec import collectives
>>> out = reference(collectives.all_reduce(2), [np.array([1., 2.]), np.array([10., 20.])])
>>> out[0].tolist(), out[1].tolist()
([11.0, 22.0], [11.0, 22.0])

FP8 inputs (torch float8 tensors, or uint8 arrays of FP8 bits with ``dtype=``) are decoded
exactly and reduced in float64 like any other; the result is not rounded back to FP8.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from purlin.errors import SpecError
from purlin.spec.collective import Collective, _fmt
from purlin.spec.dtypes import FP8, dtype as as_dtype, fp8_decode
from purlin.spec.sizing import Sizing

_REDUCERS = {
    "sum": lambda parts: np.sum(parts, axis=0),
    "avg": lambda parts: np.mean(parts, axis=0),
    "max": lambda parts: np.max(parts, axis=0),
    "min": lambda parts: np.min(parts, axis=0),
}


def infer_sizing(collective: Collective, inputs: Sequence) -> Sizing:
    """Even chunk sizes read off the input lengths, checked against every rank."""
    lengths = [len(np.ravel(x)) for x in inputs]
    chunk = None
    for rank, row in enumerate(collective.input):
        if not row:
            continue
        if lengths[rank] % len(row):
            raise SpecError(f"input of rank {rank} has {lengths[rank]} elements, which do not "
                            f"divide into its {len(row)} chunks")
        each = lengths[rank] // len(row)
        if chunk is not None and each != chunk:
            raise SpecError(f"input of rank {rank} has chunks of {each} elements, other ranks "
                            f"{chunk}; pass a Sizing for uneven chunks")
        chunk = each
    return collective.sized(chunk_sizes=lambda _name: chunk or 0)


def _float64(x, fp8: str | None) -> np.ndarray:
    """Input ``x`` as a flat float64 array; FP8 (a torch float8 tensor, or bits when ``fp8``
    names the dtype) decoded exactly."""
    name = str(getattr(x, "dtype", "")).removeprefix("torch.")
    if name in FP8 or fp8:
        return fp8_decode(x, name if name in FP8 else fp8).astype(np.float64).ravel()
    return np.asarray(x, dtype=np.float64).ravel()


def reference(collective: "Collective | Sizing", inputs: Sequence,
              dtype=None) -> list[np.ndarray]:
    """Each rank's output as a float64 array, from each rank's flat input.

    ``collective`` may be a Sizing (needed for uneven chunks) or a Collective (even chunks,
    inferred from the input lengths). ``dtype`` (an FP8 dtype) says uint8 inputs hold FP8
    bits; torch float8 tensors say so themselves.
    """
    sizing = collective if isinstance(collective, Sizing) else None
    coll = sizing.collective if sizing else collective
    if len(inputs) != coll.nranks:
        raise SpecError(f"{coll.name} has {coll.nranks} ranks but {len(inputs)} inputs were given")
    fp8 = None
    if dtype is not None:
        fp8 = as_dtype(dtype).name
        if fp8 not in FP8:
            raise SpecError(f"reference(dtype={dtype!r}) is for FP8 bits; other inputs carry "
                            "their dtype, leave dtype out")
    flat = [_float64(x, fp8) for x in inputs]
    sizing = sizing or infer_sizing(coll, flat)
    for rank, x in enumerate(flat):
        want = sizing.input_count(rank)
        if len(x) != want:
            raise SpecError(f"input of rank {rank} has {len(x)} elements, the sizing says {want}")

    def chunk(rank, pos):
        at = sizing.input_offset(rank, pos)
        return flat[rank][at: at + sizing.chunk_count(coll.input[rank][pos])]

    outputs = []
    for rank, row in enumerate(coll.output):
        parts = []
        for name in row:
            srcs = [chunk(r, p) for r, p in coll.sources(name)]
            if not srcs:  # Collective validation makes this unreachable; keep the message clear
                raise SpecError(f"output name {_fmt(name)!r} at rank {rank} has no source")
            if coll.op.is_reduce:
                parts.append(_REDUCERS[coll.op.reduce_op](np.stack(srcs)))
            else:
                parts.append(srcs[0].copy())
        outputs.append(np.concatenate(parts) if parts else np.zeros(0))
    return outputs
