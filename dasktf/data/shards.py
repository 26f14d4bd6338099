"""A worker's rows and what the client knows of them.

:class:`Shard` holds ``x``, ``y`` and optional sample weights ``w``, each an array
or a nest of arrays (:mod:`dasktf.data.structure`); :class:`ShardStats` is what the
client checks without fetching a shard (a :class:`LeafStats` per array: shape,
dtype, finiteness, value range). ``class_weight`` becomes sample weights here, as
Keras makes them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from dasktf.data.structure import (
    Nest,
    as_arrays,
    broadcast_to,
    concat,
    first_leaf,
    is_nested,
    leaves,
    map_named,
    map_nest,
    num_rows,
    take,
)


@dataclass
class Shard:
    """The rows one worker trains on (or evaluates), resident in its memory.

    ``x``, ``y`` and ``w`` (the sample weights, ``None`` for none) are arrays or
    nests of them (:mod:`dasktf.data.structure`), all with the same rows.
    """

    x: Nest
    y: Nest
    w: Nest = None

    def __len__(self) -> int:
        return len(first_leaf(self.x))

    @property
    def nbytes(self) -> int:
        return sum(leaf.nbytes for nest in (self.x, self.y, self.w) if nest is not None
                   for _, leaf in leaves(nest))

    @property
    def stats(self) -> ShardStats:
        """What the client checks of these rows (a streamed shard has its own)."""
        return ShardStats.of(self)

    def take(self, rows: Any) -> Shard:
        """The shard of rows ``rows`` (in that order)."""
        return Shard(take(self.x, rows), take(self.y, rows),
                     None if self.w is None else take(self.w, rows))

    @staticmethod
    def concat(parts: list[Shard]) -> Shard:
        return Shard(concat([p.x for p in parts]), concat([p.y for p in parts]),
                     None if parts[0].w is None else concat([p.w for p in parts]))


@dataclass(frozen=True)
class LeafStats:
    """One array's per-sample shape, dtype and value range, checked on the client."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    finite: bool
    low: float
    high: float
    integral: bool

    @property
    def layout(self) -> tuple[str, tuple[int, ...], str]:
        """What shards must agree on: the array's name, per-sample shape and dtype."""
        return self.name, self.shape, self.dtype

    @classmethod
    def of(cls, name: str, a: np.ndarray, values: bool = True) -> LeafStats:
        """``values=False``: shape, dtype and finiteness only (inputs need no range)."""
        finite = _all_finite(a)
        numeric = values and (np.issubdtype(a.dtype, np.number) or a.dtype == bool)
        integral = bool(np.issubdtype(a.dtype, np.integer)) or (
            numeric and finite and a.size > 0 and bool(np.all(np.mod(a, 1) == 0))
        )
        ranged = numeric and a.size and finite
        return cls(name, tuple(a.shape[1:]), str(a.dtype), finite,
                   float(a.min()) if ranged else 0.0, float(a.max()) if ranged else 0.0,
                   integral)


@dataclass(frozen=True)
class ShardStats:
    """What the client needs to validate a shard without fetching it: the row
    count and a :class:`LeafStats` per array, in the nest of ``x``, ``y``, ``w``."""

    n: int
    x: Nest
    y: Nest
    w: Nest = None

    @classmethod
    def of(cls, shard: Shard) -> ShardStats:
        n = num_rows({"x": shard.x, "y": shard.y,
                      **({} if shard.w is None else {"sample_weight": shard.w})})
        def inputs(name: str, a: np.ndarray) -> LeafStats:
            return LeafStats.of(name, a, values=False)

        return cls(n, map_named(inputs, shard.x, "x"),
                   map_named(LeafStats.of, shard.y, "y"),
                   None if shard.w is None else map_named(LeafStats.of, shard.w,
                                                          "sample_weight"))

    def all_leaves(self) -> list[LeafStats]:
        return [leaf for nest in (self.x, self.y, self.w) if nest is not None
                for _, leaf in leaves(nest)]

    def probe(self, rows: int = 1) -> tuple[Nest, Nest, Nest]:
        """Zero-valued ``(x, y, w)`` of ``rows`` rows with the data's shapes and dtypes."""
        def zeros(leaf: LeafStats) -> np.ndarray:
            if leaf.dtype == "object":  # strings (the only object arrays a shard holds)
                return np.full((rows, *leaf.shape), "", dtype=object)
            return np.zeros((rows, *leaf.shape), dtype=leaf.dtype)

        return (map_nest(zeros, self.x), map_nest(zeros, self.y),
                None if self.w is None else map_nest(lambda leaf: np.ones(
                    (rows, *leaf.shape), dtype=leaf.dtype), self.w))

    def layout(self) -> Any:
        """Shapes and dtypes of every array, to compare shards."""
        return [leaf.layout for leaf in self.all_leaves()]


