"""Async training over ``num_ps=K`` parameter holders (dasktf.engines.holder.sharded), and the
byte figures of async runs, on the session's 3 worker processes."""

from __future__ import annotations

import json

import keras
import numpy as np
import pytest

import dasktf
from dasktf.cluster.membership import alive_workers
from dasktf.data.base import interleaved_indices, interleaved_schedule
from dasktf.diagnostics.events import unpack
from dasktf.run.checkpoint import list_checkpoints
from dasktf.testing import KillWorkerAt, own_cluster
from dasktf.wire.packets import shard_plan
from tests.conftest import relative_error
from tests.test_async import _check_records, _copy, _mlp
from tests.test_fault import _options, assert_every_batch_applied_once

pytestmark = pytest.mark.timeout(240)

FIT = dict(mode="async", batch_size=48, shuffle=False, verbose=0, seed=0)


def _sequential_reference(initial, x, y, history, batch, n_workers, lr):
    """Sequential SGD over the workers' local batches, in the recorded order."""
    schedule = interleaved_schedule(len(x), batch, n_workers)
    rows = interleaved_indices(schedule, batch)
    offsets = [
        np.concatenate([[0], np.cumsum(schedule[:, i])]) for i in range(n_workers)
    ]
    reference = _copy(initial)
    reference.compile(
        optimizer=keras.optimizers.SGD(lr), loss="sparse_categorical_crossentropy"
    )
    u = history.updates.sort_values("update")
    for w, s in zip(u["worker"], u["step"], strict=False):
        r = rows[w][offsets[w][s] : offsets[w][s + 1]]
        reference.train_on_batch(x[r], y[r])
    return reference.get_weights()


def test_num_ps_2_with_max_staleness_0_is_the_same_sequential_sgd(client, small_digits):
    """K=0: one gradient in flight, so a run is sequential SGD in its recorded
    order (which varies from run to run): num_ps=2 and num_ps=1 each equal their
    single-process replay, so they apply the same updates."""
    x, y = small_digits
    initial, lr = _mlp(), 0.5
    errors = {}
    for num_ps in (1, 2):
        history = dasktf.fit(
            _copy(initial),
            x,
            y,
            client=client,
            n_workers=2,
            max_staleness=0,
            num_ps=num_ps,
            epochs=2,
            optimizer=keras.optimizers.SGD(lr),
            **FIT, loss="sparse_categorical_crossentropy",
        )
        u = history.updates
        assert (u["staleness"] == 0).all() and len(u) >= 2 * 3 * 2
        _check_records(history)
        reference = _sequential_reference(initial, x, y, history, 48, 2, lr)
        errors[num_ps] = max(
            relative_error(a, b) for a, b in zip(history.model.get_weights(), reference, strict=False)
        )
    assert errors[2] < 1e-5 and errors[1] < 1e-5, errors


def test_num_ps_3_equals_num_ps_1_with_adam_on_one_worker(client, small_digits):
    """One worker: the same updates in the same order; Adam's state is split with
    the parameters (element-wise), so the weights agree to float32 round-off."""
    x, y = small_digits
    initial = _mlp()
    runs = {}
    for num_ps in (1, 3):
        runs[num_ps] = dasktf.fit(
            _copy(initial),
            x,
            y,
            client=client,
            n_workers=1,
            num_ps=num_ps,
            epochs=2,
            optimizer=keras.optimizers.Adam(0.01),
            **FIT, loss="sparse_categorical_crossentropy",
        )
    for a, b in zip(runs[3].model.get_weights(), runs[1].model.get_weights(), strict=False):
        assert relative_error(a, b) < 1e-5
    assert runs[3].history["loss"][-1] < runs[3].history["loss"][0]
    assert runs[3].history["loss"] == pytest.approx(runs[1].history["loss"], rel=1e-5)


def test_staleness_bound_holds_with_num_ps_2(client, small_digits):
    x, y = small_digits
    history = dasktf.fit(
        _mlp(),
        x,
        y,
        client=client,
        n_workers=3,
        max_staleness=1,
        num_ps=2,
        epochs=2,
        optimizer=keras.optimizers.SGD(0.5),
        **FIT, loss="sparse_categorical_crossentropy",
    )
    u = history.updates
    assert u["staleness"].max() <= 1
    assert history.history["staleness_max"] == [
        float(u[u.epoch == e]["staleness"].max()) for e in range(2)
    ]
    _check_records(history)


