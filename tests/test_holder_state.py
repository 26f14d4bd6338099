"""The async run's state machine (dasktf.engines.holder.state), without a cluster.

Each test drives :class:`AsyncState` with stimuli and checks the instructions it
returns; :class:`Simulation` plays the engine and a holder that applies what is
pushed (in a random order, with workers lost and joining and the holder itself
lost and rebuilt from its restore point), to check the invariant the state owns:
every batch of the requested passes applied exactly once to the weights that
survive. No Dask, no TensorFlow: the whole file runs in about a second.
"""

from __future__ import annotations

import random

import pytest

from dasktf.engines.holder.instructions import (
    AbandonHolder,
    AddHelper,
    Adopt,
    Cancel,
    RebuildHolder,
    Release,
    RestoreHolder,
    StepApplied,
    Submit,
)
from dasktf.engines.holder.records import PushOutcome, StepResult, UpdateRecord
from dasktf.engines.holder.state import AsyncState, QuorumState
from dasktf.exceptions import DasktfError


def record(update, worker, shard_pass, step):
    return UpdateRecord(update=update, worker=worker, epoch=0, version_read=update - 1,
                        version_applied=update - 1, staleness=0, loss=0.0, batch_size=1,
                        compute_s=0.0, wall_time=0.0, shard_pass=shard_pass, step=step)


def applied(update, task):
    identity, shard_pass, step = task
    return StepResult(identity, shard_pass, step,
                      PushOutcome("applied", [record(update, identity, shard_pass, step)]))


def tasks(instructions):
    return [(i.identity, i.shard_pass, i.step) for i in instructions if isinstance(i, Submit)]


def state_of(workers=2, steps=3, epochs=2, ahead=2, cls=AsyncState, **kw):
    return cls("r", [f"w{i}" for i in range(workers)], [list(range(steps))] * workers,
               ahead=ahead, epochs=epochs, **kw)


# -- single stimuli -------------------------------------------------------------------
def test_the_start_fills_every_queue_and_a_result_hands_out_the_next_batch():
    state = state_of()
    state.next_generation()  # the engine builds the first holder
    started = state.start()
    assert tasks(started) == [(0, 0, 0), (0, 0, 1), (1, 0, 0), (1, 0, 1)]
    assert started[0].key == "dasktf-async-step-r-0-0-0-g1"
    out = state.step_done(applied(1, (1, 0, 0)))
    assert out[0] == StepApplied(0) and tasks(out[1:]) == [(1, 0, 2)]
    assert state.tally.applied == 1 and state.applied_batches == {1: {(0, 0)}}
    assert (1, 0, 0) not in state.in_flight and (1, 0, 2) in state.in_flight


def test_a_lost_workers_unapplied_batches_go_to_its_successor_first():
    state = state_of(workers=3)
    state.start()
    state.step_done(applied(1, (2, 0, 0)))  # worker 2 now has (0,1) and (0,2) in flight
    out = state.worker_lost(["w2"])
    cancel, release = out
    assert isinstance(cancel, Cancel) and len(cancel.keys) == 2
    assert release == Release(2, 3, ((0, 1), (0, 2)))
    assert not state.cursors[2].active and state.shard_index[3] == 2
    # the holder had applied (0,1) before the worker died; the client never heard
    out = state.worker_released(release, [PushOutcome("applied", [record(2, 2, 0, 1)])],
                                [(0, 1)])
    assert out[0] == Adopt(3, 2, "w0")  # the least loaded survivor (a tie: the first)
    assert tasks(out[1:]) == [(3, 0, 2), (3, 1, 0)]  # the unapplied one first, then on
    assert state.tally.applied == 2 and state.applied_batches[2] == {(0, 0), (0, 1)}
    assert state.cursors[3].done_in_pass == 2


