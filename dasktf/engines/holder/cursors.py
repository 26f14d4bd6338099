"""Which batch each worker identity of an async run takes next
(:class:`WorkerCursor`, moved only by :class:`~dasktf.engines.holder.state.AsyncState`,
so every batch is applied exactly once) and the gradient tasks' futures in flight
(:class:`InFlight`, so a loss can void exactly those).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from distributed import Future


# -- the client side ------------------------------------------------------------------
@dataclass
class WorkerCursor:
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
    #: (and whose progress it advances; dasktf.engines.holder.recovery).
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


class InFlight:
    """The gradient tasks' futures submitted and not yet gathered (which batch each
    computes is the state's: :attr:`~dasktf.engines.holder.state.AsyncState.in_flight`).

    A lost worker's tasks, or every task when the holder is lost, are *voided*:
    cancelled, and their results ignored should one still arrive.
    """

    def __init__(self, loop: Any) -> None:
        from distributed import as_completed

        #: completion order of the tasks (``distributed.as_completed``)
        self.completed = as_completed(loop=loop)
        self._futures: dict[str, Future] = {}
        self._outstanding: set[Future] = set()
        self._dead: set[str] = set()

    def __bool__(self) -> bool:
        return bool(self._outstanding)

    def add(self, future: Future) -> None:
        self._futures[future.key] = future
        self._outstanding.add(future)
        self.completed.add(future)

    def live(self, futures: list[Future]) -> list[Future]:
        """``futures`` less the voided ones."""
        return [f for f in futures if f.key not in self._dead]

    def settled(self, future: Future) -> None:
        """``future`` finished (its result is being gathered) or failed."""
        self._outstanding.discard(future)

    def gathered(self, futures: list[Future]) -> None:
        for f in futures:
            self._futures.pop(f.key, None)

    def void(self, client: Any, keys: tuple[str, ...]) -> None:
        """Cancel the tasks ``keys`` not yet gathered, finished or not (a finished
        one's result may be lost with its worker)."""
        futures = [self._futures.pop(k) for k in keys if k in self._futures]
        client.cancel(futures, force=True)
        for f in futures:
            self._outstanding.discard(f)
            self._dead.add(f.key)

    def cancel_all(self) -> None:
        """At the end of a run: nothing more is gathered."""
        for f in list(self._outstanding):
            f.cancel()
        self._outstanding.clear()
