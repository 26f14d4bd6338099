"""Client-side callbacks: Keras' own ``Callback`` API, driven by the dasktf loop.

dasktf calls standard ``keras.callbacks.Callback`` hooks (``on_train_begin``,
``on_epoch_begin``, ``on_train_batch_end``, ``on_epoch_end``, ``on_train_end``) with
``logs`` already merged across replicas, so Keras callbacks such as ``EarlyStopping``,
``CSVLogger`` or ``LambdaCallback`` work unchanged. ``self.model`` is the client-side
model, which receives the trained weights at every epoch end, and the trained
optimizer's state too where a callback saves it (:func:`saves_optimizer`:
``ModelCheckpoint``). :func:`check_callbacks`
refuses, before a run starts, what would fail mid-run or cannot mean in a dasktf run
what it means in Keras (``BackupAndRestore``).
"""

from __future__ import annotations

import numbers
import sys
import time
from collections.abc import Sequence
from typing import Any

import keras

from dasktf import compat


def check_callbacks(callbacks: Any) -> list[keras.callbacks.Callback]:
    """The callbacks a run will drive, as a list, checked before any worker is used.

    ``None`` is no callbacks and a single callback is a list of one, as in Keras'
    ``fit``. What would otherwise fail mid-run, after the replicas were built (an
    object without the ``Callback`` hooks), or silently do something else than the
    user asked for (``BackupAndRestore``), is refused here.

    Raises
    ------
    TypeError
        ``callbacks`` is not a list or tuple of ``keras.callbacks.Callback``.
    ValueError
        A ``keras.callbacks.BackupAndRestore`` (it cannot resume a dasktf run).
    """
    if callbacks is None:
        return []
    if isinstance(callbacks, keras.callbacks.Callback):
        callbacks = [callbacks]
    if not isinstance(callbacks, Sequence) or isinstance(callbacks, (str, bytes)):
        raise TypeError(
            "callbacks must be a list of keras.callbacks.Callback instances; got "
            f"{type(callbacks).__name__}."
        )
    for i, callback in enumerate(callbacks):
        _check_callback(i, callback)
    return list(callbacks)


def saves_optimizer(callbacks: Sequence[Any], logs: dict[str, Any]) -> bool:
    """Whether a callback saves the client's model whole at this epoch end (its
    ``logs``), optimizer included: a ``ModelCheckpoint`` that saves the model (not
    only its weights) once per epoch, and with ``save_best_only`` only when its
    monitored value improved. Only then does the run give the client's model the
    trained optimizer's state (one read of it from the workers or the parameter
    holder); weights alone reach it at every epoch end whatever the callbacks."""
    return any(isinstance(c, keras.callbacks.ModelCheckpoint)
               and not c.save_weights_only and c.save_freq == "epoch"
               and _improves(c, logs) for c in callbacks)


def _improves(checkpoint: Any, logs: dict[str, Any]) -> bool:
    """Whether ``ModelCheckpoint.on_epoch_end(logs)`` will save: always unless
    ``save_best_only``, then when its monitored value improves (Keras'
    ``_is_improvement``, which changes nothing; when in doubt: it will)."""
    if not checkpoint.save_best_only:
        return True
    current = logs.get(checkpoint.monitor)
    improvement = compat.improvement_check(checkpoint)
    if improvement is None or not isinstance(current, numbers.Real):
        return True
    try:
        return bool(improvement(current, checkpoint.best))
    except Exception:  # noqa: BLE001 - Keras' own check will tell; read the state
        return True