def test_a_worker_lost_earlier_never_adopts_a_shard():
    state = state_of(workers=3)
    state.start()
    state.worker_lost(["w2"])  # its successor, identity 3, goes to w0
    assert state.addresses[3] == "w0" and state.survivors(["w1"]) == ["w0"]
    out = state.worker_lost(["w1"])
    assert out[-1] == Release(1, 4, ((0, 0), (0, 1)))
    assert state.worker_released(out[-1], [], [])[0] == Adopt(4, 1, "w0")


def test_a_joined_worker_helps_the_shard_with_the_most_batches_left():
    state = state_of(workers=2, steps=4)
    state.start()
    for update, task in enumerate([(0, 0, 0), (0, 0, 1)], start=1):
        state.step_done(applied(update, task))
    assert state.batches_left() == {0: 4, 1: 6}
    out = state.worker_joined("w9")
    assert out[:2] == [Adopt(2, 1, "w9"), AddHelper(2, 1)]
    assert tasks(out[2:]) == [(2, 0, 2), (2, 0, 3)]  # shard 1's next batches
    assert state.cursors[2].feeds == 1
    # its results advance the shard it helps
    state.step_done(applied(3, (2, 0, 2)))
    assert state.cursors[1].done_in_pass == 1 and state.applied_batches[1] == {(0, 2)}


def test_a_lost_holder_is_rebuilt_from_the_restore_point_and_the_cursors_rewound():
    state = state_of(workers=3, ahead=1, holders=["w0"])
    state.next_generation()
    state.start()
    state.keep_restore_point({"weights": ["w"], "optimizer": ["o"], "version": 1,
                              "items": [(1, 0, 0)], "records": []}, "epoch 1")
    for update, task in enumerate([(1, 0, 0), (2, 0, 0), (0, 0, 0)], start=1):
        state.step_done(applied(update, task))
    state.set_learning_rate(0.5)
    out = state.worker_lost(["w0"])  # the holder's worker, and worker 0's
    kinds = [type(i).__name__ for i in out]
    assert kinds[:5] == ["AbandonHolder", "Cancel", "Adopt", "RebuildHolder",
                         "RestoreHolder"]
    assert out[0] == AbandonHolder(("w1", "w2")) and out[2].from_restore_point
    rebuild, restore = out[3], out[4]
    assert rebuild.generation == 1 and rebuild.version == 1 and rebuild.redone == 2
    assert restore.done == {1: [(0, 0)], 2: [], 3: []} and restore.learning_rate == 0.5
    # updates 2 and 3 went with the holder: their batches are computed again
    assert sorted(tasks(out[5:])) == [(1, 0, 1), (2, 0, 0), (3, 0, 0)]
    assert all(i.key.endswith("-g2") for i in out[5:])
    assert state.tally.applied == 1 and state.tally.undone == 2 and state.holder_workers == ["w2"]
    assert state.applied_batches == {0: set(), 1: {(0, 0)}, 2: set()}


def test_a_resume_computes_the_cuts_gaps_first():
    state = state_of(workers=2, steps=3)
    out = state.restored(["w"], ["o"], 4, {0: [(0, 0), (0, 2), (1, 0)], 1: [(0, 1)]})
    assert out == [RestoreHolder(["w"], ["o"], 4, {0: [(0, 0), (0, 2), (1, 0)],
                                                   1: [(0, 1)]})]
    assert state.first_epoch() == 0 and state.tally.applied == 4
    assert tasks(state.start()) == [(0, 0, 1), (0, 1, 1), (1, 0, 0), (1, 0, 2)]


def test_a_batch_applied_twice_is_refused():
    state = state_of()
    state.start()
    state.step_done(applied(1, (0, 0, 0)))
    with pytest.raises(DasktfError, match="applied batch"):
        state.step_done(applied(2, (0, 0, 0)))


