"""The public training API: :func:`fit` and :class:`Trainer`.

A :class:`Trainer` holds its checked options (:class:`~dasktf.run.options.TrainOptions`)
and its cluster; each ``fit`` call checks the data and the fault options, then hands
one :class:`~dasktf.run.run.Run` the work: place the shards, build the replicas,
drive the engine (:mod:`dasktf.run.engine` picks it) epoch by epoch, merge the
replicas' metrics and call Keras callbacks on the client.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from dasktf.callbacks import History, check_callbacks
from dasktf.cluster.devices import select_gpus
from dasktf.cluster.local import (
    TensorFlowSetup,
    choose_run_workers,
    cluster_client,
    default_tf_threads,
)
from dasktf.cluster.tfbuild import require_tensorflow
from dasktf.data.sources import fit_inputs
from dasktf.engines.base import check_integer
from dasktf.inference.evaluate import evaluate
from dasktf.inference.predict import predict
from dasktf.models import ModelLike
from dasktf.run.compiling import check_before_placing
from dasktf.run.engine import check_mode_options, refuse_options
from dasktf.run.inputs import DEFAULT_EVAL_BATCH_SIZE, RunInputs
from dasktf.run.options import (
    CONSTRUCTION,
    PER_CALL,
    FaultOptions,
    TrainOptions,
    option_fields,
    options_signature,
    split_options,
)
from dasktf.run.run import Run

if TYPE_CHECKING:
    from distributed import Client

logger = logging.getLogger(__name__)


F = TypeVar("F", bound=Callable[..., Any])
#: The global batch when fit is given none and the data has no batches of its own.
DEFAULT_BATCH_SIZE = 128


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


def refuse_unsupported_fit_options(steps_per_epoch: Any, validation_steps: Any,
                                   validation_freq: Any) -> None:
    """Keras ``fit`` arguments dasktf cannot honour, refused with the reason."""
    if steps_per_epoch is not None or validation_steps is not None:
        raise ValueError(
            "steps_per_epoch and validation_steps are not supported: every worker "
            "holds its shard and the step schedule reads every row once per epoch "
            "(the global batch split over the workers). Pass fewer rows, or a "
            "larger batch_size, for shorter epochs."
        )
    if validation_freq != 1:
        raise ValueError(
            "validation_freq is not supported: the replicas evaluate their "
            "validation pieces at every epoch end, with the epoch's merge. Pass "
            "validation_data only for the runs you want validated."
        )


class Trainer:
    """Data-parallel training of a Keras model on a Dask cluster.

    Each worker of the cluster holds a data shard and a model replica; a sync run's
    steps sum every worker's gradient worker to worker in a long-running task per
    worker (docs/p2p.md) or as a Dask task graph per step
    (docs/sync.md). A trainer keeps its cluster
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
        arrives (docs/async.md); ``history.updates`` records each
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
        the late ones ("backup workers", docs/async.md); dropped gradients are
        counted per worker in ``history.dropped`` and ``history.history["dropped"]``.
    slow_workers
        Stragglers for tests and demos: ``{worker index: factor}`` makes that worker
        sleep ``(factor - 1)`` x its compute time after every step.
    engine
        Sync only: ``"p2p"`` (a task per worker per epoch, each step's gradients
        summed worker to worker over the workers' own Dask comms, no scheduler per
        step; docs/p2p.md), ``"graph"`` (a Dask task graph per
        step), ``"collective"`` (``tf.distribute.MultiWorkerMirroredStrategy``
        children of the workers; docs/security.md) or
        ``"auto"`` (the default: p2p where it runs, else graph: async,
        ``sync_quorum``, ``num_ps`` and a graph ``topology`` run on the graph
        engine's side). The collective engine runs only when named: its
        TensorFlow servers listen unauthenticated on every interface, which it
        says in a :class:`~dasktf.exceptions.SecurityWarning` when it starts.
    on_epoch_end
        Collective engine: ``hook(weights, optimizer_variables, epoch)`` called on
        the client after each epoch (a checkpoint hook).
    optimizer, learning_rate
        A Keras optimizer name or instance; every replica holds its own copy.
        ``None`` (default): the optimizer the model was compiled with (its class
        and full config), else SGD. ``learning_rate`` overrides its rate.
    loss, loss_weights, metrics, weighted_metrics
        As in ``keras.Model.compile`` (per-output dicts or lists included); what is
        not given comes from the model's own ``compile``. A model that is neither
        compiled nor given a loss is refused, except the built-in models, whose
        loss is sparse categorical cross-entropy for integer labels, else MSE, and
        a model overriding ``compute_loss`` (its own loss, as Keras' ``fit`` takes
        it). A model whose class overrides ``train_step`` is refused. The model's
        checks run before the cluster is contacted (for a model built from a name
        or a factory on data only the workers read, once the data is placed).
    seed
        Seeds the initial weights (of a model dasktf builds), the per-epoch shuffles
        and the replicas' own random draws. ``None``: drawn from NumPy's global
        generator, so a seed set with ``keras.utils.set_random_seed`` makes two
        identical runs identical, as in Keras. A model's dropout layers draw from
        their own seed generators, as in Keras (replica 0 the model's stream).
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
        How gradients travel (:mod:`dasktf.wire.codecs`): ``"none"`` (default:
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
        ``num_ps`` servers (:mod:`dasktf.runtime.servers`) that apply the optimizer to their slice.
        Async: ``num_ps=K`` splits the parameters over K holders the same way
        (docs/async.md); each gradient task pushes each holder its slice.
    topology
        Sync, mirrored: ``"tree"`` (default: ``dasktf.communication.topology``;
        ``dasktf.reduction-fan-in`` per reduction),
        ``"naive"`` (all-to-one) or ``"ring"`` (reduce-scatter / all-gather), see
        docs/communication.md.
    local_steps
        Rounds of local steps (Local SGD, DiLoCo; :mod:`dasktf.runtime.rounds`):
        each worker takes ``local_steps`` steps of the optimizer on its own batches
        (its share of ``batch_size`` each), then the workers' parameter changes are
        averaged (through the topology and codec, batch-size weighted) and the
        outer optimizer applies the mean change: one task graph per round instead
        of per step. Async: each worker pushes its round's change, scaled by
        ``1/N``, when the round ends; staleness counts rounds. ``1`` (default) with
        ``"average"``: plain sync steps. ``history.rounds`` and the epoch logs
        ``rounds``, ``drift`` and ``bytes_per_example`` describe the rounds.
    outer_optimizer, outer_learning_rate, outer_momentum
        ``"average"`` (default: outer SGD, learning rate 1, no momentum: model
        averaging), ``"nesterov"`` (DiLoCo: SGD with Nesterov momentum, learning
        rate 0.7 and momentum 0.9 unless given) or any Keras optimizer instance.
        Its state lives with the averaged weights and is checkpointed.
    shard_state
        ``None`` (default): every replica holds the whole optimizer.
        ``"optimizer"`` (``engine="p2p"``; ZeRO-1): each worker keeps and applies
        1/N of the optimizer's state, exactly (docs/sharding.md); ``"gradients"``
        (ZeRO-2): as well, the reduce-scatter in buckets, so a worker never holds
        more than two rounds of its peers' gradient parts. Refused with the reason
        where not supported yet (codecs, local steps).
    redundancy
        With ``shard_state``: ``1`` (default) keeps each slice of the optimizer
        on a second worker as well ((1 + 1)/N of it a worker), so a lost worker
        costs no update and the run goes on exactly; ``0`` keeps one copy (1/N):
        a lost worker sends the run back to its newest checkpoint in the epoch
        (``checkpoint_dir``; ``checkpoint_every`` for some within an epoch), whose
        later steps it trains again, and stops it with a ``ShardingError`` when
        there is none.

    Examples
    --------
    >>> from distributed import Client
    >>> import dasktf
    >>> with Client(n_workers=2) as client:  # doctest: +SKIP
    ...     trainer = dasktf.Trainer("mnist-mlp", client=client, optimizer="adam")
    ...     history = trainer.fit(x, y, epochs=3, batch_size=256)
    ...     trainer.evaluate(x_test, y_test)
    """

    def __init__(self, model: ModelLike, **options: Any) -> None:
        connection, values = split_options(options, *CONSTRUCTION)
        client, scheduler = connection["client"], connection["scheduler"]
        security, gpus = connection["security"], values["gpus"]
        n_workers, threads_per_worker = values["n_workers"], values["threads_per_worker"]
        if client is not None and scheduler is not None:
            raise ValueError("Give either client or scheduler, not both.")
        require_tensorflow()
        self.options = TrainOptions(model, **values)
        if client is None and scheduler is None:
            # Fail before any process starts: GPUs this machine lacks, too many workers.
            select_gpus(gpus, n_workers)
        elif isinstance(gpus, (list, tuple)):
            raise ValueError(
                f"gpus={gpus!r}: GPU indices only apply to the cluster dasktf starts; "
                "on an existing cluster pass 'all' or a count of GPU workers."
            )
        self._cluster_cm = cluster_client(
            client, scheduler, n_workers, threads_per_worker, security, gpus
        )
        self._client: Client | None = None
        self.model: Any = None
        self.history: History | None = None

    @classmethod
    def from_options(cls, options: TrainOptions, *, client: Client | None = None,
                     scheduler: str | None = None, security: Any = None) -> Trainer:
        """A trainer with checked ``options`` (``dasktf fit`` checks them before it
        loads anything), on ``client``, ``scheduler`` or an embedded cluster."""
        values = {name: getattr(options, name) for name in TrainOptions.names()}
        return cls(values.pop("model"), client=client, scheduler=scheduler,
                   security=security, **values)

    @property
    def mode(self) -> str:
        """``"sync"`` or ``"async"``."""
        return self.options.mode

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
    def fit(self, x: Any, y: Any = None, **options: Any) -> History:
        """Train for ``epochs`` epochs; return a Keras-style :class:`History`.

        Parameters
        ----------
        x, y
            NumPy arrays, Dask arrays (chunks stay on the workers holding them), or
            ``x`` a shard loader ``load(shard_index, num_shards) -> (x, y)`` (or
            ``(x, y, sample_weight)``) run on each worker (``y`` then ``None``; a
            loader returning an iterator of such parts is streamed), or
            ``x=dataset_fn`` with ``dataset_fn(ctx) -> tf.data.Dataset`` run on each
            worker every epoch (``ctx``: :class:`~dasktf.data.streams.DatasetContext`).
            Dask DataFrames and Series are taken as Dask arrays are (``y`` may name
            a column of ``x``). Arrays may be nested in lists, tuples or dicts
            matching the model's inputs and outputs by position or by name, as
            Keras matches them; string arrays and string or categorical columns
            (one per model input) reach the model as ``tf.string``. A
            ``tf.data.Dataset`` or ``keras.utils.PyDataset`` built on the client is
            read here when small (:mod:`dasktf.data.keras_inputs`); a generator is
            refused with the reason.
        batch_size
            The *global* batch: each step averages the gradients of ``batch_size``
            examples spread over the workers (default 128, not Keras' 32: a step
            costs Dask hops, so fewer, larger steps train faster; for a
            ``tf.data.Dataset`` or ``keras.utils.PyDataset`` read on the client,
            its batches' size, as Keras trains on its batches).
        validation_data, validation_split, validation_batch_size
            As in Keras: ``(x_val, y_val)`` or ``(x_val, y_val, sample_weight_val)``
            (or a small ``tf.data.Dataset`` / ``keras.utils.PyDataset``, read here)
            evaluated on the workers at every epoch end, or the last
            ``validation_split`` of the rows, taken before any shuffling.
        shuffle
            Reshuffle every shard at every epoch (seeded). With ``shuffle=False`` and
            array inputs the global batches are exactly Keras' (``x[k*B:(k+1)*B]``).
        sample_weight, class_weight
            As in Keras: per-row weights (an array, or one per output), or
            ``{class: weight}`` for a single-output model. The weighted loss of a
            step is Keras' weighted loss of its global batch.
        initial_epoch
            The epoch to start at (as in Keras, ``epochs`` counts from 0).
        steps_per_epoch, validation_steps, validation_freq
            Refused unless left at their defaults: every epoch reads every row once
            and validates once.
        stream
            Read lazy Dask collections part by part on the workers every epoch,
            ``dasktf.data.prefetch`` parts ahead, instead of holding each shard in
            memory: for data larger than the workers' memory
            (:mod:`dasktf.data.streams`).
        callbacks
            ``keras.callbacks.Callback`` instances, run on the client.
        verbose
            0 silent, 1 a progress bar and a line per epoch, 2 a line per epoch.
        checkpoint_dir, checkpoint_every
            Write a checkpoint (weights, optimizer state, counters, seed, config;
            :mod:`dasktf.run.checkpoint`) into ``checkpoint_dir`` at every epoch end and,
            every ``checkpoint_every`` steps (sync: after steps k, 2k, ... of each
            epoch, holding exactly those updates; not with ``engine="collective"``,
            which checkpoints at epoch ends) or updates (async: the holder's state
            and the batches applied, docs/faults.md); the final model
            is also saved there as ``model.keras``.
        resume
            Continue from the newest valid checkpoint in ``checkpoint_dir`` up to
            ``epochs`` epochs in all.
        on_worker_loss
            ``"recover"`` (default): go on with the surviving workers, the lost shard
            taken over by one of them (docs/faults.md), or
            before the first step the set-up done again on them
            (:mod:`dasktf.run.setup`); ``"raise"``: stop with
            :class:`~dasktf.exceptions.WorkerLostError`, naming the worker and
            the phase.
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
        call, fault = split_options(options, *PER_CALL)
        epochs, batch_size, verbose = call["epochs"], call["batch_size"], call["verbose"]
        initial_epoch, validation_data = call["initial_epoch"], call["validation_data"]
        sample_weight, validation_batch_size = (call["sample_weight"],
                                                call["validation_batch_size"])
        check_integer("epochs", epochs)
        check_integer("batch_size", batch_size, allow_none=True)
        if verbose == "auto":
            verbose = 1
        if verbose not in (0, 1, 2):
            raise ValueError(f"verbose must be 0, 1, 2 or 'auto'; got {verbose!r}.")
        refuse_unsupported_fit_options(call["steps_per_epoch"], call["validation_steps"],
                                       call["validation_freq"])
        check_integer("initial_epoch", initial_epoch, 0, high=epochs,
                      expected=f"an integer in [0, epochs={epochs})")
        check_integer("validation_batch_size", validation_batch_size, allow_none=True)
        callbacks = check_callbacks(call["callbacks"])
        known = self.options.model if self.model is None else self.model  # its inputs
        source, validation_data = fit_inputs(
            x, y, sample_weight, validation_data=validation_data,
            validation_split=call["validation_split"], class_weight=call["class_weight"],
            stream=bool(call["stream"]), seed=self.options.seed, model=known)
        if batch_size is None:  # a dataset's batches', as Keras takes them; else ours
            batch_size = source.batch_size_read or DEFAULT_BATCH_SIZE
        options = FaultOptions(**{**fault, "resume": bool(fault["resume"]),
                                  "scale_lr": bool(fault["scale_lr"])})
        refuse_options(self.options, options)  # what its engine or mode cannot do
        started = time.perf_counter()
        o = self.options
        inputs = RunInputs(
            options=o, fault=options, source=source, batch_size=batch_size,
            epochs=epochs, initial_epoch=initial_epoch, shuffle=call["shuffle"],
            validation_data=validation_data,
            eval_batch_size=validation_batch_size or DEFAULT_EVAL_BATCH_SIZE,
            verbose=verbose, callbacks=tuple(callbacks or ()), model=self.model,
        )
        # The model's checks before the cluster is touched (an embedded one started,
        # a plugin registered, data placed): a refusal comes at once (issue 36).
        inputs = dataclasses.replace(inputs, prepared=check_before_placing(inputs))
        client = self.client
        workers, resources = choose_run_workers(client, o.n_workers, o.gpus)
        check_mode_options(o, len(workers))  # the quorum and slowed indices, against them
        plugin = None
        if o.threads_per_worker is not None or not getattr(self, "_owned", False):
            plugin = TensorFlowSetup(o.threads_per_worker or default_tf_threads(len(workers)))
        run = Run(inputs, client, workers, resources)
        try:
            history = run.fit(plugin)
        finally:
            if run.model is not None:  # trained in place, even by a run that failed
                self.model = run.model
        history.wall_seconds = time.perf_counter() - started
        self.history = history
        return history

    def evaluate(self, x: Any, y: Any = None, *, batch_size: int | None = None,
                 sample_weight: Any = None) -> dict[str, float]:
        """The trained model's loss and metrics on ``x``, ``y``, computed on this
        trainer's cluster where the data lives (:func:`dasktf.evaluate`): what
        Keras' ``evaluate(return_dict=True)`` returns on the same rows."""
        return evaluate(self._trained(), x, y, batch_size=batch_size,
                        sample_weight=sample_weight, client=self.client)

    def predict(self, x: Any, *, batch_size: int | None = None,
                as_frame: bool = False) -> Any:
        """The trained model's predictions on ``x`` on this trainer's cluster, as
        lazy Dask collections (:func:`dasktf.predict`)."""
        return predict(self._trained(), x, batch_size=batch_size, as_frame=as_frame,
                       client=self.client)

    def _trained(self) -> Any:
        if self.model is None:
            raise RuntimeError("Call fit() before evaluate() or predict().")
        return self.model


def fit(model: ModelLike, x: Any, y: Any = None, **options: Any) -> History:
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
    # Trainer takes the run's options, Trainer.fit the data and the fit call's own.
    construction = {k: v for k, v in options.items() if k in option_fields(*CONSTRUCTION)}
    per_call = {k: v for k, v in options.items() if k not in construction}
    with Trainer(model, **construction) as trainer:
        return trainer.fit(x, y, **per_call)


# The signatures users see (inspect.signature, help), built from the declaration of
# the options (dasktf.run.options); unknown names are refused with the list.
_DATA = [("x", "Any", inspect.Parameter.empty), ("y", "Any", None)]
_MODEL = ("model", "ModelLike", inspect.Parameter.empty)
_SELF = ("self", inspect.Parameter.empty, inspect.Parameter.empty)
Trainer.__init__.__signature__ = options_signature(  # type: ignore[attr-defined]
    [_SELF, _MODEL], CONSTRUCTION, "None")
Trainer.fit.__signature__ = options_signature(  # type: ignore[attr-defined]
    [_SELF, *_DATA], PER_CALL, "History")
fit.__signature__ = options_signature(  # type: ignore[attr-defined]
    [_MODEL, *_DATA], [*CONSTRUCTION, *PER_CALL], "History")
Trainer.__init__ = _explain_unknown_options(Trainer.__init__)  # type: ignore[method-assign]
Trainer.fit = _explain_unknown_options(Trainer.fit)  # type: ignore[method-assign]
fit = _explain_unknown_options(fit)
