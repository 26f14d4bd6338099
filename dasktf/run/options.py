"""Every option of a training run, declared and checked in one place.

:class:`TrainOptions` holds what a :class:`~dasktf.Trainer` is built with (all but
the cluster connection, :class:`ConnectionOptions`); :class:`CallOptions` and
:class:`FaultOptions` what one ``fit`` call adds (the data's handling; checkpoints
and worker loss). These dataclasses are the one declaration of the options' names,
defaults and types: the signatures of ``Trainer``, ``Trainer.fit`` and
:func:`~dasktf.fit` are built from them (:func:`options_signature`, in
:data:`FIT_ORDER`). ``Trainer``, :func:`~dasktf.fit` and ``dasktf fit``
all build them, so a bad value fails the same way, before any process starts. Each
family's own rules (:func:`~dasktf.wire.packets.validate_comm_options`; the engine
families' through their factory, :func:`~dasktf.run.engine.refuse_options`) are
called from here.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from dasktf.cluster.devices import GpusArg
from dasktf.cluster.liveness import settings as liveness_settings
from dasktf.engines.base import check_integer
from dasktf.run.engine import check_mode_options, check_staleness_lr, refuse_options
from dasktf.runtime.rounds import LocalSpec, local_spec, rounds_compression
from dasktf.wire.packets import CommSpec, validate_comm_options

if TYPE_CHECKING:
    from distributed import Client

MODES = ("sync", "async")
#: Accepted values of ``on_worker_loss``.
ON_WORKER_LOSS = ("recover", "raise")
ENGINES = ("graph", "p2p", "collective", "auto")


def resolve_optimizer(optimizer: Any, learning_rate: float | None) -> dict[str, Any]:
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
    if learning_rate is not None:  # checked by TrainOptions
        opt.learning_rate = learning_rate
    return keras.optimizers.serialize(opt)  # type: ignore[no-any-return]


def resolve_metrics(metrics: Any) -> Any:
    """Metrics as ``compile`` takes them (a list, or per output a dict or list of
    lists), checked, with instances made portable (:func:`~dasktf.models.portable_metrics`)."""
    import keras

    from dasktf.data.structure import leaves
    from dasktf.models import portable_metrics

    if metrics is None:
        return None
    if isinstance(metrics, str):
        metrics = [metrics]
    for _, m in leaves(metrics, "metrics"):
        if not (isinstance(m, (keras.metrics.Metric, str)) or callable(m) or m is None):
            raise TypeError(f"metrics must be names, Metric instances or callables; got {m!r}.")
    return portable_metrics(metrics)


@dataclass(frozen=True)
class TrainOptions:
    """What a run trains and how, checked once (see the module docstring).

    The fields are :class:`~dasktf.Trainer`'s options of the same names; the
    derived ones (``comm``, ``optimizer_config``, ``metric_configs``, the seed
    drawn when none was given) are filled in by the checks.
    """

    model: Any
    n_workers: int | None = None
    mode: str = "sync"
    optimizer: Any = None
    learning_rate: float | None = None
    loss: Any = None
    loss_weights: Any = None
    metrics: Any = None
    weighted_metrics: Any = None
    seed: int | None = None
    threads_per_worker: int | None = None
    gpus: GpusArg = None
    mixed_precision: bool = False
    max_staleness: int | None = None
    staleness_lr: str | None = None
    sync_quorum: int | None = None
    slow_workers: dict[int, float] | None = None
    engine: str = "auto"
    on_epoch_end: Callable[[list[Any], list[Any], int], None] | None = None
    compression: str | None = None
    weights_dtype: str | None = None
    num_ps: int | None = None
    placement: str | None = None
    topology: str | None = None
    local_steps: int = 1
    outer_optimizer: Any = "average"
    outer_learning_rate: float | None = None
    outer_momentum: float | None = None
    shard_state: str | None = None
    redundancy: int = 1
    #: how gradients and weights travel (from compression ... topology)
    comm: CommSpec = field(init=False, repr=False)
    #: the optimizer given (with ``learning_rate``) as a Keras config, ``None`` when
    #: none was: the compiled model's, else SGD (:mod:`dasktf.run.compiling`)
    optimizer_config: dict[str, Any] | None = field(init=False, repr=False)
    #: the metrics given, as names, callables or metric recipes
    metric_configs: Any = field(init=False, repr=False)
    #: rounds of local steps (from ``local_steps`` and the outer optimizer), ``None``
    #: for plain sync steps
    local: LocalSpec | None = field(init=False, repr=False)

    def __post_init__(self) -> None:
        def set_(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}; got {self.mode!r}.")
        set_("comm", validate_comm_options(
            self.mode, self.compression, self.weights_dtype, self.num_ps,
            self.placement, self.topology, self.mixed_precision))
        check_integer("n_workers", self.n_workers, allow_none=True)
        set_("slow_workers", check_mode_options(self, self.n_workers))
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {ENGINES}; got {self.engine!r}.")
        check_integer("threads_per_worker", self.threads_per_worker, allow_none=True)
        if self.learning_rate is not None and not self.learning_rate > 0:
            raise ValueError(f"learning_rate must be positive; got {self.learning_rate!r}.")
        set_("optimizer_config", None if self.optimizer is None else resolve_optimizer(
            self.optimizer, self.learning_rate))
        check_staleness_lr(self.staleness_lr, self.optimizer_config)
        set_("metric_configs", resolve_metrics(self.metrics))
        resolve_metrics(self.weighted_metrics)
        if self.seed is None:
            # Drawn from NumPy's global generator, which keras.utils.set_random_seed
            # seeds: as in Keras, a seed set that way makes two identical runs
            # identical, and runs without one differ.
            set_("seed", int(np.random.randint(0, 2**31 - 1)))
        else:
            set_("seed", int(self.seed))
        set_("mixed_precision", bool(self.mixed_precision))
        check_integer("local_steps", self.local_steps)
        set_("local", local_spec(self.local_steps, self.outer_optimizer,
                                 self.outer_learning_rate, self.outer_momentum,
                                 rounds_compression(self)))
        refuse_options(self)  # each engine family's rules

    @classmethod
    def names(cls) -> list[str]:
        """The options a user sets (the fields the checks do not derive)."""
        return [f.name for f in dataclasses.fields(cls) if f.init]


@dataclass(frozen=True)
class FaultOptions:
    """The fault-tolerance options of one ``fit`` call (validated)."""

    checkpoint_dir: str | None = None
    checkpoint_every: int | None = None
    resume: bool = False
    on_worker_loss: str = "recover"
    scale_lr: bool = False

    def __post_init__(self) -> None:
        if self.on_worker_loss not in ON_WORKER_LOSS:
            raise ValueError(
                f"on_worker_loss must be one of {ON_WORKER_LOSS}; got {self.on_worker_loss!r}."
            )
        if self.checkpoint_every is not None:
            check_integer("checkpoint_every", self.checkpoint_every,
                          expected="a positive number of steps")
            if self.checkpoint_dir is None:
                raise ValueError("checkpoint_every needs checkpoint_dir (where to write).")
        if self.resume and self.checkpoint_dir is None:
            raise ValueError("resume=True needs checkpoint_dir (where the checkpoints are).")
        liveness_settings()  # a malformed duration fails here, before any process starts


@dataclass(frozen=True)
class ConnectionOptions:
    """Where a :class:`~dasktf.Trainer` trains (see its docstring)."""

    client: Client | None = None
    scheduler: str | None = None
    security: Any = None


@dataclass(frozen=True)
class CallOptions:
    """What one ``fit`` call says about its data and its output, besides the data
    itself and the fault options (see :meth:`dasktf.Trainer.fit`; checked there)."""

    epochs: int = 1
    batch_size: int | None = None
    validation_data: tuple[Any, ...] | None = None
    validation_split: float = 0.0
    shuffle: bool = True
    sample_weight: Any = None
    class_weight: dict[int, float] | None = None
    initial_epoch: int = 0
    validation_batch_size: int | None = None
    steps_per_epoch: int | None = None
    validation_steps: int | None = None
    validation_freq: int = 1
    stream: bool = False
    callbacks: Sequence[Any] | None = None
    verbose: int | str = 1


#: :func:`dasktf.fit`'s keyword options in the order its signature shows them
#: (``Trainer`` and ``Trainer.fit`` show theirs in the same order); names, defaults
#: and types are the dataclasses' above.
FIT_ORDER = (
    "client", "scheduler", "n_workers", "mode", "epochs", "batch_size", "optimizer",
    "learning_rate", "loss", "loss_weights", "metrics", "weighted_metrics",
    "validation_data", "validation_split", "shuffle", "sample_weight", "class_weight",
    "initial_epoch", "validation_batch_size", "steps_per_epoch", "validation_steps",
    "validation_freq", "stream", "seed", "callbacks", "verbose", "threads_per_worker",
    "security", "gpus", "mixed_precision", "max_staleness", "staleness_lr",
    "sync_quorum", "slow_workers", "engine", "on_epoch_end", "checkpoint_dir",
    "checkpoint_every", "resume", "on_worker_loss", "scale_lr", "compression",
    "weights_dtype", "num_ps", "placement", "topology", "local_steps",
    "outer_optimizer", "outer_learning_rate", "outer_momentum", "shard_state",
    "redundancy",
)

#: What ``Trainer(...)`` takes, and what ``Trainer.fit`` does.
CONSTRUCTION = (ConnectionOptions, TrainOptions)
PER_CALL = (CallOptions, FaultOptions)


def option_fields(*classes: type) -> dict[str, dataclasses.Field[Any]]:
    """The options ``classes`` declare (``TrainOptions``' model and derived fields
    left out), by name."""
    return {f.name: f for cls in classes for f in dataclasses.fields(cls)
            if f.init and f.name != "model"}


def options_signature(leading: Sequence[tuple[str, str, Any]], classes: Sequence[type],
                      returns: str) -> inspect.Signature:
    """A signature of the ``leading`` positional-or-keyword parameters (name,
    annotation, default: ``inspect.Parameter.empty`` for none) and then, keyword
    only, the options ``classes`` declare, in :data:`FIT_ORDER`."""
    fields = option_fields(*classes)
    P = inspect.Parameter
    return inspect.Signature(
        [P(name, P.POSITIONAL_OR_KEYWORD, annotation=annotation, default=default)
         for name, annotation, default in leading]
        + [P(name, P.KEYWORD_ONLY, annotation=fields[name].type,
             default=fields[name].default) for name in FIT_ORDER if name in fields],
        return_annotation=returns,
    )


def split_options(options: dict[str, Any], *classes: type) -> list[dict[str, Any]]:
    """``options`` (names checked against the signature already) as one dict per
    class of ``classes``, every option it declares there: given, else its default."""
    return [{name: options.get(name, f.default) for name, f in option_fields(cls).items()}
            for cls in classes]