def test_quorum_counts_applied_steps_drops_late_gradients_and_never_rewinds():
    state = state_of(workers=3, steps=2, cls=QuorumState, steps_per_epoch=2)
    assert state.budget() == ({-1: 4}, None)
    state.start()
    late = StepResult(2, 0, 0, PushOutcome("dropped"))
    state.step_done(late)
    assert not state.epoch_done(0) and state.tally.dropped[2] == 1
    state.step_done(applied(1, (0, 0, 0)))
    state.step_done(applied(2, (1, 0, 1)))
    assert state.epoch_done(0)
    assert state.epoch_logs(1.0)["dropped"] == 1.0
    assert (state.cursors[0].shard_pass, state.cursors[0].position) == (1, 1)
    state.keep_restore_point({"weights": [], "optimizer": [], "version": 1,
                              "items": [(0, 0, 0)], "records": []}, "start")
    out = state.worker_lost(["w0"])  # the holder's worker: rebuilt from the cut
    # worker 0's successor goes on from (1, 1); an async run would redo (0, 1) first
    assert [t for t in tasks(out) if t[0] == 3] == [(3, 1, 1), (3, 2, 0)]


# -- whole runs -----------------------------------------------------------------------
class FakeHolder:
    """As much of :class:`ParameterHolder` as the state's rules rest on: it applies
    each pushed gradient at once, keeps the ledger of applied batches, answers a
    release and takes a cut."""

    def __init__(self, version=0, done=None):
        self.version = version
        self.applied = {}  # (identity, pass, step) -> record, applied by this holder
        self.restored = {(i, p, s) for i, items in (done or {}).items() for p, s in items}

    def push(self, task):
        self.version += 1
        self.applied[task] = record(self.version, *task)
        return PushOutcome("applied", [self.applied[task]])

    def release(self, identity, batches, outcomes):
        items = [(identity, p, s) for p, s in batches]
        return ([outcomes[t] for t in items if t in outcomes],
                [t[1:] for t in items if t in self.applied])

    def snapshot(self, since):
        return {"weights": [], "optimizer": [], "version": self.version,
                "items": sorted(set(self.applied) | self.restored),
                "records": [r for r in self.applied.values() if r.update > since]}


