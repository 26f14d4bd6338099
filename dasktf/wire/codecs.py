"""Gradient and weight codecs: what a buffer looks like on the wire.

A codec turns a flat float32 buffer into an :class:`Encoded` (a few NumPy arrays
and the codec's name) on the worker that produced it, and :func:`decode` turns it
back into float32 wherever it is used; sums and means are always taken in float32.

=========== ============================================= ==================================
codec       on the wire (n values)                        round-trip error (stated bound)
=========== ============================================= ==================================
``none``    float32, 4n bytes                             exact
``fp16``    IEEE half, 2n bytes                           ``|e| <= 2**-11 |x|`` (normal range)
``bf16``    bfloat16 (top 16 bits, round to nearest), 2n  ``|e| <= 2**-8 |x|``
``int8``    int8 + one float32 scale per 256 values,      ``|e| <= max|x_block| / 254``
            n + 4n/256 bytes
``topk:R``  the ``k = ceil(R n)`` largest magnitudes:     the dropped values (all but k)
            int32 index + float32 value, 8k bytes
=========== ============================================= ==================================

Lossy codecs are used through :class:`ErrorFeedback`: what a step's encoding lost
(the *residual*) is added to the next step's gradient, so over many steps every
gradient component is eventually sent and sparsified training converges
(Seide et al. 2014, "1-bit SGD"; Lin et al. 2018, "Deep Gradient Compression").

Extending: subclass :class:`Codec`, give it a unique ``name``, implement ``encode``
and ``_decode``, and add it to ``_CODECS`` (parametrised codecs also to
:func:`get_codec`); set ``sparse`` for a codec whose parts an all-reduce should
gather whole (its sums would fill in), ``sum_lossy = False`` where ``encode_sum`` is
exact.

Speed: a codec runs on the hot path twice per step per worker (encode, decode) on
buffers of millions of values, so its cost must not depend on the values, which
for half precision is hard: NumPy's own float16 cast takes ~25x longer on
gradient-sized values, and bitwise NumPy kernels still pass through float32
denormals on float16's subnormals. ``fp16`` therefore converts with TensorFlow's
cast on the CPU (hardware F16C; the workers have TensorFlow loaded anyway),
``bf16`` with the bitwise kernels of :mod:`dasktf.wire.halfcast` (a shift and a
rounding add), the others with whole-array NumPy. Decoding can write into a
caller's buffer (``out=``) so error feedback allocates nothing per step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
from dask.sizeof import sizeof

from dasktf.wire.halfcast import bf16_bits_to_f32, f32_to_bf16_bits

#: Values per int8 scale: small enough that one large component does not flatten
#: a whole layer to zero, large enough that the scales cost under 2%.
INT8_BLOCK = 256


@dataclass
class Encoded:
    """A flat float32 buffer of ``size`` values as a codec put it on the wire."""

    codec: str
    size: int
    arrays: tuple[np.ndarray, ...]

    @property
    def nbytes(self) -> int:
        """The bytes this buffer weighs on the wire (its arrays' data)."""
        return int(sum(a.nbytes for a in self.arrays))


@sizeof.register(Encoded)
def _sizeof_encoded(e: Encoded) -> int:
    # Dask places tasks by the bytes of their inputs; a dataclass would count ~50.
    return e.nbytes + 64


class Codec:
    """A way to put a float32 buffer on the wire (see the module docstring)."""

    name: ClassVar[str] = ""
    #: Whether a round trip can change values (then :class:`ErrorFeedback` applies).
    lossy: ClassVar[bool] = True
    #: Whether :meth:`encode_sum` can change values (a sum's re-encoding then keeps
    #: a residual of its own where the sum is made, :class:`ErrorFeedback`).
    sum_lossy: ClassVar[bool] = True
    #: Whether the encoding keeps a few values and their indices: the parts are then
    #: gathered whole rather than summed chunk by chunk (an all-reduce's partial sums
    #: would fill in the union of the indices).
    sparse: ClassVar[bool] = False

    def encode(self, x: np.ndarray) -> Encoded:
        raise NotImplementedError

    def encode_sum(self, x: np.ndarray) -> Encoded:
        """Encode a *sum* of decoded buffers on its way back to the replicas (no
        error feedback there: every replica receives the same values)."""
        return self.encode(x)

    def _decode(self, e: Encoded, out: np.ndarray | None = None) -> np.ndarray:
        """``e`` back in float32, written into ``out`` (``e.size`` values) if given."""
        raise NotImplementedError

    def ratio(self, size: int) -> float:
        """Bytes of float32 over bytes on the wire for a buffer of ``size`` values."""
        probe = self.encode(np.ones(size, np.float32))
        return 4.0 * size / max(1, probe.nbytes)

    def __repr__(self) -> str:
        return f"Codec({self.name!r})"


class NoCompression(Codec):
    name = "none"
    lossy = False
    sum_lossy = False

    def encode(self, x: np.ndarray) -> Encoded:
        return Encoded(self.name, x.size, (np.asarray(x, np.float32),))

    def _decode(self, e: Encoded, out: np.ndarray | None = None) -> np.ndarray:
        if out is None:
            return e.arrays[0]
        np.copyto(out, e.arrays[0])
        return out


class Float16(Codec):
    """IEEE half; it travels as a ``float16`` array. Converted by TensorFlow's cast
    on the CPU: bit-exact with NumPy's (round to nearest even, subnormals, overflow
    to infinity, NaN stays NaN) at ~5 ms per 5.8M values whatever the values,
    where NumPy's cast took up to 370 ms and bitwise NumPy kernels 9-35 ms to
    decode (benchmarks/RESULTS.md)."""

    name = "fp16"

    def encode(self, x: np.ndarray) -> Encoded:
        return Encoded(self.name, x.size, (_cpu_cast(x, "float16"),))

    def _decode(self, e: Encoded, out: np.ndarray | None = None) -> np.ndarray:
        values = _cpu_cast(e.arrays[0], "float32")
        if out is None:
            return values
        np.copyto(out, values)
        return out


def _cpu_cast(x: np.ndarray, dtype: str) -> np.ndarray:
    """``x`` (flattened) cast to ``dtype`` by TensorFlow on the CPU (a GPU worker
    would otherwise send the buffer to its device and back); a new array."""
    import tensorflow as tf

    with tf.device("/CPU:0"):
        return tf.cast(np.ascontiguousarray(x).ravel(), dtype).numpy()  # type: ignore[no-any-return]


class BFloat16(Codec):
    """bfloat16 (float32's range, 8 bits of mantissa, round to nearest even); it
    travels as its uint16 bits (bit-exact with ``ml_dtypes.bfloat16`` but NaN
    payloads, see :mod:`dasktf.wire.halfcast`)."""

    name = "bf16"

    def encode(self, x: np.ndarray) -> Encoded:
        return Encoded(self.name, x.size, (f32_to_bf16_bits(x),))

    def _decode(self, e: Encoded, out: np.ndarray | None = None) -> np.ndarray:
        return bf16_bits_to_f32(e.arrays[0], out)


class Int8(Codec):
    """Symmetric linear quantisation to int8, one float32 scale per block."""

    name = "int8"

    #: Blocks per pass: a pass's float32 scratch (128 KiB) stays in L2.
    _ROWS = 128

    def encode(self, x: np.ndarray) -> Encoded:
        x = np.ascontiguousarray(x, np.float32).ravel()
        n = x.size
        blocks = -(-n // INT8_BLOCK)
        full = n // INT8_BLOCK
        q = np.empty(blocks * INT8_BLOCK, np.int8)
        scale = np.empty(blocks, np.float32)
        tmp = np.empty((self._ROWS, INT8_BLOCK), np.float32)
        for r0 in range(0, blocks, self._ROWS):
            r1 = min(blocks, r0 + self._ROWS)
            if r1 <= full:
                rows = x[r0 * INT8_BLOCK : r1 * INT8_BLOCK].reshape(-1, INT8_BLOCK)
            else:  # the ragged last block, padded with zeros
                rows = np.zeros((r1 - r0, INT8_BLOCK), np.float32)
                rows.ravel()[: n - r0 * INT8_BLOCK] = x[r0 * INT8_BLOCK :]
            t = tmp[: r1 - r0]
            np.abs(rows, out=t)
            s = scale[r0:r1]
            np.max(t, axis=1, out=s)
            s /= np.float32(127.0)
            safe = np.where(s > 0, s, np.float32(1.0))
            np.divide(rows, safe[:, None], out=t)
            np.rint(t, out=t)
            np.clip(t, -127, 127, out=t)
            q[r0 * INT8_BLOCK : r1 * INT8_BLOCK] = t.ravel()
        return Encoded(self.name, n, (q[:n], scale))

    def _decode(self, e: Encoded, out: np.ndarray | None = None) -> np.ndarray:
        q, scale = e.arrays
        n = e.size
        if out is None:
            out = np.empty(n, np.float32)
        full = n // INT8_BLOCK
        m = full * INT8_BLOCK
        np.multiply(
            q[:m].reshape(full, INT8_BLOCK), scale[:full, None],
            out=out[:m].reshape(full, INT8_BLOCK),
        )
        if n > m:
            np.multiply(q[m:], scale[full], out=out[m:])
        return out


class TopK(Codec):
    """Sparsification: only the ``ceil(ratio * n)`` largest magnitudes travel."""

    name = "topk"
    sum_lossy = False  # (:meth:`encode_sum` is exact)
    sparse = True

    def __init__(self, ratio: float) -> None:
        self.ratio_kept = float(ratio)

    def encode(self, x: np.ndarray) -> Encoded:
        x = np.asarray(x, np.float32)
        k = self.kept(x.size)
        if k >= x.size:
            index = np.arange(x.size, dtype=np.int32)
        else:
            index = np.sort(np.argpartition(np.abs(x), x.size - k)[x.size - k :])
        index = index.astype(np.int32)
        return Encoded(self.name, x.size, (index, x[index]))

    def kept(self, size: int) -> int:
        """The values of ``size`` that travel."""
        return min(size, max(1, math.ceil(self.ratio_kept * size)))

    def ratio(self, size: int) -> float:
        return 4.0 * size / (8.0 * self.kept(size))  # (no encoding needed to know)

    def encode_sum(self, x: np.ndarray) -> Encoded:
        """A sum of sparse buffers is sparse (at most N k non-zeros): send it
        exactly, as index/value pairs, or dense float32 if that is smaller."""
        x = np.asarray(x, np.float32)
        index = np.flatnonzero(x).astype(np.int32)
        if 8 * index.size >= 4 * x.size:
            return NoCompression().encode(x)
        return Encoded(self.name, x.size, (index, x[index]))

    def _decode(self, e: Encoded, out: np.ndarray | None = None) -> np.ndarray:
        index, values = e.arrays
        if out is None:
            out = np.zeros(e.size, np.float32)
        else:
            out.fill(0)
        out[index] = values
        return out

    def __repr__(self) -> str:
        return f"Codec('topk:{self.ratio_kept:g}')"


_CODECS: dict[str, type[Codec]] = {
    c.name: c for c in (NoCompression, Float16, BFloat16, Int8)  # type: ignore[type-abstract]
}
#: The codec names :func:`get_codec` accepts (``topk`` takes a ratio: ``topk:0.01``).
CODECS = (*_CODECS, "topk:RATIO")


def get_codec(spec: str | Codec | None) -> Codec:
    """The codec named by ``spec`` (``None``: no compression).

    Raises
    ------
    ValueError
        An unknown name, or a ``topk`` ratio outside (0, 1].
    """
    if isinstance(spec, Codec):
        return spec
    if spec is None:
        return NoCompression()
    if not isinstance(spec, str):
        raise TypeError(f"compression must be a string such as 'fp16'; got {spec!r}.")
    name, _, arg = spec.strip().lower().partition(":")
    if name == "topk":
        try:
            ratio = float(arg)
        except ValueError:
            ratio = float("nan")
        if not 0 < ratio <= 1:
            raise ValueError(
                f"compression={spec!r}: topk takes the fraction of values to send, "
                "in (0, 1], e.g. 'topk:0.01'."
            )
        return TopK(ratio)
    if name in _CODECS and not arg:
        return _CODECS[name]()
    raise ValueError(
        f"Unknown compression {spec!r}; use one of {', '.join(CODECS)} "
        "(e.g. 'fp16' or 'topk:0.01')."
    )


def validate_weights_dtype(value: str | None) -> str | None:
    """``None``, ``"fp16"`` or ``"bf16"`` (``"float32"``/``"none"`` mean ``None``)."""
    if value in (None, "none", "float32", "fp32"):
        return None
    if value in ("fp16", "bf16"):
        return value
    raise ValueError(
        f"weights_dtype must be 'fp16', 'bf16' or None (float32); got {value!r}."
    )


def decode(e: Encoded, out: np.ndarray | None = None) -> np.ndarray:
    """Back to a flat float32 buffer, whichever codec made ``e`` (written into
    ``out``, a float32 buffer of ``e.size`` values, if given)."""
    if e.codec == TopK.name:
        return TopK(1.0)._decode(e, out)
    return _CODECS[e.codec]()._decode(e, out)


class ErrorFeedback:
    """A codec with a residual: what one encoding lost is sent with the next.

    ``encode(g)`` sends ``g + r`` and keeps ``r = (g + r) - decode(sent)``. Hence,
    over any number of steps, ``sum(decoded) + r == sum(g)`` (up to float32
    rounding): no gradient is lost, only delayed. Lossless codecs keep no residual.
    ``summed=True`` encodes with :meth:`Codec.encode_sum` (a finished sum re-encoded
    where it was made, as the p2p all-reduce's owner of a chunk does), keeping a
    residual only where that encoding is lossy (``Codec.sum_lossy``).
    """

    def __init__(self, codec: Codec, summed: bool = False) -> None:
        self.codec = codec
        #: encodes sums (:meth:`Codec.encode_sum`) rather than contributions
        self.summed = summed
        self.residual: np.ndarray | None = None
        self._decoded: np.ndarray | None = None

    def encode(self, x: np.ndarray) -> Encoded:
        lossy = self.codec.sum_lossy if self.summed else self.codec.lossy
        encode = self.codec.encode_sum if self.summed else self.codec.encode
        if not lossy:
            return encode(x)
        x = np.asarray(x, np.float32)
        # Both buffers are reused from step to step: the residual holds the target
        # while it is encoded, then what the encoding lost.
        if self.residual is None or self.residual.shape != x.shape:
            self.residual = np.array(x, np.float32, copy=True)
            self._decoded = np.empty_like(self.residual)
        else:
            self.residual += x
        sent = encode(self.residual)
        self.residual -= decode(sent, out=self._decoded)
        return sent