def _check_callback(index: int, callback: Any) -> None:
    if isinstance(callback, keras.callbacks.BackupAndRestore):
        # It backs up the client's model and an epoch counter, and on a restart
        # loads them there; neither reaches a dasktf run (the loop does not read the
        # counter; weights, optimizer state and data order live on the workers or
        # the holders): it would silently start over.
        raise ValueError(
            "keras.callbacks.BackupAndRestore cannot resume a dasktf run: it backs up "
            "the client-side model and counters, while the replicas' weights and "
            "optimizer state live on the workers. Use dasktf's own checkpoints "
            "instead: fit(..., checkpoint_dir=DIR) writes weights, optimizer state "
            "and counters at every epoch end (and every checkpoint_every=N steps), "
            "and fit(..., checkpoint_dir=DIR, resume=True) continues from the newest "
            "one."
        )
    if not isinstance(callback, keras.callbacks.Callback):
        # A class (not an instance), a function or a Keras 2 / tf_keras callback:
        # dasktf drives Keras 3's hooks, and would find out at the first one.
        raise TypeError(
            f"callbacks[{index}] is {callback!r} ({type(callback).__name__}), not a "
            "keras.callbacks.Callback instance. Pass instances of Keras 3 callbacks "
            "(keras.callbacks.*, or a subclass of keras.callbacks.Callback; "
            "keras.callbacks.LambdaCallback wraps plain functions)."
        )


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
    engine
        The engine that ran: ``"graph"`` or ``"collective"`` (also
        ``history.params["engine"]``, beside ``params["mode"]``).
    workers
        The addresses of the workers that held the replicas.
    replica_info
        What each replica reported when it was built (devices, threads, shard size).
    updates
        Async and quorum runs: a pandas DataFrame with one row per applied update
        (:class:`dasktf.engines.holder.records.UpdateRecord`: update, worker, epoch,
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
        ``sent`` over the run, counted by the holder (:mod:`dasktf.engines.holder.sharded`).
    recoveries
        One entry per lost worker the run went on without (when it was detected,
        how long the run took to resume, what moved where).
    applied_updates
        Sync graph runs: per replica, the global updates it applied, in order
        (every surviving replica reads ``0..N-1``); ``None`` for other engines.
    rounds
        Sync runs with ``local_steps``: one entry per round (outer update):
        ``epoch``, ``update``, ``drift`` (the workers' spread around the mean
        change, over its norm), ``loss`` (the round's mean inner-step loss),
        ``examples`` and ``redone`` (times a recovery restarted the round from its
        start on the first replica); the epoch logs add ``rounds``, the mean
        ``drift`` and ``bytes_per_example``.
    """

    def __init__(self) -> None:
        super().__init__()
        self.run_id = ""
        self.engine = ""
        self.workers: list[str] = []
        self.replica_info: list[dict[str, Any]] = []
        self.wall_seconds = 0.0
        self.updates: Any = None
        self.dropped: dict[int, int] = {}
        self.gradient_tasks: dict[str, int] = {}
        self.holder_traffic: list[dict[str, int]] | None = None
        self.recoveries: list[dict[str, Any]] = []
        self.applied_updates: dict[int, list[int]] | None = None
        self.rounds: list[dict[str, Any]] = []


def progress_bar_class() -> Any:
    """The tqdm class for a progress bar here: ``tqdm.auto``'s (a widget in a
    notebook) where ipywidgets can draw one, else the text bar.

    ``tqdm.auto`` in a Jupyter kernel without ipywidgets warns ``TqdmWarning:
    IProgress not found`` before falling back to the text bar (issue 36): asking
    ``tqdm.notebook`` first, which imports ipywidgets quietly, gives the same bar
    without the warning. Outside a Jupyter kernel ``tqdm.auto`` is the text bar:
    it is taken directly, without importing IPython."""
    if "ipykernel.zmqshell" in sys.modules:
        from tqdm import notebook

        if notebook.IProgress is not None:
            from tqdm.auto import tqdm

            return tqdm
    from tqdm.std import tqdm

    return tqdm


class ProgressBar(keras.callbacks.Callback):
    """A tqdm bar per epoch (loss, examples/s) and one summary line per epoch."""

    def __init__(self, batch_size: int, print_fn: Any = print) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.print_fn = print_fn
        self._bar: Any = None
        self._start = 0.0

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self._start = time.perf_counter()
        self._bar = progress_bar_class()(
            total=self.params.get("steps"),
            desc=f"epoch {epoch + 1}/{self.params.get('epochs')}",
            unit="step",
            leave=False,
            dynamic_ncols=True,
        )

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        if self._bar is None:
            return
        # a round of local steps ends several steps at once
        self._bar.update(max(1, batch + 1 - self._bar.n))
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


def client_learning_rate(model: Any) -> float | None:
    """The learning rate the client's model's optimizer holds now, or ``None`` when
    it follows a schedule (a ``LearningRateSchedule`` or callable runs wherever the
    optimizer steps, from its own iteration count: nothing to carry)."""
    optimizer = getattr(model, "optimizer", None)
    inner = getattr(optimizer, "inner_optimizer", optimizer)  # a LossScaleOptimizer
    if not compat.holds_learning_rate(inner):
        return None
    return float(inner.learning_rate.numpy())


def adopt_learning_rate(model: Any, optimizer_values: list[Any]) -> None:
    """Give the client's model the learning rate of a checkpoint's optimizer
    variables (Keras 3 keeps it among them), so callbacks such as
    ``ReduceLROnPlateau`` go on from the resumed value, not the configured one."""
    if client_learning_rate(model) is None:
        return
    optimizer = model.optimizer
    if not optimizer.built:
        optimizer.build(model.trainable_variables)
    for v, value in zip(optimizer.variables, optimizer_values, strict=False):
        if v.path.endswith("learning_rate"):
            optimizer.learning_rate = float(value)
            return


class LearningRateRelay:
    """Carries a learning rate set on the client to where the run's optimizers are.

    Keras callbacks act on ``self.model``, the client's model, which never trains:
    ``keras.callbacks.LearningRateScheduler`` (``on_epoch_begin``),
    ``ReduceLROnPlateau`` (``on_epoch_end``) or any callback that assigns
    ``model.optimizer.learning_rate`` would change nothing. Before each epoch the
    trainer calls :meth:`relay`, which hands a changed value to the engine's
    ``set_learning_rate``: every replica's optimizer (sync; the parameter-server
    slices too), the parameter holders (async, quorum) or the TensorFlow children
    (collective), before any step of that epoch. ``scale()`` is the factor the run
    applies on top (``scale_lr``'s linear scaling rule).
    """

    def __init__(self, model: Any, scale: Any = None) -> None:
        self.model = model
        self.scale = scale or (lambda: 1.0)
        self.last = client_learning_rate(model)

    def relay(self, engine: Any) -> float | None:
        """Push the client's learning rate if it changed; return it, else ``None``."""
        lr = client_learning_rate(self.model)
        if lr is None or lr == self.last:
            return None
        engine.set_learning_rate(lr * float(self.scale()))
        self.last = lr
        return lr