class Simulation:
    """Plays the engine: each identity computes its tasks in the order submitted
    (a worker runs one task at a time) and the client hears of them in that order,
    but the identities at their own pace; workers are lost and join, the holder is
    lost. At the end, as in a run, the holder is stopped: a task it has not started
    finds the run stopped."""

    def __init__(self, seed, workers=3, steps=4, epochs=3, ahead=2):
        self.rng = random.Random(seed)
        self.epochs = epochs
        self.state = AsyncState("r", [f"w{i}" for i in range(workers)],
                                [list(range(steps))] * workers, ahead=ahead,
                                epochs=epochs, holders=["w0"])
        self.state.next_generation()
        self.holder = FakeHolder()
        self.queued = {}  # key -> task, submitted, not pushed
        self.pushed = {}  # key -> (task, outcome), applied, result not gathered
        self.alive = {f"w{i}" for i in range(workers)}
        self.joined = 0
        self.lost_pushes = {}
        self.keep_restore_point("the start")
        self.carry_out(self.state.start())

    def keep_restore_point(self, source):
        self.state.keep_restore_point(self.holder.snapshot(self.state.tally.known_through()),
                                      source)

    def carry_out(self, instructions):
        for ins in instructions:
            if isinstance(ins, Submit):
                assert self.state.addresses[ins.identity] in self.alive
                self.queued[ins.key] = (ins.identity, ins.shard_pass, ins.step)
            elif isinstance(ins, Cancel):
                for key in ins.keys:
                    self.queued.pop(key, None)
                    self.pushed.pop(key, None)
            elif isinstance(ins, Release):
                outcomes = dict(self.lost_pushes.values())
                self.carry_out(self.state.worker_released(
                    ins, *self.holder.release(ins.identity, ins.batches, outcomes)))
            elif isinstance(ins, Adopt):
                assert ins.worker in self.alive
            elif isinstance(ins, RestoreHolder):
                self.holder = FakeHolder(ins.version, ins.done)
            elif isinstance(ins, RebuildHolder):
                assert set(ins.workers) <= self.alive
            else:
                assert isinstance(ins, StepApplied | AddHelper | AbandonHolder)

    def oldest(self, tasks):
        """The oldest task of a random identity among ``tasks`` (key -> task...)."""
        identity = lambda v: v[0] if isinstance(v[0], int) else v[0][0]  # noqa: E731
        chosen = self.rng.choice(sorted({identity(v) for v in tasks.values()}))
        return next(k for k, v in tasks.items() if identity(v) == chosen)

    def tick(self):
        roll = self.rng.random()
        if roll < 0.03 and len(self.alive) > 1:
            self.lose(self.rng.choice(sorted(self.alive)))
        elif roll < 0.05 and self.joined < 3:
            self.joined += 1
            worker = f"j{self.joined}"
            self.alive.add(worker)
            self.carry_out(self.state.worker_joined(worker))
        elif roll < 0.08:
            self.keep_restore_point("a checkpoint")
        elif self.queued and (roll < 0.6 or not self.pushed):
            key = self.oldest(self.queued)
            task = self.queued.pop(key)
            self.pushed[key] = (task, self.holder.push(task))
        elif self.pushed:
            task, outcome = self.pushed.pop(self.oldest(self.pushed))
            self.carry_out(self.state.step_done(StepResult(*task, outcome)))

    def lose(self, worker):
        self.alive.discard(worker)
        # the lost worker's pushes the holder applied: their results are lost too
        self.lost_pushes = {k: v for k, v in self.pushed.items()
                            if self.state.addresses[v[0][0]] == worker}
        self.carry_out(self.state.worker_lost([worker]))

    def run(self):
        for epoch in range(self.epochs):
            for _ in range(10_000):  # a batch never applied would keep the epoch open
                if self.state.epoch_done(epoch):
                    break
                self.tick()
            else:
                raise AssertionError(f"epoch {epoch + 1} never ended: {self.state.missing(epoch + 1)}")
            self.keep_restore_point(f"epoch {epoch + 1}")
        self.state.stop()
        for task, outcome in list(self.pushed.values()):
            self.carry_out(self.state.step_done(StepResult(*task, outcome)))
        for task in self.queued.values():
            self.carry_out(self.state.step_done(StepResult(*task, None)))
        self.state.drained({"version": self.holder.version, "dropped": {}, "discarded": 0})


@pytest.mark.parametrize("seed", range(60))
def test_every_batch_is_applied_once_through_losses_growth_and_holder_restores(seed):
    sim = Simulation(seed)
    sim.run()
    state, holder = sim.state, sim.holder
    assert state.missing(sim.epochs) == {}
    # the holder's ledger (the weights that survive) and the client's agree
    survived = {}
    for identity, shard_pass, step in set(holder.applied) | holder.restored:
        shard = state.shard_index.get(identity, identity)
        batch = (shard_pass, step)
        assert batch not in survived.setdefault(shard, set())
        survived[shard].add(batch)
    assert survived == {s: b for s, b in state.applied_batches.items() if b}
    assert not state.in_flight and state.tally.applied == holder.version
    # the records: updates 1..n without a gap, those undone by a restore dropped
    assert [r.update for r in state.tally.updates] == list(range(1, holder.version + 1))


def test_the_simulations_lose_workers_and_holders_and_grow():
    """The randomised runs above do meet every stimulus."""
    seen = {"lost": 0, "holder": 0, "joined": 0}
    for seed in range(60):
        sim = Simulation(seed)
        sim.run()
        seen["lost"] += sum(not c.active for c in sim.state.cursors)
        seen["holder"] += sim.state.generation > 1
        seen["joined"] += sim.joined
    assert all(n >= 10 for n in seen.values()), seen
