"""Data shards: where the training data lives and which rows every step reads.

Each worker holds one :class:`Shard` for the whole run; the client never ships
training data per step. Three input kinds are accepted, each through its own adapter:

* NumPy arrays (:class:`ArraySource`): the client slices them *interleaved*, so that
  with ``shuffle=False`` the union of the workers' local batches at step ``k`` is
  exactly ``x[k*B:(k+1)*B]``, the global batch single-process Keras would use;
* Dask arrays (:class:`DaskArraySource`): chunks go to the worker that already holds
  them where the balance allows (``Client.who_has``), so most never move;
* a per-shard loader ``load(shard_index, num_shards) -> (x, y)``
  (:class:`LoaderSource`) that runs on the worker, so data can be read where it is.

A *batch schedule* (``steps_per_epoch x workers`` local batch sizes) says how many
rows each worker reads at each step. Gradients are weighted by those sizes, so
uneven shards and a short last batch are averaged correctly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from distributed import Client, Future

ShardLoader = Callable[[int, int], tuple[Any, Any]]


@dataclass
class Shard:
    """The rows one worker trains on (or evaluates), resident in its memory."""

    x: np.ndarray
    y: np.ndarray

    def __len__(self) -> int:
        return len(self.x)


@dataclass(frozen=True)
class ShardStats:
    """What the client needs to validate a shard without fetching it."""

    n: int
    x_shape: tuple[int, ...]
    y_shape: tuple[int, ...]
    x_dtype: str
    y_dtype: str
    finite: bool
    y_min: float
    y_max: float
    y_integral: bool

    @classmethod
    def of(cls, x: np.ndarray, y: np.ndarray) -> ShardStats:
        _check_lengths(x, y)
        finite = bool(_all_finite(x) and _all_finite(y))
        integral = bool(np.issubdtype(y.dtype, np.integer)) or (
            finite and y.size > 0 and bool(np.all(np.mod(y, 1) == 0))
        )
        return cls(
            n=len(x),
            x_shape=tuple(x.shape[1:]),
            y_shape=tuple(y.shape[1:]),
            x_dtype=str(x.dtype),
            y_dtype=str(y.dtype),
            finite=finite,
            y_min=float(y.min()) if y.size and finite else 0.0,
            y_max=float(y.max()) if y.size and finite else 0.0,
            y_integral=integral,
        )


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
    if not np.issubdtype(a.dtype, np.number) or np.issubdtype(a.dtype, np.integer):
        return True
    return bool(np.isfinite(a).all())


def _check_lengths(x: Any, y: Any) -> None:
    if len(x) != len(y):
        raise ValueError(
            f"x and y must have the same number of samples; got {len(x)} inputs "
            f"and {len(y)} labels."
        )


def check_stats(stats: Sequence[ShardStats], where: str = "the training data") -> None:
    """Raise ``ValueError`` for NaN/inf values or shards that disagree on shapes."""
    if not all(s.finite for s in stats):
        bad = [i for i, s in enumerate(stats) if not s.finite]
        raise ValueError(
            f"{where} contains NaN or infinite values (shard(s) {bad}); "
            "clean or impute them before training."
        )
    shapes = {(s.x_shape, s.y_shape) for s in stats if s.n}
    if len(shapes) > 1:
        raise ValueError(f"The shards of {where} disagree on shapes: {sorted(shapes)}.")


def check_labels(stats: Sequence[ShardStats], num_classes: int) -> None:
    """Sparse class labels must be integers in ``[0, num_classes)``."""
    if not all(s.y_integral for s in stats if s.n):
        raise ValueError(
            "Labels must be integer class indices for a sparse categorical loss; "
            "got non-integer values."
        )
    low = min(s.y_min for s in stats if s.n)
    high = max(s.y_max for s in stats if s.n)
    if low < 0 or high >= num_classes:
        raise ValueError(
            f"Labels must lie in [0, {num_classes}) for a model with {num_classes} "
            f"outputs; got labels from {low:g} to {high:g}. Check the labels, or give "
            "the model as many outputs as there are classes."
        )


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
    """NumPy (or array-like) ``x``/``y`` held by the client, scattered once."""

    def __init__(self, x: Any, y: Any) -> None:
        if y is None:
            raise ValueError("y is required when x is an array.")
        self.x, self.y = np.asarray(x), np.asarray(y)
        if self.x.ndim == 0:
            raise ValueError("x must have a leading sample axis; got a scalar.")
        self.stats = ShardStats.of(self.x, self.y)
        check_stats([self.stats])

    def place(self, client: Client, workers: list[str], batch_size: int) -> PlacedData:
        check_worker_count(self.stats.n, len(workers), batch_size)
        schedule = interleaved_schedule(self.stats.n, batch_size, len(workers))
        rows = interleaved_indices(schedule, batch_size)
        shards = [
            client.scatter(Shard(self.x[r], self.y[r]), workers=[w], direct=True, hash=False)  # see Run.build
            for r, w in zip(rows, workers, strict=False)
        ]
        stats = [_with_n(self.stats, len(r)) for r in rows]
        return PlacedData(shards, stats, schedule)


def _with_n(stats: ShardStats, n: int) -> ShardStats:
    return ShardStats(**{**stats.__dict__, "n": n})


def shard_from_parts(x_parts: list[Any], y_parts: list[Any]) -> Shard:
    return Shard(np.concatenate(x_parts), np.concatenate(y_parts))


def load_shard(load: ShardLoader, index: int, n_shards: int) -> Shard:
    out = load(index, n_shards)
    if not (isinstance(out, tuple) and len(out) == 2):
        raise TypeError(
            f"The shard loader must return a tuple (x, y); got {type(out).__name__}."
        )
    x, y = (np.asarray(a) for a in out)
    _check_lengths(x, y)
    return Shard(x, y)


def _stats_of(shard: Shard) -> ShardStats:
    return ShardStats.of(shard.x, shard.y)


class _WorkerSideSource:
    """Sources whose shards are built on the workers; stats come back from there."""

    def _build(self, client: Client, workers: list[str]) -> list[Future]:
        raise NotImplementedError

    def place(self, client: Client, workers: list[str], batch_size: int) -> PlacedData:
        shards = self._build(client, workers)
        stats = client.gather(
            [
                # pure=False: the stats of a shard are cheap, never worth caching.
                client.submit(_stats_of, s, workers=[w], pure=False)
                for s, w in zip(shards, workers, strict=False)
            ]
        )
        check_stats(stats)
        check_worker_count(sum(s.n for s in stats), len(workers), batch_size)
        empty = [w for w, s in zip(workers, stats, strict=False) if s.n == 0]
        if empty:
            raise ValueError(
                f"Worker(s) {empty} got an empty shard; every worker needs data. "
                "Use fewer workers or split the data more evenly."
            )
        return PlacedData(shards, stats, proportional_schedule([s.n for s in stats], batch_size))


class DaskArraySource(_WorkerSideSource):
    """Dask arrays: each worker's shard is built from chunks it mostly already holds."""

    def __init__(self, x: Any, y: Any) -> None:
        import dask.array as da

        if y is None:
            raise ValueError("y is required when x is a Dask array.")
        _check_lengths(x, y)
        x = x.rechunk({i: -1 for i in range(1, x.ndim)})
        y = da.asarray(y).rechunk({0: x.chunks[0], **{i: -1 for i in range(1, y.ndim)}})
        self.x, self.y = x, y

    def _build(self, client: Client, workers: list[str]) -> list[Future]:
        x_parts = client.compute(list(self.x.to_delayed().ravel()))
        y_parts = client.compute(list(self.y.to_delayed().ravel()))
        holders = client.who_has(x_parts)
        sizes = list(self.x.chunks[0])
        self.assignment = assignment = assign_chunks(
            sizes, [holders.get(f.key, ()) for f in x_parts], workers
        )
        return [
            client.submit(
                shard_from_parts,
                [x_parts[j] for j in chunks],
                [y_parts[j] for j in chunks],
                workers=[w],
                pure=False,
            )
            for w, chunks in zip(workers, assignment, strict=False)
        ]


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
    """A function ``load(shard_index, num_shards) -> (x, y)`` run on each worker."""

    def __init__(self, load: ShardLoader) -> None:
        self.load = load

    def _build(self, client: Client, workers: list[str]) -> list[Future]:
        n = len(workers)
        return [
            # pure=False: a loader may read files that change between runs.
            client.submit(load_shard, self.load, i, n, workers=[w], pure=False)
            for i, w in enumerate(workers)
        ]


