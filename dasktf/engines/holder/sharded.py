"""Async training over ``num_ps=K > 1`` parameter holders (issue 8).

The parameters are split by the sync servers' plan (:func:`dasktf.wire.packets.shard_plan`:
size balanced, large variables cut along their first axis). Holder ``s`` is a Dask
actor that keeps the float32 master copy of slice ``s`` and the optimizer state for
it (:class:`~dasktf.runtime.servers.PSShard`: exact for element-wise optimizers); the holders sit
on different workers where the run has enough that are not slowed down. Per update::

    worker ── offer slice s ──► holder s (s >= 1, concurrently; stored, not applied)
           ── push slice 0  ──► coordinator (holder 0): gate, version V, ledger
                                  ├─ apply (worker, pass, step) as V ──► holders s >= 1
                                  └─ apply slice 0; V → V+1; admit the next gradient
           ◄─ slice 0 of V' ──  (the answer to the push)
           ── read slices at V' ──► holders s >= 1 (concurrently)

Why one coordinator. Staleness, the admission gate (``max_staleness``), the budget,
the applied ``(worker, pass, step)`` ledger and the records are counted in versions,
and a version is only meaningful if every slice has seen the same updates in the
same order. So holder 0 is the one place where updates are ordered and counted,
exactly as with one holder (:class:`~dasktf.engines.holder.actor.ParameterHolder`, which it
extends); the others only apply what it orders, in its order, and it answers a push
only after all of them have applied it. Every holder is therefore at version V+1
when version V+1 becomes readable, and ``staleness = V - version read`` keeps its
meaning for the whole model.

Why offer first, then push. A holder applies a slice only when the coordinator
orders it, and the coordinator only orders what was pushed to it, after the worker
offered every other slice. So a worker lost between its messages leaves at most
offers nobody applies, never a half-applied update or a holder waiting for a slice
that will not come. The price is one more round trip per update (the offers run
concurrently, so one whatever K).

Why the holders keep old slices. A worker admitted at version v reads the slices
after its admission, while other updates may be applied; so each holder keeps the
slice of every version still read by a gradient in flight (the coordinator sends
the oldest one with each order) and a read is always of exactly version v: the
weights a gradient is computed on are one version's, never a mix.

Evaluation, final weights, checkpoints and resume gather or scatter the slices
through the coordinator, between two applies. A checkpoint's optimizer state is the
K slices' in order, so it resumes with the same ``num_ps``.

Loss: if the worker of any holder is lost, its slice of the master weights went
with it, and the others are at versions nobody can finish. All K holders are
rebuilt on the survivors from the engine's restore point, as the single holder is
(:mod:`dasktf.engines.holder.recovery`): the coordinator's snapshot is a cut of all K slices
taken between two applies, and its ``restore`` loads every slice. The surviving
old holders are let go; the new ones have actor keys of their own, so a call still
addressed to an old one gives up instead of reaching a new one.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from dasktf import config
from dasktf.data.shards import Shard
from dasktf.engines.holder.actor import HOLDER_INDEX, ParameterHolder
from dasktf.engines.holder.options import choose_holder
from dasktf.engines.holder.records import PushOutcome
from dasktf.engines.holder.rpc import HolderRef, actor_call
from dasktf.exceptions import DasktfError, StepTimeoutError
from dasktf.runtime.servers import PSShard, server_workers
from dasktf.wire.packets import (
    Ranges,
    Slices,
    as_gradient_sum,
    encode_weights,
    gather_ranges,
    scatter_ranges,
    shard_plan,
    wire_nbytes,
)

if TYPE_CHECKING:
    from distributed import Future

    from dasktf.cluster.waits import RunContext
    from dasktf.runtime.replica import ReplicaConfig
    from dasktf.wire.messages import GradientSum

Item = tuple[int, int, int]  # (worker identity, pass, step): one update's key


def plan_holders(
    workers: list[str],
    slow_workers: dict[int, float],
    shapes: list[tuple[int, ...]],
    num_ps: int,
) -> tuple[list[str], list[Ranges]]:
    """The worker of each holder and the flat-buffer ranges of each slice.

    The coordinator goes where :func:`~dasktf.engines.holder.options.choose_holder` puts the
    single holder; the others on the next workers that are not slowed down (two
    holders share a worker only when there are fewer such workers than holders).

    Raises
    ------
    ValueError
        More holders than the parameters can be cut into.
    """
    size = int(sum(int(np.prod(s)) if len(s) else 1 for s in shapes))
    if num_ps <= 1:
        return [workers[choose_holder(workers, slow_workers)]], [[(0, size)]]
    plan = shard_plan(shapes, num_ps)
    first = choose_holder(workers, slow_workers)
    order = [(first + j) % len(workers) for j in range(len(workers))]
    fast = [i for i in order if slow_workers.get(i, 1.0) <= 1.0] or order
    return server_workers([workers[i] for i in fast], num_ps), plan


class SliceHolder:
    """Holder ``s >= 1`` of a ``num_ps=K`` async run (an actor): the float32 master
    slice and its optimizer state; applies what the coordinator orders, in order."""

    def __init__(
        self,
        config_: ReplicaConfig,
        weights: list[np.ndarray],
        probe: Shard,
        ranges: Ranges,
        index: int,
        timeout: float,
    ) -> None:
        from dasktf.runtime.replica import Replica

        replica = Replica(config_, HOLDER_INDEX + index, probe.take(slice(0, 1)),
                          np.ones((1,), int), weights, None, False)
        self.shard = PSShard(replica, ranges)
        self.index = index
        self.timeout = timeout
        self.flat = np.asarray(self.shard.variable.numpy(), np.float32)
        self.version = 0
        #: slices of versions some gradient in flight still has to read
        self.kept: dict[int, np.ndarray] = {}
        self.offers: dict[Item, GradientSum] = {}
        self.received = 0
        self.sent = 0
        self._weights_dtype = getattr(config_.comm, "weights_dtype", None)
        self._cond: asyncio.Condition | None = None

    def _condition(self) -> asyncio.Condition:
        if self._cond is None:
            self._cond = asyncio.Condition()
        return self._cond

    async def offer(self, item: Item, grad: Any) -> None:
        """A worker's slice of its gradient; applied once the coordinator orders it."""
        self.received += wire_nbytes(grad)
        cond = self._condition()
        async with cond:
            self.offers[tuple(item)] = as_gradient_sum(grad)  # type: ignore[index]
            cond.notify_all()

    async def apply(self, item: Item, version: int, scale: float, oldest: int) -> int:
        """Apply ``item``'s slice as update ``version -> version + 1``; keep the
        slices of versions ``>= oldest`` that are still to be read."""
        item = tuple(item)  # type: ignore[assignment]
        if version != self.version:
            raise DasktfError(
                f"holder {self.index} is at version {self.version}, ordered to apply "
                f"update {version + 1}; this is a dasktf bug."
            )
        cond = self._condition()
        async with cond:
            try:
                await asyncio.wait_for(
                    cond.wait_for(lambda: item in self.offers), self.timeout
                )
            except TimeoutError:
                raise StepTimeoutError(
                    f"holder {self.index} never received worker {item[0]}'s slice of "
                    f"pass {item[1]} step {item[2]} within {self.timeout:g}s."
                ) from None
            grad = self.offers.pop(item)
        self.kept = {v: w for v, w in self.kept.items() if v >= oldest}
        self.kept[self.version] = self.flat
        if grad.total is not None and grad.count:
            self.flat = self.shard.apply(grad.total, grad.count, scale)
        self.version += 1
        return self.version

    async def read(self, version: int) -> Any:
        """The slice at exactly ``version`` (as it travels: fp16/bf16 if asked)."""
        flat = self.flat if version == self.version else self.kept.get(version)
        if flat is None:
            raise DasktfError(
                f"holder {self.index} (at version {self.version}) no longer keeps the "
                f"slice of version {version}; this is a dasktf bug."
            )
        out = encode_weights(flat, self._weights_dtype)
        self.sent += wire_nbytes(out)
        return out

    async def current(self) -> tuple[np.ndarray, list[np.ndarray]]:
        """The float32 slice and its optimizer state (evaluation, checkpoints)."""
        return self.flat, self.shard.state()

    async def load(
        self, values: np.ndarray, optimizer: list[np.ndarray], version: int
    ) -> None:
        self.flat = self.shard.load(values, optimizer)
        self.version = int(version)
        self.kept.clear()

    async def set_learning_rate(self, lr: float) -> None:
        self.shard.optimizer.learning_rate = lr  # on the loop: between two applies

    async def forget(self, items: list[Item]) -> None:
        """Drop offers that will never be applied (a lost worker's)."""
        for item in items:
            self.offers.pop(tuple(item), None)  # type: ignore[arg-type]

    async def traffic(self) -> dict[str, int]:
        return {"received": self.received, "sent": self.sent}

    def close(self) -> None:
        pass


