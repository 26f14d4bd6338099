"""``engine="p2p"``: exact sync training with no scheduler task per step.

One long-running task per worker per segment sums each step's gradient with its
peers over the workers' own comms. What the graph engine promises holds here too,
tested on real worker processes: equal to single-process Keras (1 and 3 workers;
weights, dict inputs, BatchNorm, rounds, a codec); ``stop_training`` stops every
replica after the same update; checkpoints on the step grid resume to the
uninterrupted run; a SIGKILLed worker (between updates, at an epoch's start, in
the middle of the all-reduce itself: deterministic hooks on the worker) costs no
update and the final weights are the uninterrupted run's; nothing new listens; TLS
gives the same weights; ``engine="auto"`` picks p2p where it runs.
"""

from __future__ import annotations

import json
import os
from typing import Any

import dask
import keras
import numpy as np
import psutil
import pytest
from distributed import Client

import dasktf
from dasktf.cluster.membership import alive_workers
from dasktf.diagnostics.events import TOPIC, unpack
from dasktf.run.checkpoint import list_checkpoints
from dasktf.run.engine import resolve_engine
from dasktf.run.options import TrainOptions
from dasktf.testing import kill_worker_at_update, own_cluster, wait_until
from tests.conftest import relative_error
from tests.test_batchnorm import ReadReplicas, _bn, _shifted, bn_model
from tests.test_keras_parity import (
    _assert_same_weights,
    _data,
    _mlp,
    _twin,
    _two_headed,
)
from tests.test_security import SocketWatch, _listening


def _model(seed: int = 7) -> keras.Model:
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((8, 8)), keras.layers.Flatten(),
                             keras.layers.Dense(32, activation="sigmoid"),
                             keras.layers.Dense(10, activation="softmax")])


def _records(client, run_id, kind):
    return [r for e in client.get_events(TOPIC) for r in unpack(e)
            if r.get("run") == run_id and r.get("kind") == kind]


def _flat(weights):
    return np.concatenate([np.ravel(w) for w in weights])