def test_each_holder_receives_only_its_slice(client, small_digits):
    """Counted by the holders themselves: per applied update, holder s receives
    its slice of the gradient (float32 plus a 16-byte header) and nothing else."""
    x, y = small_digits
    model = _mlp(hidden=64)
    shapes = [tuple(v.shape) for v in model.trainable_variables]
    n_params = sum(int(np.prod(s)) for s in shapes)
    history = dasktf.fit(
        model,
        x,
        y,
        client=client,
        n_workers=3,
        num_ps=3,
        epochs=2,
        optimizer=keras.optimizers.SGD(0.5),
        **FIT, loss="sparse_categorical_crossentropy",
    )
    computed = history.gradient_tasks["computed"]
    slices = [sum(b - a for a, b in r) for r in shard_plan(shapes, 3)]
    traffic = history.holder_traffic
    assert len(traffic) == 3
    for size, holder in zip(slices, traffic, strict=False):
        assert holder["received"] / computed == pytest.approx(4 * size + 16, rel=1e-6)
        # the weights a gradient read: at most once per gradient (a worker that
        # already has the version reads nothing)
        assert 0 < holder["sent"] <= (computed + 3) * 4 * size
    # size balanced within one piece; the busiest holder's share of an update
    # (as the workers count it): its slice out, and back unless already there
    h = history.history
    assert max(slices) < 0.45 * n_params
    busiest = 4 * max(slices) + 16
    assert busiest < h["holder_bytes_per_update"][-1] <= 2 * busiest
    assert h["holder_bytes_per_update"][-1] < 0.45 * h["bytes_per_step"][-1]
    _check_records(history)


def test_async_bytes_per_step_in_history(client, small_digits):
    """Per update per worker: the push and the weights pulled for it (float32:
    2 x P x 4, the bound), and about half with fp16 pushes and bf16 weights."""
    x, y = small_digits
    model = _mlp()
    n_params = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    plain = dasktf.fit(
        _copy(model), x, y, client=client, n_workers=2, epochs=2, optimizer="sgd", **FIT, loss="sparse_categorical_crossentropy"
    ).history
    packed = dasktf.fit(
        _copy(model),
        x,
        y,
        client=client,
        n_workers=2,
        epochs=2,
        optimizer="sgd",
        compression="fp16",
        weights_dtype="bf16",
        **FIT, loss="sparse_categorical_crossentropy",
    ).history
    for h in (plain, packed):
        for key in (
            "bytes_per_step",
            "bytes_lower_bound",
            "bytes_bound_ratio",
            "holder_bytes_per_update",
        ):
            assert len(h[key]) == 2, key
    assert plain["bytes_lower_bound"][0] == 2 * n_params * 4
    # a worker pulls nothing when no other update came in since its push: <= 1
    assert 0.5 < plain["bytes_bound_ratio"][-1] <= 1.001
    assert plain["holder_bytes_per_update"] == plain["bytes_per_step"]  # one holder
    assert packed["bytes_per_step"][-1] < 0.6 * plain["bytes_per_step"][-1]


def test_num_ps_beyond_what_the_parameters_split_into_is_refused(client, small_digits):
    x, y = small_digits
    with pytest.raises(ValueError, match=r"num_ps=1000.*cannot be split"):
        dasktf.fit(
            _mlp(),
            x,
            y,
            client=client,
            n_workers=2,
            num_ps=1000,
            epochs=1,
            optimizer="sgd",
            **FIT, loss="sparse_categorical_crossentropy",
        )


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(mode="async", placement="ps"), "num_ps=K"),
        (dict(mode="async", num_ps=2, topology="ring"), "topology"),
    ],
)
def test_async_num_ps_option_checks(kw, match):
    with pytest.raises(ValueError, match=match):
        dasktf.Trainer("mnist-mlp", client=None, scheduler="tcp://127.0.0.1:1", **kw)


