"""Checkpoints: atomic files, resume reproduces the uninterrupted run, a corrupt
newest checkpoint falls back to the previous one, a killed client resumes."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import keras
import numpy as np
import pytest

import dasktf
from dasktf.run.checkpoint import (
    CheckpointWarning,
    list_checkpoints,
    load_latest,
    save_checkpoint,
)
from dasktf.testing import wait_until

from .conftest import relative_error


def _flat(weights):
    return np.concatenate([np.ravel(w) for w in weights])


def _fit(client, x, y, **kw):
    options = dict(client=client, n_workers=2, epochs=3, batch_size=64, optimizer="adam",
                   learning_rate=0.01, seed=5, verbose=0)
    options.update(kw)
    return dasktf.fit("mnist-mlp", x, y, **options)


def test_files_are_whole_kept_three_and_checked(tmp_path):
    state = {"weights": [np.arange(6.0).reshape(2, 3)], "optimizer": [np.ones(2)], "applied": 0}
    for applied in range(5):
        save_checkpoint(tmp_path, {**state, "applied": applied}, {"next_epoch": 0})
    kept = list_checkpoints(tmp_path)
    assert [p.name for p in kept] == [f"ckpt-{n:09d}.json" for n in (5, 4, 3)]
    assert not list(tmp_path.glob(".*tmp*"))  # no temporary left behind
    kept[0].with_suffix(".npz").write_bytes(b"cut short")
    with pytest.warns(CheckpointWarning, match="ckpt-000000005.json"):
        loaded, manifest, path = load_latest(tmp_path)
    assert path == kept[1] and loaded["applied"] == 3 and manifest["next_epoch"] == 0
    np.testing.assert_array_equal(loaded["weights"][0], state["weights"][0])


def test_resume_from_a_corrupt_newest_checkpoint_reproduces_the_uninterrupted_run(
    client, digits, tmp_path
):
    x, y = digits.x_train, digits.y_train
    full = _fit(client, x, y, checkpoint_dir=str(tmp_path / "full"))
    saved = keras.models.load_model(tmp_path / "full" / "model.keras")
    np.testing.assert_array_equal(_flat(saved.get_weights()), _flat(full.model.get_weights()))

    # Stopped after 2 of 3 epochs, checkpoints every 7 steps and at each epoch end.
    part = tmp_path / "part"
    _fit(client, x, y, epochs=2, checkpoint_dir=str(part), checkpoint_every=7)
    newest = list_checkpoints(part)[0]
    assert json.loads(newest.read_text())["next_epoch"] == 2
    data = newest.with_suffix(".npz")
    data.write_bytes(data.read_bytes()[:100])  # a torn write the rename guards against
    with pytest.warns(CheckpointWarning, match="falling back"):
        resumed = _fit(client, x, y, checkpoint_dir=str(part), resume=True)
    # It resumed mid-epoch 2 (the previous checkpoint), trained on to epoch 3 ...
    assert len(resumed.history["loss"]) == 2
    # ... and reached the uninterrupted run's weights.
    assert relative_error(_flat(resumed.model.get_weights()), _flat(full.model.get_weights())) < 1e-6


def _cli(*args):
    return [sys.executable, "-m", "dasktf.cli", "fit", "--workers", "2", "--epochs", "3",
            "--batch-size", "64", "--seed", "2", "--no-validation", "--quiet", *args]


@pytest.mark.slow
def test_killed_client_resumes_to_the_uninterrupted_weights(cluster, tmp_path):
    """`dasktf fit --checkpoint-dir` is SIGKILLed after a checkpoint; `--resume`
    finishes the run; the final model equals an uninterrupted run's."""
    address = ["--scheduler", cluster.scheduler_address]
    ckpt = tmp_path / "killed"
    proc = subprocess.Popen(_cli(*address, "--checkpoint-dir", str(ckpt),
                                 "--checkpoint-every", "5"),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_until(lambda: proc.poll() is not None or any(
            json.loads(p.read_text())["next_epoch"] >= 1 for p in list_checkpoints(ckpt)),
            180, "a checkpoint after the first epoch", interval=0.2)
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not (ckpt / "model.keras").exists()
    resumed = subprocess.run(_cli(*address, "--checkpoint-dir", str(ckpt), "--resume"),
                             capture_output=True, text=True, timeout=240)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    assert "resumed from" in resumed.stdout
    full = subprocess.run(_cli(*address, "--checkpoint-dir", str(tmp_path / "full")),
                          capture_output=True, text=True, timeout=240)
    assert full.returncode == 0, full.stderr[-2000:]
    a = keras.models.load_model(ckpt / "model.keras").get_weights()
    b = keras.models.load_model(tmp_path / "full" / "model.keras").get_weights()
    assert relative_error(_flat(a), _flat(b)) < 1e-6
