"""What an async run records: one :class:`UpdateRecord` per applied update."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class UpdateRecord:
    """One applied update, as the holder saw it.

    ``version_applied`` is the holder's version the gradient was applied to (the
    number of updates before it) and ``update`` the version it made
    (``version_applied + 1``), so ``staleness = version_applied - version_read``.
    """

    update: int
    worker: int
    epoch: int
    version_read: int
    version_applied: int
    staleness: int
    loss: float
    batch_size: int
    compute_s: float
    wall_time: float
    shard_pass: int
    step: int
    lr_scale: float = 1.0


@dataclass
class PushOutcome:
    """What the holder answers a push: the updates it applied, or a drop."""

    status: str  # "applied" | "buffered" (quorum: waits for k) | "dropped" (quorum)
    records: list[UpdateRecord] = field(default_factory=list)


@dataclass
class StepResult:
    """What one ``async_step_task`` returns to the client (never weights)."""

    worker: int
    shard_pass: int
    step: int
    outcome: PushOutcome | None  # None: the holder had stopped; nothing computed
    metric_states: list[np.ndarray] | None = None
    #: per holder: the push and the weights pulled for it, as they travelled
    nbytes: list[int] = field(default_factory=list)
    #: the replica's moving statistics after this gradient (models that have
    #: some): the holder never runs a training forward pass, so it takes their mean
    non_trainable: list[np.ndarray] | None = None


def updates_frame(records: list[UpdateRecord]) -> Any:
    """``records`` as a pandas DataFrame (one row per applied update)."""
    import dataclasses

    import pandas as pd

    columns = [f.name for f in dataclasses.fields(UpdateRecord)]
    return pd.DataFrame([dataclasses.astuple(r) for r in records], columns=columns)