def test_async_num_ps_2_checkpoint_and_resume(client, digits, tmp_path):
    """The checkpoint gathers the slices and their optimizer state; resume scatters
    them to the holders: every batch applied once over the two runs."""
    ckpt = tmp_path / "ckpt"
    kw = dict(
        client=client,
        n_workers=2,
        mode="async",
        batch_size=64,
        optimizer="adam",
        learning_rate=0.005,
        seed=3,
        verbose=0,
        num_ps=2,
        validation_data=(digits.x_test, digits.y_test),
        metrics=["accuracy"],
    )
    dasktf.fit(
        "mnist-mlp",
        digits.x_train,
        digits.y_train,
        epochs=1,
        checkpoint_dir=str(ckpt),
        **kw,
    )
    manifest = json.loads(list_checkpoints(ckpt)[0].read_text())
    done = {
        (int(shard), p, s)
        for shard, items in manifest["async"]["done"].items()
        for p, s in items
    }
    resumed = dasktf.fit(
        "mnist-mlp",
        digits.x_train,
        digits.y_train,
        epochs=3,
        checkpoint_dir=str(ckpt),
        resume=True,
        **kw,
    )
    u = resumed.updates
    assert u["update"].min() == manifest["async"]["version"] + 1
    new = set(zip(u["worker"], u["shard_pass"], u["step"], strict=False))
    assert len(new) == len(u) and not new & done  # nothing applied twice
    assert resumed.history["val_accuracy"][-1] > 0.85  # the suite's digits target
    with pytest.raises(ValueError, match="num_ps"):
        dasktf.fit(
            "mnist-mlp",
            digits.x_train,
            digits.y_train,
            epochs=4,
            checkpoint_dir=str(ckpt),
            resume=True,
            **{**kw, "num_ps": 3},
        )


def test_cli_async_ps_2_reports_the_bytes(client):
    from click.testing import CliRunner

    from dasktf.cli import main

    result = CliRunner().invoke(
        main,
        [
            "fit",
            "--scheduler",
            client.scheduler.address,
            "--workers",
            "3",
            "--mode",
            "async",
            "--ps",
            "2",
            "--epochs",
            "1",
            "--batch-size",
            "96",
            "--quiet",
        ],
    )
    assert result.exit_code == 0, result.output
    assert "MB/step/worker" in result.output and "push+pull bound" in result.output


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("victim", [2, 1, 0], ids=["no-holder", "slice-holder", "coordinator"])
def test_num_ps_2_recovers_from_losing_any_worker(digits, victim):
    """The holders are on workers 0 (the coordinator) and 1 (slice 1); worker 2
    holds none. One worker is SIGKILLed halfway and its shard goes to a survivor.
    A holder's loss rebuilds both holders on the survivors from the last epoch
    end's cut of both slices and redoes the updates after it. Over the run every
    batch of every shard's passes is applied exactly once."""
    epochs = 3
    with own_cluster(3) as (_, client):
        workers = alive_workers(client)
        steps = -(-len(digits.x_train) // 64)
        # mid-way through the second epoch, after the first epoch end's cut
        killer = KillWorkerAt(client, workers[victim], step=steps // 2, epoch=epochs // 2)
        history = dasktf.fit(
            "mnist-mlp", digits.x_train, digits.y_train, client=client, n_workers=3,
            mode="async", num_ps=2, callbacks=[killer],
            validation_data=(digits.x_test, digits.y_test),
            **_options(epochs=epochs, learning_rate=0.005),
        )
        assert killer.killed_at is not None
        (recovery,) = history.recoveries
        print("recovery:", recovery)
        assert recovery["lost"] == [workers[victim]]
        assert recovery["moved"][0][0] == victim
        # the successor, identity 3, carried on the lost worker's shard
        assert_every_batch_applied_once(history, epochs, steps, {3: victim})
        # a sanity bound (chance is 0.1): async interleavings, and so the trajectory,
        # vary from run to run (0.84-0.9 seen); exactness is the line above
        assert history.history["val_accuracy"][-1] > 0.8
        if victim == 2:
            assert "holder" not in recovery
            return
        holder = recovery["holder"]
        survivors = [w for w in workers if w != workers[victim]]
        assert sorted(holder["workers"]) == survivors  # one slice on each
        assert holder["worker"] == holder["workers"][0]
        assert holder["source"] == "the last epoch end" and holder["redone"] > 0
        records = [r for e in client.get_events("dasktf-metrics")
                   for r in unpack(e) if r.get("run") == history.run_id]
        (event,) = [r for r in records if r["kind"] == "recovered"]
        assert list(event["holder"]["workers"]) == holder["workers"]
