"""Checkpoints: atomic files, resume reproduces the uninterrupted run, a corrupt
newest checkpoint falls back to the previous one, a killed client resumes."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import warnings

import keras
import numpy as np
import pytest

import dasktf
from dasktf.run.checkpoint import (
    CheckpointWarning,
    keras_file,
    list_checkpoints,
    load_latest,
    read_checkpoint,
    save_checkpoint,
)

from .conftest import kill_once_checkpointed, relative_error


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


def test_a_format_1_checkpoint_without_keras_file_still_loads(tmp_path):
    """What checkpoints were before they held the .keras model: npz + manifest."""
    state = {"weights": [np.arange(6.0).reshape(2, 3)], "optimizer": [np.ones(2)], "applied": 4}
    path = save_checkpoint(tmp_path, state, {"next_epoch": 1})  # no model: format 1
    manifest = json.loads(path.read_text())
    assert manifest["format"] == 1 and "keras" not in manifest
    assert keras_file(path) is None and sorted(p.suffix for p in tmp_path.iterdir()) == [
        ".json", ".npz"]
    loaded, manifest, found = load_latest(tmp_path)
    assert found == path and loaded["applied"] == 4 and manifest["next_epoch"] == 1
    np.testing.assert_array_equal(loaded["optimizer"][0], np.ones(2))


def _loaded_model(path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = keras.models.load_model(path)
    assert not [w for w in caught if "Skipping variable loading" in str(w.message)]
    return model


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_each_checkpoint_holds_the_model_as_keras_saves_it(client, digits, tmp_path, mode):
    """Every checkpoint's .keras opens with ``keras.models.load_model``: the
    checkpoint's weights and its trained optimizer (iterations = the updates
    applied, Adam's moments); a torn .keras makes its checkpoint invalid."""
    x, y = digits.x_train, digits.y_train
    _fit(client, x, y, epochs=1, checkpoint_dir=str(tmp_path), checkpoint_every=9,
         mode=mode)
    paths = list_checkpoints(tmp_path)
    assert len(paths) >= 2
    for path in paths:
        state, manifest = read_checkpoint(path)
        assert manifest["format"] == 2
        for value in manifest.values():  # plain JSON: no pickled object, no class path
            assert isinstance(value, (str, int, float, bool, list, dict, type(None)))
        model = _loaded_model(keras_file(path))
        assert int(model.optimizer.iterations.numpy()) == state["applied"] + 1
        for got, want in zip(model.get_weights(), state["weights"], strict=True):
            np.testing.assert_array_equal(got, want)
        variables = model.optimizer.variables
        assert len(variables) == len(state["optimizer"])
        for v, want in zip(variables, state["optimizer"], strict=True):
            np.testing.assert_array_equal(np.asarray(v), want)
    archive = keras_file(paths[0])
    archive.write_bytes(archive.read_bytes()[:-10])
    with pytest.warns(CheckpointWarning, match="SHA-256 mismatch"):
        assert load_latest(tmp_path)[2] == paths[1]


def test_an_async_run_in_rounds_keeps_the_outer_optimizer_out_of_the_keras_file(
        client, digits, tmp_path):
    """Async rounds of local steps: the holder's optimizer is the outer one (here an
    Adam like the model's own); the .keras holds the model's optimizer fresh, not
    the outer one's state under its name."""
    _fit(client, digits.x_train, digits.y_train, epochs=1, mode="async", local_steps=2,
         outer_optimizer=keras.optimizers.Adam(0.01), checkpoint_dir=str(tmp_path))
    path = list_checkpoints(tmp_path)[0]
    state, _ = read_checkpoint(path)
    assert int(np.ravel(state["optimizer"][0])[0]) > 0  # the outer Adam's iterations
    model = _loaded_model(keras_file(path))
    assert len(model.optimizer.variables) == len(state["optimizer"])
    assert int(model.optimizer.iterations.numpy()) == 0
    for got, want in zip(model.get_weights(), state["weights"], strict=True):
        np.testing.assert_array_equal(got, want)


#: A writer that saves one checkpoint, then a second one during which it blocks
#: (as a slow disk would) at the ``stage``-th fsync: 1 the .npz's temporary file, 2
#: the .keras', 3 the manifest's. The test SIGKILLs it there.
_WRITER = textwrap.dedent("""
    import os, sys, time
    import numpy as np
    from dasktf.run import checkpoint

    directory, stage = sys.argv[1], int(sys.argv[2])
    state = {"weights": [np.full((256, 1024), 1.0, "float32")],
             "optimizer": [np.zeros(3)], "applied": 0}
    checkpoint.save_checkpoint(directory, state, {"next_epoch": 1}, model=b"first" * 1000)
    calls, fsync = [], os.fsync

    def slow_fsync(fd):
        calls.append(fd)
        if len(calls) == stage:
            print("blocked", flush=True)
            time.sleep(300)
        fsync(fd)

    os.fsync = slow_fsync
    state = {**state, "weights": [np.full((256, 1024), 2.0, "float32")], "applied": 1}
    checkpoint.save_checkpoint(directory, state, {"next_epoch": 2}, model=b"second" * 1000)
""")


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_writer_killed_mid_checkpoint_leaves_the_previous_one_loadable(tmp_path, stage):
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path), str(stage)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        line = proc.stdout.readline()  # blocks until the writer is mid-checkpoint
        assert line.strip() == "blocked", line + proc.communicate(timeout=60)[0][-2000:]
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    temporary = list(tmp_path.glob(".*.tmp-*"))
    assert len(temporary) == 1  # the file being written, never renamed into place
    assert len(list_checkpoints(tmp_path)) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing corrupt to skip: no warning
        state, manifest, path = load_latest(tmp_path)
    assert state["applied"] == 0 and manifest["next_epoch"] == 1
    assert keras_file(path).read_bytes() == b"first" * 1000
    np.testing.assert_array_equal(state["weights"][0], 1.0)
    # The next checkpoint written there removes what the killed writer left, and
    # nothing else.
    (tmp_path / ".notes.tmp-1").write_text("the user's")
    save_checkpoint(tmp_path, {**state, "applied": 5}, {"next_epoch": 3}, model=b"third")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [".notes.tmp-1", *(f"ckpt-{n:09d}{suffix}" for n in (1, 6)
                           for suffix in (".json", ".npz", ".keras"))])


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
    kill_once_checkpointed(proc, ckpt, 180)
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