class CoordinatingHolder(ParameterHolder):
    """Holder 0 of a ``num_ps=K`` async run: slice 0, and everything the single
    holder counts (gate, versions, ledger, budget, records); orders the other
    holders' applies. See the module docstring."""

    def __init__(
        self,
        *args: Any,
        plan: list[Ranges],
        peers: list[tuple[str, str]],
        **kwargs: Any,
    ) -> None:
        from distributed import get_worker

        super().__init__(*args, **kwargs)
        self._worker = get_worker()  # the actor's methods run on its loop
        self.plan = plan
        self.peers = peers
        self.size = int(sum(b - a for r in plan for a, b in r))
        self.shard = PSShard(self.replica, plan[0])
        self.flat = np.asarray(self.shard.variable.numpy(), np.float32)
        self.received = 0
        self.sent = 0

    async def _peer(self, s: int, method: str, *args: Any) -> Any:
        address, key = self.peers[s]
        return await actor_call(self._worker.rpc(address), address, key, method, args,
                                 self.timeout)

    async def _all(self, method: str, *args: Any) -> list[Any]:
        return list(
            await asyncio.gather(
                *(self._peer(s, method, *args) for s in range(len(self.peers)))
            )
        )

    # -- the per-update path ------------------------------------------------------
    async def pull(self, worker: int, have: int) -> tuple[int, int, Any] | None:
        pulled = await super().pull(worker, have)
        if pulled is not None:
            self.sent += wire_nbytes(pulled[2])
        return pulled

    async def push(self, token: int, worker: int, grad: Any, *args: Any) -> Any:
        self.received += wire_nbytes(grad)
        return await super().push(token, worker, grad, *args)

    async def _apply_now(
        self,
        worker: int,
        grad: GradientSum,
        version_read: int,
        shard_pass: int,
        step: int,
    ) -> PushOutcome:
        scale = (
            1.0 / max(1, self.version - version_read)
            if self.staleness_lr == "inverse"
            else 1.0
        )
        # the versions gradients in flight still read (this one's included)
        oldest = min(self.gate.in_flight.values(), default=self.version)
        await self._all(
            "apply", (worker, shard_pass, step), self.version, scale, oldest
        )
        return await super()._apply_now(worker, grad, version_read, shard_pass, step)

    def _apply(self, grad: GradientSum, scale: float) -> None:  # slice 0
        if grad.total is not None and grad.count:
            self.flat = self.shard.apply(grad.total, grad.count, scale)

    async def release_worker(
        self, worker: int, successor: int, items: list[Any]
    ) -> Any:
        applied = await super().release_worker(worker, successor, items)
        await self._all("forget", [(worker, p, s) for p, s in items])
        return applied

    # -- the whole model (between two applies) ------------------------------------
    async def _full(self) -> tuple[np.ndarray, list[list[np.ndarray]]]:
        """The full flat weights and every slice's optimizer state (under the lock)."""
        parts = await self._all("current")
        full = np.empty(self.size, np.float32)
        scatter_ranges(full, self.plan[0], self.flat)
        for ranges, (values, _) in zip(self.plan[1:], parts, strict=True):
            scatter_ranges(full, ranges, values)
        return full, [self.shard.state()] + [opt for _, opt in parts]

    async def _with_model(self, fn: Any) -> Any:
        """``fn()`` in the holder thread once the model holds the current weights."""
        _, lock = self._sync_objects()
        async with lock:
            full, optimizers = await self._full()

            def run() -> Any:
                self.replica.set_flat_weights(full)
                return fn(optimizers)

            return await self._run(run)

    async def evaluate(self) -> Any:
        return await self._with_model(lambda _: self._evaluate())

    async def weights(self) -> list[np.ndarray]:
        return await self._with_model(  # type: ignore[no-any-return]
            lambda _: [np.asarray(w) for w in self.replica.model.get_weights()]
        )

    def _set_learning_rate(self, lr: float) -> None:
        super()._set_learning_rate(lr)
        self.shard.optimizer.learning_rate = lr  # slice 0's optimizer applies

    async def set_learning_rate(self, lr: float) -> None:
        await self._all("set_learning_rate", lr)
        await super().set_learning_rate(lr)

    async def snapshot(self, since: int = 0) -> dict[str, Any]:
        def snap(optimizers: list[list[np.ndarray]]) -> dict[str, Any]:
            out = self._snapshot(since)
            out["optimizer"] = [v for opt in optimizers for v in opt]
            return out

        return await self._with_model(snap)  # type: ignore[no-any-return]

    async def restore(
        self,
        weights: list[np.ndarray],
        optimizer: list[np.ndarray],
        version: int,
        done: dict[int, list[tuple[int, int]]],
    ) -> None:
        n = len(self.shard.state())
        k = len(self.plan)
        if len(optimizer) != n * k:
            raise ValueError(
                f"The checkpoint holds {len(optimizer)} optimizer variables; a run "
                f"with num_ps={k} expects {n * k} ({n} per holder). Resume with the "
                "num_ps of the run that wrote it."
            )

        def full_of(w: list[np.ndarray]) -> np.ndarray:
            self.replica.model.set_weights(w)
            return self.replica.flat_weights()

        full = await self._run(full_of, weights)
        await asyncio.gather(
            *(
                self._peer(
                    s - 1,
                    "load",
                    gather_ranges(full, self.plan[s]).copy(),
                    optimizer[s * n : (s + 1) * n],
                    version,
                )
                for s in range(1, k)
            )
        )
        await super().restore(weights, optimizer[:n], version, done)

    def _restore(self, weights: list[np.ndarray], optimizer: list[np.ndarray]) -> None:
        self.replica.model.set_weights(weights)
        full = self.replica.flat_weights()
        self.flat = self.shard.load(gather_ranges(full, self.plan[0]).copy(), optimizer)

    async def traffic(self) -> list[dict[str, int]]:
        """Bytes each holder received and sent, as they travelled (holder order)."""
        return [
            {"received": self.received, "sent": self.sent},
            *await self._all("traffic"),
        ]


