"""Float32 <-> bfloat16 bit conversions in vectorised NumPy (issue 8).

A fixed sequence of whole-array integer operations (a rounding add and a shift),
so the cost does not depend on the values; bit-exact with ``ml_dtypes.bfloat16``
but for NaN payloads (tests/test_compression.py). Float16 is converted by
TensorFlow's cast instead (:class:`dasktf.wire.codecs.Float16`): bitwise float16
kernels in NumPy pass through float32 denormals on float16's subnormals, which
x86 handles in slow microcode (9-35 ms per 5.8M-value decode against ~5 ms).
"""

from __future__ import annotations

import numpy as np

#: Values per chunk: the scratch buffers of one chunk stay in L2.
CHUNK = 1 << 15

_U32 = np.uint32


class _Scratch:
    def __init__(self, n: int) -> None:
        self.u = [np.empty(n, _U32) for _ in range(3)]
        self.b = np.empty(n, np.bool_)


def _scratch(n: int) -> _Scratch:
    return _Scratch(min(n, CHUNK))


def f32_to_bf16_bits(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """bfloat16 bits (``uint16``) of float32 ``x``: round to nearest even, NaN kept."""
    x = np.ascontiguousarray(x, np.float32).ravel()
    n = x.size
    if out is None:
        out = np.empty(n, np.uint16)
    s = _scratch(n)
    for start in range(0, n, CHUNK):
        stop = min(n, start + CHUNK)
        m = stop - start
        w = x[start:stop].view(_U32)
        _t, r, a = (u[:m] for u in s.u)
        np.right_shift(w, _U32(16), out=r)
        r &= _U32(1)
        r += _U32(0x7FFF)
        r += w
        r >>= _U32(16)
        np.bitwise_and(w, _U32(0x7FFFFFFF), out=a)
        nan = s.b[:m]
        np.greater(a, _U32(0x7F800000), out=nan)
        if nan.any():
            r[nan] = (w[nan] >> _U32(16)) | _U32(0x0040)  # quiet, sign and payload kept
        out[start:stop] = r
    return out


def bf16_bits_to_f32(b: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Float32 values of bfloat16 bits ``b`` (``uint16``); exact."""
    b = np.ascontiguousarray(b).ravel().view(np.uint16)
    if out is None:
        out = np.empty(b.size, np.float32)
    np.left_shift(b, 16, out=out.view(_U32), dtype=_U32)
    return out
