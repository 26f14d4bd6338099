"""The p2p engine's worker side: one long-running task per worker runs a segment of
an epoch's steps, summing each step's gradient with its peers directly.

A *segment* is the steps of an epoch up to the next checkpoint on the step grid or
the epoch's end (:class:`Segment`, the same on every member). For each step,
:func:`segment_task` computes the replica's gradient (or a round of local steps'
change), sums it over the group (:func:`~dasktf.runtime.p2p.gradients.allreduce_step`,
the same bits on every member), applies it under the step's global update number
(so a replica applies each update once, as the graph engine's do) and queues the
step's record. The scheduler sees one task per worker per segment, nothing per step.

Riding on each step's collective, exactly summed: the members' stop votes (the
client's :func:`~dasktf.runtime.p2p.links.request_stop`: every member stops after the
same update) and, on the epoch's last step, the replicas' moving statistics
(BatchNormalization's), averaged in float64 so every replica takes the same mean.
With ``shard_state="optimizer"`` a step's sum, its apply and the new weights are
one collective (:func:`~dasktf.runtime.p2p.sharding.sharded_step`: each member
applies its slice of the optimizer), never fused with the next gradient.
An epoch's last segment (or one a vote stopped) returns the epoch's report
(:func:`~dasktf.runtime.reports.epoch_report`). A segment that *spans* epochs
(:attr:`Segment.spans`) goes on through the epochs after its first, each one's end
filed in the run's gate for the client, whose word starts the next
(:mod:`dasktf.runtime.p2p.span`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from dasktf import config
from dasktf.exceptions import CollectiveAbortedError
from dasktf.runtime.p2p.buckets import bucket_values, bucketed_update
from dasktf.runtime.p2p.gradients import allreduce_step
from dasktf.runtime.p2p.links import GroupSpec, Link, link
from dasktf.runtime.p2p.redundancy import redundant_shard
from dasktf.runtime.p2p.sharding import ShardOptimizer, sharded_step
from dasktf.runtime.replica import EpochReport, StepTiming, get_replica, straggle
from dasktf.runtime.reports import epoch_report
from dasktf.runtime.staged import StagedBackward, layer_stages
from dasktf.wire.messages import GradientSum
from dasktf.wire.packets import record_traffic

if TYPE_CHECKING:
    from dasktf.runtime.p2p.group import Group
    from dasktf.runtime.replica import Replica


@dataclass(frozen=True)
class Segment:
    """Steps ``first`` to ``last`` (inclusive; none when ``last < first``) of epoch
    ``epoch``, whose step ``s`` is global update ``update_base + s``."""

    group: GroupSpec
    epoch: int
    first: int
    last: int
    update_base: int
    #: the epoch ends with this segment: average the statistics, report
    ends_epoch: bool
    #: lossy codecs scale every gradient by this before encoding (1 / global batch)
    scale: float = 1.0
    #: the model has moving statistics to average at the epoch's end
    average_stats: bool = False
    #: stop after the first update whose global loss is not finite (the run's
    #: ``TerminateOnNaN``: the same step on every member, the loss being the same)
    stop_on_nonfinite: bool = False
    #: ``"optimizer"``: each member applies the optimizer to its slice of the
    #: parameters (:mod:`dasktf.runtime.p2p.sharding`); ``"gradients"``: as well,
    #: the reduce-scatter in buckets (:mod:`dasktf.runtime.p2p.buckets`); ``None``:
    #: to all of them
    shard_state: str | None = None
    #: go on through the next epochs (``last``: the epoch's last step), each epoch's
    #: result filed in the run's gate, until the client's word ends it
    spans: bool = False
    #: with ``shard_state``: copies of each slice besides its owner's
    #: (:mod:`dasktf.runtime.p2p.redundancy`)
    redundancy: int = 0


@dataclass
class SegmentResult:
    """What one member hands back: the last step it applied and how it ended."""

    worker: str
    #: the last step of the epoch applied (``first - 1``: none)
    last: int
    #: why the segment (and the epoch) ended early after ``last``: ``"a stop
    #: request"`` (the members' votes), ``"a non-finite loss"``; ``None``: it did not
    stopped: str | None
    #: the epoch's report, when the epoch ended here
    report: EpochReport | None
    #: the last update this replica had applied when the client's stop arrived
    stop_heard_after: int | None = None
    #: a segment spanning epochs that the client's word ended: ``(replica index,
    #: every update it applied, in order)``, what the run's end reads (one message
    #: with the tasks' results, not a task per worker), the report left out (the
    #: client read it from the gate)
    applied_log: tuple[int, list[int]] | None = None


def segment_task(run_id: str, segment: Segment) -> SegmentResult:
    """Run ``segment`` on this worker's replica of ``run_id`` (see the module).

    Raises
    ------
    PeerLostError
        A member was lost; this replica stopped at a completed update (the run
        reconciles the survivors).
    CollectiveAbortedError
        The run aborted the group (it recovers from a loss seen elsewhere), or the
        replica was fenced.
    """
    from distributed import get_worker, secede

    # Out of the worker's thread pool for the segment's length: a segment waits on
    # its peers every step, so holding a thread slot would deadlock two runs that
    # share workers (each one's segment waiting for a peer whose slot the other's
    # holds), and would starve every other task of the worker meanwhile.
    secede()
    here = get_worker().address
    replica = get_replica(run_id)
    peers = link(run_id, here)
    try:
        group = peers.group_for(segment.group)
        if segment.spans:
            return _span(replica, group, segment, peers, here)
        return _segment(replica, group, segment, peers, here)
    except BaseException as exc:
        peers.fail(exc)
        raise


def _segment(replica: Replica, group: Group, segment: Segment, peers: Link, here: str
             ) -> SegmentResult:
    """One segment's steps, and its epoch's report if the epoch ends there."""
    last, stopped, statistics = _steps(replica, group, segment, peers, here)
    report = None
    if segment.ends_epoch or stopped is not None:
        if segment.average_stats and statistics is None:
            # a vote ended the epoch before its last step, whose collective the
            # statistics ride on: one of their own, numbered as the next update
            # (none follows in this epoch)
            statistics = _average_statistics(
                replica, group, segment.update_base + last + 1)
        # Inside a span only the replica whose records carry the global loss sends
        # its buffered records at each epoch end (the client hears the epoch's last
        # losses before its results); the others hand theirs to the client with the
        # epoch's report, which publishes them with the epoch's record in one
        # message (N messages an epoch, or at the span's end, were most of a short
        # fit's metrics messages to the scheduler: issue 39).
        report = epoch_report(replica, group.rank == 0, statistics,
                              flush=not segment.spans or replica.events.reports_loss)
    else:  # the client hears the segment's last losses before its results
        replica.events.flush()
    return SegmentResult(here, last, stopped, report, peers.stop_heard_after)


def _span(replica: Replica, group: Group, segment: Segment, peers: Link, here: str
          ) -> SegmentResult:
    """Epoch after epoch from ``segment`` (each one ended as :func:`_segment` ends
    it), each epoch's result filed in the gate, until a vote stops them or the
    client's word ends them; the last epoch's result (the client read it from the
    gate), or after the word that ended them, the replica's applied updates
    (:attr:`SegmentResult.applied_log`) in place of the report."""
    units = segment.last + 1
    timeout = config.get_seconds("step-timeout")
    while True:
        result = _segment(replica, group, segment, peers, here)
        peers.gate.put(segment.epoch, result)
        if result.stopped is not None:
            replica.events.flush()
            return result
        if not peers.gate.wait_word(segment.epoch, group, timeout):
            replica.events.flush()
            return dataclasses.replace(result, report=None, applied_log=(
                replica.index, list(replica.applied_log)))
        segment = dataclasses.replace(segment, epoch=segment.epoch + 1, first=0,
                                      update_base=segment.update_base + units)


def _steps(replica: Replica, group: Group, segment: Segment, peers: Link, here: str
           ) -> tuple[int, str | None, list[np.ndarray] | None]:
    """The segment's steps: the last one applied, why they stopped early (``None``:
    they did not), and the averaged statistics when they rode on the epoch's last
    step."""
    size = int(sum(replica.sizes))
    last, averaged = segment.first - 1, None
    # The sum of a step that is not the segment's last waits to be applied with the
    # next step's gradient, in one TensorFlow call (the same state, in order): the
    # replica applies it before anything else reads its weights, and before this
    # function returns or raises from a collective.
    pending: GradientSum | None = None
    for step in range(segment.first, segment.last + 1):
        update = segment.update_base + step
        for hook in peers.step_hooks:
            hook(replica, update)
        began = time.perf_counter()
        shard = replica.shard_optimizer
        staged = _staged_backward(replica, segment, step)
        if replica.rounds is not None:
            out = replica.rounds.run(segment.epoch, step)
        elif staged is not None:  # the forward pass; the backward runs in the collective
            out = GradientSum(None, staged.count, staged.loss_sum)
        elif shard is not None:  # the last step's weights taken in the same call
            out = shard.take_then_gradient(replica, segment.epoch, step)
        elif pending is not None:
            out = replica.apply_then_gradient(pending, segment.epoch, step)
        else:
            out = replica.gradient(segment.epoch, step)
        pending = None
        _check_fence(replica, update - 1)
        computed = time.perf_counter()
        statistics = None
        if segment.average_stats and step == segment.last and segment.ends_epoch:
            statistics = replica.non_trainable_values()
        votes = _votes(peers.stop, statistics)
        sharded = segment.shard_state is not None
        if sharded:  # summed, applied and the weights taken, in one collective
            collective = (functools.partial(bucketed_update,
                                            bucket_values(segment.group.shard_bucket),
                                            staged=staged)
                          if segment.shard_state == "gradients" else None)
            summed, sums = sharded_step(
                replica, group, out, update, size, votes,
                redundant_shard if segment.redundancy else ShardOptimizer, collective,
                staged=staged)
        else:
            summed, sums = allreduce_step(group, out, update, size=size,
                                          scale=segment.scale, votes=votes)
        reduced = time.perf_counter()
        summed.update = update
        stopped = ("a stop request" if sums[0] > 0 else
                   "a non-finite loss" if segment.stop_on_nonfinite and summed.count
                   and not math.isfinite(summed.loss_sum) else None)
        if sharded:
            _check_fence(replica, update)
            if stopped is not None or step == segment.last:
                replica.shard_optimizer.settle(replica)
        elif replica.rounds is None and stopped is None and step < segment.last:
            pending = summed
        else:
            replica.apply(summed)
            _check_fence(replica, update)
        if statistics is not None:
            averaged = _mean(statistics, sums[1:], group.size)
        _account(replica, group, out, summed, segment.epoch, step, update,
                 (computed - began) + (time.perf_counter() - reduced), here)
        last = step
        if stopped is not None:
            return last, stopped, averaged
    return last, None, averaged


def _staged_backward(replica: Replica, segment: Segment, step: int
                     ) -> StagedBackward | None:
    """With ``shard_state="gradients"`` on a chain model whose gradient is over
    ``dasktf.p2p.shard-stage``: the step's forward pass done, its backward pass
    to run a group of layers at a time inside the collective
    (:mod:`dasktf.runtime.staged`); else ``None`` (one call, before it)."""
    spec = segment.group
    if (segment.shard_state != "gradients" or replica.rounds is not None
            or spec.shard_stage is None or 4 * sum(replica.sizes) <= spec.shard_stage):
        return None
    bucket = bucket_values(spec.shard_bucket)
    if replica.backward_stages is None or replica.backward_stages[0] != bucket:
        replica.backward_stages = (bucket, layer_stages(replica.model, replica.variables,
                                                        bucket))
    stages = replica.backward_stages[1]
    if stages is None or len(stages) < 2:  # one stage: the one call
        return None
    if replica.shard_optimizer is not None:  # the last update's weights, before reading them
        replica.shard_optimizer.settle(replica)
    return StagedBackward(replica, stages, replica.batch(segment.epoch, step))


def _check_fence(replica: Replica, update: int) -> None:
    if replica.fenced:  # a recovery runs (a worker with several threads)
        raise CollectiveAbortedError(
            f"replica {replica.index} was fenced at update {update}: the run is "
            "recovering from a lost worker.")


def _account(replica: Replica, group: Group, out: GradientSum, summed: GradientSum,
             epoch: int, step: int, update: int, compute: float, here: str) -> None:
    """A step's bytes into the run's ledger, its time and its record."""
    stats = group.last
    assert stats is not None
    record_traffic(replica.run_id, here, stats.bytes_sent, stats.bytes_received)
    out.compute_seconds = compute
    straggle(replica, compute)
    replica.step_seconds.append(compute)
    timing = StepTiming(max(0.0, stats.seconds - stats.wait_seconds), stats.wait_seconds)
    replica.record_step(epoch, step, summed, out, timing,
                        stats.bytes_sent + stats.bytes_received, loss_step=update)


def _average_statistics(replica: Replica, group: Group, number: int
                        ) -> list[np.ndarray] | None:
    """The replicas' moving statistics averaged by a collective of their own."""
    values = replica.non_trainable_values()
    if values is None:
        return None
    empty = GradientSum(None, 0, 0.0)
    _, sums = allreduce_step(group, empty, number, size=1, votes=_votes(False, values))
    return _mean(values, sums[1:], group.size)


def _votes(stop: bool, statistics: list[np.ndarray] | None) -> np.ndarray:
    """What rides on a step's collective besides the gradient: the stop vote, then
    the statistics (flat, float64: their sum is exact whatever the order)."""
    parts = [np.array([1.0 if stop else 0.0])]
    parts += [np.asarray(v, np.float64).ravel() for v in statistics or []]
    return np.concatenate(parts)


def _mean(like: list[np.ndarray], sums: np.ndarray, n: int) -> list[np.ndarray]:
    """``sums`` (flat, float64) over ``n`` replicas, cut and cast as ``like``."""
    out, at = [], 0
    for v in like:
        size = int(np.size(v))
        out.append((sums[at:at + size] / n).reshape(np.shape(v)).astype(v.dtype))
        at += size
    return out
