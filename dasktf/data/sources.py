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
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from dasktf import config
from dasktf.data.keras_inputs import read_input, reads_on_client
from dasktf.data.partitions import (
    compute_leaves,
    convert,
    holds_frames,
    is_dask_frame,
    partition_leaves,
)
from dasktf.data.shards import (
    Shard,
    ShardStats,
    check_class_weight,
    check_stats,
    with_weights,
)
from dasktf.data.streams import (
    DaskParts,
    DatasetContext,
    DatasetParts,
    LoaderParts,
    StreamedShard,
    accepts_context,
    part_from,
)
from dasktf.data.structure import (
    as_arrays,
    broadcast_to,
    concat,
    first_leaf,
    is_nested,
    leaves,
    map_nest,
    num_rows,
    take,
)

if TYPE_CHECKING:
    from distributed import Client, Future

ShardLoader = Callable[[int, int], tuple[Any, Any]]


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
               class_weight: dict[int, float] | None = None) -> Shard | StreamedShard:
    out = load(index, n_shards)
    if isinstance(out, Iterator):  # parts to stream, read anew every epoch
        return StreamedShard(LoaderParts(load, index, n_shards, class_weight),
                             int(config.get("data.prefetch")), f"shard {index}").scan()
    shard = part_from(out, "The shard loader", class_weight)
    ShardStats.of(shard)  # the row counts agree, or an error naming the arrays
    return shard


