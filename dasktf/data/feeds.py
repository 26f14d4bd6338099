"""How a partition's blocks become a model's inputs, labels and weights.

Inference reads a collection partition by partition: per partition, a worker gets
one block of every Dask array of ``x`` (NumPy), or one partition of every Dask
DataFrame or Series (pandas). A :class:`Feed` says how one model input is read from
them: which block, which of a frame's columns, the dtype the model's input takes
(``"string"`` for a ``StringLookup``'s input) and its per-row shape. The client
builds the feeds once, from metadata alone (:mod:`dasktf.inference.inputs`), and
checks them on a probe row before any task runs; the workers only apply them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from dasktf.data.structure import Nest, map_nest

#: What a :class:`Feed` reads a string input as: Python ``str`` objects, which
#: TensorFlow converts to ``tf.string`` (Keras' ``predict`` refuses NumPy's
#: ``<U`` and object arrays, so the worker converts them itself).
STRING = "string"


@dataclass(frozen=True)
class Feed:
    """One model input (or label, or weight) read from a partition's blocks."""

    #: Which block of the partition (the position of its leaf in ``x``'s nest).
    part: int
    #: A frame's column (``str``) or columns (``tuple``) to take; ``None``: the block.
    columns: str | tuple[str, ...] | None
    #: The dtype to read it as: a NumPy dtype name, ``"string"``, or ``None`` (as is).
    dtype: str | None
    #: The per-row shape the model takes; a ``(n,)`` column becomes ``(n, 1)`` where
    #: the input is ``(None, 1)``. ``None``: as it comes.
    shape: tuple[int | None, ...] | None
    #: Where it comes from, for messages (``x['cat']``, ``x[column 'age']``).
    name: str

    def read(self, parts: list[Any]) -> np.ndarray:
        """This input's array from the partition's ``parts``."""
        block = parts[self.part]
        if self.columns is not None:
            block = block[list(self.columns) if isinstance(self.columns, tuple)
                          else self.columns]
        if hasattr(block, "to_numpy"):  # pandas
            if self.dtype == STRING:
                array = block.astype(str).to_numpy(dtype=object)
            else:
                array = block.to_numpy(dtype=None if self.dtype is None else np.dtype(self.dtype))
        else:
            array = np.asarray(block)
            if self.dtype == STRING and array.dtype.kind != "O":
                array = array.astype(str).astype(object)
        if (self.shape is not None and array.ndim == 1 and len(self.shape) == 1
                and self.shape[0] == 1):
            array = array[:, None]
        return array


def read_feeds(feeds: Nest, parts: list[Any]) -> Nest:
    """The nest of arrays ``feeds`` (a nest of :class:`Feed`) reads from ``parts``."""
    if feeds is None:
        return None
    return map_nest(lambda feed: feed.read(parts), feeds)


def probe_rows(dtype: Any, shape: tuple[int, ...], rows: int = 1) -> np.ndarray:
    """``rows`` placeholder rows of a leaf: zeros, or empty strings for text."""
    if dtype == STRING or np.dtype(dtype).kind in "OUS":
        return np.full((rows, *shape), "", dtype=object)
    return np.zeros((rows, *shape), dtype=dtype)