@dataclass(frozen=True)
class ShardedHolderRef(HolderRef):
    """What the gradient tasks of a ``num_ps=K`` run get: the coordinator (``address``,
    ``key``) and the other holders; :meth:`call` speaks the single holder's
    ``pull``/``push`` protocol over all of them."""

    peers: tuple[tuple[str, str], ...] = ()
    plan: tuple[tuple[tuple[int, int], ...], ...] = ()
    size: int = 0

    def keys(self) -> tuple[str, ...]:
        return (self.key, *(key for _, key in self.peers))

    def _each(
        self, calls: list[tuple[int, str, tuple[Any, ...]]], timeout: float
    ) -> list[Any]:
        from distributed import get_worker
        from distributed.utils import sync

        worker = get_worker()

        async def run() -> list[Any]:
            return list(
                await asyncio.gather(
                    *(
                        actor_call(worker.rpc(self.peers[s][0]), *self.peers[s], method,
                                    args, timeout)
                        for s, method, args in calls
                    )
                )
            )

        return sync(worker.loop, run)  # type: ignore[no-any-return]

    def _complete(self, pulled: Any, timeout: float) -> Any:
        """The coordinator's admission plus the other slices at the same version."""
        if pulled is None or pulled[2] is None:
            return pulled
        token, version, first = pulled
        rest = self._each(
            [(s, "read", (version,)) for s in range(len(self.peers))], timeout
        )
        return (
            token,
            version,
            Slices([first, *rest], [list(r) for r in self.plan], self.size),
        )

    def call(self, method: str, *args: Any, timeout: float) -> Any:
        if method == "pull":
            return self._complete(super().call("pull", *args, timeout=timeout), timeout)
        if method == "push":
            token, worker, packed, version, shard_pass, step = args
            assert isinstance(packed, Slices)
            item = (worker, shard_pass, step)
            self._each(
                [(s, "offer", (item, part)) for s, part in enumerate(packed.parts[1:])],
                timeout,
            )
            outcome, pulled = super().call(
                "push",
                token,
                worker,
                packed.parts[0],
                version,
                shard_pass,
                step,
                timeout=timeout,
            )
            return outcome, self._complete(pulled, timeout)
        return super().call(method, *args, timeout=timeout)


