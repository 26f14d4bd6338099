"""Data shards: where the training data lives and which rows every step reads.

Each worker holds one :class:`Shard` for the whole run; the client never ships
training data per step. A shard holds ``x``, ``y`` and optional sample weights
``w``, each an array or a nest of arrays (lists, tuples, dicts: several inputs or
outputs, :mod:`dasktf.data.structure`); ``class_weight`` becomes sample weights as
Keras makes them. Three input kinds are accepted, each through its own adapter:

* NumPy arrays (:class:`ArraySource`): the client slices them *interleaved*, so that
  with ``shuffle=False`` the union of the workers' local batches at step ``k`` is
  exactly ``x[k*B:(k+1)*B]``, the global batch single-process Keras would use;
* Dask arrays (:class:`DaskArraySource`): chunks go to the worker that already holds
  them where the balance allows (``Client.who_has``), so most never move;
* a per-shard loader ``load(shard_index, num_shards) -> (x, y[, sample_weight])``
  (:class:`LoaderSource`) that runs on the worker, so data can be read where it is.

A *batch schedule* (``steps_per_epoch x workers`` local batch sizes) says how many
rows each worker reads at each step. Gradients are weighted by those sizes, so
uneven shards and a short last batch are averaged correctly.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from dasktf.data.frames import frames_to_arrays, holds_frames
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

if TYPE_CHECKING:
    from distributed import Client, Future

ShardLoader = Callable[[int, int], tuple[Any, Any]]


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

    def take(self, rows: Any) -> Shard:
        """The shard of rows ``rows`` (in that order)."""
        return Shard(take(self.x, rows), take(self.y, rows),
                     None if self.w is None else take(self.w, rows))

    def batch(self, rows: Any) -> tuple[Nest, Nest, Nest]:
        return take(self.x, rows), take(self.y, rows), (
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
            return np.zeros((rows, *leaf.shape), dtype=leaf.dtype)

        return (map_nest(zeros, self.x), map_nest(zeros, self.y),
                None if self.w is None else map_nest(lambda leaf: np.ones(
                    (rows, *leaf.shape), dtype=leaf.dtype), self.w))

    def layout(self) -> Any:
        """Shapes and dtypes of every array, to compare shards."""
        return [(leaf.name, leaf.shape, leaf.dtype) for leaf in self.all_leaves()]


@dataclass
class PlacedData:
    """Shards placed on the workers: one resident ``Shard`` future per worker."""

    shards: list[Future]
    stats: list[ShardStats]
    schedule: np.ndarray  # (steps_per_epoch, n_workers) local batch sizes

    @property
    def steps_per_epoch(self) -> int:
        return int(self.schedule.shape[0])

    @property
    def n_samples(self) -> int:
        return sum(s.n for s in self.stats)


def _all_finite(a: np.ndarray) -> bool:
    if not np.issubdtype(a.dtype, np.inexact):
        return True
    return bool(np.isfinite(a).all())


def check_stats(stats: Sequence[ShardStats], where: str = "the training data") -> None:
    """Raise ``ValueError`` for NaN/inf values or shards that disagree on shapes,
    naming the array (``x['image']``, ``y[1]``, ``sample_weight``) at fault."""
    for i, s in enumerate(stats):
        bad = [leaf.name for leaf in s.all_leaves() if not leaf.finite]
        if bad:
            shard = f" (shard {i})" if len(stats) > 1 else ""
            raise ValueError(
                f"{where} contains NaN or infinite values in {', '.join(bad)}{shard}; "
                "clean or impute them before training."
            )
    layouts = {repr(s.layout()) for s in stats if s.n}
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


def interleaved_schedule(n: int, batch_size: int, n_workers: int) -> np.ndarray:
    """Local batch sizes when each global batch of Keras' order is split N ways."""
    steps = -(-n // batch_size)
    sizes = np.minimum(batch_size, n - batch_size * np.arange(steps))
    base, extra = np.divmod(sizes[:, None], n_workers)
    return base + (np.arange(n_workers)[None, :] < extra)


def proportional_schedule(shard_sizes: Sequence[int], batch_size: int) -> np.ndarray:
    """Local batch sizes for shards of any size: every shard spread over the steps.

    The number of steps is that of the global data at ``batch_size``, so a global
    step still reads about ``batch_size`` rows, each shard exactly once per epoch.
    """
    steps = max(1, -(-sum(shard_sizes) // batch_size))
    columns = [[len(p) for p in np.array_split(np.empty(n), steps)] for n in shard_sizes]
    return np.array(columns, dtype=np.int64).T


def interleaved_indices(schedule: np.ndarray, batch_size: int) -> list[np.ndarray]:
    """The rows of each worker's shard for :func:`interleaved_schedule`."""
    starts = batch_size * np.arange(schedule.shape[0])[:, None] + np.concatenate(
        [np.zeros((schedule.shape[0], 1), dtype=np.int64), schedule.cumsum(axis=1)[:, :-1]],
        axis=1,
    )
    return [
        np.concatenate([np.arange(s, s + c) for s, c in zip(starts[:, i], schedule[:, i], strict=False)])
        for i in range(schedule.shape[1])
    ]


def check_worker_count(n_samples: int, n_workers: int, batch_size: int) -> None:
    if n_workers > n_samples:
        raise ValueError(
            f"More workers ({n_workers}) than training samples ({n_samples}): "
            "every worker needs at least one sample. Use fewer workers."
        )
    if batch_size < n_workers:
        raise ValueError(
            f"The global batch_size ({batch_size}) is smaller than the number of "
            f"workers ({n_workers}); each worker needs at least one sample per step. "
            "Raise batch_size or use fewer workers."
        )


class ArraySource:
    """NumPy (or array-like) ``x``/``y``/``sample_weight`` held by the client, each
    an array or a nest of them, scattered once."""

    def __init__(self, x: Any, y: Any, sample_weight: Any = None,
                 class_weight: dict[int, float] | None = None) -> None:
        if y is None:
            raise ValueError("y is required when x is an array.")
        x, y = as_arrays(x, "x"), as_arrays(y, "y")
        w = None if sample_weight is None else as_arrays(
            broadcast_to(sample_weight, y), "sample_weight")
        self.data = with_weights(Shard(x, y, w), class_weight)
        self.stats = ShardStats.of(self.data)
        check_stats([self.stats])

    def place(self, client: Client, workers: list[str], batch_size: int) -> PlacedData:
        check_worker_count(self.stats.n, len(workers), batch_size)
        schedule = interleaved_schedule(self.stats.n, batch_size, len(workers))
        rows = interleaved_indices(schedule, batch_size)
        shards = [
            client.scatter(self.data.take(r), workers=[w], direct=True, hash=False)  # see Run.build
            for r, w in zip(rows, workers, strict=True)
        ]
        stats = [dataclasses.replace(self.stats, n=len(r)) for r in rows]
        return PlacedData(shards, stats, schedule)


def shard_from_parts(x_parts: list[Any], y_parts: list[Any], w_parts: list[Any] | None = None,
                     class_weight: dict[int, float] | None = None) -> Shard:
    shard = Shard(concat(x_parts), concat(y_parts), None if w_parts is None else concat(w_parts))
    return with_weights(shard, class_weight)


def load_shard(load: ShardLoader, index: int, n_shards: int,
               class_weight: dict[int, float] | None = None) -> Shard:
    out = load(index, n_shards)
    if not (isinstance(out, tuple) and len(out) in (2, 3)):
        raise TypeError(
            "The shard loader must return a tuple (x, y) or (x, y, sample_weight); "
            f"got {type(out).__name__}."
        )
    x, y = as_arrays(out[0], "x"), as_arrays(out[1], "y")
    w = as_arrays(broadcast_to(out[2], y), "sample_weight") if len(out) == 3 else None
    if w is not None and class_weight is not None:
        raise ValueError("The shard loader returns sample weights: give no class_weight too.")
    shard = with_weights(Shard(x, y, w), class_weight)
    ShardStats.of(shard)  # the row counts agree, or an error naming the arrays
    return shard


class _WorkerSideSource:
    """Sources whose shards are built on the workers; stats come back from there."""

    def _build(self, client: Client, workers: list[str]) -> list[Future]:
        raise NotImplementedError

    def place(self, client: Client, workers: list[str], batch_size: int) -> PlacedData:
        shards = self._build(client, workers)
        stats = client.gather(
            [
                # pure=False: the stats of a shard are cheap, never worth caching.
                client.submit(ShardStats.of, s, workers=[w], pure=False)
                for s, w in zip(shards, workers, strict=True)
            ]
        )
        check_stats(stats)
        check_worker_count(sum(s.n for s in stats), len(workers), batch_size)
        empty = [w for w, s in zip(workers, stats, strict=True) if s.n == 0]
        if empty:
            raise ValueError(
                f"Worker(s) {empty} got an empty shard; every worker needs data. "
                "Use fewer workers or split the data more evenly."
            )
        return PlacedData(shards, stats, proportional_schedule([s.n for s in stats], batch_size))


class DaskArraySource(_WorkerSideSource):
    """Dask arrays (or nests of them): each worker's shard is built from chunks it
    mostly already holds."""

    def __init__(self, x: Any, y: Any, sample_weight: Any = None,
                 class_weight: dict[int, float] | None = None) -> None:
        if y is None:
            raise ValueError("y is required when x is a Dask array.")
        arrays: dict[str, Any] = {"x": x, "y": y}
        if sample_weight is not None:
            arrays["sample_weight"] = broadcast_to(sample_weight, y)
        num_rows(arrays)
        lead = first_leaf(x)
        lead = lead.rechunk({i: -1 for i in range(1, lead.ndim)})

        def align(a: Any) -> Any:  # every array cut into the leading array's row chunks
            import dask.array as da

            a = da.asarray(a)
            return a.rechunk({0: lead.chunks[0], **{i: -1 for i in range(1, a.ndim)}})

        self.x, self.y = map_nest(align, x), map_nest(align, y)
        self.w = None if sample_weight is None else map_nest(align, arrays["sample_weight"])
        self.class_weight = class_weight
        self.row_chunks = list(lead.chunks[0])

    def _parts(self, client: Client, chunks: Sequence[int]) -> list[Any]:
        """Futures of row chunks ``chunks``: per chunk, the nest ``[x, y, w]``."""
        nests = [self.x, self.y] + ([] if self.w is None else [self.w])
        delayed = map_nest(lambda a: a.to_delayed().ravel(), nests)
        per_chunk = [map_nest(lambda d, j=j: d[j], delayed) for j in chunks]
        # One future per array chunk (compute() of a nest would make one per nest).
        futures = iter(client.compute([leaf for nest in per_chunk for _, leaf in leaves(nest)]))
        return [map_nest(lambda _: next(futures), nest) for nest in per_chunk]

    def _submit(self, client: Client, parts: list[Any], worker: str) -> Future:
        return client.submit(
            shard_from_parts, [p[0] for p in parts], [p[1] for p in parts],
            None if self.w is None else [p[2] for p in parts], self.class_weight,
            workers=[worker], pure=False,
        )

    def _build(self, client: Client, workers: list[str]) -> list[Future]:
        parts = self._parts(client, range(len(self.row_chunks)))
        lead = [first_leaf(p[0]) for p in parts]
        holders = client.who_has(lead)
        self.assignment = assignment = assign_chunks(
            self.row_chunks, [holders.get(f.key, ()) for f in lead], workers
        )
        return [self._submit(client, [parts[j] for j in chunks], w)
                for w, chunks in zip(workers, assignment, strict=True)]

    def reload(self, client: Client, index: int, worker: str) -> Future:
        """Shard ``index`` rebuilt on ``worker``, recomputed from the Dask graph where
        a lost worker held the only copy of its chunks."""
        return self._submit(client, self._parts(client, self.assignment[index]), worker)


def assign_chunks(
    sizes: Sequence[int], holders: Sequence[Sequence[str]], workers: Sequence[str]
) -> list[list[int]]:
    """Give every chunk to a worker: its holder unless that worker is full.

    A worker is full once it holds its fair share (total / workers) of the rows;
    chunks that cannot stay are given to the least-loaded worker.
    """
    fair = sum(sizes) / len(workers)
    load = dict.fromkeys(workers, 0)
    out: dict[str, list[int]] = {w: [] for w in workers}
    for j in sorted(range(len(sizes)), key=lambda j: -sizes[j]):
        local = [w for w in holders[j] if w in load and load[w] + sizes[j] <= fair * 1.1]
        target = min(local or workers, key=lambda w: load[w])
        out[target].append(j)
        load[target] += sizes[j]
    return [sorted(out[w]) for w in workers]


class LoaderSource(_WorkerSideSource):
    """A function ``load(shard_index, num_shards) -> (x, y[, sample_weight])`` run on
    each worker."""

    def __init__(self, load: ShardLoader, class_weight: dict[int, float] | None = None) -> None:
        self.load = load
        self.class_weight = class_weight

    def _build(self, client: Client, workers: list[str]) -> list[Future]:
        n = len(workers)
        return [
            # pure=False: a loader may read files that change between runs.
            client.submit(load_shard, self.load, i, n, self.class_weight, workers=[w],
                          pure=False)
            for i, w in enumerate(workers)
        ]


DataSource = ArraySource | DaskArraySource | LoaderSource


def make_source(x: Any, y: Any = None, sample_weight: Any = None,
                class_weight: dict[int, float] | None = None) -> DataSource:
    """Pick the adapter for what the user passed as training data.

    ``x``, ``y`` and ``sample_weight`` may each be an array or a (nested) list,
    tuple or dict of arrays, matched to the model's inputs and outputs as Keras
    matches them.

    Raises
    ------
    TypeError
        ``x`` is none of: arrays, Dask arrays, a shard loader.
    ValueError
        The arrays are inconsistent (row counts, NaN/inf values), or
        ``class_weight`` is given with ``sample_weight`` or a multi-output ``y``.
    """
    if class_weight is not None and sample_weight is not None:
        raise ValueError("Give sample_weight or class_weight, not both (as in Keras).")
    if holds_frames(x, y, sample_weight):
        x, y, sample_weight = frames_to_arrays(x, y, sample_weight)
    if class_weight is not None:
        check_class_weight(class_weight, y)
    if callable(x) and not hasattr(x, "__array__") and not is_nested(x):
        if y is not None or sample_weight is not None:
            raise ValueError(
                "y and sample_weight must be None when x is a shard loader; it returns "
                "(x, y) or (x, y, sample_weight)."
            )
        return LoaderSource(x, class_weight)
    kinds = {_is_dask_array(leaf) for nest in (x, y, sample_weight) if nest is not None
             for _, leaf in leaves(nest)}
    if kinds == {True}:
        return DaskArraySource(x, y, sample_weight, class_weight)
    if kinds == {True, False}:
        raise TypeError(
            "Some of x, y and sample_weight are Dask arrays and some are in memory; "
            "pass them all alike (dask.array.from_array wraps in-memory ones)."
        )
    bad = [path for path, leaf in leaves(x, "x")
           if not (hasattr(leaf, "__array__") or isinstance(leaf, (list, tuple, int, float)))]
    if bad or callable(x):
        raise TypeError(
            "x must be a NumPy array (or array-like), a Dask array, a list/tuple/dict "
            "of them, or a shard loader load(shard_index, num_shards) -> (x, y); got "
            f"{type(x).__name__}" + (f" at {', '.join(bad)}." if is_nested(x) else ".")
        )
    return ArraySource(x, y, sample_weight, class_weight)


def _is_dask_array(a: Any) -> bool:
    return type(a).__module__.startswith("dask.array")


def split_validation(x: Any, y: Any, sample_weight: Any, fraction: float
                     ) -> tuple[tuple[Any, Any, Any], tuple[Any, Any, Any]]:
    """Keras' ``validation_split``: the last ``fraction`` of the rows, before any
    shuffling, become the validation data (``floor(n * (1 - fraction))`` rows stay)."""
    if not 0 < fraction < 1:
        raise ValueError(f"validation_split must be in (0, 1); got {fraction!r}.")
    if holds_frames(x, y, sample_weight):
        x, y, sample_weight = frames_to_arrays(x, y, sample_weight)
    if callable(x) and not hasattr(x, "__array__") and not is_nested(x):
        raise ValueError(
            "validation_split needs x and y as arrays (it takes their last rows); a "
            "shard loader's data is only read on the workers. Pass validation_data."
        )
    arrays = {"x": x, "y": y,
              **({} if sample_weight is None else {"sample_weight": sample_weight})}
    if not all(_is_dask_array(leaf) for _, leaf in leaves(arrays)):
        arrays = {k: as_arrays(v, k) for k, v in arrays.items()}
    n = num_rows(arrays)
    split_at = int(np.floor(n * (1.0 - fraction)))
    if split_at in (0, n):
        raise ValueError(
            f"validation_split={fraction} leaves no rows for training or validation "
            f"out of {n}; use a fraction that leaves at least one row each."
        )
    train = {k: take(v, slice(0, split_at)) for k, v in arrays.items()}
    val = {k: take(v, slice(split_at, None)) for k, v in arrays.items()}
    return ((train["x"], train["y"], train.get("sample_weight")),
            (val["x"], val["y"], val.get("sample_weight")))


def unpack_validation(validation_data: Any) -> tuple[Any, Any, Any]:
    """``(x, y)`` or ``(x, y, sample_weight)``, as Keras takes ``validation_data``."""
    if not isinstance(validation_data, (tuple, list)) or len(validation_data) not in (2, 3):
        raise ValueError(
            "validation_data must be a tuple (x_val, y_val) or (x_val, y_val, "
            f"sample_weight_val); got {type(validation_data).__name__}"
            + (f" of length {len(validation_data)}." if isinstance(
                validation_data, (tuple, list)) else ".")
        )
    x, y, *rest = validation_data
    return x, y, rest[0] if rest else None


def validation_shard(validation_data: tuple[Any, Any, Any]) -> Shard:
    """``(x, y, sample_weight)`` validation data as one checked in-memory shard."""
    x, y, w = validation_data
    if holds_frames(x, y, w):  # computed to the client: validation data is small
        x, y, w = frames_to_arrays(x, y, w)
    x, y = as_arrays(x, "x_val"), as_arrays(y, "y_val")
    w = None if w is None else as_arrays(broadcast_to(w, y), "sample_weight_val")
    data = Shard(x, y, w)
    check_stats([ShardStats.of(data)], where="the validation data")
    return data


def validation_piece(data: Shard, index: int, n: int) -> Shard:
    """Worker ``index``'s contiguous piece of ``n``."""
    return data.take(np.array_split(np.arange(len(data)), n)[index])


def place_validation(
    client: Client, validation_data: tuple[Any, Any, Any], workers: list[str]
) -> list[Future] | None:
    """Scatter validation data in contiguous pieces, one per worker, for evaluation."""
    data = validation_shard(validation_data)
    parts = np.array_split(np.arange(len(data)), len(workers))
    return [
        client.scatter(data.take(p), workers=[w], direct=True, hash=False)  # see Run.build
        for p, w in zip(parts, workers, strict=True)
    ]
