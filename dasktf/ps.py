"""Sharded parameter servers for sync training (``placement="ps"``, ``num_ps=K``).

The trainable parameters are split over ``K`` servers by :func:`shard_plan`: every
variable is a piece, a variable larger than a fair share (``P / K``) is first cut
along its first axis, and the pieces go, largest first, to the least-loaded server
(size balanced within one piece). Server ``s`` runs on worker ``s mod N`` beside
that worker's replica and holds the float32 master copy of its slice and its own
optimizer state for it. Per step::

    step_task(w_i) ──► pick(chunk s) ──► ps_apply(s) on worker s mod N ──► weights slice s
      (every worker)     (local)         sum in float32, optimizer step      ──► next step_task
                                                                             (every worker)

so each server receives only its slice of every gradient and sends back only its
slice of the weights, optionally in fp16/bf16 (``weights_dtype``), while its master
copy stays float32. The optimizer on a slice is the model's optimizer applied to one
flat variable, which is exact for element-wise optimizers (SGD, momentum, Adam,
RMSprop, Adagrad, ...); so K servers give the same weights as one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from dasktf.comm import Packet, Ranges, _sum, account, gather_ranges
from dasktf.compression import get_codec

if TYPE_CHECKING:
    from dasktf.replica import Replica

_SHARDS: dict[tuple[str, int], PSShard] = {}


def shard_plan(shapes: list[tuple[int, ...]], num_ps: int) -> list[Ranges]:
    """Flat-buffer ranges of each of ``num_ps`` shards (see the module docstring).

    Raises
    ------
    ValueError
        More servers than the parameters can be cut into.
    """
    sizes = [int(np.prod(s)) if len(s) else 1 for s in shapes]
    total = sum(sizes)
    fair = total / num_ps
    pieces: list[tuple[int, int]] = []  # (start, stop) in the flat buffer
    offset = 0
    for shape, size in zip(shapes, sizes):
        rows = shape[0] if len(shape) else 1
        if size > fair and rows > 1:
            row = size // rows
            n = min(rows, int(np.ceil(size / fair)))
            cuts = [round(rows * j / n) for j in range(n + 1)]
            pieces += [(offset + a * row, offset + b * row) for a, b in zip(cuts, cuts[1:])]
        else:
            pieces.append((offset, offset + size))
        offset += size
    if len([p for p in pieces if p[1] > p[0]]) < num_ps:
        raise ValueError(
            f"num_ps={num_ps}: the model's {len(shapes)} trainable variables "
            f"({total:,} values) cannot be split over that many servers; use fewer."
        )
    loads = [0] * num_ps
    shards: list[Ranges] = [[] for _ in range(num_ps)]
    for start, stop in sorted(pieces, key=lambda p: (p[0] - p[1], p[0])):
        s = int(np.argmin(loads))
        shards[s].append((start, stop))
        loads[s] += stop - start
    return [sorted(r) for r in shards]


def server_workers(workers: list[str], num_ps: int) -> list[str]:
    """The worker each server runs on: ``s mod N`` (beside a replica)."""
    return [workers[s % len(workers)] for s in range(num_ps)]


class PSShard:
    """One server's slice: the float32 master copy and its optimizer state."""

    def __init__(self, replica: Replica, ranges: Ranges) -> None:
        import keras
        import tensorflow as tf

        # The replica on this worker holds the same initial weights as every other
        # (async: the holder's own replica, built from the run's initial weights).
        initial = gather_ranges(replica.flat_weights(), ranges).copy()
        self.ranges = ranges
        self.variable = keras.Variable(initial, dtype="float32", name="ps_shard")
        opt = replica.model.optimizer
        self.optimizer = opt.__class__.from_config(opt.get_config())
        self.optimizer.build([self.variable])
        self._apply_fn = tf.function(
            self._apply,
            input_signature=[tf.TensorSpec((initial.size,), tf.float32),
                             tf.TensorSpec((), tf.float32)],
        )

    def _apply(self, total: Any, count: Any) -> None:
        self.optimizer.apply_gradients([(total / count, self.variable)])

    def apply(self, total: np.ndarray, count: int, lr_scale: float = 1.0) -> np.ndarray:
        """One optimizer step on the slice; ``lr_scale`` scales the learning rate of
        this step only (async ``staleness_lr``)."""
        if lr_scale != 1.0:
            base = float(np.asarray(self.optimizer.learning_rate))
            self.optimizer.learning_rate = base * lr_scale
            try:
                self._apply_fn(total, np.float32(count))
            finally:
                self.optimizer.learning_rate = base
        else:
            self._apply_fn(total, np.float32(count))
        return np.asarray(self.variable.numpy(), np.float32)

    def state(self) -> list[np.ndarray]:
        """The optimizer's variables (a checkpoint's part of this slice)."""
        return [np.asarray(v.numpy()) for v in self.optimizer.variables]

    def load(self, values: np.ndarray, optimizer: list[np.ndarray]) -> np.ndarray:
        self.variable.assign(values)
        for v, value in zip(self.optimizer.variables, optimizer, strict=True):
            v.assign(value)
        return np.asarray(self.variable.numpy(), np.float32)


def ps_apply_task(
    run_id: str, shard: int, ranges: Ranges, weights_dtype: str | None, *parts: Packet
) -> Packet:
    """Server ``shard``: sum its slice of every worker's gradient, step the
    optimizer on it, return the slice of the new weights for the replicas."""
    from distributed import get_worker

    from dasktf.replica import get_replica

    address = get_worker().address
    account(run_id, parts)
    state = _SHARDS.get((run_id, shard))
    if state is None:
        state = _SHARDS[(run_id, shard)] = PSShard(get_replica(run_id), ranges)
    total, count, loss_sum = _sum(parts)
    if total is not None and count:
        weights = state.apply(total, count)
    else:
        weights = np.asarray(state.variable.numpy(), np.float32)
    return Packet(get_codec(weights_dtype).encode(weights), count, loss_sum,
                  max(p.compute_seconds for p in parts), address, kind="weights")


def set_shards_learning_rate(run_id: str, lr: float) -> None:
    """The servers' optimizers on this worker follow a learning rate the run set."""
    for key, state in _SHARDS.items():
        if key[0] == run_id:
            state.optimizer.learning_rate = lr


def release_shards(run_id: str, dask_worker: Any = None) -> None:
    for key in [k for k in _SHARDS if k[0] == run_id]:
        del _SHARDS[key]
