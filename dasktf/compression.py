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
:func:`get_codec`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from dask.sizeof import sizeof

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

    def encode(self, x: np.ndarray) -> Encoded:
        raise NotImplementedError

    def encode_sum(self, x: np.ndarray) -> Encoded:
        """Encode a *sum* of decoded buffers on its way back to the replicas (no
        error feedback there: every replica receives the same values)."""
        return self.encode(x)

    def _decode(self, e: Encoded) -> np.ndarray:
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

    def encode(self, x: np.ndarray) -> Encoded:
        return Encoded(self.name, x.size, (np.asarray(x, np.float32),))

    def _decode(self, e: Encoded) -> np.ndarray:
        return e.arrays[0]


class Float16(Codec):
    name = "fp16"

    def encode(self, x: np.ndarray) -> Encoded:
        return Encoded(self.name, x.size, (np.asarray(x, np.float32).astype(np.float16),))

    def _decode(self, e: Encoded) -> np.ndarray:
        return e.arrays[0].astype(np.float32)


class BFloat16(Codec):
    """bfloat16 (float32's range, 8 bits of mantissa, round to nearest even), by
    ``ml_dtypes`` (a TensorFlow dependency); it travels as its uint16 bits."""

    name = "bf16"

    def encode(self, x: np.ndarray) -> Encoded:
        import ml_dtypes

        bits = np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)
        return Encoded(self.name, x.size, (bits,))

    def _decode(self, e: Encoded) -> np.ndarray:
        import ml_dtypes

        return e.arrays[0].view(ml_dtypes.bfloat16).astype(np.float32)


class Int8(Codec):
    """Symmetric linear quantisation to int8, one float32 scale per block."""

    name = "int8"

    def encode(self, x: np.ndarray) -> Encoded:
        x = np.asarray(x, np.float32)
        n = x.size
        blocks = -(-n // INT8_BLOCK)
        padded = np.zeros(blocks * INT8_BLOCK, np.float32)
        padded[:n] = x
        padded = padded.reshape(blocks, INT8_BLOCK)
        scale = np.abs(padded).max(axis=1) / 127.0
        safe = np.where(scale > 0, scale, 1.0).astype(np.float32)
        q = np.clip(np.rint(padded / safe[:, None]), -127, 127).astype(np.int8)
        return Encoded(self.name, n, (q.ravel()[:n], scale.astype(np.float32)))

    def _decode(self, e: Encoded) -> np.ndarray:
        q, scale = e.arrays
        blocks = scale.size
        padded = np.zeros(blocks * INT8_BLOCK, np.float32)
        padded[: e.size] = q
        out = padded.reshape(blocks, INT8_BLOCK) * scale[:, None]
        return out.ravel()[: e.size]


class TopK(Codec):
    """Sparsification: only the ``ceil(ratio * n)`` largest magnitudes travel."""

    name = "topk"

    def __init__(self, ratio: float) -> None:
        self.ratio_kept = float(ratio)

    def encode(self, x: np.ndarray) -> Encoded:
        x = np.asarray(x, np.float32)
        k = min(x.size, max(1, math.ceil(self.ratio_kept * x.size)))
        if k >= x.size:
            index = np.arange(x.size, dtype=np.int32)
        else:
            index = np.sort(np.argpartition(np.abs(x), x.size - k)[x.size - k :])
        index = index.astype(np.int32)
        return Encoded(self.name, x.size, (index, x[index]))

    def encode_sum(self, x: np.ndarray) -> Encoded:
        """A sum of sparse buffers is sparse (at most N k non-zeros): send it
        exactly, as index/value pairs, or dense float32 if that is smaller."""
        x = np.asarray(x, np.float32)
        index = np.flatnonzero(x).astype(np.int32)
        if 8 * index.size >= 4 * x.size:
            return NoCompression().encode(x)
        return Encoded(self.name, x.size, (index, x[index]))

    def _decode(self, e: Encoded) -> np.ndarray:
        index, values = e.arrays
        out = np.zeros(e.size, np.float32)
        out[index] = values
        return out

    def __repr__(self) -> str:
        return f"Codec('topk:{self.ratio_kept:g}')"


_CODECS: dict[str, type[Codec]] = {
    c.name: c for c in (NoCompression, Float16, BFloat16, Int8)  # type: ignore[type-abstract]
}
#: The codec names :func:`get_codec` accepts (``topk`` takes a ratio: ``topk:0.01``).
CODECS = (*_CODECS, "topk:RATIO")
#: Lower-precision forms the weights may travel in.
WEIGHT_DTYPES = (None, "fp16", "bf16")


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


def decode(e: Encoded) -> np.ndarray:
    """Back to a flat float32 buffer, whichever codec made ``e``."""
    if e.codec == TopK.name:
        return TopK(1.0)._decode(e)
    return _CODECS[e.codec]()._decode(e)


class ErrorFeedback:
    """A codec with a residual: what one encoding lost is sent with the next.

    ``encode(g)`` sends ``g + r`` and keeps ``r = (g + r) - decode(sent)``. Hence,
    over any number of steps, ``sum(decoded) + r == sum(g)`` (up to float32
    rounding): no gradient is lost, only delayed. Lossless codecs keep no residual.
    """

    def __init__(self, codec: Codec) -> None:
        self.codec = codec
        self.residual: np.ndarray | None = None

    def encode(self, x: np.ndarray) -> Encoded:
        if not self.codec.lossy:
            return self.codec.encode(x)
        target = x if self.residual is None else x + self.residual
        sent = self.codec.encode(target)
        self.residual = target - decode(sent)
        return sent
