"""Moving statistics (BatchNorm's mean and variance): the model's non-trainable
float variables, which every replica updates from its own batches and the run
averages across the replicas at each epoch's end, as MirroredStrategy does."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


def non_trainable_floats(model: Any) -> list[Any]:
    """The model's non-trainable float variables: moving statistics that every
    replica updates from its own batches. Integer ones (a seed generator's state)
    are no statistic and stay each replica's own."""
    import keras

    return [v for v in model.non_trainable_variables
            if keras.backend.is_float_dtype(v.dtype)]


def non_trainable_values(model: Any) -> list[np.ndarray] | None:
    """:func:`non_trainable_floats`' values, ``None`` when the model has none."""
    return read_values(non_trainable_floats(model))


def read_values(variables: list[Any]) -> list[np.ndarray] | None:
    """The variables' values, ``None`` for none."""
    return [np.asarray(v.numpy()) for v in variables] or None


def mean_non_trainable(values: Sequence[list[np.ndarray]]) -> list[np.ndarray]:
    """The replicas' statistics averaged, as MirroredStrategy reads a variable
    aggregated with MEAN: summed in the order given, so every replica averaging the
    same list gets bitwise the same result. A variable no replica changed (frozen
    layers, an adapted ``Normalization``) is kept bit for bit: the mean of equal
    float32 values can be an ulp off."""
    return [_mean([v[i] for v in values]) for i in range(len(values[0]))]


def _mean(arrays: list[np.ndarray]) -> np.ndarray:
    if all(np.array_equal(a, arrays[0]) for a in arrays[1:]):
        return arrays[0]
    return np.mean(arrays, axis=0).astype(arrays[0].dtype)
