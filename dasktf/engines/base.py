"""The contract between a run and its engine.

A run (:mod:`dasktf.run`) drives every engine the same way: ``run_epoch`` once per
epoch, ``epoch_logs`` for what the engine adds to the merged metrics,
``set_learning_rate`` when a callback changed it, ``finish`` and ``close`` at the
end. What differs between engines is *declared* in :class:`Capabilities` (how the
run checkpoints, resumes and re-forms one), never probed with ``hasattr``; what the
run gives an engine (how to publish, reload a shard, name the last checkpoint) is
handed over at construction in :class:`RunHooks`, never set on it afterwards.
:class:`Engine` holds the defaults an engine without that ability inherits.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import numpy as np

    from dasktf.runtime.replica import EpochReport
    from dasktf.runtime.rounds import LocalSpec

#: How a run checkpoints an engine's training state.
#: ``steps``: :meth:`Engine.state` on ``checkpoint_every``'s per-epoch step grid;
#: ``epochs``: :meth:`Engine.state` at epoch ends only; ``holder``: the parameter
#: holder's consistent cut (an async run's own format); ``final``: only the final
#: ``model.keras`` (the state is nowhere in one piece during the run).
CheckpointKind = Literal["steps", "epochs", "holder", "final"]


@dataclass(frozen=True)
class Capabilities:
    """What an engine can do, so the run asks instead of probing."""

    checkpoints: CheckpointKind
    #: resumes from a checkpoint (of its ``checkpoints`` kind)
    resume: bool
    #: re-forms over the workers alive at an epoch end (joined or rebalanced)
    reforms: bool = False


def _ignore(*_: Any) -> None:
    return None


@dataclass(frozen=True)
class RunHooks:
    """What a run hands its engine at construction."""

    #: publish one record on the run's metrics stream
    publish: Callable[[dict[str, Any]], None] = _ignore
    #: one line for the user (a lost worker, a re-form)
    announce: Callable[[str], None] = _ignore
    #: ``reload(shard index, worker) -> (shard, validation shard)`` placed there
    reload: Callable[[int, str], tuple[Any, Any]] | None = None
    #: the newest checkpoint written, named when a run must stop
    last_checkpoint: Callable[[], str | None] = lambda: None
    #: ``holder_inputs(worker) -> (probe, validation shards)``: what a rebuilt
    #: parameter holder starts from
    holder_inputs: Callable[[str], tuple[Any, list[Any]]] | None = None
    #: ``"recover"`` (go on without a lost worker) or ``"raise"``
    on_worker_loss: str = "recover"
    #: the run shuffles each epoch's batches
    shuffle: bool = True
    #: sync collective engine: ``hook(weights, optimizer_variables, epoch)`` each epoch
    on_epoch_end: Callable[[list[np.ndarray], list[np.ndarray], int], None] | None = None


@dataclass
class RunOutcome:
    """What an engine that holds the master weights away from the replicas hands
    back when it finishes (async and quorum runs)."""

    final_weights: list[Any]
    updates: Any  #: pandas DataFrame of :class:`~dasktf.engines.holder.records.UpdateRecord`
    dropped: dict[int, int] = field(default_factory=dict)
    gradient_tasks: dict[str, int] = field(default_factory=dict)
    holder_traffic: list[dict[str, int]] | None = None


class Engine:
    """The interface a run drives; every engine derives from it.

    Subclasses set ``mode`` (``"sync"``, ``"async"``, ``"quorum"``), ``engine``
    (``"graph"`` or ``"collective"``) and ``capabilities``, implement
    :meth:`run_epoch` and override the defaults below where they do more.
    """

    mode: str
    engine: str
    capabilities: Capabilities
    #: one entry per lost worker the run went on without
    losses: list[dict[str, Any]]
    #: ``reforms`` engines: a loss left the run uneven; re-form at the epoch end
    reform_needed = False
    #: the global update number of the current epoch's first step
    update_base = 0
    #: a callback set ``model.stop_training`` mid-epoch (``TerminateOnNaN``): an
    #: engine that can end its epoch early submits no further step
    stop_requested = False
    #: rounds of local steps (``local_steps=H``): an update, the unit ``run_epoch``
    #: counts in (``on_step``, ``start``), is then a round of H inner steps
    local: LocalSpec | None = None

    def units(self, steps_per_epoch: int) -> int:
        """Updates in an epoch: its steps, or its rounds of local steps."""
        return steps_per_epoch if self.local is None else self.local.rounds(steps_per_epoch)

    def last_step(self, unit: int, steps_per_epoch: int) -> int:
        """The batch index Keras callbacks see for ``on_step(unit)``."""
        return unit

    def round_records(self) -> list[dict[str, Any]]:
        """Rounds of local steps: the last epoch's outer updates (``update``,
        ``drift``, ``loss``, ``examples``), for the history."""
        return []

    def run_epoch(self, epoch: int, on_step: Callable[[int], None] | None = None,
                  start: int = 0) -> list[EpochReport]:
        """Train one epoch (from step ``start``); every replica's report."""
        raise NotImplementedError

    def epoch_logs(self, seconds: float) -> dict[str, float]:
        """What the engine adds to the epoch's merged metrics."""
        return {}

    def set_learning_rate(self, lr: float) -> None:
        """Carry a learning rate a client-side callback set to the optimizers that train."""
        raise NotImplementedError

    # -- checkpoints (``capabilities.checkpoints`` says which apply) ---------------
    def set_checkpoint_grid(self, every: int | None) -> None:
        """Keep the training state every ``every`` steps of an epoch (``steps``)."""

    def checkpoint_due(self, step: int) -> bool:
        """Whether step ``step`` of the epoch is on the checkpoint grid (``steps``)."""
        return False

    def state(self) -> dict[str, Any]:
        """Weights, optimizer variables and ``applied`` (``steps`` and ``epochs``)."""
        raise NotImplementedError(f"{type(self).__name__} keeps no state in one piece")

    def load_state(self, state: dict[str, Any]) -> None:
        """Load a checkpoint's state into whatever trains."""
        raise NotImplementedError(f"{type(self).__name__} does not resume")

    def start_at(self, update: int) -> None:
        """The global update number of the epoch's first step (after a resume)."""

    def keep_restore_point(self, state: dict[str, Any] | None = None) -> None:
        """Keep ``state`` (read now if not given) to rewind to after a loss."""

    def prepare(self) -> None:
        """The last of the run's set-up, after a resume loaded its state: what must
        be in place before the first update (async: the state a lost holder is
        rebuilt from). A worker lost here is a set-up loss: the run sets up again."""

    def reform(self, schedule: np.ndarray) -> None:
        """Go on over the run's workers as they are now, the data re-placed with
        ``schedule`` (``reforms``); the caller loads the state."""
        raise NotImplementedError(f"{type(self).__name__} does not re-form")

    # -- the end ----------------------------------------------------------------------
    def applied_logs(self) -> dict[int, list[int]] | None:
        """Per replica, the global updates it applied (sync graph runs)."""
        return None

    def finish(self) -> RunOutcome | None:
        """Drain what is in flight; the outcome when the weights live elsewhere."""
        return None

    def close(self) -> None:
        """Release what the engine holds on the workers; never raises."""
