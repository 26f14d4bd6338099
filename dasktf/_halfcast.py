"""Float32 <-> float16 / bfloat16 bit conversions in vectorised NumPy (issue 8).

NumPy's ``astype(np.float16)`` converts element by element in software, and it is
slowest exactly where gradients live: values in float16's subnormal range
(|x| < 6.1e-5) took ~370 ms per 5.8M values on the 2-core machine, against
~15 ms for values near 1 (``benchmarks/RESULTS.md``). These kernels are a fixed
sequence of whole-array integer/float operations, run over cache-sized chunks
into preallocated scratch, so their cost does not depend on the values. They are
bit-exact with NumPy (float16, round to nearest even, subnormals, overflow to
infinity, NaN stays NaN) and with ``ml_dtypes.bfloat16`` (tests/test_compression.py).

The float16 formulas are Maratyszcza's (the FP16 library, MIT): scaling by powers
of two lets the FPU do the rounding, subnormals included.
"""

from __future__ import annotations

import numpy as np

#: Values per chunk: the ~5 scratch buffers of one chunk stay in L2.
CHUNK = 1 << 15

_U32 = np.uint32
_SCALE_TO_INF = np.float32(2.0**112)
_SCALE_TO_ZERO = np.float32(2.0**-110)
_EXP_SCALE = np.float32(2.0**-112)


class _Scratch:
    def __init__(self, n: int) -> None:
        self.u = [np.empty(n, _U32) for _ in range(3)]
        self.f = np.empty(n, np.float32)
        self.b = np.empty(n, np.bool_)


def _scratch(n: int) -> _Scratch:
    return _Scratch(min(n, CHUNK))


def f32_to_f16_bits(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """IEEE half bits (``uint16``) of float32 ``x``, round to nearest even."""
    with np.errstate(all="ignore"):  # inf and NaN in the scaling are intended
        return _f32_to_f16_bits(x, out)


def _f32_to_f16_bits(x: np.ndarray, out: np.ndarray | None) -> np.ndarray:
    x = np.ascontiguousarray(x, np.float32).ravel()
    n = x.size
    if out is None:
        out = np.empty(n, np.uint16)
    s = _scratch(n)
    for start in range(0, n, CHUNK):
        stop = min(n, start + CHUNK)
        m = stop - start
        xf = x[start:stop]
        w = xf.view(_U32)
        shl1, bias, t = (u[:m] for u in s.u)
        base = s.f[:m]
        # base = (|x| * 2^112) * 2^-110: rounds huge values to infinity
        np.abs(xf, out=base)
        base *= _SCALE_TO_INF
        base *= _SCALE_TO_ZERO
        np.add(w, w, out=shl1)  # drops the sign
        np.bitwise_and(shl1, _U32(0xFF000000), out=bias)
        np.maximum(bias, _U32(0x71000000), out=bias)
        bias >>= _U32(1)
        bias += _U32(0x07800000)
        base += bias.view(np.float32)  # the FPU rounds to 10 mantissa bits here
        bits = base.view(_U32)
        np.right_shift(bits, _U32(13), out=t)
        t &= _U32(0x00007C00)
        bits &= _U32(0x00000FFF)
        t += bits  # exponent + mantissa
        # NaN (not infinity): a quiet NaN
        nan = s.b[:m]
        np.greater(shl1, _U32(0xFF000000), out=nan)
        np.copyto(t, _U32(0x7E00), where=nan)
        np.right_shift(w, _U32(16), out=bias)
        bias &= _U32(0x8000)
        t |= bias
        out[start:stop] = t
    return out


def f16_bits_to_f32(h: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Float32 values of IEEE half bits ``h`` (``uint16`` or ``float16``); exact."""
    with np.errstate(all="ignore"):  # NaN payloads scaled on purpose
        return _f16_bits_to_f32(h, out)


def _f16_bits_to_f32(h: np.ndarray, out: np.ndarray | None) -> np.ndarray:
    h = np.ascontiguousarray(h).ravel().view(np.uint16)
    n = h.size
    if out is None:
        out = np.empty(n, np.float32)
    s = _scratch(n)
    for start in range(0, n, CHUNK):
        stop = min(n, start + CHUNK)
        m = stop - start
        w, two_w, t = (u[:m] for u in s.u)
        dn = s.f[:m]
        np.left_shift(h[start:stop], 16, out=w, dtype=_U32)
        np.add(w, w, out=two_w)
        # normal (and inf/NaN): exponent re-biased by an add, then scaled
        o = out[start:stop]
        ou = o.view(_U32)
        np.right_shift(two_w, _U32(4), out=ou)
        ou += _U32(0xE0 << 23)
        o *= _EXP_SCALE
        # subnormal: the mantissa as the low bits of 0.5's, minus 0.5
        np.right_shift(two_w, _U32(17), out=t)
        t |= _U32(126 << 23)
        np.subtract(t.view(np.float32), np.float32(0.5), out=dn)
        small = s.b[:m]
        np.less(two_w, _U32(1 << 27), out=small)
        np.copyto(ou, dn.view(_U32), where=small)
        w &= _U32(0x80000000)
        ou |= w
    return out


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
        t, r, a = (u[:m] for u in s.u)
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
