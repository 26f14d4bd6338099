"""The contract between a run and its engine, and the recipe for a new engine.

A run (:mod:`dasktf.run`) drives every engine the same way: ``run_epoch`` once per
epoch, ``epoch_logs`` for what the engine adds to the merged metrics,
``set_learning_rate`` when a callback changed it, ``checkpoint`` / ``resume`` for the
run's checkpoints, ``finish``, ``final_state`` and ``close`` at the end. What
differs between engines is *declared* in :class:`Capabilities` (how the run
checkpoints, resumes and re-forms one), never probed with ``hasattr``; what the run
gives an engine (how to publish, reload a shard, name the last checkpoint) is
handed over at construction in :class:`RunHooks`, never set on it afterwards (a
stop: :meth:`Engine.request_stop`); a worker lost or gained, the engine reports
(:attr:`RunHooks.workers_changed`) and the run, the one writer, applies it.
:class:`Engine` holds the defaults an engine without that ability inherits.

A new engine
------------
1. Derive from :class:`Engine` (in its own family under ``dasktf/engines/``; the
   families never import each other) and set ``mode``, ``engine`` and
   ``capabilities``. Keep the run's :class:`~dasktf.cluster.waits.RunContext` as
   ``ctx`` and take what the run provides from the :class:`RunHooks` given at
   construction.
2. Implement :meth:`Engine.run_epoch` (train one epoch from update ``start``, call
   ``on_step(unit)`` after each update, return every replica's
   :class:`~dasktf.runtime.replica.EpochReport`) and :meth:`Engine.set_learning_rate`.
3. Checkpoints: an engine that can read its training state in one piece
   (``checkpoints="steps"`` or ``"epochs"``) implements :meth:`Engine.state` and
   :meth:`Engine.load_state` (and :meth:`Engine.start_at`); the defaults of
   :meth:`Engine.checkpoint` and :meth:`Engine.resume` then write and read the sync
   format, which every such engine resumes, and :meth:`Engine.final_state` returns
   :meth:`Engine.state` for the client's model. An engine whose state lives
   elsewhere (``"updates"``: a parameter holder's cut) overrides those three,
   keeping its own progress in the manifest fields it returns; an engine that
   cannot (``"final"``) leaves them. When what holds the state was lost but the
   engine rebuilds it, :meth:`Engine.checkpoint` raises :class:`StateLostError` and
   the run skips that checkpoint.
4. Optionally: ``reforms=True`` with :meth:`Engine.reform` and
   :meth:`Engine.ramp_learning_rate`, :meth:`Engine.finish` returning a
   :class:`RunOutcome` when the final weights live away from the replicas, and
   :meth:`Engine.close`, which must never raise.
5. Register it in the one factory, :func:`dasktf.run.engine.make_engine` (and its
   checks of the model, :func:`dasktf.run.engine.plan_engine`). Nothing else in
   :mod:`dasktf.run` names an engine.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from dasktf.exceptions import DasktfError

if TYPE_CHECKING:
    from dasktf.cluster.waits import RunContext
    from dasktf.runtime.replica import EpochReport
    from dasktf.runtime.rounds import LocalSpec

#: How a run checkpoints an engine's training state.
#: ``steps``: :meth:`Engine.state` on ``checkpoint_every``'s per-epoch step grid;
#: ``epochs``: :meth:`Engine.state` at epoch ends only; ``updates``: every
#: ``checkpoint_every`` applied updates, counted by the run, whatever the engine's
#: :meth:`Engine.checkpoint` cut is (an async run's: the parameter holder's);
#: ``final``: only the final ``model.keras`` (the state is nowhere in one piece
#: during the run).
CheckpointKind = Literal["steps", "epochs", "updates", "final"]


def check_integer(name: str, value: Any, low: int = 1, *, allow_none: bool = False,
                  high: int | None = None, expected: str | None = None) -> None:
    """Refuse an option that is not an integer (a bool is not) in ``[low, high)``;
    the run's options and each engine family's are checked with this one rule."""
    if value is None and allow_none:
        return
    if (isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low
            or (high is not None and value >= high)):
        expected = expected or ("a positive integer" if low == 1 else f"an integer >= {low}")
        raise ValueError(f"{name} must be {expected}; got {value!r}.")


class StateLostError(DasktfError):
    """What holds an engine's training state away from the replicas (a parameter
    holder) was lost; the engine rebuilds it the next time it looks, and the run
    skips the checkpoint it was taking."""


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
    #: the newest global update whose loss reached the client from the workers' step
    #: records (``None``: none yet): an engine whose steps the client does not see
    #: one by one (a long-running task per worker) calls ``on_step`` up to it
    heard: Callable[[], int | None] = lambda: None
    #: ``workers_changed(workers)``: the run's workers from now on (a loss, a join)
    workers_changed: Callable[[list[str]], None] = _ignore
    #: a callback stops the run at the first step whose loss is not finite
    #: (``TerminateOnNaN``); an engine that sees each step's global loss on the
    #: workers may stop there itself, at exactly that step
    stop_on_nonfinite: bool = False


@dataclass
class Checkpoint:
    """What :meth:`Engine.checkpoint` hands the run to save."""

    #: ``weights``, ``optimizer`` (variables) and ``applied`` (the last global update)
    state: dict[str, Any]
    #: the engine's fields of the manifest (where to go on from), which
    #: :meth:`Engine.resume` reads back; the run adds its own
    fields: dict[str, Any]
    #: called with the path once saved (the engine may keep it as a restore point)
    kept: Callable[[str], None] = _ignore
    #: ``state["optimizer"]`` is the model's own optimizer's, which the checkpoint's
    #: ``.keras`` then holds (``False``: an outer optimizer's, rounds of local steps
    #: on a parameter holder; the ``.keras`` holds a fresh optimizer)
    model_optimizer: bool = True


@dataclass(frozen=True)
class Saved:
    """A checkpoint the run read back, for :meth:`Engine.resume`."""

    state: dict[str, Any]
    #: the engine's :attr:`Checkpoint.fields` and the run's (``mode``, ``seed``,
    #: ``batch_size``, ``workers``, ...)
    manifest: dict[str, Any]
    #: where it was read from, for messages
    path: str
    #: the run's global batch size now
    batch_size: int
    #: the model's non-trainable float state (moving statistics) in ``state``'s
    #: weights; ``None`` when it has none
    statistics: list[np.ndarray] | None = None


@dataclass(frozen=True)
class Resumed:
    """Where a resumed run goes on: epoch, update of the epoch, what to announce."""

    epoch: int
    step: int
    announce: str


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
    (``"graph"``, ``"p2p"`` or ``"collective"``) and ``capabilities``, implement
    :meth:`run_epoch` and override the defaults below where they do more (the
    module docstring is the recipe).
    """

    mode: str
    engine: str
    capabilities: Capabilities
    ctx: RunContext
    #: one entry per lost worker the run went on without
    losses: list[dict[str, Any]]
    #: ``reforms`` engines: a loss left the run uneven; re-form at the epoch end
    reform_needed = False
    #: the global update number of the current epoch's first step
    update_base = 0
    #: :meth:`request_stop` was called: an engine that can end its epoch early
    #: submits no further step
    stop_requested = False
    #: rounds of local steps (``local_steps=H``): an update, the unit ``run_epoch``
    #: counts in (``on_step``, ``start``), is then a round of H inner steps
    local: LocalSpec | None = None

    def request_stop(self) -> None:
        """A callback set ``model.stop_training`` mid-epoch (``TerminateOnNaN``)."""
        self.stop_requested = True

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

    def ramp_learning_rate(self, factor: float, steps: int) -> tuple[float, float]:
        """Scale the learning rate by ``factor``, linearly over the next ``steps``
        updates (after a re-form, ``scale_lr``); the rates before and after."""
        raise NotImplementedError(f"{type(self).__name__} does not re-form")

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
        self.update_base = update

    def keep_restore_point(self, state: dict[str, Any] | None = None,
                           source: str | None = None) -> None:
        """Keep ``state`` (an engine that reads its own when not given may) to rewind
        to after a loss; ``source``: where it comes from (a checkpoint's path), for
        the messages of a rewind."""

    def prepare(self) -> None:
        """The last of the run's set-up, after a resume loaded its state: what must
        be in place before the first update (async: the state a lost holder is
        rebuilt from). A worker lost here is a set-up loss: the run sets up again."""

    def checkpoint(self, epoch: int, epoch_end: bool = False) -> Checkpoint:
        """The training state to save during epoch ``epoch`` (after it:
        ``epoch_end``) and where a resume goes on from. The default: :meth:`state`,
        the next ``(epoch, step)`` and the epoch's first update; once saved, the
        state is the restore point.

        Raises
        ------
        StateLostError
            What holds the state was lost; the engine rebuilds it (skip this one).
        """
        state = self.state()
        base = self.update_base
        step = state["applied"] + 1 - base
        if epoch_end or step >= self.units(self.ctx.steps_per_epoch):
            next_epoch, next_step = epoch + 1, 0
        else:
            next_epoch, next_step = epoch, step
        fields = {
            "next_epoch": next_epoch, "next_step": next_step,
            "epoch_base": base if next_step else state["applied"] + 1,
            # a step means a round of these: a resume must train in the same rounds
            "local_steps": self.local.steps if self.local is not None else 1,
        }
        return Checkpoint(state, fields, kept=lambda where: self.keep_restore_point(state, where))

    def resume(self, saved: Saved) -> Resumed:
        """Check that ``saved`` is a checkpoint this engine goes on from and load it
        into whatever trains; where the run goes on. The default: a checkpoint of
        :meth:`checkpoint`'s default, loaded with :meth:`load_state`.

        Raises
        ------
        ValueError
            A checkpoint of another mode, or of other rounds of local steps.
        """
        state, manifest, path = saved.state, saved.manifest, saved.path
        mode = manifest.get("mode", self.mode)
        if mode != self.mode:
            raise ValueError(f"{path} is an {mode} run's checkpoint; resume it with "
                             f"mode={mode!r}.")
        local_steps = self.local.steps if self.local is not None else 1
        if int(manifest.get("local_steps", 1)) != local_steps:
            raise ValueError(
                f"{path} was written by a run with local_steps="
                f"{manifest.get('local_steps', 1)}; resume it with the same local_steps "
                f"(this run has {local_steps}): its step counter counts those rounds.")
        self.load_state(state)
        epoch, step = int(manifest["next_epoch"]), int(manifest["next_step"])
        self.start_at(int(manifest["epoch_base"]) if step else state["applied"] + 1)
        self.keep_restore_point(state, path)
        return Resumed(epoch, step, f"resumed from {path} at epoch {epoch + 1}, step "
                                    f"{step + 1} (update {state['applied'] + 1})")

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

    def final_state(self) -> dict[str, Any] | None:
        """After :meth:`finish`: the training state whose optimizer variables the
        client's model takes (``history.model`` then resumes like a model Keras
        trained); ``None`` when there is none to give. Also read at an epoch end
        when a callback saves the client's model whole (``ModelCheckpoint``)."""
        return None

    def close(self) -> None:
        """Release what the engine holds on the workers; never raises."""