class ShardedHolders:
    """The client's handle on a ``num_ps=K`` run's holders (built by the engine's
    :meth:`~dasktf.engines.holder.engine.AsyncEngine.start_holder`): the coordinator's actor
    is ``key``, slice ``s``'s ``{key}-slice{s}``."""

    def __init__(
        self,
        ctx: RunContext,
        holders: list[str],
        plan: list[Ranges],
        holder_args: tuple[Any, ...],
        key: str,
    ) -> None:
        from dasktf.cluster.waits import wait_for

        config_, weights, probe = holder_args[:3]
        timeout = config.get_seconds("step-timeout")
        self.peer_futures: list[Future] = [
            ctx.client.submit(
                SliceHolder,
                config_,
                weights,
                probe,
                plan[s],
                s,
                timeout,
                key=f"{key}-slice{s}",
                # each slice's master copy lives on its worker for the whole run
                workers=[holders[s]],
                allow_other_workers=False,
                actor=True,
            )
            for s in range(1, len(plan))
        ]
        peers = [
            (holders[s], str(f.key))
            for s, f in zip(range(1, len(plan)), self.peer_futures, strict=True)
        ]
        self.coordinator: Future = ctx.client.submit(
            CoordinatingHolder,
            *holder_args,
            plan=plan,
            peers=peers,
            key=key,
            workers=[holders[0]],
            allow_other_workers=False,
            actor=True,
        )
        wait_for(
            ctx,
            [self.coordinator, *self.peer_futures],
            "building the parameter holders",
        )
        self.ref = ShardedHolderRef(
            holders[0],
            str(self.coordinator.key),
            tuple(peers),
            tuple(tuple(r) for r in plan),
            int(sum(b - a for r in plan for a, b in r)),
        )

    def traffic(self, holder: Any) -> list[dict[str, int]]:
        """Bytes each holder received and sent over the run, counted by the holders
        (``holder``: the client's handle on the coordinator)."""
        return holder.traffic().result(  # type: ignore[no-any-return]
            timeout=config.get_seconds("step-timeout")
        )

    def close(self) -> None:
        for f in self.peer_futures:
            f.release()


