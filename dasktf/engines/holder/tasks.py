"""The async step task a worker runs: gradient, push, newest weights back."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from dasktf import config
from dasktf.engines.holder.records import PushOutcome, StepResult
from dasktf.engines.holder.rpc import HolderRef
from dasktf.runtime.channel import encode_push
from dasktf.runtime.replica import (
    Replica,
    get_replica,
    replicas_of,
    straggle,
)
from dasktf.wire.messages import GradientSum
from dasktf.wire.packets import (
    decode_weights,
    holder_nbytes,
    wire_nbytes,
)

# -- the worker side ------------------------------------------------------------------
_LOCK = threading.Lock()
_FIRST = object()


@dataclass
class HolderLink:
    """A replica's side of its conversation with the parameter holder."""

    #: tasks of one worker run one at a time even on a multi-threaded worker
    lock: threading.Lock = field(default_factory=threading.Lock)
    #: the holder this replica last spoke to (a restored one has a new key)
    holder_key: str | None = None
    #: what the last push brought back: the next weights to start from
    next_pull: Any = _FIRST
    #: when the last task ended (the idle time before the next one)
    task_end: float | None = None


def _link(replica: Replica) -> HolderLink:
    with _LOCK:
        if replica.holder_link is None:
            replica.holder_link = HolderLink()
        return replica.holder_link  # type: ignore[no-any-return]


def async_step_task(
    run_id: str, holder: HolderRef, shard_pass: int, step: int, slot: int | None = None,
    *after: Any,
) -> StepResult:
    """One update of one worker: pull the newest weights, compute, push. ``slot``:
    a replica adopted from a lost worker (:func:`dasktf.engines.holder.recovery.adopt_async_task`);
    ``after``: the task building it, a dependency only."""
    begin = time.perf_counter()
    replica = get_replica(run_id, slot)
    timeout = config.get_seconds("step-timeout")
    link = _link(replica)
    with link.lock:
        if link.holder_key not in (None, holder.key):
            # a restored holder: its versions restart from its restore point, so
            # what this replica read from the lost one says nothing
            replica.holder_version = -1
            link.next_pull = _FIRST
        link.holder_key = holder.key
        # The previous push admitted this gradient and brought the weights back;
        # a worker's first task asks for them.
        pulled, link.next_pull = link.next_pull, _FIRST
        if pulled is _FIRST:
            pulled = holder.call("pull", replica.identity, replica.holder_version,
                                 timeout=timeout)
        if pulled is None:  # the run has stopped: stay stopped
            link.next_pull = None
            return StepResult(replica.identity, shard_pass, step, None)
        token, version, flat = pulled
        rounds = replica.rounds
        if rounds is not None:
            # a round starts from the holder's weights; ``None``: the version this
            # replica read last, whose weights its last round started from
            assert flat is not None or rounds.start is not None
            rounds.begin_at(decode_weights(flat) if flat is not None
                            else rounds.start.weights, version)  # type: ignore[union-attr]
        elif flat is not None:
            replica.set_flat_weights(decode_weights(flat))
        replica.holder_version = version
        start = time.perf_counter()
        # with local_steps, ``step`` is a round: its steps, then the change to push
        grad = (replica.gradient(shard_pass, step) if rounds is None
                else rounds.run(shard_pass, step, synced=False))
        grad.compute_seconds = time.perf_counter() - start
        straggle(replica, grad.compute_seconds)
        states = replica.take_metric_states()
        pushed = time.perf_counter()
        packed = encode_push(replica, grad)
        outcome, link.next_pull = holder.call(
            "push", token, replica.identity, packed, version, shard_pass, step,
            timeout=timeout,
        )
    end = time.perf_counter()
    # Where an update's time goes: between tasks (the worker's own task hand-over),
    # in the task before and after the gradient, and in the push round trip.
    previous_end = link.task_end if link.task_end is not None else begin
    timings = {
        "idle_s": max(0.0, begin - previous_end),
        "task_s": end - begin,
        "push_s": end - pushed,
    }
    link.task_end = end
    # the record's "bytes": this update's push and the weights it started from,
    # as they travelled (counted at the codec)
    timings["bytes"] = wire_nbytes(packed) + wire_nbytes(flat)
    _emit(replica, outcome, shard_pass, step, grad, timings)
    return StepResult(replica.identity, shard_pass, step, outcome, states,
                      holder_nbytes(packed, flat), replica.non_trainable_values())


def flush_events(run_id: str, dask_worker: Any = None) -> None:
    """Send this worker's buffered step records now (run through ``Client.run``)."""
    for replica in replicas_of(run_id, dask_worker):
        replica.events.flush(dask_worker)


def _emit(
    replica: Replica, outcome: PushOutcome, shard_pass: int, step: int, grad: GradientSum,
    timings: dict[str, float],
) -> None:
    """Step records on the metrics stream, with the update's staleness."""
    base = {
        "run": replica.run_id, "kind": "update", "epoch": shard_pass, "step": step,
        "worker": replica.index, "batch_size": grad.count, "local_loss": grad.loss,
        "compute_s": grad.compute_seconds, "wall_time": time.time(), **timings,
        # the dashboard's step-time breakdown: the push round trip is this mode's
        # communication, the time between two tasks its waiting
        "communication_s": timings["push_s"], "waiting_s": timings["idle_s"],
    }
    if outcome.status == "dropped":
        replica.events.add({**base, "dropped": True})
    for r in outcome.records:
        if r.worker == replica.index:
            replica.events.add(
                {**base, "loss": r.loss, "loss_step": r.update, "update": r.update,
                 "staleness": r.staleness,
                 "version_read": r.version_read}
            )
