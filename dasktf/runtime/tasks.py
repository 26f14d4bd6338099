"""The worker-side entry points of a run's replicas (plain module functions, so
their Dask task names read well on the dashboard); they find their replica in
the worker's :class:`~dasktf.runtime.manager.RunManager`.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np

from dasktf.cluster.devices import (
    placement_summary,
)
from dasktf.cluster.malloc import fixed_mmap_threshold
from dasktf.data.shards import Shard
from dasktf.runtime.channel import channel, receive, send
from dasktf.runtime.manager import run_manager
from dasktf.runtime.replica import (
    EpochReport,
    Replica,
    ReplicaConfig,
    get_replica,
    register_replica,
    straggle,
)
from dasktf.runtime.reports import epoch_report
from dasktf.runtime.servers import set_shards_learning_rate
from dasktf.runtime.statistics import mean_non_trainable
from dasktf.transport import forget_model
from dasktf.wire.packets import release_run

logger = logging.getLogger(__name__)


# -- task functions (run on the workers) ------------------------------------
def create_replica_task(
    run_id: str,
    expected_address: str,
    config: ReplicaConfig,
    index: int,
    shard: Shard,
    schedule: np.ndarray,
    val_shard: Shard | None,
    shuffle: bool,
    slow_factor: float = 1.0,
) -> dict[str, Any]:
    """Build replica ``index`` on this worker from ``config.model``, the run's model
    package (on this worker already: :func:`dasktf.transport.share_model`)."""
    from distributed import get_worker

    address = get_worker().address
    if address != expected_address:
        raise ValueError(
            f"Replica {index} was meant for {expected_address} but ran on {address}; "
            "the task was moved, which dasktf never asks for."
        )
    replica = Replica(config, index, shard, schedule, None, val_shard, shuffle)
    replica.run_id = run_id
    replica.slow_factor = float(slow_factor)
    register_replica(run_id, replica)
    import tensorflow as tf

    placement = placement_summary(replica.model, replica.device)
    logger.info("Replica %d of run %s on %s: %s", index, run_id, address, placement)
    return {
        "placement": placement,
        "worker": address,
        "devices": [d.name for d in tf.config.get_visible_devices()],
        "intra_op_threads": tf.config.threading.get_intra_op_parallelism_threads(),
        "shard_size": len(shard),
        "malloc": fixed_mmap_threshold(),
    }


def step_task(
    run_id: str, epoch: int, step: int, previous: Any, update: int = -1,
    keep: bool = False,
) -> Any:
    """One fused sync step on one worker: apply the last summed gradient, then
    compute the gradient of this step's local batch (global update ``update``),
    encoded for the wire by :mod:`dasktf.wire.packets`. ``keep``: keep the state after the
    apply for a checkpoint of that update."""

    start = time.perf_counter()
    replica = get_replica(run_id)
    timing = replica.timing.begin(epoch, start)
    to_apply, previous = receive(replica, previous, run_id)
    replica.apply(to_apply)
    if keep:
        replica.keep_state()
    # with local_steps=H, ``step`` is a round: H inner steps, then the change to send
    out = replica.gradient(epoch, step) if replica.rounds is None else replica.rounds.run(
        epoch, step)
    out.update = update
    end = time.perf_counter()
    out.compute_seconds = end - start
    replica.timing.end(end)
    straggle(replica, out.compute_seconds)
    replica.step_seconds.append(out.compute_seconds)
    sent = send(replica, out)
    ch = channel(replica)
    replica.record_step(epoch, step, previous, out, timing,
                        ch.last_bytes if ch is not None else None)
    return sent


def epoch_stats_task(run_id: str, previous: Any) -> list[np.ndarray] | None:
    """Apply the epoch's last gradient; return the replica's non-trainable float
    state for :func:`end_epoch_task` to average (models that have some)."""

    replica = get_replica(run_id)
    replica.apply(receive(replica, previous, run_id)[0])
    return replica.non_trainable_values()


def end_epoch_task(
    run_id: str, previous: Any, with_weights: bool, *stats: list[np.ndarray]
) -> EpochReport:
    """Apply the epoch's last gradient, then report metrics (and weights if asked).

    ``stats``: every replica's :func:`epoch_stats_task` (which applied the gradient,
    ``previous`` is then None). Their mean replaces this replica's moving statistics
    before it evaluates, so validation, the weights reported, the checkpoint and the
    next epoch all use statistics of the whole data, and the replicas agree again.
    """
    replica = get_replica(run_id)
    replica.apply(receive(replica, previous, run_id)[0])
    return epoch_report(replica, with_weights, mean_non_trainable(stats) if stats else None)


def set_learning_rate_task(run_id: str, lr: float) -> float:
    """Set the learning rate of this worker's replica (and of the parameter-server
    slices it holds), between two epochs; it replaces a ``scale_lr`` warm-up under
    way. Returns the value set."""
    replica = get_replica(run_id)
    with replica.apply_lock:
        replica.lr_ramp = None
        replica.model.optimizer.learning_rate = lr
    set_shards_learning_rate(run_id, lr)
    return float(replica.model.optimizer.learning_rate.numpy())


def set_non_trainable_task(run_id: str, values: list[np.ndarray] | None,
                           slot: int | None = None) -> None:
    """Give this worker's replica the non-trainable float state ``values``."""
    get_replica(run_id, slot).set_non_trainable(values)


def release_replicas(run_id: str, model_key: str | None = None,
                     dask_worker: Any = None) -> int:
    """Drop this worker's replicas and groups of ``run_id`` (run through
    ``Client.run``: never waits, it runs on the event loop) and this process's copy
    of the run's model package ``model_key``."""
    released = run_manager(dask_worker).release(run_id)
    if model_key is not None:
        forget_model(model_key)
    release_run(run_id)
    return released
