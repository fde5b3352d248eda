"""FP8 on the device: decode to float32 and encode from it, in integer arithmetic.

The conversions are written out (no ``cvt`` instruction) so that they run on every GPU the
executor runs on, in the simulator, and agree bit for bit with torch's float8 casts, which
the cpu datapath uses: an encode rounds to nearest even once; out of range, ``float8_e4m3fn``
saturates to +-448 (an infinity too: it has none) and ``float8_e5m2`` goes to +-inf; NaN
stays NaN with its sign (``0x7f`` / ``0xff``). (PTX's ``cvt.rn.satfinite.e5m2x2.f32`` would
saturate e5m2 to 57344 instead of torch's infinity.) A decode is exact.

Codes are the isa's (``E4M3``, ``E5M2``): one byte per element.
"""

from __future__ import annotations

from purlin.kernels.intrinsics import bits_to_f32, device, f32_to_bits
from purlin.kernels.isa import E4M3


@device
def fp8_to_f32(byte, dt):
    """The float32 value of FP8 bits ``byte`` (an int) of dtype code ``dt`` (exact)."""
    sign = (byte & 0x80) << 24
    if dt == E4M3:
        e = (byte >> 3) & 0xF
        m = byte & 0x7
        if e == 0xF and m == 0x7:
            return bits_to_f32(sign | 0x7FF00000)  # torch's NaN bits
        if e == 0:  # subnormal: m x 2^-9, normalised into float32's exponent
            if m == 0:
                return bits_to_f32(sign)
            shift = 0
            while (m & 0x8) == 0:
                m <<= 1
                shift += 1
            return bits_to_f32(sign | ((127 - 6 - shift) << 23) | ((m & 0x7) << 20))
        return bits_to_f32(sign | ((e + 120) << 23) | (m << 20))
    # E5M2: float16's upper byte
    e = (byte >> 2) & 0x1F
    m = byte & 0x3
    if e == 0x1F:
        return bits_to_f32(sign | 0x7F800000 | (m << 21) | (0x400000 if m else 0))
    if e == 0:
        if m == 0:
            return bits_to_f32(sign)
        shift = 0
        while (m & 0x4) == 0:
            m <<= 1
            shift += 1
        return bits_to_f32(sign | ((127 - 14 - shift) << 23) | ((m & 0x3) << 21))
    return bits_to_f32(sign | ((e + 112) << 23) | (m << 21))


@device
def f32_to_fp8(x, dt):
    """FP8 bits (an int) of float32 ``x`` rounded once to nearest even, as torch casts."""
    bits = f32_to_bits(x) & 0xFFFFFFFF
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    if mag > 0x7F800000:  # NaN
        return sign | 0x7F
    if dt == E4M3:
        mbits, bias, top = 3, 7, 0x7E  # top: the largest finite code
    else:
        mbits, bias, top = 2, 15, 0x7B
    if mag == 0x7F800000:
        return sign | (top if dt == E4M3 else 0x7C)
    e32 = mag >> 23
    full = (mag & 0x7FFFFF) | (0x800000 if e32 else 0)
    # units of the last FP8 place: 2^(e - bias - mbits) for a normal, 2^(1 - bias - mbits) below
    e = e32 - 127 + bias
    if e >= 1:
        shift = 23 - mbits
        base = (e << mbits)
        q = base + ((full & 0x7FFFFF) >> shift)
    else:
        shift = 23 - mbits + 1 - e
        q = 0 if shift > 31 else (full >> shift)
    if shift <= 31:
        rem = full & ((1 << shift) - 1)
        half = 1 << (shift - 1)
        if rem > half or (rem == half and (q & 1) == 1):
            q += 1
    if q > top:
        return sign | (top if dt == E4M3 else 0x7C)
    return sign | q
