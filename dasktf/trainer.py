"""The public training API: :func:`fit` and :class:`Trainer`.

``Trainer.fit`` validates its arguments on the client, resolves the cluster once,
places the data shards, builds one replica per worker, then drives a step engine
(:mod:`dasktf.sync`) epoch by epoch, merging the replicas' metrics and calling Keras
callbacks on the client.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from dasktf import config
from dasktf.asynchronous import choose_holder, updates_frame, validate_mode_options
from dasktf.callbacks import History, LearningRateRelay, ProgressBar
from dasktf.cluster import (
    TensorFlowSetup,
    alive_workers,
    choose_run_workers,
    cluster_client,
    default_tf_threads,
)
from dasktf.collective import validate_engine, validate_fault_options
from dasktf.comm import validate_comm_options
from dasktf.data import (
    PlacedData,
    ShardStats,
    check_labels,
    make_source,
    place_validation,
)
from dasktf.devices import GpusArg, select_gpus
from dasktf.events import (
    TOPIC,
    epoch_record,
    publish,
    run_end_record,
    run_start_record,
    unpack,
)
from dasktf.metrics import ensure_store
from dasktf.models import ModelLike, ModelSpec, model_spec
from dasktf.recovery import FaultOptions, RunGuard
from dasktf.replica import (
    ReplicaConfig,
    build_metrics,
    create_replica_task,
    merge_metric_states,
    release_replicas,
)
from dasktf.sync import RunContext, wait_for

if TYPE_CHECKING:
    from distributed import Client

logger = logging.getLogger(__name__)

MODES = ("sync", "async")
_SPARSE_LOSSES = ("sparse_categorical_crossentropy", "SparseCategoricalCrossentropy")

F = TypeVar("F", bound=Callable[..., Any])


def _explain_unknown_options(func: F) -> F:
    """Turn Python's bare 'unexpected keyword' into a message listing the options."""
    allowed = [
        p.name
        for p in inspect.signature(func).parameters.values()
        if p.kind is p.KEYWORD_ONLY or p.kind is p.POSITIONAL_OR_KEYWORD
    ]

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        unknown = [k for k in kwargs if k not in allowed]
        if unknown:
            hints = {k: difflib.get_close_matches(k, allowed, n=1) for k in unknown}
            said = ", ".join(
                f"{k!r}" + (f" (did you mean {h[0]!r}?)" if h else "") for k, h in hints.items()
            )
            raise TypeError(
                f"{func.__qualname__}() got unknown option(s) {said}; "
                f"allowed: {', '.join(a for a in allowed if a != 'self')}."
            )
        return func(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


def _positive_int(name: str, value: Any, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive integer; got {value!r}.")


def _resolve_optimizer(optimizer: Any, learning_rate: float | None) -> dict[str, Any]:
    import keras

    if isinstance(optimizer, str):
        try:
            opt = keras.optimizers.get(optimizer)
        except ValueError:
            names = ["adam", "adamw", "sgd", "rmsprop", "adagrad", "adadelta", "nadam", "lion"]
            raise ValueError(
                f"Unknown optimizer {optimizer!r}; use a Keras optimizer name "
                f"({', '.join(names)}, ...) or a keras.optimizers.Optimizer instance."
            ) from None
    elif isinstance(optimizer, keras.optimizers.Optimizer):
        opt = optimizer.__class__.from_config(optimizer.get_config())
    else:
        raise TypeError(
            "optimizer must be a name or a keras.optimizers.Optimizer; "
            f"got {type(optimizer).__name__}."
        )
    if learning_rate is not None:
        if not learning_rate > 0:
            raise ValueError(f"learning_rate must be positive; got {learning_rate!r}.")
        opt.learning_rate = learning_rate
    return keras.optimizers.serialize(opt)  # type: ignore[no-any-return]


def _resolve_loss(loss: Any, model: Any, stats: ShardStats) -> Any:
    import keras

    if loss is None:
        loss = getattr(model, "loss", None) if getattr(model, "compiled", False) else None
    if loss is None:
        outputs = model.outputs[0].shape[-1] if getattr(model, "outputs", None) else 1
        loss = "sparse_categorical_crossentropy" if stats.y_integral and outputs > 1 else "mse"
        logger.info("No loss given; using %s", loss)
    if isinstance(loss, str):
        try:
            keras.losses.get(loss)
        except ValueError:
            raise ValueError(
                f"Unknown loss {loss!r}; use a Keras loss name (e.g. "
                "sparse_categorical_crossentropy, categorical_crossentropy, mse, mae) "
                "or a keras.losses.Loss instance."
            ) from None
    return loss


def _resolve_metrics(metrics: Sequence[Any] | None) -> list[Any] | None:
    import keras

    if metrics is None:
        return None
    if isinstance(metrics, str):
        metrics = [metrics]
    out: list[Any] = []
    for m in metrics:
        if isinstance(m, keras.metrics.Metric):
            out.append(keras.metrics.serialize(m))
        elif isinstance(m, str) or callable(m):
            out.append(m)
        else:
            raise TypeError(f"metrics must be names, Metric instances or callables; got {m!r}.")
    return out


def _is_sparse(loss: Any) -> bool:
    name = loss if isinstance(loss, str) else type(loss).__name__
    return name in _SPARSE_LOSSES


class Trainer:
    """Data-parallel training of a Keras model on a Dask cluster.

    Each worker of the cluster holds a data shard and a model replica; every training
    step is a Dask task graph (see :mod:`dasktf.sync`). A trainer keeps its cluster
    between ``fit`` calls; call :meth:`close` (or use it as a context manager) to
    release a cluster it started. A client you pass is never closed.

    Parameters
    ----------
    model
        A ``keras.Model`` (its current weights are the starting point), a callable
        returning one, a built-in name (``"mnist-mlp"``, ``"cnn"``, ``"exp-mlp"``) or
        an importable ``"module:function"``. Factories may take ``input_shape`` and
        ``num_outputs`` keyword arguments, which dasktf fills from the data.
    client
        A ``distributed.Client`` to train on. If ``None`` and ``scheduler`` is
        ``None``, an embedded ``LocalCluster`` of ``n_workers`` processes is started.
    scheduler
        Address of an existing scheduler to connect to instead.
    n_workers
        Replicas to train with: the first ``n_workers`` workers of the cluster (all
        of them by default; 2 for an embedded cluster).
    mode
        ``"sync"``: every step averages all workers' gradients. ``"async"``: every
        worker loops on its own and a parameter holder applies each gradient as it
        arrives (:mod:`dasktf.asynchronous`); ``history.updates`` records each
        update's staleness.
    max_staleness
        Async only: bounded staleness ``K``; a worker waits rather than let any
        update be applied more than ``K`` updates after the version it read
        (``0``: sequential SGD, every staleness 0).
    staleness_lr
        Async only: ``"inverse"`` scales each update's learning rate by
        ``1 / max(1, staleness)``; ``None`` (default) leaves it.
    sync_quorum
        Sync only: apply each step with the first ``k`` of the N gradients and drop
        the late ones ("backup workers", :mod:`dasktf.quorum`); dropped gradients are
        counted per worker in ``history.dropped`` and ``history.history["dropped"]``.
    slow_workers
        Stragglers for tests and demos: ``{worker index: factor}`` makes that worker
        sleep ``(factor - 1)`` x its compute time after every step.
    engine
        Sync only: ``"graph"`` (a Dask task graph per step), ``"collective"``
        (``tf.distribute.MultiWorkerMirroredStrategy`` children of the workers, ring
        all-reduce, no scheduler per step; :mod:`dasktf.collective`) or ``"auto"``
        (the default: the graph engine, with an
        :class:`~dasktf.exceptions.EngineHint` warning where the collective engine
        measured faster). The collective engine runs only when named: its
        TensorFlow servers listen unauthenticated on every interface, which it
        says in a :class:`~dasktf.exceptions.SecurityWarning` when it starts.
    on_epoch_end
        Collective engine: ``hook(weights, optimizer_variables, epoch)`` called on
        the client after each epoch (a checkpoint hook).
    optimizer, learning_rate
        A Keras optimizer name or instance; every replica holds its own copy.
    loss, metrics
        As in ``keras.Model.compile``; the loss defaults to sparse categorical
        cross-entropy for integer labels and MSE otherwise.
    seed
        Seeds the initial weights, the per-epoch shuffles and dropout.
    threads_per_worker
        TensorFlow intra-op threads per worker (default: cores // workers).
    security
        A ``distributed.security.Security`` (TLS) for clusters dasktf connects to or
        starts.
    gpus
        GPUs to train on, one worker per GPU. ``None``: every GPU there is (the
        embedded cluster starts a worker per visible GPU; on an existing cluster the
        workers advertising a ``GPU`` resource), else CPUs. ``"all"``, ``"none"``,
        a count, or (embedded cluster only) a list of GPU indices. Step tasks of a
        GPU run request the resource ``GPU=1``.
    mixed_precision
        Keras mixed precision on the workers: ``mixed_float16`` with dynamic loss
        scaling on GPUs, ``mixed_bfloat16`` on CPUs. Gradients are still summed and
        averaged in float32. It applies to models built on the workers (a name or a
        factory); a ``keras.Model`` instance keeps the dtype policy it was made with.
    compression
        How gradients travel (:mod:`dasktf.compression`): ``"none"`` (default:
        ``dasktf.communication.compression``), ``"fp16"``, ``"bf16"``, ``"int8"`` or
        ``"topk:RATIO"``; lossy codecs keep a per-worker error-feedback residual
        (async: on the pushes to the holder). Sums are taken in float32.
        ``history.history["bytes_per_step"]`` has the bytes moved per worker.
    weights_dtype
        ``placement="ps"`` or async: the servers (the holder) send weights back as
        ``"fp16"`` or ``"bf16"`` (the master copy stays float32); ``None``: float32.
    num_ps, placement
        Sync: ``placement="mirrored"`` (default) has every replica apply the mean
        itself; ``"ps"`` (implied by ``num_ps``) splits the parameters over
        ``num_ps`` servers (:mod:`dasktf.ps`) that apply the optimizer to their slice.
        Async: ``num_ps=K`` splits the parameters over K holders the same way
        (:mod:`dasktf.async_ps`); each gradient task pushes each holder its slice.
    topology
        Sync, mirrored: ``"tree"`` (default: ``dasktf.communication.topology``;
        ``dasktf.reduction-fan-in`` per reduction),
        ``"naive"`` (all-to-one) or ``"ring"`` (reduce-scatter / all-gather), see
        :mod:`dasktf.topology`.

    Examples
    --------
    >>> from distributed import Client
    >>> import dasktf
    >>> with Client(n_workers=2) as client:  # doctest: +SKIP
    ...     trainer = dasktf.Trainer("mnist-mlp", client=client, optimizer="adam")
    ...     history = trainer.fit(x, y, epochs=3, batch_size=256)
    ...     trainer.evaluate(x_test, y_test)
    """

    @_explain_unknown_options
    def __init__(
        self,
        model: ModelLike,
        *,
        client: Client | None = None,
        scheduler: str | None = None,
        n_workers: int | None = None,
        mode: str = "sync",
        optimizer: Any = "sgd",
        learning_rate: float | None = None,
        loss: Any = None,
        metrics: Sequence[Any] | None = None,
        seed: int | None = None,
        threads_per_worker: int | None = None,
        security: Any = None,
        gpus: GpusArg = None,
        mixed_precision: bool = False,
        max_staleness: int | None = None,
        staleness_lr: str | None = None,
        sync_quorum: int | None = None,
        slow_workers: dict[int, float] | None = None,
        engine: str = "auto",
        on_epoch_end: Callable[[list[Any], list[Any], int], None] | None = None,
        compression: str | None = None,
        weights_dtype: str | None = None,
        num_ps: int | None = None,
        placement: str | None = None,
        topology: str | None = None,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}; got {mode!r}.")
        self.comm = validate_comm_options(
            mode, compression, weights_dtype, num_ps, placement, topology, mixed_precision
        )
        _positive_int("n_workers", n_workers, allow_none=True)
        self.slow_workers = validate_mode_options(
            mode, max_staleness, staleness_lr, sync_quorum, slow_workers, n_workers
        )
        self.max_staleness, self.staleness_lr = max_staleness, staleness_lr
        self.sync_quorum = sync_quorum
        validate_engine(engine, mode, sync_quorum, slow_workers)
        self.engine, self.on_epoch_end = engine, on_epoch_end
        _positive_int("threads_per_worker", threads_per_worker, allow_none=True)
        if client is not None and scheduler is not None:
            raise ValueError("Give either client or scheduler, not both.")
        self._model_arg = model
        self.mode = mode
        self.n_workers = n_workers
        self._optimizer = _resolve_optimizer(optimizer, learning_rate)
        if staleness_lr is not None and isinstance(
            self._optimizer.get("config", {}).get("learning_rate"), dict
        ):
            raise ValueError(
                "staleness_lr='inverse' scales a fixed learning rate; this optimizer "
                "has a LearningRateSchedule. Use a float learning rate, or drop "
                "staleness_lr."
            )
        self._loss_arg = loss
        self._metrics = _resolve_metrics(metrics)
        self.seed = int(np.random.SeedSequence().entropy % 2**31) if seed is None else int(seed)
        self.threads_per_worker = threads_per_worker
        if client is None and scheduler is None:
            # Fail before any process starts: GPUs this machine lacks, too many workers.
            select_gpus(gpus, n_workers)
        elif isinstance(gpus, (list, tuple)):
            raise ValueError(
                f"gpus={gpus!r}: GPU indices only apply to the cluster dasktf starts; "
                "on an existing cluster pass 'all' or a count of GPU workers."
            )
        self.gpus = gpus
        self.mixed_precision = bool(mixed_precision)
        self._cluster_cm = cluster_client(
            client, scheduler, n_workers, threads_per_worker, security, gpus
        )
        self._client: Client | None = None
        self.model: Any = None
        self.history: History | None = None

    # -- cluster lifecycle ------------------------------------------------------
    @property
    def client(self) -> Client:
        """The Dask client (the embedded cluster starts on first use)."""
        if self._client is None:
            self._client, self._owned = self._cluster_cm.__enter__()
        return self._client

    def close(self) -> None:
        """Close the cluster this trainer started (a client you passed stays open)."""
        if self._client is not None:
            self._cluster_cm.__exit__(None, None, None)
            self._client = None

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- training ---------------------------------------------------------------
    @_explain_unknown_options
    def fit(
        self,
        x: Any,
        y: Any = None,
        *,
        epochs: int = 1,
        batch_size: int = 128,
        validation_data: tuple[Any, Any] | None = None,
        shuffle: bool = True,
        callbacks: Sequence[Any] | None = None,
        verbose: int = 1,
        checkpoint_dir: str | None = None,
        checkpoint_every: int | None = None,
        resume: bool = False,
        on_worker_loss: str = "recover",
        scale_lr: bool = False,
    ) -> History:
        """Train for ``epochs`` epochs; return a Keras-style :class:`History`.

        Parameters
        ----------
        x, y
            NumPy arrays, Dask arrays (chunks stay on the workers holding them), or
            ``x`` a shard loader ``load(shard_index, num_shards) -> (x, y)`` run on
            each worker (``y`` then ``None``).
        batch_size
            The *global* batch: each step averages the gradients of ``batch_size``
            examples spread over the workers.
        validation_data
            ``(x_val, y_val)`` evaluated on the workers at every epoch end.
        shuffle
            Reshuffle every shard at every epoch (seeded). With ``shuffle=False`` and
            array inputs the global batches are exactly Keras' (``x[k*B:(k+1)*B]``).
        callbacks
            ``keras.callbacks.Callback`` instances, run on the client.
        verbose
            0 silent, 1 a progress bar and a line per epoch, 2 a line per epoch.
        checkpoint_dir, checkpoint_every
            Write a checkpoint (weights, optimizer state, counters, seed, config;
            :mod:`dasktf.checkpoint`) into ``checkpoint_dir`` at every epoch end and,
            every ``checkpoint_every`` steps (sync: after steps k, 2k, ... of each
            epoch, holding exactly those updates; not with ``engine="collective"``,
            which checkpoints at epoch ends) or updates (async: the holder's state
            and the batches applied, :mod:`dasktf.async_checkpoint`); the final model
            is also saved there as ``model.keras``.
        resume
            Continue from the newest valid checkpoint in ``checkpoint_dir`` up to
            ``epochs`` epochs in all.
        on_worker_loss
            ``"recover"`` (default): go on with the surviving workers, the lost shard
            taken over by one of them (:mod:`dasktf.elastic`); ``"raise"``: stop
            with :class:`~dasktf.exceptions.WorkerLostError`.
        scale_lr
            When the worker count changes, rescale the global batch and the learning
            rate by the linear scaling rule, with a short warm-up (logged as an event).
            Sync mode only: an async update is one worker's batch, whatever the count.

        Raises
        ------
        ValueError, TypeError
            Bad arguments or data (shapes, NaN, labels out of range, ...).
        dasktf.exceptions.DasktfError
            A worker was lost, a replica failed or a step timed out.
        """
        _positive_int("epochs", epochs)
        _positive_int("batch_size", batch_size)
        if verbose not in (0, 1, 2):
            raise ValueError(f"verbose must be 0, 1 or 2; got {verbose!r}.")
        source = make_source(x, y)
        options = FaultOptions(checkpoint_dir, checkpoint_every, bool(resume),
                               on_worker_loss, bool(scale_lr))
        validate_fault_options(self.engine, options)
        if options.scale_lr and (self.mode != "sync" or self.sync_quorum is not None):
            # An async update (or a quorum step's share) is one worker's batch, whose
            # size a change of the worker count does not touch: there is no global
            # batch for the linear scaling rule to follow.
            raise ValueError(
                "scale_lr follows the global batch of sync steps when the worker count "
                "changes; an async or sync_quorum update is one worker's batch, which "
                "does not change with the worker count. Use mode='sync' without "
                "sync_quorum, or leave scale_lr off (the learning rate stays as given)."
            )
        if validation_data is not None and (
            not isinstance(validation_data, (tuple, list)) or len(validation_data) != 2
        ):
            raise ValueError("validation_data must be a tuple (x_val, y_val).")
        started = time.perf_counter()
        client = self.client
        workers, resources = choose_run_workers(client, self.n_workers, self.gpus)
        validate_mode_options(  # the quorum and the slowed indices against the workers
            self.mode, self.max_staleness, self.staleness_lr, self.sync_quorum,
            self.slow_workers, len(workers),
        )
        if self.threads_per_worker is not None or not getattr(self, "_owned", False):
            threads = self.threads_per_worker or default_tf_threads(len(workers))
            client.register_plugin(TensorFlowSetup(threads))
        placed = source.place(client, workers, batch_size)
        run = _Run(self, client, workers, placed, batch_size, shuffle, resources)
        run.source, run.validation_data, run.verbose = source, validation_data, verbose
        run.options = options
        try:
            run.build(validation_data)
            history = run.train(epochs, callbacks, verbose)
        finally:
            run.release()
        history.wall_seconds = time.perf_counter() - started
        self.history = history
        return history

    def evaluate(
        self, x: Any, y: Any, *, batch_size: int = 256, verbose: int = 0
    ) -> dict[str, float]:
        """Evaluate the trained model on the client; returns ``{"loss": ..., ...}``."""
        if self.model is None:
            raise RuntimeError("Call fit() before evaluate().")
        return self.model.evaluate(  # type: ignore[no-any-return]
            np.asarray(x), np.asarray(y), batch_size=batch_size, verbose=verbose,
            return_dict=True,
        )


class _Run:
    """One ``fit`` call: the replicas, the engine, the epoch loop and the clean-up."""

    def __init__(
        self,
        trainer: Trainer,
        client: Client,
        workers: list[str],
        placed: PlacedData,
        batch_size: int,
        shuffle: bool,
        resources: dict[str, float] | None = None,
    ) -> None:
        self.trainer = trainer
        self.client = client
        self.workers = workers
        self.placed = placed
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.run_id = uuid.uuid4().hex[:10]
        self.ctx = RunContext(
            client, self.run_id, workers, placed.steps_per_epoch, resources
        )
        self.replica_info: list[dict[str, Any]] = []
        self._latest_loss: float | None = None
        self._futures: list[Any] = []
        # fault tolerance (dasktf.recovery); Trainer.fit sets them
        self.source: Any = None
        self.validation_data: tuple[Any, Any] | None = None
        self.verbose = 0
        self.options = FaultOptions()
        self._generation = 0

    # -- set-up -------------------------------------------------------------------
    def _reference_model(self) -> tuple[Any, ModelSpec]:
        """Build (or take) the client-side model and its recipe; check the shapes."""
        import keras

        t = self.trainer
        stats = self.placed.stats[0]
        if t.model is not None:  # a second fit() continues from the trained weights
            model, spec = t.model, model_spec(t.model, stats.x_shape, None)
        elif isinstance(t._model_arg, keras.Model):
            model, spec = t._model_arg, model_spec(t._model_arg, stats.x_shape, None)
        else:
            keras.utils.set_random_seed(t.seed)
            num_outputs = (
                int(max(s.y_max for s in self.placed.stats)) + 1
                if stats.y_integral and not stats.y_shape
                else int(np.prod(stats.y_shape or (1,)))
            )
            spec = model_spec(t._model_arg, stats.x_shape, num_outputs)
            model = spec.build()
        probe = np.zeros((2, *stats.x_shape), dtype=stats.x_dtype)
        try:
            model(probe)
        except Exception as exc:
            raise ValueError(
                f"The model does not accept inputs of shape {(None, *stats.x_shape)} "
                f"({type(exc).__name__}: {str(exc).splitlines()[0]}). Check x's shape "
                "against the model's input."
            ) from exc
        return model, spec

    def build(self, validation_data: tuple[Any, Any] | None) -> None:
        import keras

        t = self.trainer
        model, spec = self._reference_model()
        loss = _resolve_loss(t._loss_arg, model, self.placed.stats[0])
        if _is_sparse(loss):
            check_labels(self.placed.stats, int(model.outputs[0].shape[-1]))
        model.compile(
            optimizer=keras.optimizers.deserialize(t._optimizer),
            loss=loss,
            metrics=_metrics_objects(t._metrics),
        )
        stats = self.placed.stats[0]
        probe_x = np.zeros((1, *stats.x_shape), dtype=stats.x_dtype)
        probe_y = np.zeros((1, *stats.y_shape), dtype=stats.y_dtype)
        build_metrics(model, probe_x, probe_y)
        self.model = model
        t.model = model
        self.spec_description = spec.description or getattr(model, "name", "")
        self._cfg = ReplicaConfig(
            spec, t._optimizer, loss, t._metrics, t.seed,
            mixed_precision=t.mixed_precision,
            publish_metrics=bool(config.get("metrics")),
            comm=dataclasses.replace(t.comm, n_workers=len(self.workers)),
        )
        self._validation = validation_data
        if t.comm.num_ps > 1:  # refuse a num_ps the parameters cannot be split over
            from dasktf.ps import shard_plan

            shapes = [tuple(v.shape) for v in model.trainable_variables]
            shard_plan(shapes, t.comm.num_ps)
        self.ps_layout = None
        if t.comm.placement == "ps" and t.mode == "sync" and t.sync_quorum is None:
            from dasktf.ps import optimizer_layout

            # Checkpoints, restore points and re-forms merge the servers' optimizer
            # slices into the model optimizer's layout: refuse one that has none.
            positions = {id(w): i for i, w in enumerate(model.weights)}
            self.ps_layout = (
                optimizer_layout(t._optimizer, model.trainable_variables),
                [positions[id(v)] for v in model.trainable_variables],
            )
        self._create_replicas()

    def _create_replicas(self) -> None:
        """One replica per worker of ``self.workers`` from ``self.model``'s weights."""
        t, cfg, validation_data = self.trainer, self._cfg, self._validation
        val = (
            place_validation(self.client, *validation_data, self.workers)
            if validation_data is not None
            else [None] * len(self.workers)
        )
        # hash=False: a content-hashed key is shared with an earlier fit of the same
        # model, whose release can then race this scatter ("lost dependencies").
        weights = self.client.scatter(
            [np.asarray(w) for w in self.model.get_weights()], broadcast=True, hash=False
        )
        futures = [
            self.client.submit(
                create_replica_task,
                self.run_id,
                w,
                cfg,
                i,
                self.placed.shards[i],
                self.placed.schedule[:, i],
                weights,
                val[i],
                self.shuffle,
                t.slow_workers.get(i, 1.0),
                key=f"dasktf-replica-{self.run_id}-{i}"
                + (f"-g{self._generation}" if self._generation else ""),
                workers=[w],
                allow_other_workers=False,
                resources=self.ctx.resources,
            )
            for i, w in enumerate(self.workers)
        ]
        self._futures = futures
        self._engine_inputs = (cfg, weights, val)
        with _config_override("step-timeout", config.get("replica-timeout")):
            wait_for(self.ctx, futures, "building the replicas")
        self.replica_info = self.client.gather(futures)

    # -- the epoch loop -----------------------------------------------------------------
    def train(self, epochs: int, callbacks: Sequence[Any] | None, verbose: int) -> History:
        import keras

        history = History()
        history.run_id, history.workers = self.run_id, list(self.workers)
        history.replica_info = self.replica_info
        cbs = list(callbacks or [])
        if verbose:
            cbs.append(ProgressBar(self.batch_size) if verbose == 1 else _LinePrinter())
        cb = keras.callbacks.CallbackList(
            [*cbs, history], add_history=False, add_progbar=False, model=self.model,
            epochs=epochs, steps=self.ctx.steps_per_epoch, verbose=verbose,
        )
        from dasktf.membership import MembershipWatcher

        self.ctx.watcher = MembershipWatcher(self.client)
        guard = self.guard = RunGuard(self, self.options, epochs)
        engine = self._make_engine(epochs)
        history.engine = engine.engine
        # Which engine ran, where Keras callbacks (and users) read a run's settings.
        cb.set_params({**cb.params, "mode": engine.mode, "engine": engine.engine})
        first_epoch, first_step = guard.begin(engine)
        # after begin: a resumed run's learning rate is the checkpoint's
        relay = LearningRateRelay(self.model, guard.lr_factor)
        self._publish(self._run_start_record(epochs, engine.mode, engine.engine))
        self.client.subscribe_topic(TOPIC, self._on_event)
        self.model.stop_training = False
        cb.on_train_begin()

        def on_step(step: int) -> None:
            cb.on_train_batch_end(step, {"loss": self._latest_loss})
            guard.after_step(engine, epoch, step)

        try:
            for epoch in range(first_epoch, epochs):
                cb.on_epoch_begin(epoch)
                relay.relay(engine)  # LearningRateScheduler, ReduceLROnPlateau, ...
                start = time.perf_counter()
                resume_at = {"start": first_step} if epoch == first_epoch and first_step else {}
                reports = engine.run_epoch(epoch, on_step, **resume_at)
                seconds = time.perf_counter() - start
                logs = self._epoch_logs(reports, seconds)
                if hasattr(engine, "epoch_logs"):  # async and quorum: staleness, drops
                    logs.update(engine.epoch_logs(seconds))
                self.model.set_weights(reports[0].weights)
                cb.on_epoch_end(epoch, logs)
                relay.relay(engine)  # ReduceLROnPlateau: before the checkpoint
                last_update = (epoch + 1) * self.ctx.steps_per_epoch - 1
                self._publish(epoch_record(self.run_id, epoch, last_update, logs))
                if self.model.stop_training:
                    break
                guard.end_epoch(engine, epoch)
            if hasattr(engine, "finish"):
                engine.finish()  # drains the updates in flight: the final weights
                self.model.set_weights(engine.final_weights)
                history.updates = updates_frame(engine.updates)
                history.dropped = dict(engine.dropped)
                history.gradient_tasks = dict(engine.tasks, discarded=engine.discarded)
                if getattr(engine, "sharded", None) is not None:  # async num_ps > 1
                    history.holder_traffic = engine.sharded.traffic(engine)
            history.recoveries = list(getattr(engine, "losses", []))
            history.workers = list(self.ctx.workers)  # after any loss or growth
            if hasattr(engine, "applied_logs"):
                history.applied_updates = engine.applied_logs()
            guard.finish(self.model, engine)
        except BaseException as exc:
            self._publish(run_end_record(self.run_id, exc))
            lost = guard.scheduler_lost(exc)
            if lost is not None:
                raise lost from exc
            raise
        finally:
            self.client.unsubscribe_topic(TOPIC)
            self.ctx.watcher.close()
            if hasattr(engine, "close"):
                engine.close()
        self._publish(run_end_record(self.run_id))
        cb.on_train_end()
        history.set_model(self.model)
        return history

    def _make_engine(self, epochs: int) -> Any:
        """The step engine of the trainer's mode (sync, async, or sync with quorum)."""
        t = self.trainer
        if t.mode == "sync" and t.sync_quorum is None:
            from dasktf.collective import make_engine

            return make_engine(self, epochs, graph=self.guard.sync_engine)
        from dasktf.asynchronous import AsyncEngine
        from dasktf.quorum import QuorumEngine

        cfg, weights, val = self._engine_inputs
        holder = choose_holder(self.workers, t.slow_workers)
        args = (self.ctx, self.workers[holder], cfg, weights, self.placed.shards[holder],
                val, self.placed.schedule)
        if t.mode == "async":
            from dasktf.async_ps import plan_holders

            # num_ps=K: K holders, one slice each (K=1: the one holder above)
            holders, plan = plan_holders(
                self.workers, t.slow_workers,
                [tuple(v.shape) for v in self.model.trainable_variables], t.comm.num_ps,
            )
            return self.guard.attach_async(AsyncEngine(
                *args, max_staleness=t.max_staleness, staleness_lr=t.staleness_lr,
                epochs=epochs, holders=holders, plan=plan,
            ))
        return self.guard.attach_async(QuorumEngine(*args, quorum=t.sync_quorum, epochs=epochs))

    def _epoch_logs(self, reports: list[Any], seconds: float) -> dict[str, float]:
        logs = merge_metric_states(self.model, [r.train_states for r in reports])
        if reports[0].val_states is not None:
            val = merge_metric_states(self.model, [r.val_states for r in reports])
            logs.update({f"val_{k}": v for k, v in val.items()})
        logs["examples_per_sec"] = self.placed.n_samples / seconds
        logs["epoch_seconds"] = seconds
        return logs

    def _run_start_record(self, epochs: int, mode: str, engine: str) -> dict[str, Any]:
        return run_start_record(
            self.run_id, mode=mode, engine=engine, model=self.spec_description,
            workers=self.workers,
            replica_info=self.replica_info, epochs=epochs,
            steps_per_epoch=self.ctx.steps_per_epoch, batch_size=self.batch_size,
            n_samples=self.placed.n_samples,
        )

    def _publish(self, record: dict[str, Any]) -> None:
        """Send a run record to the scheduler's MetricsStore; never fails the run."""
        try:
            if record["kind"] == "run_start":
                ensure_store(self.client)
            publish(self.client, record)
        except Exception:
            logger.warning("publishing the %s record of run %s failed",
                           record["kind"], self.run_id, exc_info=True)

    def _on_event(self, event: Any) -> None:
        for record in unpack(event):
            if record.get("run") == self.run_id and record.get("loss") is not None:
                self._latest_loss = float(record["loss"])

    def reform(self, workers: list[str], batch_size: int) -> None:
        """Rebuild the run on ``workers`` at an epoch boundary: data re-placed,
        replicas rebuilt (their state is then loaded by :class:`RunGuard`)."""
        self.release()
        self.workers = list(workers)
        self.batch_size = batch_size
        self.placed = self.source.place(self.client, self.workers, batch_size)
        self.ctx.workers = list(workers)
        self.ctx.steps_per_epoch = self.placed.steps_per_epoch
        self._generation += 1
        # a ring's chunks are cut for the worker count
        self._cfg = dataclasses.replace(
            self._cfg, comm=dataclasses.replace(self._cfg.comm, n_workers=len(workers)))
        self._create_replicas()

    def release(self) -> None:
        """Free the replicas and shards on the workers, whatever happened."""
        try:
            # Only the live ones: a dead worker's address costs a 30 s connect timeout.
            alive = set(alive_workers(self.client))
            workers = [w for w in self.ctx.workers if w in alive]
            if workers:
                self.client.run(release_replicas, self.run_id, workers=workers,
                                on_error="ignore")
        except Exception:
            logger.debug("releasing replicas of %s failed", self.run_id, exc_info=True)
        self._futures = []
        self.placed.shards = []


class _LinePrinter(ProgressBar):
    def __init__(self) -> None:
        super().__init__(batch_size=0)

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        pass


def _metrics_objects(metrics: list[Any] | None) -> list[Any] | None:
    import keras

    if metrics is None:
        return None
    return [keras.metrics.deserialize(m) if isinstance(m, dict) else m for m in metrics]


class _config_override:
    def __init__(self, key: str, value: Any) -> None:
        import dask

        self._cm = dask.config.set({f"dasktf.{key}": value})

    def __enter__(self) -> None:
        self._cm.__enter__()

    def __exit__(self, *exc: Any) -> None:
        self._cm.__exit__(*exc)


@_explain_unknown_options
def fit(
    model: ModelLike,
    x: Any,
    y: Any = None,
    *,
    client: Client | None = None,
    scheduler: str | None = None,
    n_workers: int | None = None,
    mode: str = "sync",
    epochs: int = 1,
    batch_size: int = 128,
    optimizer: Any = "sgd",
    learning_rate: float | None = None,
    loss: Any = None,
    metrics: Sequence[Any] | None = None,
    validation_data: tuple[Any, Any] | None = None,
    shuffle: bool = True,
    seed: int | None = None,
    callbacks: Sequence[Any] | None = None,
    verbose: int = 1,
    threads_per_worker: int | None = None,
    security: Any = None,
    gpus: GpusArg = None,
    mixed_precision: bool = False,
    max_staleness: int | None = None,
    staleness_lr: str | None = None,
    sync_quorum: int | None = None,
    slow_workers: dict[int, float] | None = None,
    engine: str = "auto",
    on_epoch_end: Callable[[list[Any], list[Any], int], None] | None = None,
    checkpoint_dir: str | None = None,
    checkpoint_every: int | None = None,
    resume: bool = False,
    on_worker_loss: str = "recover",
    scale_lr: bool = False,
    compression: str | None = None,
    weights_dtype: str | None = None,
    num_ps: int | None = None,
    placement: str | None = None,
    topology: str | None = None,
) -> History:
    """Train ``model`` data-parallel on a Dask cluster; return its :class:`History`.

    The one-call form of :class:`Trainer` (see there for every parameter). The
    trained model is ``history.model``. An embedded cluster started for the call is
    closed when it returns; a ``client`` you pass stays open.

    Examples
    --------
    >>> history = dasktf.fit("mnist-mlp", x, y, n_workers=3, epochs=2,  # doctest: +SKIP
    ...                      optimizer="adam", metrics=["accuracy"])
    >>> history.history["loss"]  # doctest: +SKIP
    """
    with Trainer(
        model,
        client=client,
        scheduler=scheduler,
        n_workers=n_workers,
        mode=mode,
        optimizer=optimizer,
        learning_rate=learning_rate,
        loss=loss,
        metrics=metrics,
        seed=seed,
        threads_per_worker=threads_per_worker,
        security=security,
        gpus=gpus,
        mixed_precision=mixed_precision,
        max_staleness=max_staleness,
        staleness_lr=staleness_lr,
        sync_quorum=sync_quorum,
        slow_workers=slow_workers,
        engine=engine,
        on_epoch_end=on_epoch_end,
        compression=compression,
        weights_dtype=weights_dtype,
        num_ps=num_ps,
        placement=placement,
        topology=topology,
    ) as trainer:
        return trainer.fit(
            x,
            y,
            epochs=epochs,
            batch_size=batch_size,
            validation_data=validation_data,
            shuffle=shuffle,
            callbacks=callbacks,
            verbose=verbose,
            checkpoint_dir=checkpoint_dir,
            checkpoint_every=checkpoint_every,
            resume=resume,
            on_worker_loss=on_worker_loss,
            scale_lr=scale_lr,
        )
