"""Client-side callbacks: Keras' own ``Callback`` API, driven by the dasktf loop.

dasktf calls standard ``keras.callbacks.Callback`` hooks (``on_train_begin``,
``on_epoch_begin``, ``on_train_batch_end``, ``on_epoch_end``, ``on_train_end``) with
``logs`` already merged across replicas, so Keras callbacks such as ``EarlyStopping``,
``CSVLogger`` or ``LambdaCallback`` work unchanged. ``self.model`` is the client-side
model, which receives the trained weights at every epoch end.
"""

from __future__ import annotations

import time
from typing import Any

import keras


class History(keras.callbacks.History):
    """Keras' ``History`` plus what a distributed run adds.

    Attributes
    ----------
    history
        Per-epoch values: ``loss``, metric names, ``val_*``, ``examples_per_sec``,
        ``epoch_seconds``.
    model
        The trained Keras model (on the client).
    run_id
        The id under which the run published its metrics.
    workers
        The addresses of the workers that held the replicas.
    replica_info
        What each replica reported when it was built (devices, threads, shard size).
    updates
        Async and quorum runs: a pandas DataFrame with one row per applied update
        (:class:`dasktf.asynchronous.UpdateRecord`: update, worker, epoch,
        version_read, version_applied, staleness, loss, batch_size, compute_s,
        wall_time, ...); ``None`` for sync runs.
    dropped
        Quorum runs: dropped gradients per worker index (async: all zero).
    gradient_tasks
        Async and quorum runs: gradient tasks that ``computed`` a gradient, that
        found the run ``stopped``, and gradients ``discarded`` at the end because
        their quorum step never completed.
    holder_traffic
        Async runs with ``num_ps=K > 1``: per holder, the bytes it ``received`` and
        ``sent`` over the run, counted by the holder (:mod:`dasktf.async_ps`).
    """

    def __init__(self) -> None:
        super().__init__()
        self.run_id = ""
        self.workers: list[str] = []
        self.replica_info: list[dict[str, Any]] = []
        self.wall_seconds = 0.0
        self.updates: Any = None
        self.dropped: dict[int, int] = {}
        self.gradient_tasks: dict[str, int] = {}
        self.holder_traffic: list[dict[str, int]] | None = None


class ProgressBar(keras.callbacks.Callback):
    """A tqdm bar per epoch (loss, examples/s) and one summary line per epoch."""

    def __init__(self, batch_size: int, print_fn: Any = print) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.print_fn = print_fn
        self._bar: Any = None
        self._start = 0.0

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        from tqdm.auto import tqdm

        self._start = time.perf_counter()
        self._bar = tqdm(
            total=self.params.get("steps"),
            desc=f"epoch {epoch + 1}/{self.params.get('epochs')}",
            unit="step",
            leave=False,
            dynamic_ncols=True,
        )

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        if self._bar is None:
            return
        self._bar.update(1)
        elapsed = time.perf_counter() - self._start
        postfix = {"ex/s": f"{(batch + 1) * self.batch_size / max(elapsed, 1e-9):,.0f}"}
        if logs and logs.get("loss") is not None:
            postfix["loss"] = f"{logs['loss']:.4f}"
        self._bar.set_postfix(postfix, refresh=False)

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        self.print_fn(format_epoch_line(epoch, self.params.get("epochs"), logs or {}))


def format_epoch_line(epoch: int, epochs: Any, logs: dict[str, Any]) -> str:
    parts = [f"epoch {epoch + 1}/{epochs}"]
    order = ["loss", "val_loss", "val_accuracy", "accuracy"]
    keys = [k for k in order if k in logs] + sorted(
        k for k in logs if k not in order and k not in ("examples_per_sec", "epoch_seconds")
        # the byte counts stay in history; the run's summary line prints MB/step
        and not k.startswith("bytes_")
    )
    parts += [_format_value(k, logs[k]) for k in keys if isinstance(logs[k], (int, float))]
    if "examples_per_sec" in logs:
        parts.append(f"{logs['examples_per_sec']:,.0f} examples/s")
    return "  ".join(parts)


#: Counts (async and quorum epochs) print as integers.
_COUNT_KEYS = ("updates", "dropped", "staleness_max")


def _format_value(key: str, value: float) -> str:
    if key in _COUNT_KEYS:
        return f"{key} {value:.0f}"
    if key == "staleness_mean":
        return f"{key} {value:.2f}"
    return f"{key} {value:.4f}"
