"""A step's :class:`~dasktf.wire.messages.GradientSum` summed over a group.

The graph engine's semantics (:mod:`dasktf.wire.packets`): the members' ``Σ n_i g_i``
(the float32 buffer), ``Σ n_i``, ``Σ n_i loss_i`` and ``Σ n_i ||Δ_i||²`` (float64
scalars, summed exactly alongside). With a lossy codec every member first scales
its buffer by the same ``scale`` (``1 / global batch``, so fp16 stays in range
whatever the batch: the graph engine's mean packets do the same) and the sum is
scaled back in float32, the same operation on the same bits on every member.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from dasktf.wire.messages import GradientSum

if TYPE_CHECKING:
    from dasktf.runtime.p2p.group import Group


def allreduce_gradient(group: Group, grad: GradientSum, step: int, *,
                       size: int | None = None, scale: float = 1.0) -> GradientSum:
    """The group's sum of every member's ``grad`` for collective ``step``.

    Parameters
    ----------
    group
        This member's group.
    grad
        This member's gradient sum; ``total`` may be ``None`` (no example here this
        step: zeros are sent, so every member takes part).
    step
        The collective's number (see :meth:`Group.allreduce`).
    size
        Values in the buffer; needed only when ``grad.total`` is ``None``.
    scale
        Lossy codecs: the factor every member applies before encoding (the same on
        all; ``1 / global batch size``). Ignored without a lossy codec.

    Returns
    -------
    GradientSum
        The same on every member; ``total`` is ``None`` when no member had an
        example; ``compute_seconds`` and ``update`` are this member's.
    """
    return allreduce_step(group, grad, step, size=size, scale=scale)[0]


def allreduce_step(group: Group, grad: GradientSum, step: int, *, size: int | None = None,
                   scale: float = 1.0, votes: Sequence[float] | np.ndarray = ()
                   ) -> tuple[GradientSum, np.ndarray]:
    """:func:`allreduce_gradient`, with ``votes`` (a few numbers every member passes
    as many of: a stop request, a flag) summed exactly alongside in the same
    collective; returns the sum and the summed votes, the same on every member."""
    if grad.total is None:
        if size is None:
            raise ValueError("allreduce_gradient: grad.total is None; pass size= "
                             "(the values in the flat gradient buffer).")
        total = np.zeros(size, np.float32)
    else:
        total = np.asarray(grad.total, np.float32).ravel()
    scaled = group.coding.lossy and scale != 1.0
    if scaled:
        total = total * np.float32(scale)
    scalars = np.concatenate([[grad.count, grad.loss_sum, grad.square_sum],
                              np.asarray(votes, np.float64).ravel()])
    out, sums = group.allreduce(total, step, scalars)
    assert sums is not None
    if scaled:  # (a new array: a received one may be read-only)
        out = out / np.float32(scale)
    count = round(float(sums[0]))
    summed = GradientSum(out if count else None, count, float(sums[1]),
                         grad.compute_seconds, grad.update, float(sums[2]))
    return summed, sums[3:]
