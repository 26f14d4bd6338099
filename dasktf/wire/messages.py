"""The gradient message every engine moves: a flat float32 sum with its count."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class GradientSum:
    """A sum of per-example gradients (``count`` examples) as one flat buffer.

    ``total`` is ``None`` when no example contributed (a worker whose share of a
    short last batch is empty), which costs no transfer.
    """

    total: np.ndarray | None
    count: int
    loss_sum: float
    compute_seconds: float = 0.0
    #: The global update this sum makes when applied (-1: untracked). A replica
    #: applies each update once, whoever hands it over (see :meth:`Replica.apply`).
    update: int = -1
    #: Rounds of local steps: ``Σ n_i ||Δ_i||²`` of the changes summed (the workers'
    #: spread, :func:`dasktf.runtime.rounds.drift`); 0 for gradients.
    square_sum: float = 0.0

    @property
    def loss(self) -> float:
        return self.loss_sum / self.count if self.count else float("nan")


def sum_gradients(*parts: GradientSum) -> GradientSum:
    """The reduction of the sync step graph: add gradient sums."""
    totals = [p.total for p in parts if p.total is not None]
    total = None
    if totals:
        total = totals[0].copy()
        for t in totals[1:]:
            total += t
    return GradientSum(
        total,
        sum(p.count for p in parts),
        sum(p.loss_sum for p in parts),
        max(p.compute_seconds for p in parts),
        max(p.update for p in parts),
        sum(p.square_sum for p in parts),
    )
