"""The parameter holder: a Dask actor that applies each worker's gradient as it
arrives, gated by the staleness bound, and records the staleness it saw.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from dasktf.data.shards import Shard
from dasktf.engines.holder.records import PushOutcome, UpdateRecord
from dasktf.exceptions import StepTimeoutError
from dasktf.runtime.replica import (
    Replica,
    ReplicaConfig,
)
from dasktf.wire.messages import GradientSum, sum_gradients
from dasktf.wire.packets import (
    as_gradient_sum,
    encode_weights,
)

#: The holder builds its model as a replica with this index (it only offsets the seed).
HOLDER_INDEX = 10_000


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
    it reuses :class:`~dasktf.runtime.replica.Replica` for the model, the optimizer, the
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
        val = Shard.concat(val_parts) if val_parts else None
        shard = probe.take(slice(0, 1))
        self.replica = Replica(config_, HOLDER_INDEX, shard, np.ones((1,), int), weights, val, False)
        optimizer = self.replica.model.optimizer
        self._base_lr = float(optimizer.learning_rate.numpy())
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
        #: A joined worker helping a shard (dasktf.engines.holder.recovery): identity -> owner.
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
        grad = as_gradient_sum(grad)  # decode a compressed push (dasktf.wire.packets)
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
        self._base_lr = float(model.optimizer.learning_rate.numpy())
        self.flat = self.replica.flat_weights()

    async def restore(
        self, weights: list[np.ndarray], optimizer: list[np.ndarray], version: int,
        done: dict[int, list[tuple[int, int]]],
    ) -> None:
        """Load a checkpoint (:func:`dasktf.engines.holder.state.resumable`) before the first pull:
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
