"""What the client knows of an async run, apart from its I/O.

:class:`AsyncState` holds an asynchronous (or quorum) run as the client sees it:
which batch each worker identity computes next (its
:class:`~dasktf.engines.holder.cursors.WorkerCursor`), which batches are in flight
and under which task key, where every identity's replica lives, which batches were
applied, and the restore point a lost holder is rebuilt from; its
:class:`~dasktf.engines.holder.records.Tally` keeps the records of the applied updates and the epoch's figures. Like
distributed's ``worker_state_machine``, it does no I/O: a *stimulus*
(:meth:`~AsyncState.step_done`, :meth:`~AsyncState.worker_lost`,
:meth:`~AsyncState.worker_released`, :meth:`~AsyncState.worker_joined`,
:meth:`~AsyncState.restored`) changes it and returns the *instructions*
(:mod:`.instructions`) that :class:`~dasktf.engines.holder.engine.AsyncEngine`
carries out, in order: submit a task, cancel tasks, release a lost worker on the
holder, build a replica on a worker, rebuild or restore the holder, add a helper,
tell the run an update was applied. So the rules below are tested without a
cluster (``tests/test_holder_state.py``).

Identities. A replica speaks to the holder as an *identity*: at first its worker's
index. A lost worker's shard goes on under a new identity on the least loaded
survivor (its *successor*, which takes the lost one's cursor); a worker that joins
helps the shard with the most batches left under a new identity that *feeds* that
shard's cursor. Both are added by one method, :meth:`AsyncState._add_identity`.

Every batch applied once. A batch ``(pass, step)`` of a shard is, at any time, in
one place: ahead of its shard's cursor, on a cursor's ``retry`` list, in flight
(:attr:`AsyncState.in_flight`), in a :class:`Release` on its way to a successor, or
applied (:attr:`AsyncState.applied_batches`, the client's copy of the holder's
ledger). Only this class moves it: a submission takes it from a cursor into flight;
a result that the holder applied moves it to applied (a second application
raises); a lost worker's batches in flight go to its successor's ``retry`` list
unless the holder says they were applied; when the holder is lost, whatever was
applied after its restore point went with it, and every shard's cursor goes back to
the cut (:meth:`WorkerCursor.restore`: the gaps first), as on a resume from a
checkpoint. An epoch ends once every batch of every shard's next pass is applied
(not once as many results arrived: a helper's batch may still be in flight while
its owner's of the next pass are applied). Quorum runs drop late gradients by
design: there a batch is applied at most once (:class:`QuorumState`).

Checkpoints. "Epoch e, step s" does not describe an async run's progress (workers
run ahead of each other, several gradients are in flight), so a checkpoint is the
holder's consistent cut between two applies
(:meth:`~dasktf.engines.holder.actor.ParameterHolder.snapshot`): its state
(:func:`cut_state`) and the ``(pass, step)`` items applied for every shard, in the
manifest (``"async"``; the files are the run's, :mod:`dasktf.run.checkpoint`). The
shuffle order needs no state: every permutation is drawn from ``(seed, pass,
shard)``. On resume (:func:`resumable`, then :meth:`AsyncState.restored`) the
holder counts the applied items against each shard's budget and each cursor
computes its gaps first, so every batch of the requested epochs is applied exactly
once over the two runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from dasktf.engines.holder.cursors import WorkerCursor
from dasktf.engines.holder.instructions import (
    AbandonHolder,
    AddHelper,
    Adopt,
    Batch,
    Cancel,
    Instruction,
    RebuildHolder,
    Release,
    RestoreHolder,
    StepApplied,
    Submit,
)
from dasktf.engines.holder.records import PushOutcome, StepResult, Tally, UpdateRecord
from dasktf.exceptions import DasktfError
from dasktf.runtime.servers import server_workers

if TYPE_CHECKING:
    from dasktf.engines.base import Saved


class AsyncState:
    """The client's picture of one async run (see the module docstring).

    Parameters
    ----------
    run_id
        Names the tasks (``dasktf-async-step-<run>-<identity>-<pass>-<step>-g<n>``).
    workers
        The address of each worker, identity ``i`` on ``workers[i]``.
    items
        Per worker, the items of one pass over its shard: its non-empty steps (or,
        with local steps, rounds).
    ahead
        Tasks kept queued per identity (``dasktf.async.submit-ahead``).
    epochs
        Passes each shard owes (``None``: unbounded).
    holders, n_holders
        Where the holders are (``holders[0]`` the coordinator), and how many a
        rebuild places (``num_ps``).
    """

    def __init__(
        self,
        run_id: str,
        workers: list[str],
        items: list[list[int]],
        *,
        ahead: int = 1,
        epochs: int | None = None,
        holders: list[str] | None = None,
        n_holders: int = 1,
    ) -> None:
        self.run_id = run_id
        self.ahead = ahead
        self.epochs = epochs
        self.cursors = [WorkerCursor(list(s)) for s in items]
        #: each identity's worker, shard (a successor's or helper's) and replica
        #: slot (an adopted replica is registered under its identity)
        self.addresses: dict[int, str] = dict(enumerate(workers))
        self.shard_index: dict[int, int] = {}
        self.slots: dict[int, int | None] = {}
        self.holder_workers = list(holders or workers[:1])
        self.n_holders = n_holders
        #: holders built so far: a rebuilt holder's actor and its tasks have keys
        #: of their own generation
        self.generation = 0
        #: ``(identity, pass, step) -> task key`` of the tasks not yet accounted
        self.in_flight: dict[tuple[int, int, int], str] = {}
        #: per shard, the batches applied to the weights that survive
        self.applied_batches: dict[int, set[Batch]] = {}
        #: per shard, how many batches of each pass were applied
        self._per_pass: dict[int, dict[int, int]] = {}
        self._full: dict[int, int] = {}  # ... and its first passes applied in full
        self.stopped = False
        self.current_epoch = 0
        #: the newest holder state to rebuild a lost holder from: a snapshot taken
        #: at the start, at every epoch end and with every checkpoint
        self.restore_point: dict[str, Any] | None = None
        #: the last learning rate the client set: a holder rebuilt from an older
        #: cut takes it again
        self.learning_rate: float | None = None
        self.tally = Tally(len(workers))

    # -- queries ----------------------------------------------------------------------
    def workers(self) -> list[str]:
        """The workers of the active identities."""
        return sorted({a for i, a in self.addresses.items() if self.cursors[i].active})

    def survivors(self, lost: list[str]) -> list[str]:
        """The workers of the active identities that are not in ``lost`` (a worker
        lost earlier is no survivor: its identities are no longer active)."""
        return [a for a in self.workers() if a not in lost]

    def owners(self) -> list[int]:
        """The active identities that own a shard (not helpers)."""
        return [i for i, c in enumerate(self.cursors) if c.active and c.feeds is None]

    def epoch_done(self, epoch: int) -> bool:
        """Every batch of every shard's first ``epoch + 1`` passes was applied."""
        return all(self._passes_applied(i) > epoch for i in self.owners())

    def budget(self) -> tuple[dict[int, int] | None, int | None]:
        """What a holder is built with to stop by itself after the last epoch's
        updates (not one more): per owner, the batches it owes; and the passes."""
        if self.epochs is None:
            return None, None
        return {i: len(self.cursors[i].steps) * self.epochs for i in self.owners()}, self.epochs

    def batches_left(self) -> dict[int, int]:
        """Per owner, the batches of its shard not handed out yet in the run's passes."""
        left = {}
        for i in self.owners():
            cursor = self.cursors[i]
            passes = self.epochs if self.epochs is not None else cursor.shard_pass + 1
            ahead = max(0, passes - cursor.shard_pass) * len(cursor.steps) - cursor.position
            left[i] = max(0, ahead) + len(cursor.retry)
        return left

    def statistics(self) -> list[list[np.ndarray]]:
        """The moving statistics whose mean the holder takes: the active
        identities' latest (all of them when none is active any more)."""
        latest = self.tally.non_trainable
        active = [v for i, v in latest.items() if self.cursors[i].active]
        return active or list(latest.values())

    def progress(self, items: list[Any]) -> dict[str, list[list[int]]]:
        """A cut's applied ``(identity, pass, step)`` items by shard, as a checkpoint
        keeps them (a successor's or helper's under the shard it carries on)."""
        done: dict[str, list[list[int]]] = {}
        for identity, shard_pass, step in items:
            shard = self.shard_index.get(identity, identity)
            done.setdefault(str(shard), []).append([int(shard_pass), int(step)])
        return done

    def first_epoch(self) -> int:
        """The epoch a resumed run goes on with."""
        return min(c.completed_passes for c in self.cursors)

    def missing(self, passes: int) -> dict[int, list[Batch]]:
        """Per shard, the batches of its first ``passes`` passes not applied: none
        once an async run of ``passes`` epochs has finished."""
        steps = {self.shard_index.get(i, i): c.steps for i, c in enumerate(self.cursors)}
        gaps = {s: [(p, t) for p in range(passes) for t in steps[s]
                    if (p, t) not in self.applied_batches.get(s, set())] for s in steps}
        return {s: g for s, g in gaps.items() if g}

    def epoch_logs(self, seconds: float) -> dict[str, float]:
        """The epoch's summaries (:meth:`Tally.epoch_logs`); starts the next."""
        return self.tally.epoch_logs(seconds)

    # -- stimuli ----------------------------------------------------------------------
    def next_generation(self) -> int:
        """A holder is built: its generation (its actor key's suffix)."""
        self.generation += 1
        return self.generation - 1

    def start(self) -> list[Instruction]:
        """The run's first epoch begins: fill every identity's queue."""
        return [s for i in range(len(self.cursors)) for s in self._fill(i)]

    def begin_epoch(self, epoch: int) -> None:
        self.current_epoch = epoch

    def set_learning_rate(self, lr: float) -> None:
        self.learning_rate = lr

    def keep_restore_point(self, snapshot: dict[str, Any], source: str) -> None:
        """Keep ``snapshot`` of the holder (taken at ``source``) to rebuild it from,
        unless the one kept is newer."""
        if self.restore_point is None or snapshot["version"] >= self.restore_point["version"]:
            self.restore_point = {**snapshot, "source": source}

    def stop(self) -> None:
        """Training is over: no further task is handed out."""
        self.stopped = True

    def step_done(self, result: StepResult) -> list[Instruction]:
        """A gradient task's result arrived: account it and hand its identity its
        next batch."""
        self.in_flight.pop((result.worker, result.shard_pass, result.step), None)
        out = self._account(result)
        self.cursors[result.worker].queued -= 1
        if not self.stopped and result.outcome is not None:
            out += self._fill(result.worker)
        return out

    def worker_lost(self, lost: list[str]) -> list[Instruction]:
        """The workers ``lost`` are gone. Their identities' tasks are cancelled and
        each has a successor on the least loaded survivor. With a holder alive, the
        holder is asked what they had applied (:class:`Release`, answered by
        :meth:`worker_released`); with a holder lost, every task is void and the
        holders are rebuilt from the restore point, every cursor rewound to it."""
        survivors = self.survivors(lost)
        holder_lost = not set(self.holder_workers).isdisjoint(lost)
        out: list[Instruction] = []
        if holder_lost:  # its applies went with it: everything in flight is void
            out += [AbandonHolder(tuple(survivors)), self._void()[0]]
            for cursor in self.cursors:
                cursor.queued = 0
        for i in [i for i, a in self.addresses.items() if a in lost and self.cursors[i].active]:
            cancel, batches = self._void(i)
            old = self.cursors[i]
            old.active = False
            shard = self.shard_index.get(i, i)
            new = self._add_identity(
                WorkerCursor(old.steps, old.shard_pass, old.position, 0,
                             old.completed_passes, old.done_in_pass, list(old.retry),
                             feeds=old.feeds),
                shard, self._least_loaded(survivors))
            for cursor in self.cursors:  # who helped the lost one helps its successor
                if cursor.feeds == i:
                    cursor.feeds = new
            if cancel.keys:
                out.append(cancel)
            if holder_lost:
                out.append(Adopt(new, shard, self.addresses[new], from_restore_point=True))
            else:
                out.append(Release(i, new, tuple(batches)))
        if holder_lost:
            out += self._rebuild(survivors)
        return out

    def worker_released(
        self, release: Release, outcomes: list[PushOutcome], applied: list[Any]
    ) -> list[Instruction]:
        """The holder's answer to ``release``: the outcomes of the lost identity's
        pushes that completed an update before it died (the client never heard of
        them) and which of its batches in flight were applied. The others go to the
        successor's ``retry`` list; the successor gets its replica and goes on."""
        new = release.successor
        done = {tuple(b) for b in applied}
        self.cursors[new].retry += [b for b in release.batches if b not in done]
        for outcome in outcomes:  # applied before the loss, never reported: count them
            self._account(StepResult(new, -1, -1, outcome))
        return [Adopt(new, self.shard_index[new], self.addresses[new]), *self._fill(new)]

    def worker_joined(self, worker: str) -> list[Instruction]:
        """``worker`` joined: it helps the shard with the most batches left (ties:
        the one with fewer helpers), taking them from the same cursor."""
        left = self.batches_left()
        donor = max(left, key=lambda i: (left[i], -sum(c.feeds == i for c in self.cursors)))
        shard = self.shard_index.get(donor, donor)
        identity = self._add_identity(WorkerCursor(self.cursors[donor].steps, feeds=donor),
                                      shard, worker)
        return [Adopt(identity, shard, worker), AddHelper(identity, donor),
                *self._fill(identity)]

    def restored(
        self, weights: list[np.ndarray], optimizer: list[np.ndarray], version: int,
        done: dict[int, list[Batch]],
    ) -> list[Instruction]:
        """A checkpoint's cut is loaded before the first epoch (a resume): the
        holder takes it, each shard's cursor goes on after its batches in ``done``."""
        for i, cursor in enumerate(self.cursors):
            cursor.restore(set(done.get(i, [])))
        self.tally.applied = version
        self._reset_applied({s: set(b) for s, b in done.items()})
        return [RestoreHolder(weights, optimizer, version, done, self.learning_rate)]

    def drained(self, counters: dict[str, Any]) -> None:
        """The run is over and nothing is in flight: take the holder's final
        ``counters`` and check the client's accounting against them."""
        self.tally.drained(counters, [i for i, c in enumerate(self.cursors) if not c.active])

    # -- the rules ----------------------------------------------------------------------
    def _fill(self, identity: int) -> list[Instruction]:
        """Hand ``identity`` batches until ``ahead`` of its tasks are queued: its own
        retries first (a lost helper's), then its shard's next ones."""
        cursor = self.cursors[identity]
        source = cursor if cursor.feeds is None else self.cursors[cursor.feeds]
        out: list[Instruction] = []
        while cursor.queued < self.ahead and cursor.steps:
            shard_pass, step = cursor.take() if cursor.retry else source.take()
            # a restored holder recomputes items: a key of its own generation
            key = (f"dasktf-async-step-{self.run_id}-{identity}-{shard_pass}-{step}"
                   f"-g{self.generation}")
            self.in_flight[(identity, shard_pass, step)] = key
            cursor.queued += 1
            out.append(Submit(identity, shard_pass, step, key))
        return out

    def _void(self, identity: int | None = None) -> tuple[Cancel, list[Batch]]:
        """Take ``identity``'s tasks (every task: ``None``) out of flight, finished or
        not (a finished one's result may be lost with its worker)."""
        tasks = [t for t in self.in_flight if identity is None or t[0] == identity]
        keys = tuple(self.in_flight.pop(t) for t in tasks)
        return Cancel(keys), [(p, s) for _, p, s in tasks]

    def _passes_applied(self, owner: int) -> int:
        """How many of the first passes over ``owner``'s shard are applied in full."""
        shard = self.shard_index.get(owner, owner)
        per_pass, n = self._per_pass.get(shard, {}), len(self.cursors[owner].steps)
        full = self._full.get(shard, 0)
        while n and per_pass.get(full, 0) == n:  # a batch is applied once: all of them
            full += 1
        self._full[shard] = full
        return full

    def _reset_applied(self, batches: dict[int, set[Batch]]) -> None:
        self.applied_batches, self._per_pass, self._full = batches, {}, {}
        for shard, applied in batches.items():
            per_pass = self._per_pass[shard] = {}
            for shard_pass, _ in applied:
                per_pass[shard_pass] = per_pass.get(shard_pass, 0) + 1

    def _least_loaded(self, survivors: list[str]) -> str:
        """The survivor with the fewest active identities (the first of them)."""
        load = self._load(survivors)
        return min(survivors, key=lambda a: load[a])

    def _load(self, workers: list[str]) -> dict[str, int]:
        return {a: sum(1 for i, b in self.addresses.items()
                       if b == a and self.cursors[i].active) for a in workers}

    def _add_identity(self, cursor: WorkerCursor, shard: int, worker: str) -> int:
        """A new identity computing batches of ``shard`` on ``worker`` with
        ``cursor`` (a lost one's successor, or a helper that joined); its replica is
        registered on that worker under the identity."""
        identity = len(self.cursors)
        self.cursors.append(cursor)
        self.tally.dropped[identity] = 0
        self.shard_index[identity] = shard
        self.addresses[identity] = worker
        self.slots[identity] = identity
        return identity

    def _account(self, result: StepResult) -> list[Instruction]:
        """Count one result: its shard's progress, its applied batches and the
        tally; an applied update is reported to the run."""
        outcome = result.outcome
        if not self.tally.count(result) or outcome is None:  # the run had stopped
            return []
        cursor = self.cursors[result.worker]
        if cursor.feeds is not None:  # a helper advances the shard it helps
            cursor = self.cursors[cursor.feeds]
        cursor.done_in_pass += 1
        if cursor.done_in_pass == len(cursor.steps):
            cursor.completed_passes, cursor.done_in_pass = cursor.completed_passes + 1, 0
        if outcome.status == "dropped":  # quorum: too late for its step
            return []
        for record in outcome.records:
            record.epoch = self.current_epoch
            self._applied(record)
        applied = self.tally.add(result, self._epoch_of(result))
        return [StepApplied(self.tally.applied - 1)] if applied else []

    def _epoch_of(self, result: StepResult) -> int:
        """The epoch whose figures a counted result's metric states go to: its
        shard pass's, or the current one if that epoch was reported already.

        Not simply the current epoch: workers run ahead into later passes, and one
        batch of results heard together can finish two epochs (a lagging shard's
        last batch of pass e after the others' whole pass e + 1), which left the
        second with no figures at all."""
        return max(result.shard_pass, self.current_epoch)

    def _applied(self, record: UpdateRecord) -> None:
        """Mark ``record``'s batch applied to its shard: once."""
        shard = self.shard_index.get(record.worker, record.worker)
        batches = self.applied_batches.setdefault(shard, set())
        batch = (record.shard_pass, record.step)
        if batch in batches:
            raise DasktfError(
                f"Update {record.update} applied batch {batch} of shard {shard}, which "
                "an earlier update had applied; this is a dasktf bug."
            )
        batches.add(batch)
        per_pass = self._per_pass.setdefault(shard, {})
        per_pass[batch[0]] = per_pass.get(batch[0], 0) + 1

    def _rebuild(self, survivors: list[str]) -> list[Instruction]:
        """New holders on survivors from the restore point: the cut's state and its
        batches, each shard's cursor rewound to them, the records after it dropped,
        then every identity handed batches again (see the module docstring)."""
        point = self.restore_point
        assert point is not None, "worker_lost without a restore point"
        version = int(point["version"])
        # the holders on the survivor with the fewest replicas to feed, the other
        # slices' on the survivors after it
        load = self._load(survivors)
        first = survivors.index(min(survivors, key=lambda a: (load[a], survivors.index(a))))
        self.holder_workers = server_workers(survivors[first:] + survivors[:first],
                                             self.n_holders)
        # the cut's batches by shard, then by the identity that now owns each shard
        owners = {self.shard_index.get(i, i): i for i in self.owners()}
        by_shard: dict[int, set[Batch]] = {s: set() for s in owners}
        for identity, shard_pass, step in point["items"]:
            by_shard.setdefault(self.shard_index.get(identity, identity), set()).add(
                (int(shard_pass), int(step)))
        self._reset_applied(by_shard)
        done = {owners[s]: sorted(batches) for s, batches in by_shard.items() if s in owners}
        redone = self.tally.forget_after(version, point.get("records", []),
                                         self.current_epoch)
        out: list[Instruction] = [
            RebuildHolder(tuple(self.holder_workers), self.next_generation(), version,
                          point.get("source", "restore point"), redone),
            RestoreHolder(point["weights"], point["optimizer"], version, done,
                          self.learning_rate),
        ]
        for identity, cursor in enumerate(self.cursors):
            if not cursor.active:
                continue
            if cursor.feeds is not None:  # a joined helper takes its owner's batches again
                cursor.retry = []
                out.append(AddHelper(identity, cursor.feeds))
            else:
                self._rewind(cursor, set(done.get(identity, [])))
        return out + [s for i, c in enumerate(self.cursors) if c.active for s in self._fill(i)]

    def _rewind(self, cursor: WorkerCursor, done: set[Batch]) -> None:
        """A shard's cursor after a holder restore: the cut's gaps, then on."""
        cursor.restore(done)


