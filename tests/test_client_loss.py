"""The client lost: a process running ``dasktf.fit`` is SIGKILLed mid-run, and a
new ``dasktf.fit(..., checkpoint_dir=..., resume=True)`` finishes the run.

The killed client is a script of its own on a LocalCluster the test started (the
workers outlive it, as on a real cluster); it is killed once a checkpoint past the
first epoch's end exists. Sync (default engine, ``shuffle=True`` with a seed): the
resumed run's weights equal the uninterrupted run's. Async: what docs/faults.md
promises, every batch of the requested epochs applied exactly once over the killed
run (up to its checkpoint's cut) and the resumed one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import dasktf
from dasktf.run.checkpoint import FINAL_MODEL, load_latest
from dasktf.testing import own_cluster, wait_until

from .conftest import kill_once_checkpointed, relative_error

pytestmark = [pytest.mark.slow, pytest.mark.timeout(540)]

EPOCHS = 4
BATCH = 64
OPTIONS = dict(n_workers=2, epochs=EPOCHS, batch_size=BATCH, optimizer="adam",
               learning_rate=0.005, seed=11, shuffle=True, checkpoint_every=5, verbose=0)

#: The client that is killed: the same fit, with a client-side pause at each epoch
#: end (callbacks change no weight) so that the kill lands mid-run.
_CLIENT = textwrap.dedent("""
    import json, sys, time
    import keras
    from distributed import Client
    import dasktf

    address, options = sys.argv[1], json.loads(sys.argv[2])
    data = dasktf.load_dataset("digits")
    pause = keras.callbacks.LambdaCallback(on_epoch_end=lambda *_: time.sleep(1.0))
    with Client(address) as client:
        dasktf.fit("mnist-mlp", data.x_train, data.y_train, client=client,
                   callbacks=[pause], **options)
""")


@pytest.fixture(scope="module")
def workers():
    """Two worker processes of this module's own (the killed client's run leaves
    its state there until the workers notice)."""
    with own_cluster(2) as (cluster, client):
        yield cluster, client


def _fit(client, digits, **kw):
    return dasktf.fit("mnist-mlp", digits.x_train, digits.y_train, client=client,
                      **{**OPTIONS, **kw})


def _kill_mid_run(address: str, options: dict) -> None:
    """Run the fit in a client process of its own; SIGKILL it once a checkpoint
    after the first epoch's end exists."""
    # its workers release what it left there 1 s after it is gone (default 30 s)
    env = {**os.environ, "DASK_DASKTF__CLIENT_LOST_TIMEOUT": "1s"}
    proc = subprocess.Popen([sys.executable, "-c", _CLIENT, address, json.dumps(options)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env)
    kill_once_checkpointed(proc, options["checkpoint_dir"], 240)


def _flat(weights):
    return np.concatenate([np.ravel(w) for w in weights])


def _replicas_held(dask_worker=None) -> int:
    from dasktf.runtime.replica import registered_replicas

    return len(registered_replicas(dask_worker))


def test_sync_client_killed_mid_run_resumes_to_the_uninterrupted_weights(
        workers, digits, tmp_path):
    cluster, client = workers
    killed = tmp_path / "killed"
    _kill_mid_run(cluster.scheduler_address, {**OPTIONS, "checkpoint_dir": str(killed)})
    assert not (killed / FINAL_MODEL).exists()  # it did not finish
    # the orphaned replicas are released on the workers once the client is gone
    wait_until(lambda: not any(client.run(_replicas_held).values()), 30,
               "the killed client's replicas released")
    _, manifest, _ = load_latest(killed)
    assert manifest["next_epoch"] < EPOCHS

    resumed = _fit(client, digits, checkpoint_dir=str(killed), resume=True)
    # it went on from the checkpoint: fewer epochs than the run asked for
    assert len(resumed.history["loss"]) == EPOCHS - manifest["next_epoch"]
    full = _fit(client, digits, checkpoint_dir=str(tmp_path / "full"))
    want = _flat(full.model.get_weights())
    assert relative_error(_flat(resumed.model.get_weights()), want) < 1e-6
    # the trained optimizer too: the same updates, the same Adam moments
    got_opt, want_opt = resumed.model.optimizer, full.model.optimizer
    assert int(got_opt.iterations.numpy()) == int(want_opt.iterations.numpy()) > 0
    assert relative_error(_flat([np.asarray(v) for v in got_opt.variables[2:]]),
                          _flat([np.asarray(v) for v in want_opt.variables[2:]])) < 1e-5


def test_async_client_killed_mid_run_resumes_applying_each_batch_once(
        workers, digits, tmp_path):
    cluster, client = workers
    killed = tmp_path / "killed"
    options = {**OPTIONS, "mode": "async", "checkpoint_dir": str(killed)}
    _kill_mid_run(cluster.scheduler_address, options)
    assert not (killed / FINAL_MODEL).exists()
    _, manifest, _ = load_latest(killed)  # the checkpoint the resume starts from
    done = {(int(shard), p, s) for shard, items in manifest["async"]["done"].items()
            for p, s in items}
    assert len(done) == manifest["async"]["version"] > 0

    resumed = _fit(client, digits, mode="async", checkpoint_dir=str(killed), resume=True)
    updates = resumed.updates
    new = list(zip(updates["worker"], updates["shard_pass"], updates["step"], strict=True))
    assert len(new) == len(set(new)) and not set(new) & done  # nothing applied twice
    steps = -(-len(digits.x_train) // BATCH)  # every step has a local batch on both
    owed = {(w, p, s) for w in (0, 1) for p in range(EPOCHS) for s in range(steps)}
    # every batch of the requested epochs applied exactly once over the two runs
    # (a fast worker may run into a further pass before the holder stops it)
    assert {i for i in done | set(new) if i[1] < EPOCHS} == owed
    assert np.isfinite(_flat(resumed.model.get_weights())).all()
    assert (killed / FINAL_MODEL).exists()