def byte_logs(plan: list[Ranges], task_bytes: list[list[int]]) -> dict[str, float]:
    """An async epoch's byte figures, from its gradient tasks' per-holder counts
    (push + pulled weights, counted at the codec).

    ``bytes_per_step``: mean bytes per update per worker (one update is one
    worker's step); ``holder_bytes_per_update``: the busiest holder's share of it.
    ``bytes_lower_bound`` is what an update moves in float32 without codecs,
    ``2 x P x 4`` (the gradient out, the weights back; an allreduce bound does
    not apply, nothing is reduced), whatever ``num_ps``: splitting spreads the
    bytes over holders, it moves no fewer per worker. So ``bytes_bound_ratio`` is
    about 1 for float32, and below 1 with a codec or when a worker skips pulling
    weights it already has.
    """
    n_params = int(sum(b - a for r in plan for a, b in r))
    bound = 2.0 * n_params * 4
    task_bytes = [b for b in task_bytes if len(b) == len(plan)]
    per_holder = np.asarray(task_bytes, float).reshape(len(task_bytes), len(plan))
    per_step = float(per_holder.sum(axis=1).mean()) if len(task_bytes) else 0.0
    busiest = float(per_holder.mean(axis=0).max()) if len(task_bytes) else 0.0
    return {
        "bytes_per_step": per_step,
        "bytes_lower_bound": bound,
        "bytes_bound_ratio": per_step / bound if bound else 0.0,
        "holder_bytes_per_update": busiest,
    }
