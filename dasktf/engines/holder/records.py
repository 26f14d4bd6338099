"""What an async run records: one :class:`UpdateRecord` per applied update, and
what the client counts of them (:class:`Tally`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dasktf.exceptions import DasktfError


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


def updates_frame(records: list[UpdateRecord]) -> Any:
    """``records`` as a pandas DataFrame (one row per applied update)."""
    import dataclasses

    import pandas as pd

    columns = [f.name for f in dataclasses.fields(UpdateRecord)]
    return pd.DataFrame([dataclasses.astuple(r) for r in records], columns=columns)


class Tally:
    """What the client counts of an async run: the applied updates and their
    records, drops and task counts (checked against the holder's at the end), and
    the epoch's figures (metric states, bytes, moving statistics)."""

    def __init__(self, workers: int) -> None:
        self.applied = 0  # updates the client has seen applied
        #: applied updates undone by a holder restore (they went with the holder)
        self.undone = 0
        self.updates: list[UpdateRecord] = []
        self.epoch_records: list[UpdateRecord] = []
        self.dropped: dict[int, int] = {i: 0 for i in range(workers)}
        #: drops counted by holders before the current one
        self.dropped_base: dict[int, int] = {}
        #: gradient tasks that computed (and pushed) a gradient, and those that
        #: found the run stopped: ``computed == applied contributions + dropped +
        #: discarded`` (checked by the tests)
        self.tasks = {"computed": 0, "stopped": 0}
        self.discarded = 0
        self.epoch_dropped = 0
        #: summed metric states by the epoch they count in (:meth:`add`)
        self.epoch_states: dict[int, list[np.ndarray]] = {}
        self.epoch_bytes: list[list[int]] = []
        #: each identity's latest moving statistics (StepResult.non_trainable)
        self.non_trainable: dict[int, list[np.ndarray]] = {}

    def count(self, result: StepResult) -> bool:
        """Count a task; whether it computed a gradient (it found the run going)."""
        if result.outcome is None:
            self.tasks["stopped"] += 1
            return False
        self.tasks["computed"] += 1
        if result.non_trainable is not None:  # a dropped gradient's batch counts too
            self.non_trainable[result.worker] = result.non_trainable
        if result.nbytes:  # not a result recovery made up for a lost worker
            self.epoch_bytes.append(result.nbytes)
        if result.outcome.status == "dropped":
            self.dropped[result.worker] += 1
            self.epoch_dropped += 1
        return True

    def add(self, result: StepResult, epoch: int) -> bool:
        """Add a counted result's metric states (to ``epoch``'s) and records;
        whether it applied an update (the run's ``applied``-th)."""
        assert result.outcome is not None
        if result.metric_states is not None:
            states = self.epoch_states.get(epoch)
            if states is None:
                self.epoch_states[epoch] = [np.array(s, copy=True)
                                            for s in result.metric_states]
            else:
                for total, s in zip(states, result.metric_states, strict=False):
                    total += s
        self.epoch_records.extend(result.outcome.records)
        if result.outcome.status != "applied":
            return False
        self.applied += 1
        return True

    def known_through(self) -> int:
        """The last update ``u`` such that the client has the records of 1..u."""
        known = {r.update for r in self.updates} | {r.update for r in self.epoch_records}
        last = 0
        while last + 1 in known:
            last += 1
        return last

    def epoch_logs(self, seconds: float) -> dict[str, float]:
        """Per-epoch summaries for ``history.history`` (and the epoch line)."""
        records, self.epoch_records = self.epoch_records, []
        self.updates.extend(records)
        staleness = [r.staleness for r in records]
        examples = sum(r.batch_size for r in records)
        self.epoch_dropped = 0
        return {
            "updates": float(len({r.update for r in records})),
            "staleness_mean": float(np.mean(staleness)) if staleness else 0.0,
            "staleness_max": float(max(staleness, default=0)),
            "examples_per_sec": examples / seconds if seconds > 0 else 0.0,
        }

    def take_epoch_states(self, epoch: int) -> list[np.ndarray]:
        """Epoch ``epoch``'s summed metric states (additive totals), with any left
        of earlier epochs; those counted for later epochs stay for them."""
        taken = [self.epoch_states.pop(e) for e in sorted(self.epoch_states) if e <= epoch]
        if len(taken) <= 1:
            return taken[0] if taken else []
        return [np.sum(parts, axis=0) for parts in zip(*taken, strict=False)]

    def take_epoch_bytes(self) -> list[list[int]]:
        """The epoch's per-task byte counts (per holder); starts the next."""
        counts, self.epoch_bytes = self.epoch_bytes, []
        return counts

    def forget_after(self, version: int, records: list[UpdateRecord], epoch: int) -> int:
        """The updates after ``version`` went with the holder: drop their records
        (the cut's ``records`` the client had not heard of come back, in ``epoch``);
        how many applied updates were undone."""
        seen = [r.update for r in self.updates] + [r.update for r in self.epoch_records]
        undone = max(0, max(seen, default=0) - version)
        self.undone += undone
        self.applied = version
        self.updates = [r for r in self.updates if r.update <= version]
        self.epoch_records = [r for r in self.epoch_records if r.update <= version]
        known = {r.update for r in self.updates} | {r.update for r in self.epoch_records}
        for record in records:  # applied before the cut, never reported
            if record.update not in known:
                record.epoch = epoch
                self.epoch_records.append(record)
        self.dropped_base = dict(self.dropped)
        return undone

    def drained(self, counters: dict[str, Any], inactive: list[int]) -> None:
        """The holder's final ``counters``, checked against the client's counts
        (``inactive``: the lost identities, whose drops only the holder knows)."""
        late, self.epoch_records = self.epoch_records, []
        self.updates.extend(late)
        self.updates.sort(key=lambda r: (r.update, r.worker))
        # A lost worker's last pushes may have been dropped after it died: the
        # holder's count is the only one.
        for i in inactive:
            self.dropped[i] = self.dropped_base.get(i, 0) + counters["dropped"].get(i, 0)
        # drops counted by this holder (a restored holder starts from zero)
        dropped = {i: n - self.dropped_base.get(i, 0) for i, n in self.dropped.items()}
        if counters["version"] != self.applied or dropped != {
            **{i: 0 for i in self.dropped}, **counters["dropped"]
        }:
            raise DasktfError(
                f"Update accounting mismatch: the holder applied {counters['version']} "
                f"updates and dropped {counters['dropped']}, the client saw "
                f"{self.applied} and {self.dropped}. This is a dasktf bug."
            )
        self.discarded = int(counters["discarded"])