DataSource = ArraySource | DaskArraySource | LoaderSource


def make_source(x: Any, y: Any = None) -> DataSource:
    """Pick the adapter for what the user passed as training data.

    Raises
    ------
    TypeError
        ``x`` is none of: an array, a Dask array, a shard loader.
    ValueError
        The arrays are inconsistent (lengths, NaN/inf values).
    """
    if _is_dask_array(x):
        return DaskArraySource(x, y)
    if callable(x) and not hasattr(x, "__array__"):
        if y is not None:
            raise ValueError("y must be None when x is a shard loader; it returns both.")
        return LoaderSource(x)
    if hasattr(x, "__array__") or isinstance(x, (list, tuple)):
        if _is_dask_array(y):
            raise TypeError("x is in memory but y is a Dask array; pass both alike.")
        return ArraySource(x, y)
    raise TypeError(
        "x must be a NumPy array (or array-like), a Dask array, or a shard loader "
        f"load(shard_index, num_shards) -> (x, y); got {type(x).__name__}."
    )


def _is_dask_array(a: Any) -> bool:
    return type(a).__module__.startswith("dask.array")


def place_validation(
    client: Client, x: Any, y: Any, workers: list[str]
) -> list[Future] | None:
    """Scatter validation data in contiguous pieces, one per worker, for evaluation."""
    x, y = np.asarray(x), np.asarray(y)
    _check_lengths(x, y)
    check_stats([ShardStats.of(x, y)], where="the validation data")
    parts = np.array_split(np.arange(len(x)), len(workers))
    return [
        client.scatter(Shard(x[p], y[p]), workers=[w], direct=True, hash=False)  # see Run.build
        for p, w in zip(parts, workers, strict=False)
    ]