class QuorumState(AsyncState):
    """A ``sync_quorum=k`` run (:class:`~dasktf.engines.holder.engine.QuorumEngine`): an epoch is
    ``steps_per_epoch`` applied steps, one budget counts them, a late gradient is
    dropped (and counted in the epoch's figures), and a rebuilt holder goes on
    from where the cursors are (quorum steps never owed every batch)."""

    def __init__(self, *args: Any, steps_per_epoch: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.steps_per_epoch = steps_per_epoch

    def epoch_done(self, epoch: int) -> bool:
        return self.tally.applied >= (epoch + 1) * self.steps_per_epoch

    def _epoch_of(self, result: StepResult) -> int:
        """The epoch of the next applied step by count (a quorum epoch is
        ``steps_per_epoch`` applied steps, whatever the passes)."""
        return max(self.tally.applied // self.steps_per_epoch, self.current_epoch)

    def budget(self) -> tuple[dict[int, int] | None, int | None]:
        if self.epochs is None:
            return None, None
        return {-1: self.epochs * self.steps_per_epoch}, None

    def epoch_logs(self, seconds: float) -> dict[str, float]:
        """The tally's summaries and the gradients dropped in the epoch."""
        dropped = self.tally.epoch_dropped
        return {**self.tally.epoch_logs(seconds), "dropped": float(dropped)}

    def _rewind(self, cursor: WorkerCursor, done: set[Batch]) -> None:
        pass


def cut_state(snapshot: dict[str, Any]) -> dict[str, Any]:
    """A holder snapshot as a checkpoint's state: weights, optimizer, ``applied``."""
    return {"weights": snapshot["weights"], "optimizer": snapshot["optimizer"],
            "applied": snapshot["version"] - 1}


def resumable(saved: Saved, n_shards: int) -> tuple[int, dict[int, list[tuple[int, int]]]]:
    """The version and the applied batches per shard of an async run's checkpoint.

    Raises
    ------
    ValueError
        A checkpoint of another mode, or of a run on other shards or batches.
    """
    manifest, path = saved.manifest, saved.path
    if manifest.get("mode") != "async" or "async" not in manifest:
        raise ValueError(
            f"{path} is a checkpoint of a mode={manifest.get('mode', 'sync')!r} run; an "
            "async run resumes only from an async run's checkpoints (use another "
            "checkpoint_dir or the same mode)."
        )
    if manifest["n_shards"] != n_shards or manifest["batch_size"] != saved.batch_size:
        raise ValueError(
            f"{path} was written by a run on {manifest['n_shards']} worker(s) with "
            f"batch_size={manifest['batch_size']}; this run has {n_shards} and "
            f"{saved.batch_size}. Resume with the same n_workers and batch_size."
        )
    progress = manifest["async"]
    done = {int(k): [(int(p), int(s)) for p, s in v] for k, v in progress["done"].items()}
    return int(progress["version"]), done
