"""Nested inputs and outputs: arrays, or lists, tuples and dicts of them.

Keras' ``fit`` takes ``x``, ``y`` and ``sample_weight`` as one array or as a nest
matching the model's inputs and outputs (by position or by name). dasktf keeps the
nest as given and only ever does row-wise work on it: take rows, concatenate
parts, describe each leaf. Every leaf has a path name such as ``x['image']`` or
``y[1]``, so an error says which input or output is at fault.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

Nest = Any  # np.ndarray | list[Nest] | tuple[Nest, ...] | dict[str, Nest]


def is_nested(value: Any) -> bool:
    return isinstance(value, (list, tuple, dict))


def leaves(nest: Nest, name: str = "x") -> Iterator[tuple[str, Any]]:
    """``(path name, leaf)`` pairs in a stable order (dict keys as given)."""
    if isinstance(nest, dict):
        for key, value in nest.items():
            yield from leaves(value, f"{name}[{key!r}]")
    elif isinstance(nest, (list, tuple)):
        for i, value in enumerate(nest):
            yield from leaves(value, f"{name}[{i}]")
    else:
        yield name, nest


def map_nest(fn: Callable[..., Any], nest: Nest, *others: Nest) -> Nest:
    """``fn`` applied leaf by leaf over nests of the same structure."""
    if isinstance(nest, dict):
        return {k: map_nest(fn, v, *(o[k] for o in others)) for k, v in nest.items()}
    if isinstance(nest, (list, tuple)):
        return type(nest)(
            map_nest(fn, v, *(o[i] for o in others)) for i, v in enumerate(nest)
        )
    return fn(nest, *others)


def map_named(fn: Callable[[str, Any], Any], nest: Nest, name: str = "x") -> Nest:
    """``fn(path name, leaf)`` leaf by leaf, keeping the structure."""
    if isinstance(nest, dict):
        return {k: map_named(fn, v, f"{name}[{k!r}]") for k, v in nest.items()}
    if isinstance(nest, (list, tuple)):
        return type(nest)(map_named(fn, v, f"{name}[{i}]") for i, v in enumerate(nest))
    return fn(name, nest)


def take(nest: Nest, rows: Any) -> Nest:
    """The rows ``rows`` of every leaf (a plain array is the fast path: every step)."""
    if isinstance(nest, np.ndarray):
        return nest[rows]
    return map_nest(lambda a: a[rows], nest)


def concat(parts: list[Nest]) -> Nest:
    """Row-wise concatenation of nests of the same structure."""
    if isinstance(parts[0], np.ndarray):
        return np.concatenate(parts)
    return map_nest(lambda *leaf: np.concatenate(leaf), parts[0], *parts[1:])


def as_arrays(nest: Nest, name: str) -> Nest:
    """Every leaf as a NumPy array with a sample axis (a list of numbers at the top
    is one array, as Keras reads it, not a list of scalar inputs)."""
    if isinstance(nest, (list, tuple)) and not any(_is_array(leaf) for _, leaf in leaves(nest)):
        nest = np.asarray(nest)

    def convert(path: str, leaf: Any) -> np.ndarray:
        array = np.asarray(leaf)
        if array.ndim == 0:
            raise ValueError(f"{path} must have a leading sample axis; got a scalar.")
        if array.dtype == object:
            raise ValueError(
                f"{path} is not a numeric array (dtype object): ragged rows or mixed "
                "types. Pad it to one shape, or pass each input as its own array."
            )
        return array

    return map_named(convert, nest, name)


def _is_array(value: Any) -> bool:
    return hasattr(value, "__array__") or hasattr(value, "shape")


def num_rows(nests: dict[str, Nest]) -> int:
    """The common length of every leaf of ``{"x": x, "y": y, ...}``; a ``ValueError``
    naming the arrays when they differ."""
    lengths = {path: len(leaf) for key, nest in nests.items() for path, leaf in leaves(nest, key)}
    if not lengths:
        raise ValueError(f"{' and '.join(nests)} hold no arrays.")
    if len(set(lengths.values())) > 1:
        said = ", ".join(f"{path}: {n}" for path, n in lengths.items())
        raise ValueError(
            f"{', '.join(nests)} must have the same number of rows in every array; "
            f"got {said}.")
    return next(iter(lengths.values()))


def first_leaf(nest: Nest) -> Any:
    return next(leaves(nest))[1]


def broadcast_to(weights: Nest, like: Nest) -> Nest:
    """One ``sample_weight`` array for every output of a multi-output ``y``, as
    Keras does; a nest of weights must match ``y``'s structure."""
    if weights is None or not is_nested(like) or is_nested(weights):
        return weights
    return map_nest(lambda _: weights, like)
