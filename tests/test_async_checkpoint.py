"""Async runs: checkpoints of the parameter holder and resume, with real workers."""

from __future__ import annotations

import json
import time

import dasktf
from dasktf.run.checkpoint import list_checkpoints

ACCURACY = 0.85  # the digits target every training test in the suite uses


def _fit(client, digits, **kw):
    options = dict(client=client, n_workers=2, mode="async", batch_size=64,
                   optimizer="adam", learning_rate=0.005, seed=3, verbose=0,
                   validation_data=(digits.x_test, digits.y_test), metrics=["accuracy"])
    options.update(kw)
    return dasktf.fit("mnist-mlp", digits.x_train, digits.y_train, **options)


def test_async_resume_from_a_mid_run_checkpoint_applies_each_remaining_batch_once(
    client, digits, tmp_path
):
    start = time.monotonic()
    ckpt = tmp_path / "ckpt"
    _fit(client, digits, epochs=1, checkpoint_dir=str(ckpt), checkpoint_every=9)
    # Drop the epoch-end checkpoint: resume from a periodic one taken mid-run, with
    # gradients in flight at the cut (gaps in the applied batches).
    newest = list_checkpoints(ckpt)[0]
    newest.unlink()
    manifest = json.loads(list_checkpoints(ckpt)[0].read_text())
    assert manifest["mode"] == "async"
    done = {(int(shard), p, s) for shard, items in manifest["async"]["done"].items()
            for p, s in items}
    assert len(done) == manifest["async"]["version"] > 0

    epochs = 3
    resumed = _fit(client, digits, epochs=epochs, checkpoint_dir=str(ckpt), resume=True)
    updates = resumed.updates
    assert updates["update"].min() == manifest["async"]["version"] + 1
    new = [(w, p, s) for w, p, s in zip(updates["worker"], updates["shard_pass"],
                                        updates["step"], strict=False)]
    assert len(new) == len(set(new)) and not set(new) & done  # nothing applied twice
    steps = -(-len(digits.x_train) // 64)  # every step has a local batch on both
    owed = {(w, p, s) for w in (0, 1) for p in range(epochs) for s in range(steps)}
    # every batch of the requested epochs applied exactly once over the two runs
    # (a fast worker may run into a further pass before the holder stops it)
    assert {i for i in done | set(new) if i[1] < epochs} == owed
    assert resumed.history["val_accuracy"][-1] > ACCURACY
    assert (ckpt / "model.keras").exists()
    assert time.monotonic() - start < 120


def test_a_restored_cursor_computes_the_gaps_first_then_goes_on():
    from dasktf.engines.holder.cursors import WorkerCursor

    cursor = WorkerCursor([0, 1, 2])
    # pass 0 done but step 1 (in flight at the cut); pass 1 begun with step 0
    cursor.restore({(0, 0), (0, 2), (1, 0)})
    taken = [cursor.take() for _ in range(6)]
    assert taken == [(0, 1), (1, 1), (1, 2), (2, 0), (2, 1), (2, 2)]
    assert (cursor.completed_passes, cursor.done_in_pass) == (1, 0)
