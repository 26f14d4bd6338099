"""Asynchronous training: a parameter holder applies each gradient as it arrives.

The master weights and the optimizer state live in one :class:`ParameterHolder`, a
Dask actor on one worker (the *holder*; a worker that is not slowed down). Every
worker loops on its own, one Dask task per update::

    async_step_task on worker i (pinned)
      pull   ── actor call ──► holder: newest weights (version v), unless i has them
      gradient of i's next local batch at version v
      push   ── actor call ──► holder: apply at once (version V → V+1),
                               record staleness = V - v
      return a small StepResult (the record and the batch's metric states)

Gradients and weights travel worker ↔ holder directly; the scheduler is not on
the per-update path and the client only sees the small records. The holder applies
on its event loop, not on its task thread, so a holder that also trains never makes
the others wait for its gradient. The client keeps ``dasktf.async.submit-ahead`` tasks queued per worker and
reacts to their completion (``distributed.as_completed``): it submits that worker's
next batch, accounts the epoch and, at an epoch end, evaluates the holder's current
weights, while the queued tasks keep every worker busy.

*Bounded staleness* (``max_staleness=K``) is enforced where the versions are known,
on the holder, by :class:`StalenessGate`: a pull waits until starting a gradient
cannot let any gradient in flight be applied more than K updates late.

An *epoch* ends once every shard has been consumed once more. Workers never wait for
it: a fast worker goes on into its next pass over its shard (reshuffled by pass)
while a slow one finishes, so examples/s counts every example applied.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
from distributed import as_completed

from dasktf import config
from dasktf.comm import (
    as_gradient_sum,
    decode_weights,
    encode_push,
    encode_weights,
    holder_nbytes,
    wire_nbytes,
)
from dasktf.data import Shard
from dasktf.exceptions import DasktfError, StepTimeoutError
from dasktf.replica import (
    EpochReport,
    GradientSum,
    Replica,
    ReplicaConfig,
    get_replica,
    mean_non_trainable,
    straggle,
    sum_gradients,
)
from dasktf.sync import RunContext, check_alive, raise_task_error, wait_for

if TYPE_CHECKING:
    from distributed import Future

logger = logging.getLogger(__name__)

#: Accepted values of ``staleness_lr``.
STALENESS_LR = (None, "inverse")
#: The holder builds its model as a replica with this index (it only offsets the seed).
_HOLDER_INDEX = 10_000


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


class StalenessGate:
    """Admission for bounded staleness, counted in updates.

    Invariant, for every gradient ``g`` in flight (read at version ``r_g``, ``n`` in
    flight, holder at version ``V``)::

        (V - r_g) + (n - 1) <= K

    An apply raises ``V`` by one and lowers ``n`` by one, so it keeps the invariant;
    a new gradient (read at ``V``) is admitted only if it keeps it too. Hence every
    gradient is applied at most ``K`` updates after the version it read. With K=0
    one gradient is in flight at a time: sequential SGD.
    """

    def __init__(self, bound: int | None) -> None:
        self.bound = bound
        self.in_flight: dict[int, int] = {}
        self._tokens = 0

    def admissible(self, version: int) -> bool:
        if self.bound is None:
            return True
        oldest = min(self.in_flight.values(), default=version)
        return (version - oldest) + len(self.in_flight) <= self.bound

    def start(self, version: int) -> int:
        self._tokens += 1
        self.in_flight[self._tokens] = version
        return self._tokens

    def finish(self, token: int) -> None:
        self.in_flight.pop(token, None)


class ParameterHolder:
    """The master weights and optimizer state of an async or quorum run (an actor).

    Built on the holder worker from the same :class:`ReplicaConfig` as the replicas,
    it reuses :class:`~dasktf.replica.Replica` for the model, the optimizer, the
    compiled apply and the evaluation. Its coroutine methods run on the worker's
    event loop, which also runs each apply (one compiled call, about a millisecond
    for 100k parameters): a thread hand-over each way would cost more than the apply
    on a loaded machine. Evaluation, which takes longer, runs in a dedicated thread.

    Parameters
    ----------
    quorum
        ``None``: asynchronous, apply every gradient as it arrives. ``k``: sync with
        backup workers, apply step ``s`` with the first ``k`` gradients read at
        version ``s`` and drop the later ones.
    budget
        When to stop on its own, before admitting one gradient too many: async,
        ``{worker: updates}`` each worker owes (its batches of the run's passes;
        updates from later passes of a fast worker do not count); quorum,
        ``{-1: steps}``.
    passes
        Async: the passes over its shard each worker owes (updates of later passes
        do not count against ``budget``).
    """

    def __init__(
        self,
        config_: ReplicaConfig,
        weights: list[np.ndarray],
        probe: Shard,
        val_shards: list[Shard | None],
        max_staleness: int | None = None,
        staleness_lr: str | None = None,
        quorum: int | None = None,
        timeout: float = 600.0,
        budget: dict[int, int] | None = None,
        passes: int | None = None,
    ) -> None:
        val_parts = [s for s in val_shards if s is not None and len(s)]
        val = (
            Shard(np.concatenate([s.x for s in val_parts]), np.concatenate([s.y for s in val_parts]))
            if val_parts
            else None
        )
        shard = Shard(probe.x[:1], probe.y[:1])
        self.replica = Replica(config_, _HOLDER_INDEX, shard, np.ones((1,), int), weights, val, False)
        optimizer = self.replica.model.optimizer
        self._base_lr = float(np.asarray(optimizer.learning_rate))
        self.flat = self.replica.flat_weights()
        self.version = 0
        self.gate = StalenessGate(max_staleness)
        self.staleness_lr = staleness_lr
        self.quorum = quorum
        self.timeout = timeout
        self.stopped = False
        self.budget = dict(budget or {})
        self.passes = passes
        self.dropped: dict[int, int] = {}
        self.discarded = 0
        self._pending: dict[int, list[tuple[int, GradientSum, int, int]]] = {}
        self._last_step: dict[int, int] = {}
        self._queue: deque[int] = deque()  # tickets of the pulls waiting, in order
        self._tickets = 0
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="dasktf-holder")
        #: Workers lost mid-run (see :meth:`release_worker`), the owner of each
        #: admission token, and every applied update by (worker, pass, step).
        self.gone: set[int] = set()
        self._token_owner: dict[int, int] = {}
        self._applied_items: dict[tuple[int, int, int], UpdateRecord] = {}
        #: The "applied" outcome of each push that completed an update, by the
        #: pushing (worker, pass, step): what the client learns from that push's task.
        self._outcomes: dict[tuple[int, int, int], PushOutcome] = {}
        self._restored: set[tuple[int, int, int]] = set()  # applied before a resume
        #: A joined worker helping a shard (dasktf.async_elastic): identity -> owner.
        self.helps: dict[int, int] = {}
        self._weights_dtype = getattr(config_.comm, "weights_dtype", None)
        self._cond: asyncio.Condition | None = None
        self._lock: asyncio.Lock | None = None

    # -- coordination (event loop) ------------------------------------------------
    def _sync_objects(self) -> tuple[asyncio.Condition, asyncio.Lock]:
        if self._cond is None or self._lock is None:
            self._cond, self._lock = asyncio.Condition(), asyncio.Lock()
        return self._cond, self._lock

    def _may_start(self, worker: int, ticket: int) -> bool:
        if self.quorum is not None:  # one gradient per worker and step
            return self.version > self._last_step.get(worker, -1)
        # First come, first served: the worker that just pushed must not take the
        # slot a waiting worker was promised (with K=0 it would starve the others).
        return self._queue[0] == ticket and self.gate.admissible(self.version)

    async def pull(self, worker: int, have: int) -> tuple[int, int, np.ndarray | None] | None:
        """Wait until ``worker`` may start a gradient; return (token, version,
        weights), the weights ``None`` when the worker already has that version, or
        ``None`` once the run has stopped."""
        cond, _ = self._sync_objects()
        if worker in self.gone:  # a lost worker's last push: no new admission
            return None
        async with cond:
            self._tickets += 1
            ticket = self._tickets
            self._queue.append(ticket)
            try:
                await asyncio.wait_for(
                    cond.wait_for(lambda: self.stopped or worker in self.gone
                                  or self._may_start(worker, ticket)),
                    self.timeout,
                )
            except TimeoutError:
                raise StepTimeoutError(
                    f"Worker {worker} waited {self.timeout:g}s to start a gradient "
                    f"(holder at version {self.version}, in flight: "
                    f"{self.gate.in_flight}, quorum {self.quorum}); the workers in "
                    "flight never pushed. Check their logs, or raise dasktf.step-timeout."
                ) from None
            finally:
                self._queue.remove(ticket)
                cond.notify_all()  # the next in line may be admissible too
            if self.stopped or worker in self.gone:
                return None
            version = self.version
            self._last_step[worker] = version
            token = self.gate.start(version) if self.quorum is None else 0
            self._token_owner[token] = worker
        if have == version:
            return token, version, None
        # fp16/bf16 weights on the wire if asked; the master copy stays float32
        return token, version, encode_weights(self.flat, self._weights_dtype)

    async def push(
        self, token: int, worker: int, grad: GradientSum, version_read: int,
        shard_pass: int, step: int,
    ) -> tuple[PushOutcome, tuple[int, int, np.ndarray | None] | None]:
        """Apply ``grad`` now (async) or as part of its quorum step, then admit the
        worker's next gradient: one round trip per update, returning the outcome and
        what :meth:`pull` would (so the worker's next read is the newest weights)."""
        grad = as_gradient_sum(grad)  # decode a compressed push (dasktf.comm)
        outcome = await self._push(token, worker, grad, version_read, shard_pass, step)
        return outcome, await self.pull(worker, version_read)

    async def _push(
        self, token: int, worker: int, grad: GradientSum, version_read: int,
        shard_pass: int, step: int,
    ) -> PushOutcome:
        cond, lock = self._sync_objects()
        async with lock:  # one apply at a time, versions in apply order
            if worker in self.gone:  # released: its gradient is dropped, never applied
                outcome = PushOutcome("lost")
            elif self.quorum is None:
                outcome = await self._apply_now(worker, grad, version_read, shard_pass, step)
            else:
                outcome = await self._apply_quorum(worker, grad, version_read, shard_pass, step)
        async with cond:
            self.gate.finish(token)
            self._token_owner.pop(token, None)
            cond.notify_all()
        return outcome

    async def release_worker(
        self, worker: int, successor: int, items: list[tuple[int, int]]
    ) -> tuple[list[PushOutcome], list[tuple[int, int]]]:
        """``worker`` was lost: drop its admission (nobody waits for its gradient),
        refuse anything it still sends, hand what it owes to ``successor``. Return
        the outcomes of its in-flight ``(pass, step)`` pushes that completed an
        update before it died (the client never heard of them) and those of the
        items whose gradient went into an applied update (never computed again)."""
        cond, lock = self._sync_objects()
        async with lock:  # after any apply in progress
            self.gone.add(worker)
            if worker in self.budget:
                self.budget[successor] = self.budget.pop(worker)
            for helper, owner in list(self.helps.items()):  # they now help the successor
                if owner == worker:
                    self.helps[helper] = successor
            if worker in self.helps:  # a lost helper's successor helps the same shard
                self.helps[successor] = self.helps[worker]
            outcomes = [self._outcomes[(worker, p, s)] for p, s in items
                        if (worker, p, s) in self._outcomes]
            applied = [(p, s) for p, s in items if (worker, p, s) in self._applied_items]
        async with cond:
            for token, owner in list(self._token_owner.items()):
                if owner == worker:
                    self.gate.finish(token)
                    del self._token_owner[token]
            cond.notify_all()
        return outcomes, applied

    async def _apply_now(
        self, worker: int, grad: GradientSum, version_read: int, shard_pass: int, step: int
    ) -> PushOutcome:
        staleness = self.version - version_read
        scale = 1.0 / max(1, staleness) if self.staleness_lr == "inverse" else 1.0
        self._apply(grad, scale)
        record = self._record(worker, grad, version_read, shard_pass, step, scale)
        self._applied_items[(worker, shard_pass, step)] = record
        self.version += 1
        if self.passes is None or shard_pass < self.passes:
            self._spend(self.helps.get(worker, worker))
        outcome = self._outcomes[(worker, shard_pass, step)] = PushOutcome("applied", [record])
        return outcome

    def _spend(self, key: int) -> None:
        """Count one update against the budget; stop once the whole run is done."""
        if key in self.budget:
            self.budget[key] = max(0, self.budget[key] - 1)
            if not any(self.budget.values()):
                self.stopped = True

    async def _apply_quorum(
        self, worker: int, grad: GradientSum, version_read: int, shard_pass: int, step: int
    ) -> PushOutcome:
        assert self.quorum is not None
        if version_read < self.version:  # its step was applied without it: late
            self.dropped[worker] = self.dropped.get(worker, 0) + 1
            return PushOutcome("dropped")
        pending = self._pending.setdefault(version_read, [])
        pending.append((worker, grad, shard_pass, step))
        if len(pending) < self.quorum:
            return PushOutcome("buffered")
        del self._pending[version_read]
        self._apply(sum_gradients(*(p[1] for p in pending)), 1.0)
        records = [self._record(w, g, version_read, p, s, 1.0) for w, g, p, s in pending]
        for r in records:
            self._applied_items[(r.worker, r.shard_pass, r.step)] = r
        self.version += 1
        self._spend(-1)
        outcome = self._outcomes[(worker, shard_pass, step)] = PushOutcome("applied", records)
        return outcome

    def _record(
        self, worker: int, grad: GradientSum, version_read: int, shard_pass: int,
        step: int, scale: float,
    ) -> UpdateRecord:
        return UpdateRecord(
            update=self.version + 1, worker=worker, epoch=-1, version_read=version_read,
            version_applied=self.version, staleness=self.version - version_read,
            loss=grad.loss, batch_size=grad.count, compute_s=grad.compute_seconds,
            wall_time=time.time(), shard_pass=shard_pass, step=step, lr_scale=scale,
        )

    async def _run(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    # -- TensorFlow work (holder thread) -----------------------------------------
    def _apply(self, grad: GradientSum, scale: float) -> None:  # on the event loop
        optimizer = self.replica.model.optimizer
        if scale != 1.0:
            # The learning rate, not the gradient: Adam-like optimizers normalise
            # the gradient's scale away.
            optimizer.learning_rate = self._base_lr * scale
        try:
            self.replica.apply(grad)
        finally:
            if scale != 1.0:
                optimizer.learning_rate = self._base_lr
        self.flat = self.replica.flat_weights()

    def _evaluate(self) -> tuple[int, list[np.ndarray] | None, list[np.ndarray]]:
        version = self.version
        states = self.replica.evaluate()
        self.replica.model.reset_metrics()
        return version, states, [np.asarray(w) for w in self.replica.model.get_weights()]

    async def evaluate(self) -> tuple[int, list[np.ndarray] | None, list[np.ndarray]]:
        """(version, validation metric states or None, weights) of the current model."""
        _, lock = self._sync_objects()
        async with lock:  # between two applies
            return await self._run(self._evaluate)  # type: ignore[no-any-return]

    async def weights(self) -> list[np.ndarray]:
        """The current weights (all of the model's, in ``get_weights`` order)."""
        _, lock = self._sync_objects()
        async with lock:
            return await self._run(  # type: ignore[no-any-return]
                lambda: [np.asarray(w) for w in self.replica.model.get_weights()]
            )

    def _snapshot(self, since: int) -> dict[str, Any]:
        model = self.replica.model
        return {
            "weights": [np.asarray(w) for w in model.get_weights()],
            "optimizer": [np.asarray(v.numpy()) for v in model.optimizer.variables],
            "version": self.version,
            "items": sorted(set(self._applied_items) | self._restored),
            "records": [r for r in self._applied_items.values() if r.update > since],
        }

    async def snapshot(self, since: int = 0) -> dict[str, Any]:
        """A checkpoint's consistent cut (between two applies): weights, optimizer
        variables, version, every applied ``(worker, pass, step)`` and the records of
        the updates after ``since`` (the client may not have heard of the last ones)."""
        _, lock = self._sync_objects()
        async with lock:
            return await self._run(self._snapshot, since)  # type: ignore[no-any-return]

    def _restore(self, weights: list[np.ndarray], optimizer: list[np.ndarray]) -> None:
        model = self.replica.model
        model.set_weights(weights)
        for v, value in zip(model.optimizer.variables, optimizer, strict=False):
            v.assign(value)
        # the cut's learning rate (an optimizer variable) is the one to go on with
        self._base_lr = float(np.asarray(model.optimizer.learning_rate))
        self.flat = self.replica.flat_weights()

    async def restore(
        self, weights: list[np.ndarray], optimizer: list[np.ndarray], version: int,
        done: dict[int, list[tuple[int, int]]],
    ) -> None:
        """Load a checkpoint (:mod:`dasktf.async_checkpoint`) before the first pull:
        the applied items of each worker count against its budget."""
        _, lock = self._sync_objects()
        async with lock:
            await self._run(self._restore, weights, optimizer)
            self.version = int(version)
            if self.quorum is not None:  # quorum steps count against one budget
                for _ in range(self.version):
                    self._spend(-1)
            for worker, items in done.items():
                self._restored.update((worker, int(p), int(s)) for p, s in items)
                for p, _ in items:
                    if self.passes is None or p < self.passes:
                        self._spend(worker)

    async def set_non_trainable(self, values: list[np.ndarray]) -> None:
        """Take the workers' mean moving statistics (see :class:`StepResult`)."""
        _, lock = self._sync_objects()
        async with lock:
            await self._run(self.replica.set_non_trainable, values)

    def _set_learning_rate(self, lr: float) -> None:
        self._base_lr = float(lr)  # staleness_lr scales from it
        self.replica.model.optimizer.learning_rate = lr

    async def set_learning_rate(self, lr: float) -> None:
        """Apply the next updates with learning rate ``lr`` (a client callback's)."""
        _, lock = self._sync_objects()
        async with lock:
            await self._run(self._set_learning_rate, lr)

    async def add_helper(self, identity: int, owner: int) -> None:
        """``identity`` (a worker that joined) computes batches of ``owner``'s shard:
        its updates count against that shard's budget."""
        _, lock = self._sync_objects()
        async with lock:
            self.helps[identity] = owner

    async def stop(self) -> None:
        """Refuse new gradients: pulls return ``None`` from now on."""
        cond, _ = self._sync_objects()
        async with cond:
            self.stopped = True
            cond.notify_all()

    async def counters(self) -> dict[str, Any]:
        """After :meth:`stop` and the last push: discard the gradients still waiting
        for a quorum; report version, drops and discards."""
        _, lock = self._sync_objects()
        async with lock:
            self.discarded += sum(len(p) for p in self._pending.values())
            self._pending.clear()
        return {"version": self.version, "dropped": dict(self.dropped),
                "discarded": self.discarded}

    def close(self) -> None:
        self._executor.shutdown(wait=False)


# -- the worker side ------------------------------------------------------------------
_LOCK = threading.Lock()
_FIRST = object()
#: Keys of holders the client declared lost (:func:`abandon_holder_task`): a call to
#: one of them gives up at once instead of waiting for a worker that is gone.
_LOST_HOLDERS: set[str] = set()


class HolderLostError(DasktfError):
    """The parameter holder a gradient task talks to was lost (the client restores
    it on a survivor and recomputes what was not applied)."""


@dataclass(frozen=True)
class HolderRef:
    """Where a run's :class:`ParameterHolder` lives: what the gradient tasks get
    instead of the :class:`~distributed.actor.Actor`.

    An Actor argument makes the holder's task a *dependency* of every gradient task,
    so losing the holder's worker sends them all into the scheduler's recomputation
    of a task pinned to a worker that is gone; and a call to a dead actor waits for
    the actor's future forever. A call through this reference fails within a poll
    interval once the client has declared the holder lost, and within ``timeout``
    otherwise.
    """

    address: str
    key: str

    def keys(self) -> tuple[str, ...]:
        """Every holder actor a call through this reference may wait on."""
        return (self.key,)

    def call(self, method: str, *args: Any, timeout: float) -> Any:
        """``holder.method(*args)`` from a task on a worker (blocking)."""
        from distributed import get_worker
        from distributed.utils import sync

        worker = get_worker()
        return sync(worker.loop, _actor_call, worker.rpc(self.address), self.address,
                    self.key, method, args, timeout)


class ClientHolder:
    """The client's handle on a holder: ``holder.method(*args).result(timeout)`` as
    with an :class:`~distributed.actor.Actor`, but failing fast like
    :meth:`HolderRef.call` (an Actor call to a lost worker waits on the actor's
    future, which a task pinned to a dead worker never completes): it gives up
    with :class:`HolderLostError` once ``lost()`` says the holder's worker is gone
    or it cannot be reached."""

    def __init__(self, client: Any, ref: HolderRef, lost: Callable[[], bool]) -> None:
        self._client, self._ref, self._lost = client, ref, lost

    def __getattr__(self, method: str) -> Callable[..., Any]:
        def call(*args: Any) -> _PendingCall:
            return _PendingCall(lambda timeout: self._client.sync(
                _actor_call, self._rpc(), self._ref.address, self._ref.key, method,
                args, timeout, self._lost))
        return call

    def _rpc(self) -> Any:
        # as distributed's Actor does: through the scheduler unless the client
        # talks to workers directly
        if self._client.direct_to_workers:
            return self._client.rpc(self._ref.address)
        from distributed.actor import ProxyRPC

        return ProxyRPC(self._client.scheduler, self._ref.address)


@dataclass
class _PendingCall:
    run: Callable[[float], Any]

    def result(self, timeout: float | None = None) -> Any:
        return self.run(config.get_seconds("step-timeout") if timeout is None else timeout)


async def _actor_call(
    rpc: Any, address: str, key: str, method: str, args: tuple[Any, ...], timeout: float,
    lost: Callable[[], bool] | None = None,
) -> Any:
    """``actor.method(*args)`` on ``address`` through ``rpc`` (from a worker or the
    client), awaited on its loop: gives up within a poll once that holder is
    declared lost (``_LOST_HOLDERS`` or ``lost()``: HolderLostError, also when its
    worker is unreachable) and after ``timeout`` (StepTimeoutError)."""
    from distributed.protocol import to_serialize

    request = asyncio.ensure_future(rpc.actor_execute(
        function=method, actor=key, args=[to_serialize(a) for a in args], kwargs={},
    ))
    poll = min(0.1, config.get_seconds("poll-interval"))
    deadline = time.monotonic() + timeout
    while True:
        done, _ = await asyncio.wait({request}, timeout=poll)
        if done:
            break
        gone = key in _LOST_HOLDERS or (lost is not None and lost())
        if gone or time.monotonic() > deadline:
            request.cancel()
            if gone:
                raise HolderLostError(f"the parameter holder on {address} was lost")
            raise StepTimeoutError(
                f"The parameter holder on {address} did not answer {method} within "
                f"{timeout:g}s (dasktf.step-timeout); check that worker's log."
            )
    try:
        response = request.result()
    except Exception as exc:
        # its worker is gone (connection refused or closed; through the scheduler's
        # proxy, whatever the proxy raises while the worker is reported lost)
        if isinstance(exc, OSError) or (lost is not None and lost()):
            raise HolderLostError(
                f"the parameter holder on {address} is unreachable: {exc}") from exc
        raise
    if response["status"] != "OK":
        raise response["exception"]
    return response["result"]


def abandon_holder_task(*keys: str) -> None:
    """Run on the survivors (``Client.run``) when a holder was lost: calls to the
    run's holders (all of them: a surviving one may itself wait on the lost one) stop
    waiting, so the threads blocked in them are free for the new holders."""
    _LOST_HOLDERS.update(keys)


def _replica_lock(replica: Replica) -> threading.Lock:
    """Tasks of one worker run one at a time even on a multi-threaded worker."""
    with _LOCK:
        lock = replica.__dict__.get("_async_lock")
        if lock is None:
            lock = replica.__dict__["_async_lock"] = threading.Lock()
        return lock  # type: ignore[no-any-return]


def async_step_task(
    run_id: str, holder: HolderRef, shard_pass: int, step: int, slot: int | None = None,
    *after: Any,
) -> StepResult:
    """One update of one worker: pull the newest weights, compute, push. ``slot``:
    a replica adopted from a lost worker (:func:`dasktf.elastic.adopt_async_task`);
    ``after``: the task building it, a dependency only."""
    begin = time.perf_counter()
    replica = get_replica(run_id, slot)
    timeout = config.get_seconds("step-timeout")
    with _replica_lock(replica):
        if replica.__dict__.get("_holder_key", holder.key) != holder.key:
            # a restored holder: its versions restart from its restore point, so
            # what this replica read from the lost one says nothing
            replica.holder_version = -1
            replica.__dict__.pop("_next_pull", None)
        replica.__dict__["_holder_key"] = holder.key
        # The previous push admitted this gradient and brought the weights back;
        # a worker's first task asks for them.
        pulled = replica.__dict__.pop("_next_pull", _FIRST)
        if pulled is _FIRST:
            pulled = holder.call("pull", replica.identity, replica.holder_version,
                                 timeout=timeout)
        if pulled is None:  # the run has stopped: stay stopped
            replica.__dict__["_next_pull"] = None
            return StepResult(replica.identity, shard_pass, step, None)
        token, version, flat = pulled
        if flat is not None:
            replica.set_flat_weights(decode_weights(flat))
        replica.holder_version = version
        start = time.perf_counter()
        grad = replica.gradient(shard_pass, step)
        grad.compute_seconds = time.perf_counter() - start
        straggle(replica, grad.compute_seconds)
        states = replica.take_metric_states()
        pushed = time.perf_counter()
        packed = encode_push(replica, grad)
        outcome, replica.__dict__["_next_pull"] = holder.call(
            "push", token, replica.identity, packed, version, shard_pass, step,
            timeout=timeout,
        )
    end = time.perf_counter()
    # Where an update's time goes: between tasks (the worker's own task hand-over),
    # in the task before and after the gradient, and in the push round trip.
    previous_end = replica.__dict__.get("_task_end", begin)
    timings = {
        "idle_s": max(0.0, begin - previous_end),
        "task_s": end - begin,
        "push_s": end - pushed,
    }
    replica.__dict__["_task_end"] = end
    # the record's "bytes": this update's push and the weights it started from,
    # as they travelled (counted at the codec)
    timings["bytes"] = wire_nbytes(packed) + wire_nbytes(flat)
    _emit(replica, outcome, shard_pass, step, grad, timings)
    return StepResult(replica.identity, shard_pass, step, outcome, states,
                      holder_nbytes(packed, flat), replica.non_trainable_values())


def flush_events(run_id: str, dask_worker: Any = None) -> None:
    """Send this worker's buffered step records now (run through ``Client.run``)."""
    from dasktf.replica import _REPLICAS

    for (run, _), replica in list(_REPLICAS.items()):
        if run == run_id:
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


# -- the client side ------------------------------------------------------------------
@dataclass
class _WorkerCursor:
    """Which batch a worker computes next, and how many of its tasks are queued."""

    steps: list[int]  # the non-empty local batches of one pass over its shard
    shard_pass: int = 0
    position: int = 0
    queued: int = 0
    completed_passes: int = 0
    done_in_pass: int = 0
    #: Items a lost worker had in flight and never finished: computed again first.
    retry: list[tuple[int, int]] = field(default_factory=list)
    #: False once its worker is lost (a successor cursor carries on).
    active: bool = True
    #: A joined worker's cursor: the index of the cursor whose batches it takes
    #: (and whose progress it advances; dasktf.async_elastic).
    feeds: int | None = None

    def restore(self, done: set[tuple[int, int]]) -> None:
        """Resume after the items ``done`` (a checkpoint's): the gaps first, then on
        from the pass after the furthest one reached."""
        last = max((p for p, _ in done), default=-1)
        self.retry = [(p, s) for p in range(last + 1) for s in self.steps
                      if (p, s) not in done]
        self.shard_pass, self.position = last + 1, 0
        # the running count, as _account keeps it: results over passes
        self.completed_passes, self.done_in_pass = divmod(len(done), len(self.steps))

    def take(self) -> tuple[int, int]:
        if self.retry:
            return self.retry.pop(0)
        item = (self.shard_pass, self.steps[self.position])
        self.position += 1
        if self.position == len(self.steps):
            self.shard_pass, self.position = self.shard_pass + 1, 0
        return item


class AsyncEngine:
    """Runs asynchronous epochs: workers loop freely, the holder applies on arrival.

    Parameters
    ----------
    ctx
        The run's workers and id.
    holder_worker
        Address of the worker that holds the :class:`ParameterHolder`.
    replica_config, weights, probe, val_shards
        What the holder builds its model from (futures of the initial weights, the
        holder worker's shard and the validation shards: they move worker to
        worker, never through the client).
    schedule
        The run's ``steps x workers`` local batch sizes; a worker cycles over the
        non-empty ones of its column.
    max_staleness
        ``K``: no applied update is more than ``K`` updates stale (None: unbounded).
    staleness_lr
        ``"inverse"``: the holder scales an update's learning rate by
        ``1 / max(1, staleness)``.
    epochs
        The run's epochs: the holder stops admitting gradients once they are done,
        so no update is applied past the last epoch (an early stop by a callback
        lets the gradients already admitted, at most one per worker, complete).
    """

    mode = "async"
    engine = "graph"

    def __init__(
        self,
        ctx: RunContext,
        holder_worker: str,
        replica_config: ReplicaConfig,
        weights: Any,
        probe: Any,
        val_shards: list[Any],
        schedule: np.ndarray,
        *,
        max_staleness: int | None = None,
        staleness_lr: str | None = None,
        quorum: int | None = None,
        epochs: int | None = None,
        holders: list[str] | None = None,
        plan: list[list[tuple[int, int]]] | None = None,
    ) -> None:
        self.ctx = ctx
        self.holder_worker = holder_worker
        self.ahead = max(1, int(config.get("async.submit-ahead")))
        # what rebuilding a lost worker's replica takes (dasktf.elastic.recover_async)
        self.replica_config, self.schedule = replica_config, schedule
        self.shard_index: dict[int, int] = {}
        self.shuffle = True
        self.reload: Callable[[int, str], tuple[Any, Any]] | None = None
        self.cursors = [
            _WorkerCursor([s for s in range(schedule.shape[0]) if schedule[s, i] > 0])
            for i in range(len(ctx.workers))
        ]
        self.updates: list[UpdateRecord] = []
        self.dropped: dict[int, int] = {i: 0 for i in range(len(ctx.workers))}
        self.applied = 0  # updates the client has seen applied
        self._epoch_records: list[UpdateRecord] = []
        self._epoch_dropped = 0
        self._epoch_states: list[np.ndarray] | None = None
        #: each worker's latest moving statistics (StepResult.non_trainable)
        self._non_trainable: dict[int, list[np.ndarray]] = {}
        self._ac = as_completed(loop=ctx.client.loop)
        self._outstanding: set[Future] = set()
        #: Fault tolerance (:meth:`_recover`): each cursor's worker address and
        #: replica slot, the item every outstanding task computes, lost futures.
        self.addresses: dict[int, str] = dict(enumerate(ctx.workers))
        self.slots: dict[int, int | None] = {}
        #: The task building a successor's or helper's replica: its step tasks
        #: depend on it, so the client never blocks on it. (A worker thread may wait
        #: in the holder for the others' gradients, quorum or bounded staleness;
        #: a client waiting for a replica queued behind it would stop feeding them.)
        self.building: dict[int, tuple[Future]] = {}
        self._items: dict[str, tuple[int, int, int, Future]] = {}
        self._dead: set[str] = set()
        self.losses: list[dict[str, Any]] = []
        self.policy = "raise"  # the trainer's RunGuard.attach_async makes it "recover"
        self.publish: Callable[[dict[str, Any]], None] = lambda record: None
        self.announce: Callable[[str], None] = lambda line: logger.warning("%s", line)
        self._stopped = False
        self._started = False
        #: Elastic growth (dasktf.async_elastic.grow_async; the trainer's RunGuard
        #: sets it): called between results, takes in the workers that joined.
        self.grow: Callable[[AsyncEngine], None] | None = None
        self.grow_since = time.time()
        self._epoch = 0
        self.discarded = 0
        self.final_weights: list[np.ndarray] | None = None
        #: Gradient tasks that computed (and pushed) a gradient, and those that
        #: found the run stopped: ``computed == applied contributions + dropped +
        #: discarded`` (checked by the tests).
        self.tasks = {"computed": 0, "stopped": 0}
        self.epochs = epochs
        self._holder_args = (replica_config, max_staleness, staleness_lr, quorum)
        #: The last learning rate the client set: a holder rebuilt from an older cut
        #: takes it again (dasktf.async_recovery).
        self.learning_rate: float | None = None
        #: Holders built so far (a lost holder is rebuilt on a survivor:
        #: dasktf.async_recovery), and the newest state to rebuild it from: a
        #: snapshot taken at the start, at every epoch end and with every checkpoint.
        self.generation = 0
        self.restore_point: dict[str, Any] | None = None
        #: Applied updates undone by a holder restore (they went with the holder).
        self.undone = 0
        self._dropped_base: dict[int, int] = {}
        #: (probe, validation shards) for a new holder on a worker (the RunGuard's).
        self.holder_inputs: Callable[[str], tuple[Any, list[Any]]] | None = None
        #: num_ps=K: the flat-buffer ranges of each holder's slice (dasktf.async_ps)
        self.plan = plan or []
        #: num_ps=K: the client's handle on the K holders (dasktf.async_ps)
        self.sharded: Any = None
        self._epoch_bytes: list[list[int]] = []
        self.start_holder(holders or [holder_worker], weights, probe, val_shards)

    def start_holder(
        self, workers: list[str], weights: Any, probe: Any, val_shards: list[Any]
    ) -> None:
        """Build the run's holders: a :class:`ParameterHolder` on ``workers[0]``, or
        with ``num_ps=K`` holder ``s`` on ``workers[s]`` (dasktf.async_ps)."""
        cfg, max_staleness, staleness_lr, quorum = self._holder_args
        args = (cfg, weights, probe, val_shards, max_staleness, staleness_lr, quorum,
                config.get_seconds("step-timeout"), *self._budget(self.epochs))
        # a rebuilt holder's actor must not be mistaken for the lost one's
        key = f"dasktf-holder-{self.ctx.run_id}" + (
            f"-{self.generation}" if self.generation else "")
        if len(self.plan) > 1:
            from dasktf.async_ps import ShardedHolders

            self.sharded = ShardedHolders(self, workers, self.plan, args, key)
            holder, ref = self.sharded.coordinator, self.sharded.ref
        else:
            holder = self.ctx.client.submit(
                ParameterHolder, *args, key=key,
                # The holder's state lives on this worker for the whole run.
                workers=workers[:1], allow_other_workers=False, actor=True,
            )
            wait_for(self.ctx, [holder],
                     f"building the parameter holder on {workers[0]}")
            ref = HolderRef(workers[0], holder.key)
        self.generation += 1
        self.holder_worker, self.holder_workers = workers[0], list(workers)
        self._holder_future, self.holder_ref = holder, ref
        # any holder's loss: the coordinator may be waiting on a lost slice's
        self.holder: Any = ClientHolder(
            self.ctx.client, ref, lambda: not set(workers).isdisjoint(self._lost_now()))

    def release_holders(self) -> None:
        """Let go of the holders' actors (never waits: their workers may be gone)."""
        self._holder_future.release()
        if self.sharded is not None:
            self.sharded.close()

    def set_learning_rate(self, lr: float) -> None:
        """The holders apply the next updates with ``lr`` (gradients in flight too:
        the learning rate is the holder's, read when it applies)."""
        self.learning_rate = lr
        try:
            self.holder.set_learning_rate(lr).result(
                timeout=config.get_seconds("step-timeout"))
        except HolderLostError:  # the rebuilt holder takes it (restore_holder)
            pass

    def known_through(self) -> int:
        """The last update ``u`` such that the client has the records of 1..u."""
        known = {r.update for r in self.updates} | {r.update for r in self._epoch_records}
        last = 0
        while last + 1 in known:
            last += 1
        return last

    def take_restore_point(self, snapshot: dict[str, Any] | None = None,
                           source: str = "the last epoch end") -> None:
        """Keep the holder's state (or ``snapshot`` of it) to rebuild it from."""
        if snapshot is None:
            if self.policy != "recover":
                return
            snapshot = self.holder.snapshot(self.known_through()).result(
                timeout=config.get_seconds("step-timeout"))
        if self.restore_point is None or snapshot["version"] >= self.restore_point["version"]:
            self.restore_point = {**snapshot, "source": source}

    def _budget(self, epochs: int | None) -> tuple[dict[int, int] | None, int | None]:
        """The holder stops by itself after the last epoch's updates (not one more)."""
        if epochs is None:
            return None, None
        return {i: len(c.steps) * epochs for i, c in enumerate(self.cursors)
                if c.active and c.feeds is None}, epochs

    # -- submission ---------------------------------------------------------------
    def _submit(self, i: int) -> None:
        cursor = self.cursors[i]
        source = cursor if cursor.feeds is None else self.cursors[cursor.feeds]
        while cursor.queued < self.ahead and cursor.steps:
            # a helper's own retries (of a lost helper) first, then its owner's batches
            shard_pass, step = cursor.take() if cursor.retry else source.take()
            future = self.ctx.client.submit(
                async_step_task, self.ctx.run_id, self.holder_ref, shard_pass, step,
                self.slots.get(i), *self.building.get(i, ()),
                # a restored holder recomputes items: a key of its own generation
                key=f"dasktf-async-step-{self.ctx.run_id}-{i}-{shard_pass}-{step}"
                    f"-g{self.generation}",
                # The replica and its shard live on this worker alone.
                workers=[self.addresses[i]], allow_other_workers=False,
                pure=False, resources=self.ctx.resources,
            )
            self._items[future.key] = (i, shard_pass, step, future)
            cursor.queued += 1
            self._outstanding.add(future)
            self._ac.add(future)

    def _next_results(self, what: str) -> list[StepResult]:
        """Completed tasks' results; waits bounded, checking the workers' liveness."""
        poll = config.get_seconds("poll-interval")
        deadline = time.monotonic() + config.get_seconds("step-timeout")
        while not self._ac.has_ready():
            if not self._outstanding:
                raise DasktfError(f"{what}: no update in flight; this is a dasktf bug.")
            # as_completed notifies this condition after queueing a finished future;
            # checking under it loses no wake-up. (distributed.wait would run on the
            # default client's loop, which need not be this run's client.)
            with self._ac.thread_condition:
                if not self._ac.has_ready():
                    self._ac.thread_condition.wait(timeout=poll)
            if not self._ac.has_ready():
                if self._recover_lost(what):
                    continue
                if time.monotonic() > deadline:
                    raise StepTimeoutError(
                        f"No update of {what} finished within dasktf.step-timeout; "
                        f"workers {self.ctx.workers} were alive. Check their logs."
                    ) from None
        done = [f for f in self._ac.next_batch(block=False) if f.key not in self._dead]
        # A finished task's result may have died with its worker: gathering it would
        # wait forever. Recover first; the holder says which of them were applied.
        if self._lost_now() or any(f.status != "finished" for f in done):
            self._recover_lost(what)
            done = [f for f in done if f.key not in self._dead]
        if any(f.status == "error" for f in done) and self._await_holder_loss(done, what):
            done = [f for f in done if f.key not in self._dead]
        for f in done:
            self._outstanding.discard(f)
            if f.status == "error":
                raise_task_error(f, what)
        return self._gather(done, what)

    def _await_holder_loss(self, done: list[Future], what: str) -> bool:
        """A task that found the holder unreachable may report it before the
        scheduler reports its worker removed: wait (bounded) for that, and recover.
        ``False`` if no task failed that way."""
        if not any(f.status == "error" and isinstance(f.exception(), HolderLostError)
                   for f in done):
            return False
        self._wait_and_recover(what)
        return True

    def _wait_and_recover(self, what: str) -> None:
        """The holder could not be reached: wait (bounded) for the scheduler to
        report its worker gone, and recover (dasktf.async_recovery)."""
        poll = config.get_seconds("poll-interval")
        deadline = time.monotonic() + config.get_seconds("worker-loss-timeout")
        while not self._recover_lost(what):
            if time.monotonic() > deadline:
                raise HolderLostError(
                    f"During {what} the workers could not reach the parameter holder on "
                    f"{self.holder_worker}, yet the scheduler still lists that worker "
                    "(dasktf.worker-loss-timeout). Check its log and the network "
                    "between the workers."
                )
            time.sleep(poll / 5)

    def _gather(self, done: list[Future], what: str) -> list[StepResult]:
        """Gather finished tasks' results, never waiting on one that died with its
        worker (the scheduler cannot recompute a task pinned to a lost worker)."""
        client = self.ctx.client
        poll = config.get_seconds("poll-interval")
        deadline = time.monotonic() + config.get_seconds("step-timeout")
        # One gather on the client's loop, awaited a poll at a time. Not a new gather
        # each poll (sync() with a callback_timeout): that leaves the old one running
        # on the loop, so on a loaded machine, once one gather outlasts a poll, every
        # retry starts over behind the abandoned ones and none ever finishes.
        pending: concurrent.futures.Future[Any] | None = None
        try:
            while True:
                if pending is None:
                    pending = asyncio.run_coroutine_threadsafe(
                        client._gather(done), client.loop.asyncio_loop)
                try:
                    results = pending.result(timeout=poll)
                except concurrent.futures.TimeoutError:
                    if self._recover_lost(what):
                        pending.cancel()  # it may wait on a result that died
                        pending = None
                        done = [f for f in done if f.key not in self._dead]
                    elif time.monotonic() > deadline:
                        raise StepTimeoutError(
                            f"Fetching the results of {what} took longer than "
                            "dasktf.step-timeout; check the workers' logs."
                        ) from None
                    continue
                for f in done:
                    self._items.pop(f.key, None)
                return results  # type: ignore[no-any-return]
        finally:
            if pending is not None and not pending.done():
                pending.cancel()

    def _lost_now(self) -> list[str]:
        """Active workers the scheduler has reported removed (no round trip)."""
        watcher = self.ctx.watcher
        if watcher is None:
            return []
        active = [a for i, a in self.addresses.items() if self.cursors[i].active]
        return sorted({c.worker for c in watcher.removed(active)})

    def _recover_lost(self, what: str) -> bool:
        """Recover from the loss of any worker of the run; ``False`` if none was
        lost. Raises :class:`WorkerLostError` under ``on_worker_loss="raise"``."""
        from dasktf.elastic import recover_async

        workers = sorted({a for i, a in self.addresses.items() if self.cursors[i].active})
        lost = self._lost_now()
        if not lost:
            self.ctx.workers = workers
            check_alive(self.ctx, what)
            return False
        if self.policy == "raise":
            self.ctx.workers = workers
            check_alive(self.ctx, what)
        recover_async(self, lost)  # raises, naming the last checkpoint, if the holder went
        return True

    # -- the loop -----------------------------------------------------------------
    def run_epoch(
        self, epoch: int, on_step: Callable[[int], None] | None = None
    ) -> list[EpochReport]:
        """Train until every shard has been consumed once more; evaluate."""
        if not self._started:  # epoch 0, or the first epoch of a resumed run
            self._started = True
            self.take_restore_point(source="the start of the run")
            for i in range(len(self.cursors)):
                self._submit(i)
        self._epoch = epoch
        what = f"epoch {epoch + 1}"
        while not self._epoch_done(epoch):
            for result in self._next_results(what):
                self._account(result, epoch, on_step)
                self.cursors[result.worker].queued -= 1
                if not self._stopped and result.outcome is not None:
                    self._submit(result.worker)
            if self.grow is not None:
                self.grow(self)
            if self._epoch_done(epoch):
                try:
                    return [self._end_epoch(epoch)]
                except HolderLostError:  # rebuilt from its restore point: go on
                    self._wait_and_recover(what)
        return [self._end_epoch(epoch)]

    def _epoch_done(self, epoch: int) -> bool:
        return min(c.completed_passes for c in self.cursors
                   if c.active and c.feeds is None) > epoch

    def _account(
        self, result: StepResult, epoch: int, on_step: Callable[[int], None] | None
    ) -> None:
        if result.outcome is None:
            self.tasks["stopped"] += 1
            return
        self.tasks["computed"] += 1
        if result.non_trainable is not None:  # a dropped gradient's batch counts too
            self._non_trainable[result.worker] = result.non_trainable
        if result.nbytes:  # not a result recovery made up for a lost worker
            self._epoch_bytes.append(result.nbytes)
        cursor = self.cursors[result.worker]
        if cursor.feeds is not None:  # a helper advances the shard it helps
            cursor = self.cursors[cursor.feeds]
        cursor.done_in_pass += 1
        if cursor.done_in_pass == len(cursor.steps):
            cursor.completed_passes, cursor.done_in_pass = cursor.completed_passes + 1, 0
        if result.outcome.status == "dropped":
            self.dropped[result.worker] += 1
            self._epoch_dropped += 1
            return
        if result.metric_states is not None and result.outcome.status != "dropped":
            self._add_states(result.metric_states)
        for record in result.outcome.records:
            record.epoch = epoch
            self._epoch_records.append(record)
        if result.outcome.status == "applied":
            self.applied += 1
            if on_step is not None:
                on_step(self.applied - 1)

    def _add_states(self, states: list[np.ndarray]) -> None:
        if self._epoch_states is None:
            self._epoch_states = [np.array(s, copy=True) for s in states]
        else:
            for total, s in zip(self._epoch_states, states, strict=False):
                total += s

    def send_non_trainable(self) -> None:
        """Give the holder the mean of the workers' latest moving statistics, before
        it evaluates, hands out its weights or is snapshotted (models without
        such state: nothing to send, no call)."""
        active = [v for i, v in self._non_trainable.items() if self.cursors[i].active]
        values = active or list(self._non_trainable.values())
        if values:
            self.holder.set_non_trainable(mean_non_trainable(values)).result(
                timeout=config.get_seconds("step-timeout"))

    def _end_epoch(self, epoch: int) -> EpochReport:
        timeout = config.get_seconds("step-timeout")
        self.send_non_trainable()
        _, val_states, weights = self.holder.evaluate().result(timeout=timeout)
        self.take_restore_point()
        train = self._epoch_states or []
        self._epoch_states = None
        return EpochReport(self.holder_worker, train, val_states, weights)

    def epoch_logs(self, seconds: float) -> dict[str, float]:
        """Per-epoch summaries for ``history.history`` (and the epoch line)."""
        records, self._epoch_records = self._epoch_records, []
        self.updates.extend(records)
        staleness = [r.staleness for r in records]
        examples = sum(r.batch_size for r in records)
        logs = {
            "updates": float(len({r.update for r in records})),
            "staleness_mean": float(np.mean(staleness)) if staleness else 0.0,
            "staleness_max": float(max(staleness, default=0)),
            "examples_per_sec": examples / seconds if seconds > 0 else 0.0,
        }
        if self.mode == "quorum":
            logs["dropped"] = float(self._epoch_dropped)
        self._epoch_dropped = 0
        if self.plan:  # bytes per update, counted at the codec (dasktf.async_ps)
            from dasktf.async_ps import byte_logs

            logs.update(byte_logs(self.plan, self._epoch_bytes))
        self._epoch_bytes = []
        return logs

    def finish(self) -> None:
        """Stop the workers' loops, drain the queued tasks, check the accounting."""
        if self._stopped:
            return
        self._stopped = True
        timeout = config.get_seconds("step-timeout")
        self.holder.stop().result(timeout=timeout)
        while self._outstanding:
            for result in self._next_results("the end of training"):
                self._account(result, self._epoch, None)
                self.cursors[result.worker].queued -= 1
        counters = self.holder.counters().result(timeout=timeout)
        late = self._epoch_records
        self._epoch_records = []
        self.updates.extend(late)
        self.updates.sort(key=lambda r: (r.update, r.worker))
        # A lost worker's last pushes may have been dropped after it died: the
        # holder's count is the only one.
        for i, cursor in enumerate(self.cursors):
            if not cursor.active:
                self.dropped[i] = self._dropped_base.get(i, 0) + counters["dropped"].get(i, 0)
        # drops counted by this holder (a restored holder starts from zero)
        dropped = {i: n - self._dropped_base.get(i, 0) for i, n in self.dropped.items()}
        if counters["version"] != self.applied or dropped != {
            **{i: 0 for i in self.dropped}, **counters["dropped"]
        }:
            raise DasktfError(
                f"Update accounting mismatch: the holder applied {counters['version']} "
                f"updates and dropped {counters['dropped']}, the client saw "
                f"{self.applied} and {self.dropped}. This is a dasktf bug."
            )
        self.discarded = int(counters["discarded"])
        self.send_non_trainable()
        self.final_weights = self.holder.weights().result(timeout=timeout)
        self.ctx.client.run(flush_events, self.ctx.run_id, workers=sorted(
            {a for i, a in self.addresses.items() if self.cursors[i].active}))

    def close(self) -> None:
        try:
            if not self._stopped:
                self.holder.stop().result(timeout=config.get_seconds("poll-interval") * 4)
            self.holder.close().result(timeout=config.get_seconds("poll-interval") * 4)
        except Exception:
            logger.debug("closing the holder of %s failed", self.ctx.run_id, exc_info=True)
        for f in list(self._outstanding):
            f.cancel()
        self._outstanding.clear()
        self.release_holders()


def updates_frame(records: list[UpdateRecord]) -> Any:
    """``records`` as a pandas DataFrame (one row per applied update)."""
    import dataclasses

    import pandas as pd

    columns = [f.name for f in dataclasses.fields(UpdateRecord)]
    return pd.DataFrame([dataclasses.astuple(r) for r in records], columns=columns)


# -- argument validation (the public boundary calls these) ---------------------------
def validate_mode_options(
    mode: str,
    max_staleness: Any,
    staleness_lr: Any,
    sync_quorum: Any,
    slow_workers: Any,
    n_workers: int | None = None,
) -> dict[int, float]:
    """Check the async/quorum/straggler options; return ``slow_workers`` as a dict.

    ``n_workers`` (when known) bounds ``sync_quorum`` and the slowed indices.
    """
    def _int(name: str, value: Any, low: int) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}; got {value!r}.")

    if max_staleness is not None:
        _int("max_staleness", max_staleness, 0)
        if mode != "async":
            raise ValueError(
                f"max_staleness bounds the staleness of mode='async'; got mode={mode!r}."
            )
    if staleness_lr not in STALENESS_LR:
        raise ValueError(f"staleness_lr must be None or 'inverse'; got {staleness_lr!r}.")
    if staleness_lr is not None and mode != "async":
        raise ValueError(f"staleness_lr applies to mode='async'; got mode={mode!r}.")
    if sync_quorum is not None:
        _int("sync_quorum", sync_quorum, 1)
        if mode != "sync":
            raise ValueError(
                f"sync_quorum makes sync steps use the first k of N gradients; it needs "
                f"mode='sync', got mode={mode!r}."
            )
        if n_workers is not None and sync_quorum > n_workers:
            raise ValueError(
                f"sync_quorum={sync_quorum} exceeds the {n_workers} worker(s) of the run; "
                f"a step can wait for at most all of them (use 1..{n_workers})."
            )
    slow: dict[int, float] = {}
    if slow_workers:
        if not isinstance(slow_workers, dict):
            raise TypeError(
                "slow_workers must be a dict {worker index: slow-down factor}, e.g. "
                f"{{0: 4}}; got {type(slow_workers).__name__}."
            )
        for index, factor in slow_workers.items():
            _int("a slow_workers index", index, 0)
            if n_workers is not None and index >= n_workers:
                raise ValueError(
                    f"slow_workers index {index} is out of range for {n_workers} "
                    f"worker(s); use 0..{n_workers - 1}."
                )
            if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor >= 1:
                raise ValueError(
                    f"slow_workers[{index}] must be a factor >= 1 (4 makes that worker "
                    f"take 4x its compute time); got {factor!r}."
                )
            slow[int(index)] = float(factor)
    return slow


def spread_holders(order: list[str], num_ps: int) -> list[str]:
    """Holder ``s`` on ``order[s]``; round the list again (two holders on one worker)
    only when it has fewer workers than holders."""
    return [order[s % len(order)] for s in range(num_ps)]


def choose_holder(workers: list[str], slow_workers: dict[int, float]) -> int:
    """The holder's worker index: the first worker that is not slowed down (the
    applies run in the holder's own thread, but a slowed process would still blur
    what a straggler costs)."""
    for i in range(len(workers)):
        if slow_workers.get(i, 1.0) <= 1.0:
            return i
    return 0
