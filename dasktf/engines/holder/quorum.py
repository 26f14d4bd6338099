"""First-k-of-n synchronous training ("backup workers").

Each step ``s`` applies the sum of the first ``k`` gradients computed on the
weights of version ``s``; a gradient that arrives after its step was applied is
*dropped* and counted for its worker (``history.history["dropped"]`` per epoch,
``history.dropped`` per worker, ``"dropped": True`` records on the metrics stream).

The weights live in the same :class:`~dasktf.engines.holder.actor.ParameterHolder` as in
async mode, in quorum mode: a worker's pull waits for the first step it has not
contributed to, so no worker contributes twice to a step and no gradient counts
twice; a worker whose gradient was dropped starts its next one from the newest
weights, so it never lags behind by more than the step it was computing. Steps thus
complete at the pace of the k-th fastest worker. An epoch is ``steps_per_epoch``
applied steps, as in sync mode.
"""

from __future__ import annotations

from typing import Any

from dasktf.engines.base import Capabilities
from dasktf.engines.holder.engine import AsyncEngine
from dasktf.engines.holder.state import QuorumState


class QuorumEngine(AsyncEngine):
    """Sync steps applied with the first ``quorum`` of N gradients (see module doc).

    What differs from an async run is overridden here and in
    :class:`~dasktf.engines.holder.state.QuorumState` (when an epoch ends, the
    budget, drops, no rewind after a holder restore): a quorum run keeps its
    workers (a joined one would change every step's k of N) and saves only its
    final model."""

    mode = "quorum"
    #: the master weights and a step's applied updates are never in one piece
    #: between two steps: only the final model is saved
    capabilities = Capabilities(checkpoints="final", resume=False)
    grows = False

    def __init__(self, *args: Any, quorum: int, **kwargs: Any) -> None:
        super().__init__(*args, quorum=quorum, **kwargs)
        self.quorum = quorum

    def _new_state(self, **kwargs: Any) -> QuorumState:
        return QuorumState(steps_per_epoch=self.ctx.steps_per_epoch, **kwargs)

    def final_state(self) -> None:
        return None
