"""The instructions :class:`~dasktf.engines.holder.state.AsyncState`'s stimuli
return, and :class:`~dasktf.engines.holder.engine.AsyncEngine` carries out in
order (distributed's ``worker_state_machine`` calls its own the same).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

#: ``(pass, step)``: one batch of a shard
Batch = tuple[int, int]


@dataclass(frozen=True)
class Submit:
    """Submit the gradient task of batch ``(shard_pass, step)`` for ``identity``,
    under task key ``key``."""

    identity: int
    shard_pass: int
    step: int
    key: str


@dataclass(frozen=True)
class Cancel:
    """Cancel these tasks; a result of theirs that still arrives is ignored."""

    keys: tuple[str, ...]


@dataclass(frozen=True)
class Release:
    """Tell the holder ``identity`` is lost and ``successor`` owes what it owed; its
    answer goes to :meth:`AsyncState.worker_released`."""

    identity: int
    successor: int
    #: the lost identity's batches that were in flight
    batches: tuple[Batch, ...]


@dataclass(frozen=True)
class Adopt:
    """Build ``identity``'s replica of shard ``shard`` on ``worker`` from the
    holder's current weights, or the restore point's (``from_restore_point``: the
    holder is being rebuilt from it)."""

    identity: int
    shard: int
    worker: str
    from_restore_point: bool = False


@dataclass(frozen=True)
class AddHelper:
    """Tell the holder ``identity`` computes batches of ``owner``'s shard."""

    identity: int
    owner: int


@dataclass(frozen=True)
class AbandonHolder:
    """The holder was lost: make the survivors' calls to it give up."""

    survivors: tuple[str, ...]


@dataclass(frozen=True)
class RebuildHolder:
    """Build the holders anew on ``workers`` (actor keys of ``generation``) from the
    restore point of ``version`` (``source``); ``redone``: the applied updates it
    undoes, computed again."""

    workers: tuple[str, ...]
    generation: int
    version: int
    source: str
    redone: int


@dataclass(frozen=True)
class RestoreHolder:
    """Load a cut into the holder: weights, optimizer variables, ``version`` and the
    batches each identity's shard had applied (``done``); then ``learning_rate``,
    if set (the client set it after the cut)."""

    weights: list[np.ndarray]
    optimizer: list[np.ndarray]
    version: int
    done: dict[int, list[Batch]]
    learning_rate: float | None = None


@dataclass(frozen=True)
class StepApplied:
    """The run's update ``unit`` (0-based) was applied: tell the run (``on_step``)."""

    unit: int


Instruction = (Submit | Cancel | Release | Adopt | AddHelper | AbandonHolder | RebuildHolder
               | RestoreHolder | StepApplied)


