"""What one ``fit`` call hands its run, checked and frozen once.

:meth:`dasktf.Trainer.fit` builds a :class:`RunInputs` from its options and the
call's arguments; :class:`~dasktf.run.run.Run`, :class:`~dasktf.run.guard.RunGuard`
and :class:`~dasktf.run.setup.SetupGuard` read it and never the Trainer, and the
run hands back the trained model (``history.model``, :attr:`Run.model`) instead of
writing into the Trainer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dasktf.data.base import Source
from dasktf.run.options import FaultOptions, TrainOptions

if TYPE_CHECKING:
    from dasktf.models import CompileRecipe
    from dasktf.run.engine import EnginePlan

#: The batch of the replicas' validation passes when fit is given none.
DEFAULT_EVAL_BATCH_SIZE = 256


@dataclass(frozen=True)
class ClientModel:
    """The client's model, built (or taken) and checked against the data, with
    what every replica compiles it with
    (:func:`~dasktf.run.compiling.client_model`)."""

    model: Any
    #: its outputs on a probe batch
    y_pred: Any
    #: what rebuilds a subclassed model dasktf made (``None``: none)
    factory: Any
    recipe: CompileRecipe
    plan: EnginePlan


@dataclass(frozen=True)
class RunInputs:
    """One ``fit`` call's inputs (see the module docstring)."""

    #: the trainer's checked options
    options: TrainOptions
    #: the call's checkpoint and worker-loss options, checked against ``options``
    fault: FaultOptions
    #: where the shards come from (:func:`dasktf.data.sources.make_source`)
    source: Source
    #: the global batch the run starts with
    batch_size: int
    epochs: int
    initial_epoch: int = 0
    shuffle: bool = True
    #: ``(x, y, sample_weight)`` evaluated at every epoch end, or ``None``
    validation_data: tuple[Any, Any, Any] | None = None
    eval_batch_size: int = DEFAULT_EVAL_BATCH_SIZE
    #: 0 silent, 1 a progress bar, 2 a line per epoch
    verbose: int = 0
    callbacks: tuple[Any, ...] = ()
    #: the model an earlier ``fit`` of the same trainer trained (this one goes on
    #: from its weights), else ``None``
    model: Any = None
    #: the client's model, built and checked before the cluster was contacted
    #: (:func:`~dasktf.run.compiling.check_before_placing`); ``None``: the run
    #: builds it from the placed shards' stats
    prepared: ClientModel | None = None
