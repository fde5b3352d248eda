"""Element types a collective can move, independent of numpy, torch or CUDA.

>>> dtype("bf16").itemsize
2
>>> dtype("float32").name
'float32'
>>> dtype("e4m3").itemsize, dtype("e4m3").is_fp8
(1, True)

numpy has no FP8: FP8 elements are held on the host as their bits (uint8 arrays), and
:func:`fp8_decode` / :func:`fp8_encode` convert them with torch's own float8 casts (torch is
imported only there, so ``import purlin`` stays torch-free).
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

    @property
    def is_fp8(self) -> bool:
        """An 8-bit float (``float8_e4m3fn`` or ``float8_e5m2``)."""
        return self.name in FP8

    def numpy(self):
        """The numpy dtype that holds these elements on the host: bfloat16 is held as
        float32, FP8 as its bits in uint8."""
        import numpy as np

        if self.is_fp8:
            return np.dtype("uint8")
        return np.dtype("float32" if self.name == "bfloat16" else self.name)


FP8 = ("float8_e4m3fn", "float8_e5m2")
E4M3_MAX = 448.0  # float8_e4m3fn's largest finite value, where its overflow saturates


DTYPES = {
    d.name: d
    for d in (
        DType("bfloat16", 2, True),
        DType("float16", 2, True),
        DType("float32", 4, True),
        DType("float64", 8, True),
        DType("int32", 4, False),
        DType("int64", 8, False),
        DType("float8_e4m3fn", 1, True),
        DType("float8_e5m2", 1, True),
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
    "e4m3": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
    "e5m2": "float8_e5m2",
    "fp8_e5m2": "float8_e5m2",
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


def _fp8_torch(name: str):
    import torch  # FP8 only: numpy has none, and torch's casts are the codec

    if name not in FP8:
        raise SpecError(f"{name} is not an FP8 dtype; FP8 dtypes are {', '.join(FP8)}")
    return torch, getattr(torch, name)


def fp8_decode(bits, name: str):
    """FP8 elements as a float32 numpy array (exact): ``bits`` is a uint8 array of their bits
    or a torch float8 tensor.

    >>> fp8_decode(__import__("numpy").array([0x38, 0x7f], dtype="uint8"), "float8_e4m3fn")
    array([ 1., nan], dtype=float32)
    """
    import numpy as np

    torch, tdt = _fp8_torch(name)
    if isinstance(bits, torch.Tensor):
        return bits.detach().cpu().to(torch.float32).numpy()
    raw = np.ascontiguousarray(bits, dtype=np.uint8)
    return torch.from_numpy(raw).view(tdt).to(torch.float32).numpy()


def _saturate_e4m3fn(f32):
    """float32 values beyond +-448 (infinities too) clamped to +-448 before the cast: torch's
    CPU cast sent them to NaN until pytorch/pytorch#178817, and the codec must not depend on
    which torch is installed. NaN passes unchanged."""
    import numpy as np

    if not (np.abs(f32) > E4M3_MAX).any():  # (NaN compares false: it passes)
        return f32
    return np.where(np.isnan(f32), f32, np.clip(f32, -E4M3_MAX, E4M3_MAX)).astype(np.float32)


def fp8_encode(values, name: str, out=None):
    """``values`` rounded to FP8 ``name`` once, to nearest even, by torch's cast (float32
    inputs are cast directly, others go through float32 first); returns (or writes into
    ``out``) the uint8 bits. Out of range, e4m3fn saturates to +-448 (it has no infinity;
    an infinity saturates too) and e5m2 goes to +-inf; NaN stays NaN -- what
    ``purlin.kernels.fp8`` computes on the GPU.

    >>> fp8_encode([1.0, 500.0, float("-inf")], "float8_e4m3fn").tolist()
    [56, 126, 254]
    """
    import numpy as np

    torch, tdt = _fp8_torch(name)
    f32 = np.ascontiguousarray(values, dtype=np.float32)
    if name == "float8_e4m3fn":
        f32 = _saturate_e4m3fn(f32)
    bits = torch.from_numpy(f32).to(tdt).view(torch.uint8).numpy()
    if out is None:
        return bits
    np.copyto(out, bits.reshape(np.shape(out)))
    return out