class _WorkerSideSource:
    """Sources whose shards are built on the workers; stats come back from there."""

    def _build(self, client: Client, workers: list[str], batch_size: int) -> list[Future]:
        raise NotImplementedError

    def place(self, client: Client, workers: list[str], batch_size: int) -> PlacedData:
        shards = self._build(client, workers, batch_size)
        stats = client.gather(
            [
                # pure=False: the stats of a shard are cheap, never worth caching.
                client.submit(stats_of, s, workers=[w], pure=False)
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
    """Dask arrays, DataFrames and Series (or nests of them): each worker's shard is
    built from partitions it mostly already holds, converted where they live."""

    def __init__(self, x: Any, y: Any, sample_weight: Any = None,
                 class_weight: dict[int, float] | None = None) -> None:
        self.chunks, self.row_chunks = partition_leaves(x, y, sample_weight)
        self.class_weight = class_weight
        self.weighted = sample_weight is not None

    def _parts(self, client: Client, chunks: Sequence[int]) -> list[Any]:
        """Futures of partitions ``chunks``: per partition, the nest ``[x, y, w]``."""
        import dask

        per_chunk = [self.chunks[j] for j in chunks]
        # One future per array of a partition, each computed on the cluster where
        # its partition is (compute() of a nest would make one per nest).
        futures = iter(client.compute([dask.delayed(convert)(leaf.delayed, leaf.kind, leaf.path)
                                       for nest in per_chunk for _, leaf in leaves(nest)]))
        return [map_nest(lambda _: next(futures), nest) for nest in per_chunk]

    def _submit(self, client: Client, parts: list[Any], worker: str) -> Future:
        return client.submit(
            shard_from_parts, [p[0] for p in parts], [p[1] for p in parts],
            [p[2] for p in parts] if self.weighted else None, self.class_weight,
            workers=[worker], pure=False,
        )

    def _build(self, client: Client, workers: list[str], batch_size: int) -> list[Future]:
        parts = self._parts(client, range(len(self.chunks)))
        lead = [first_leaf(p[0]) for p in parts]
        sizes = self.row_chunks or client.gather([client.submit(len, f, pure=False)
                                                  for f in lead])
        holders = client.who_has(lead)
        self.assignment = assignment = assign_chunks(
            sizes, [holders.get(f.key, ()) for f in lead], workers
        )
        return [self._submit(client, [parts[j] for j in chunks], w)
                for w, chunks in zip(workers, assignment, strict=True)]

    def reload(self, client: Client, index: int, n: int, worker: str) -> Future:
        """Shard ``index`` rebuilt on ``worker``, recomputed from the Dask graph where
        a lost worker held the only copy of its partitions."""
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

    def _build(self, client: Client, workers: list[str], batch_size: int) -> list[Future]:
        n = len(workers)
        return [
            # pure=False: a loader may read files that change between runs.
            client.submit(load_shard, self.load, i, n, self.class_weight, workers=[w],
                          pure=False)
            for i, w in enumerate(workers)
        ]


def stats_of(shard: Shard | StreamedShard) -> ShardStats:
    """A placed shard's stats (a streamed one has them from its first read)."""
    return shard.stats if isinstance(shard, StreamedShard) else ShardStats.of(shard)


def build_stream(parts: Any, where: str) -> StreamedShard:
    return StreamedShard(parts, int(config.get("data.prefetch")), where).scan()


class DaskStreamSource(_WorkerSideSource):
    """Lazy Dask arrays or DataFrames (or nests of them) streamed: each worker reads
    its block of partitions one at a time, every epoch (:class:`DaskParts`)."""

    def __init__(self, x: Any, y: Any, sample_weight: Any = None,
                 class_weight: dict[int, float] | None = None) -> None:
        self.chunks, _ = partition_leaves(x, y, sample_weight)
        self.class_weight = class_weight

    def blocks(self, n: int) -> list[np.ndarray]:
        if len(self.chunks) < n:
            raise ValueError(
                f"The data has {len(self.chunks)} partitions for {n} workers; streaming "
                "gives each worker whole partitions. Repartition into at least "
                f"{n} (more, smaller ones bound memory better)."
            )
        return np.array_split(np.arange(len(self.chunks)), n)

    def parts_of(self, index: int, n: int) -> DaskParts:
        block = self.blocks(n)[index]
        return DaskParts([self.chunks[j] for j in block], self.class_weight,
                         f"partitions {block[0]}-{block[-1]}")

    def _build(self, client: Client, workers: list[str], batch_size: int) -> list[Future]:
        n = len(workers)
        return [client.submit(build_stream, self.parts_of(i, n), f"shard {i} ({w})",
                              workers=[w], pure=False)
                for i, w in enumerate(workers)]

    def reload(self, client: Client, index: int, n: int, worker: str) -> Future:
        return client.submit(build_stream, self.parts_of(index, n), f"shard {index}",
                             workers=[worker], pure=False)


class DatasetFnSource(_WorkerSideSource):
    """``dataset_fn(ctx) -> tf.data.Dataset`` run on every worker, every epoch
    (:class:`DatasetParts`), as ``distribute_datasets_from_function`` runs it."""

    def __init__(self, dataset_fn: Any, seed: int,
                 class_weight: dict[int, float] | None = None) -> None:
        self.dataset_fn, self.seed, self.class_weight = dataset_fn, seed, class_weight
        self.batch_size = 0

    def parts_of(self, index: int, n: int) -> DatasetParts:
        local = self.batch_size // n + (index < self.batch_size % n)
        context = DatasetContext(index, n, local, self.batch_size, 0, self.seed)
        return DatasetParts(self.dataset_fn, context, self.class_weight)

    def _build(self, client: Client, workers: list[str], batch_size: int) -> list[Future]:
        self.batch_size = batch_size
        n = len(workers)
        return [client.submit(build_stream, self.parts_of(i, n),
                              f"dataset_fn on shard {i} ({w})", workers=[w], pure=False)
                for i, w in enumerate(workers)]

    def reload(self, client: Client, index: int, n: int, worker: str) -> Future:
        return client.submit(build_stream, self.parts_of(index, n),
                             f"dataset_fn on shard {index}", workers=[worker], pure=False)


DataSource = (ArraySource | DaskArraySource | LoaderSource | DaskStreamSource
              | DatasetFnSource)


def make_source(x: Any, y: Any = None, sample_weight: Any = None,
                class_weight: dict[int, float] | None = None, stream: bool = False,
                seed: int = 0) -> DataSource:
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
    batch_size = None
    if reads_on_client(x):  # tf.data.Dataset, keras.utils.PyDataset, a generator
        if y is not None or sample_weight is not None:
            raise ValueError(f"y and sample_weight must be None when x is a "
                             f"{type(x).__name__} (it yields them).")
        read = read_input(x, "x")
        x, y, sample_weight, batch_size = read.x, read.y, read.w, read.batch_size
    source = _adapter(x, y, sample_weight, class_weight, stream, seed)
    #: the batches' size of data read on the client: the run's if fit gets none
    source.batch_size_read = batch_size
    return source


def _adapter(x: Any, y: Any, sample_weight: Any, class_weight: dict[int, float] | None,
             stream: bool, seed: int) -> DataSource:
    if class_weight is not None and not callable(x):
        check_class_weight(class_weight, y)
    if callable(x) and not hasattr(x, "__array__") and not is_nested(x):
        if y is not None or sample_weight is not None:
            raise ValueError(
                "y and sample_weight must be None when x is a shard loader or a "
                "dataset_fn; it gives (x, y) or (x, y, sample_weight)."
            )
        if accepts_context(x):
            return DatasetFnSource(x, seed, class_weight)
        return LoaderSource(x, class_weight)
    dask_leaves = holds_frames(x, y, sample_weight) or any(
        _is_dask_array(leaf) for nest in (x, y, sample_weight) if nest is not None
        for _, leaf in leaves(nest))
    if stream:
        if not dask_leaves:
            raise ValueError(
                "stream=True reads lazy Dask arrays or DataFrames part by part on the "
                "workers; in-memory arrays are placed whole. Pass Dask collections (e.g. "
                "dd.read_parquet(...)), a loader yielding parts, or a dataset_fn."
            )
        check_lazy(x, y, sample_weight)
        return DaskStreamSource(x, y, sample_weight, class_weight)
    kinds = {_is_dask(leaf) for nest in (x, y, sample_weight) if nest is not None
             for _, leaf in leaves(nest) if not isinstance(leaf, str)}  # str: a column
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


def check_lazy(*nests: Any) -> None:
    """``stream=True`` reads partitions from their sources on each worker; a
    persisted collection's partitions are already in the cluster's memory."""
    from distributed import futures_of

    persisted = [path for name, nest in zip(("x", "y", "sample_weight"), nests, strict=True)
                 if nest is not None for path, leaf in leaves(nest, name)
                 if _is_dask(leaf) and futures_of(leaf)]
    if persisted:
        raise ValueError(
            f"stream=True reads lazy collections part by part, but {', '.join(persisted)} "
            "is persisted: its partitions are already in memory. Drop stream=True (the "
            "workers use the partitions they hold), or pass the collection unpersisted."
        )


def _is_dask_array(a: Any) -> bool:
    return type(a).__module__.startswith("dask.array")


def _is_dask(a: Any) -> bool:
    return _is_dask_array(a) or is_dask_frame(a)


def split_validation(x: Any, y: Any, sample_weight: Any, fraction: float
                     ) -> tuple[tuple[Any, Any, Any], tuple[Any, Any, Any]]:
    """Keras' ``validation_split``: the last ``fraction`` of the rows, before any
    shuffling, become the validation data (``floor(n * (1 - fraction))`` rows stay)."""
    if not 0 < fraction < 1:
        raise ValueError(f"validation_split must be in (0, 1); got {fraction!r}.")
    if holds_frames(x, y, sample_weight):
        raise ValueError(
            "validation_split takes the last rows, which a Dask DataFrame cannot "
            "index by position. Split it by partitions (df.partitions[:-k] and "
            "df.partitions[-k:]) or with df.random_split, and pass validation_data."
        )
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
    """``(x, y)`` or ``(x, y, sample_weight)``, a ``tf.data.Dataset`` or a
    ``keras.utils.PyDataset`` (read here), as Keras takes ``validation_data``."""
    if reads_on_client(validation_data):
        read = read_input(validation_data, "validation_data")
        return read.x, read.y, read.w
    if not isinstance(validation_data, (tuple, list)) or len(validation_data) not in (2, 3):
        raise ValueError(
            "validation_data must be a tuple (x_val, y_val) or (x_val, y_val, "
            "sample_weight_val), a tf.data.Dataset or a keras.utils.PyDataset; got "
            f"{type(validation_data).__name__}"
            + (f" of length {len(validation_data)}." if isinstance(
                validation_data, (tuple, list)) else ".")
        )
    x, y, *rest = validation_data
    return x, y, rest[0] if rest else None


def validation_shard(validation_data: tuple[Any, Any, Any]) -> Shard:
    """``(x, y, sample_weight)`` validation data as one checked in-memory shard."""
    x, y, w = validation_data
    x, y, w = compute_leaves(x, y, w)  # Dask ones, here: validation data is small
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