def _all_finite(a: np.ndarray) -> bool:
    if not np.issubdtype(a.dtype, np.inexact):
        return True
    return bool(np.isfinite(a).all())


def check_stats(stats: Sequence[ShardStats], where: str = "the training data") -> None:
    """Raise ``ValueError`` for NaN/inf values or shards that disagree on shapes,
    naming the array (``x['image']``, ``y[1]``, ``sample_weight``) at fault."""
    layouts = set()
    for i, s in enumerate(stats):
        arrays = s.all_leaves()
        bad = [leaf.name for leaf in arrays if not leaf.finite]
        if bad:
            shard = f" (shard {i})" if len(stats) > 1 else ""
            raise ValueError(
                f"{where} contains NaN or infinite values in {', '.join(bad)}{shard}; "
                "clean or impute them before training."
            )
        if s.n:
            layouts.add(repr([leaf.layout for leaf in arrays]))
    if len(layouts) > 1:
        raise ValueError(f"The shards of {where} disagree on shapes: {sorted(layouts)}.")


def check_labels(stats: Sequence[ShardStats], path: str, num_classes: int) -> None:
    """Sparse class labels of output ``path`` must be integers in ``[0, num_classes)``."""
    labels = [leaf for s in stats if s.n for name, leaf in leaves(s.y, "y") if name == path]
    if not labels:
        return
    if not all(leaf.integral for leaf in labels):
        raise ValueError(
            f"Labels {path} must be integer class indices for a sparse categorical "
            "loss; got non-integer values."
        )
    low, high = min(leaf.low for leaf in labels), max(leaf.high for leaf in labels)
    if low < 0 or high >= num_classes:
        raise ValueError(
            f"Labels {path} must lie in [0, {num_classes}) for an output with "
            f"{num_classes} units; got labels from {low:g} to {high:g}. Check the "
            "labels, or give the model as many outputs as there are classes."
        )


def class_weight_to_sample_weight(y: np.ndarray, class_weight: dict[int, float]) -> np.ndarray:
    """Keras' mapping: each row weighs ``class_weight[its class]`` (1 if absent); the
    class of one-hot rows is their argmax."""
    labels = np.asarray(y)
    if labels.ndim > 1:
        labels = labels.argmax(axis=-1) if labels.shape[-1] != 1 else labels[..., 0]
    labels = np.round(labels).astype(np.int64).reshape(len(labels))
    weights = np.ones(len(labels), dtype=np.float32)
    for cls, weight in class_weight.items():
        weights[labels == int(cls)] = weight
    return weights


def check_class_weight(class_weight: Any, y: Nest) -> None:
    if class_weight is None:
        return
    if not isinstance(class_weight, dict) or not all(
        isinstance(k, (int, np.integer)) and not isinstance(k, bool) for k in class_weight
    ):
        raise TypeError("class_weight must be a dict {class index: weight}; "
                        f"got {class_weight!r}.")
    if is_nested(y):
        raise ValueError(
            "class_weight is only supported for models with a single output (as in "
            "Keras); give per-output sample_weight instead."
        )


def with_weights(shard: Shard, class_weight: dict[int, float] | None) -> Shard:
    """The shard with ``class_weight`` turned into sample weights (Keras' rule)."""
    if class_weight is None:
        return shard
    return Shard(shard.x, shard.y, class_weight_to_sample_weight(shard.y, class_weight))


def shard_of(x: Nest, y: Nest, w: Nest = None, class_weight: dict[int, float] | None = None,
             where: str = "", suffix: str = "") -> Shard:
    """``x``, ``y`` and sample weights ``w`` as one :class:`Shard`'s arrays, each leaf
    named as the user knows it (``suffix``: ``"_val"`` for validation data), and
    ``class_weight`` turned into sample weights, as Keras does."""
    x, y = as_arrays(x, f"x{suffix}"), as_arrays(y, f"y{suffix}")
    w = None if w is None else as_arrays(broadcast_to(w, y), f"sample_weight{suffix}")
    if w is not None and class_weight is not None:
        raise ValueError(f"{where} gives sample weights: give no class_weight too.")
    return with_weights(Shard(x, y, w), class_weight)


def part_from(out: Any, where: str, class_weight: dict[int, float] | None = None) -> Shard:
    """One ``(x, y[, sample_weight])`` element (a loader's, a dataset's batch) as a
    :class:`Shard`."""
    if not (isinstance(out, tuple) and len(out) in (2, 3)):
        raise TypeError(f"{where} must give (x, y) or (x, y, sample_weight) tuples; got "
                        f"{type(out).__name__}.")
    return shard_of(*out, class_weight=class_weight, where=where)
