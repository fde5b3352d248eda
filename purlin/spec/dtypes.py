"""Element types a collective can move, independent of numpy, torch or CUDA.

>>> dtype("bf16").itemsize
2
>>> dtype("float32").name
'float32'
"""

from __future__ import annotations

from dataclasses import dataclass

from purlin.errors import SpecError


@dataclass(frozen=True)
class DType:
    """An element type: its canonical name, size in bytes and whether it is floating point."""

    name: str
    itemsize: int
    is_float: bool

    def __repr__(self) -> str:
        return self.name

    def numpy(self):
        """The numpy dtype that holds these elements (bfloat16 is held as float32 on the host)."""
        import numpy as np

        return np.dtype("float32" if self.name == "bfloat16" else self.name)


DTYPES = {
    d.name: d
    for d in (
        DType("bfloat16", 2, True),
        DType("float16", 2, True),
        DType("float32", 4, True),
        DType("float64", 8, True),
        DType("int32", 4, False),
        DType("int64", 8, False),
    )
}

_ALIASES = {
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
    "fp32": "float32",
    "float": "float32",
    "fp64": "float64",
    "double": "float64",
    "int": "int32",
}


def dtype(value) -> DType:
    """Look up a DType from a name, an alias, a DType, a numpy dtype or scalar type, or a
    torch dtype.

    >>> dtype("fp16"), dtype(__import__("numpy").float32)
    (float16, float32)
    """
    if isinstance(value, DType):
        return value
    if isinstance(value, type):  # numpy scalar types such as np.float32
        value = getattr(value, "__name__", value)
    text = str(value).removeprefix("torch.")
    text = _ALIASES.get(text, text)
    if text not in DTYPES:
        known = ", ".join(DTYPES)
        raise SpecError(f"unknown dtype {value!r}: Purlin moves {known}")
    return DTYPES[text]