# -- equal to Keras ---------------------------------------------------------------------
@pytest.mark.parametrize("n_workers", [1, 3])
def test_p2p_matches_single_process_keras(client, small_digits, n_workers):
    x, y = small_digits  # 250 rows at batch 48: the last step of 10 rows, uneven shares
    reference = _model()
    ours, initial = _twin(reference), [w.copy() for w in reference.get_weights()]
    reference.compile(optimizer=keras.optimizers.Adam(0.01),
                      loss="sparse_categorical_crossentropy")
    want = reference.fit(x, y, batch_size=48, epochs=2, shuffle=False, verbose=0)
    history = dasktf.fit(ours, x, y, client=client, n_workers=n_workers, epochs=2,
                         batch_size=48, optimizer=keras.optimizers.Adam(0.01),
                         loss="sparse_categorical_crossentropy", shuffle=False, seed=0,
                         verbose=0, engine="p2p")
    assert history.engine == "p2p" and history.params["engine"] == "p2p"
    _assert_same_weights(history.model, reference, initial)
    np.testing.assert_allclose(history.history["loss"], want.history["loss"], rtol=1e-5)
    # every replica applied every update once, in order
    steps = 2 * -(-len(x) // 48)
    assert history.applied_updates == {i: list(range(steps)) for i in range(n_workers)}
    # no scheduler task per step: one task per worker per epoch (no checkpoints)
    assert {r["engine"] for r in _records(client, history.run_id, "run_start")} == {"p2p"}
    if n_workers > 1:  # bytes against the bound, as the graph engine reports them
        assert history.history["bytes_per_step"][-1] > 0
        assert history.history["bytes_bound_ratio"][-1] >= 0.99


def _applied_updates_here(run_id: str) -> list[int]:
    """On a worker: the updates its replicas of ``run_id`` have applied so far."""
    from dasktf.runtime.replica import replicas_of

    return [r.applied + 1 for r in replicas_of(run_id)]


def _probe_at_step(update: int, dask_worker: Any = None) -> None:
    """On a worker: as its replica's step of ``update`` begins, the segment submits
    a probe task to this same worker and waits for it (at most 30 s): it runs only
    if the segment left the worker's one thread free."""
    from distributed import get_client

    from dasktf.runtime.manager import run_manager

    worker = dask_worker
    worker._dasktf_probe = None

    def probe(replica: Any, u: int) -> None:
        if u != update:
            return
        future = get_client().submit(_applied_updates_here, replica.run_id,
                                     workers=[worker.address],
                                     allow_other_workers=False, pure=False)
        try:
            worker._dasktf_probe = future.result(timeout=30)
        except TimeoutError:
            worker._dasktf_probe = "the probe did not run within 30 s"

    probe.dasktf_test_probe = True  # type: ignore[attr-defined]
    run_manager(worker).step_hooks.append(probe)


def _probe_result(dask_worker: Any = None) -> Any:
    _remove_test_hooks(dask_worker)
    return dask_worker._dasktf_probe


@pytest.mark.timeout(240)
def test_a_segment_leaves_its_workers_free_for_other_tasks(client, digits):
    """A segment waits on its peers every step for a whole epoch; it leaves the
    worker's thread pool, so another task (a prediction, a second user's run, a
    search fitting in parallel) runs on the same one-thread workers meanwhile
    instead of queueing behind the epoch (two p2p runs each holding the slot a peer
    of the other waits for would deadlock). Mid-epoch, each worker's segment asks
    for a task on its own worker and waits for it."""
    x, y = digits.x_train, digits.y_train
    steps = -(-len(x) // 16)  # one epoch of 90 steps
    workers = alive_workers(client)
    client.run(_probe_at_step, 5, workers=workers)
    try:
        history = dasktf.fit("mnist-mlp", x, y, client=client, n_workers=3, epochs=1,
                             batch_size=16, seed=0, verbose=0, engine="p2p")
    finally:
        seen = client.run(_probe_result, workers=workers)
    assert len(history.history["loss"]) == 1
    # each probe ran while its worker's replica was mid-epoch (update 4 pending, the
    # 4 before applied), not after the segment
    counts = [n for w in workers for n in (seen[w] if isinstance(seen[w], list) else [-1])]
    assert len(counts) == 3 and all(0 < n < steps for n in counts), (seen, steps)


@pytest.mark.timeout(240)
def test_two_runs_sharing_the_workers_both_finish_as_if_alone(client, small_digits):
    """Two p2p runs at once on the same three workers: each trains what it trains
    alone."""
    import threading

    x, y = small_digits

    def fit(seed):
        return dasktf.fit("mnist-mlp", x, y, client=client, n_workers=3, epochs=2,
                          batch_size=50, seed=seed, verbose=0, engine="p2p")

    alone = {seed: _flat(fit(seed).model.get_weights()) for seed in (1, 2)}
    together, errors = {}, []

    def run(seed):
        try:
            together[seed] = _flat(fit(seed).model.get_weights())
        except Exception as exc:  # noqa: BLE001 (the test thread reports it)
            errors.append(exc)

    # a deadlock ends in the group's bounded wait, not the test's timeout
    with dask.config.set({"dasktf.p2p.timeout": "60s"}):
        threads = [threading.Thread(target=run, args=(seed,)) for seed in (1, 2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
    assert not errors, errors
    for seed in (1, 2):
        np.testing.assert_array_equal(together[seed], alone[seed])


def test_p2p_weights_and_dict_inputs_match_keras(client, digits):
    """Sample weights on a dict-input, dict-output model, then class weights."""
    d = _data(n=240)
    reference = _two_headed()
    ours, initial = _twin(reference), [w.copy() for w in reference.get_weights()]
    weights = np.linspace(0.5, 2.0, 240).astype("float32")
    args = dict(loss={"label": "sparse_categorical_crossentropy", "score": "mse"},
                loss_weights={"label": 1.0, "score": 0.3})
    for m in (reference, ours):
        m.compile(optimizer=keras.optimizers.Adam(0.02), **args)
    x = {"image": d["image"], "meta": d["meta"]}
    y = {"label": d["label"], "score": d["score"]}
    sample_weight = {"label": np.ones_like(weights), "score": weights}
    reference.fit(x, y, sample_weight=sample_weight, batch_size=40, epochs=2,
                  shuffle=False, verbose=0)
    history = dasktf.fit(ours, x, y, sample_weight=sample_weight, client=client,
                         n_workers=3, batch_size=40, epochs=2, shuffle=False, verbose=0,
                         engine="p2p")
    _assert_same_weights(history.model, reference, initial)

    x, y = digits.x_train[:260].reshape(260, -1), digits.y_train[:260]
    reference = _mlp(seed=5)
    ours, initial = _twin(reference), [w.copy() for w in reference.get_weights()]
    for m in (reference, ours):
        m.compile(optimizer=keras.optimizers.SGD(0.4), loss="sparse_categorical_crossentropy")
    class_weight = {0: 4.0, 3: 0.25, 7: 2.0}
    reference.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0,
                  class_weight=class_weight)
    history = dasktf.fit(ours, x, y, client=client, n_workers=3, batch_size=64, epochs=2,
                         shuffle=False, verbose=0, class_weight=class_weight, engine="p2p")
    _assert_same_weights(history.model, reference, initial)


def test_p2p_batchnorm_statistics_are_averaged_like_the_graph_engine(client, digits):
    x, y, xt, yt = _shifted(digits)
    runs = {}
    for engine in ("graph", "p2p"):
        reader = ReadReplicas(client)
        runs[engine] = dasktf.fit(
            bn_model, x, y, client=client, n_workers=3, epochs=2, batch_size=64,
            # SGD: Adam turns the two engines' different orders of adding the same
            # gradients (an ulp) into larger differences than the statistics'
            optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy",
            metrics=["accuracy"], validation_data=(xt, yt), seed=3, verbose=0,
            engine=engine, callbacks=[reader])
        if engine == "p2p":  # the replicas agree again, and the client holds it
            for by_worker, client_stats in reader.seen:
                replicas = [s[runs[engine].run_id] for s in by_worker.values()
                            if runs[engine].run_id in s]
                assert len(replicas) == 3
                for other in [*replicas[1:], client_stats]:
                    for got, want in zip(other, replicas[0], strict=True):
                        np.testing.assert_array_equal(got, want)
    # the same statistics (p2p averages them in float64, the graph engine in float32)
    for a, b in zip(_bn(runs["p2p"].model).weights, _bn(runs["graph"].model).weights,
                    strict=True):
        assert relative_error(np.asarray(a), np.asarray(b)) < 1e-5
    np.testing.assert_allclose(runs["p2p"].history["val_accuracy"],
                               runs["graph"].history["val_accuracy"], atol=1e-6)


def test_p2p_rounds_and_a_codec_match_the_graph_engine(client, small_digits):
    """Rounds of local steps (the sums are rounds' changes) equal the graph
    engine's; with fp16 the sums stay close and the bytes halve."""
    x, y = small_digits
    kw = dict(client=client, n_workers=3, epochs=2, batch_size=32, optimizer="adam",
              learning_rate=0.01, seed=2, verbose=0, shuffle=False)
    rounds = {e: dasktf.fit("mnist-mlp", x, y, local_steps=3, engine=e, **kw)
              for e in ("graph", "p2p")}
    assert relative_error(_flat(rounds["p2p"].model.get_weights()),
                          _flat(rounds["graph"].model.get_weights())) < 1e-5
    assert rounds["p2p"].history["rounds"] == rounds["graph"].history["rounds"]
    plain = dasktf.fit("mnist-mlp", x, y, engine="p2p", **kw)
    with dask.config.set({"dasktf.p2p.algorithm": "direct"}):
        packed = dasktf.fit("mnist-mlp", x, y, engine="p2p", compression="fp16", **kw)
    diff = max(float(np.abs(a - b).max()) for a, b in
               zip(packed.model.get_weights(), plain.model.get_weights(), strict=True))
    assert 0 < diff < 0.05
    # direct: each worker sends and receives the allreduce bound, here in fp16
    assert packed.history["bytes_bound_ratio"][-1] == pytest.approx(0.5, abs=0.01)
    assert packed.history["bytes_per_step"][-1] < 0.6 * plain.history["bytes_per_step"][-1]


# -- stopping, checkpoints ------------------------------------------------------------
class StopAt(keras.callbacks.Callback):
    def __init__(self, batch):
        super().__init__()
        self.batch = batch

    def on_train_batch_end(self, batch, logs=None):
        if batch >= self.batch:
            self.model.stop_training = True


def _wait_for_stop_at(update: int, dask_worker: Any = None) -> None:
    """On a worker: its replica's step of ``update`` waits (at most 30 s) until the
    client's stop request reached this worker, so that a fast epoch cannot end
    before the request arrives."""
    from dasktf.runtime.manager import run_manager
    from dasktf.runtime.p2p.links import link

    address = dask_worker.address

    def wait(replica: Any, u: int) -> None:
        if u == update:  # (the client hears the steps so far: the records go out)
            replica.events.flush()
            wait_until(lambda: link(replica.run_id, address).stop, 30, "the stop request")

    wait.dasktf_test_probe = True  # type: ignore[attr-defined]
    run_manager(dask_worker).step_hooks.append(wait)


def _remove_test_hooks(dask_worker: Any = None) -> None:
    from dasktf.runtime.manager import run_manager

    hooks = run_manager(dask_worker).step_hooks
    hooks[:] = [h for h in hooks if not getattr(h, "dasktf_test_probe", False)]


def test_stop_training_stops_every_replica_after_the_same_update(client, digits):
    workers = alive_workers(client)
    client.run(_wait_for_stop_at, 40, workers=workers)
    try:
        history = dasktf.fit("mnist-mlp", digits.x_train, digits.y_train, client=client,
                             n_workers=3, epochs=3, batch_size=16, seed=1, verbose=0,
                             engine="p2p", callbacks=[StopAt(3)], slow_workers={1: 3.0})
    finally:
        client.run(_remove_test_hooks, workers=workers)
    assert len(history.history["loss"]) == 1  # the epoch ended early, the run stopped
    logs = list(history.applied_updates.values())
    assert all(log == logs[0] for log in logs) and logs[0] == list(range(len(logs[0])))
    steps = -(-len(digits.x_train) // 16)
    assert 4 <= len(logs[0]) < steps
    (stopped,) = _records(client, history.run_id, "stopped")
    assert stopped["update"] == logs[0][-1]
    # every worker stopped within two updates of the request reaching it
    assert stopped["update"] - stopped["requested_after"] <= 2, stopped


def test_terminate_on_nan_stops_the_workers_at_the_step(client):
    data = dasktf.load_dataset("exp")
    history = dasktf.fit("exp-mlp", data.x_train, data.y_train, client=client,
                         n_workers=2, epochs=3, batch_size=50, optimizer="sgd",
                         learning_rate=1e6, seed=0, verbose=0, engine="p2p",
                         callbacks=[keras.callbacks.TerminateOnNaN()])
    assert len(history.history["loss"]) == 1
    assert not np.isfinite(history.history["loss"][-1])
    (stopped,) = _records(client, history.run_id, "stopped")
    steps = -(-len(data.x_train) // 50)
    assert stopped["update"] < steps - 1 and stopped["reason"] == "a non-finite loss"


def test_checkpoints_on_the_step_grid_resume_to_the_uninterrupted_run(client, digits,
                                                                      tmp_path):
    x, y = digits.x_train, digits.y_train
    kw = dict(client=client, n_workers=3, epochs=3, batch_size=64, optimizer="adam",
              learning_rate=0.01, seed=5, verbose=0, engine="p2p")
    full = dasktf.fit("mnist-mlp", x, y, **kw)
    part = tmp_path / "part"
    dasktf.fit("mnist-mlp", x, y, **{**kw, "epochs": 2}, checkpoint_dir=str(part),
               checkpoint_every=7)
    manifests = [json.loads(p.read_text()) for p in list_checkpoints(part)]
    assert manifests[0]["next_epoch"] == 2 and manifests[1]["next_step"] == 21
    for newest in list_checkpoints(part)[:1]:  # resume mid-epoch 2, from step 21
        newest.unlink()
        newest.with_suffix(".npz").unlink()
    resumed = dasktf.fit("mnist-mlp", x, y, **kw, checkpoint_dir=str(part), resume=True)
    assert len(resumed.history["loss"]) == 2
    assert relative_error(_flat(resumed.model.get_weights()),
                          _flat(full.model.get_weights())) < 1e-6


# -- a lost worker ----------------------------------------------------------------------
EPOCHS, BATCH = 3, 64


def _fault_fit(client, digits, **kw):
    return dasktf.fit("mnist-mlp", digits.x_train, digits.y_train, client=client,
                      n_workers=3, epochs=EPOCHS, batch_size=BATCH, optimizer="sgd",
                      learning_rate=0.2, metrics=["accuracy"], seed=4, verbose=0,
                      engine="p2p", **kw)


@pytest.fixture(scope="module")
def uninterrupted(cluster, digits):
    with Client(cluster) as client:
        client.wait_for_workers(3, timeout=60)
        return _fault_fit(client, digits).model.get_weights()


# (rank, update, where): updates of the last epoch, so no re-form builds fresh replicas
# whose logs would hide an update applied twice. 1,438 digits at 64: 23 steps an epoch.
KILLS = {
    "between-updates": (2, 2 * 23 + 9, "step"),
    # rank 0 of three is the one the fold hands its buffer to: killed once its first
    # exchange message was acknowledged, rank 1 completes the update, rank 2 cannot
    "during-the-allreduce": (0, 2 * 23 + 5, "allreduce"),
    "at-an-epoch-start": (1, 2 * 23, "step"),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(KILLS.values()), ids=list(KILLS))
@pytest.mark.timeout(300)
def test_a_sigkilled_worker_costs_no_update(digits, uninterrupted, case):
    rank, update, where = case
    with own_cluster(3) as (_, client):
        workers = alive_workers(client)
        kill_worker_at_update(client, workers[rank], update, where)
        history = _fault_fit(client, digits)
        (recovery,) = history.recoveries
        assert recovery["lost"] == [workers[rank]] and recovery["steps_lost"] == 0
        survivors = sorted(history.applied_updates)
        assert len(survivors) == 2
        for log in history.applied_updates.values():  # each update once, none skipped
            assert log == list(range(EPOCHS * 23))
        if where == "allreduce":  # the survivors stood one update apart: reconciled
            assert sorted(recovery["survivors_applied"]) == [update - 1, update]
            assert recovery["resumed_at_update"] == update + 1
        else:
            assert recovery["survivors_applied"] == [update - 1] * 2
            assert recovery["resumed_at_update"] == update
        lost = _records(client, history.run_id, "worker_lost")
        assert lost and lost[0]["worker_address"] == workers[rank]
    got, want = _flat(history.model.get_weights()), _flat(uninterrupted)
    assert relative_error(got, want) < 1e-5


# -- security and the choice of engine ---------------------------------------------------
def test_p2p_listens_on_nothing_new(client, small_digits):
    x, y = small_digits
    before = {(ip, port) for ip, port, _ in _listening(psutil.Process())}
    with SocketWatch(os.getpid()) as watch:
        history = dasktf.fit("mnist-mlp", x, y, client=client, n_workers=3, epochs=2,
                             batch_size=32, verbose=0, engine="p2p")
    assert history.engine == "p2p"
    assert len({port for _, port, _ in watch.seen}) >= 4, watch.seen  # it did look
    assert not watch.beyond_loopback(), sorted(watch.seen)
    assert {(ip, port) for ip, port, _ in watch.seen} <= before, sorted(watch.seen)


def _transports() -> dict[str, int]:
    from dasktf.runtime.p2p.group import collectives_by_transport

    return dict(collectives_by_transport)


@pytest.mark.timeout(240)
def test_a_tls_cluster_trains_and_equals_the_plain_one(client, small_digits):
    from distributed.security import Security

    x, y = small_digits
    kw = dict(epochs=2, batch_size=50, seed=0, verbose=0, shuffle=False, engine="p2p")
    trainer = dasktf.Trainer("mnist-mlp", n_workers=2, security=Security.temporary(),
                             seed=0, engine="p2p")
    with trainer:
        assert trainer.client.scheduler.address.startswith("tls://127.0.0.1:")
        tls = trainer.fit(x, y, **{k: v for k, v in kw.items() if k not in ("seed",
                                                                            "engine")})
        used = trainer.client.run(_transports)
    assert all(w.startswith("tls://") for w in tls.workers) and tls.engine == "p2p"
    # every step's all-reduce (10: 250 rows, batch 50, 2 epochs) went on the
    # training threads' own TLS sockets
    assert len(used) == 2 and all(set(u) == {"direct"} and u["direct"] >= 10
                                  for u in used.values()), used
    plain = dasktf.fit("mnist-mlp", x, y, client=client, n_workers=2, **kw)
    assert relative_error(_flat(tls.model.get_weights()),
                          _flat(plain.model.get_weights())) < 1e-6


def test_auto_picks_p2p_for_plain_sync_and_graph_for_the_rest(client, small_digits):
    def chosen(**kw):
        o = TrainOptions("mnist-mlp", **kw)
        return resolve_engine(o.engine, o.mode, o.sync_quorum, o.comm)

    assert chosen() == "p2p"
    assert chosen(local_steps=4, compression="int8") == "p2p"
    for kw in ({"mode": "async"}, {"sync_quorum": 2}, {"num_ps": 2},
               {"topology": "ring"}):
        assert chosen(**kw) == "graph", kw
    assert chosen(engine="graph") == "graph" and chosen(engine="collective") == "collective"
    for kw, named in (({"mode": "async"}, "async"), ({"sync_quorum": 2}, "sync_quorum"),
                      ({"num_ps": 2}, "num_ps"), ({"topology": "naive"}, "topology")):
        with pytest.raises(ValueError, match=named):
            TrainOptions("mnist-mlp", engine="p2p", **kw)
    x, y = small_digits
    history = dasktf.fit("mnist-mlp", x, y, client=client, n_workers=2, epochs=1,
                         batch_size=50, verbose=0)
    assert history.engine == "p2p" and history.params["engine"] == "p2p"
    quorum = dasktf.fit("mnist-mlp", x, y, client=client, n_workers=2, epochs=1,
                        batch_size=50, verbose=0, sync_quorum=1)
    assert quorum.engine == "graph"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_round_in_flight_is_redone_from_its_start(digits):
    """local_steps=4: a worker killed as round 14 (epoch 2's third) begins; the
    survivors had begun it too, and redo it from its start (weights, inner state)."""
    with own_cluster(3) as (_, client):
        workers = alive_workers(client)
        kill_worker_at_update(client, workers[2], 14, "step")
        history = _fault_fit(client, digits, local_steps=4)
        (recovery,) = history.recoveries
        assert recovery["steps_lost"] == 0 and recovery["resumed_at_update"] == 14
        for log in history.applied_updates.values():
            assert log == list(range(EPOCHS * 6))  # each round's update once
        assert [r["update"] for r in history.rounds if r["redone"]] == [14]
