"""A client that loses its scheduler mid-run exits with a message naming the
scheduler and the last checkpoint (no hang).

The scheduler and workers are real processes this test starts on 127.0.0.1 and
kills; everything is bounded in time and cleaned up.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import dask
import keras
import pytest

import dasktf
from dasktf.testing import wait_until

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _accepts(address: str) -> bool:
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=1).close()
    except OSError:
        return False
    return True


@pytest.fixture
def scheduler_and_workers() -> Iterator[tuple[str, subprocess.Popen]]:
    address = f"tcp://127.0.0.1:{_free_port()}"
    bin_dir = os.path.dirname(sys.executable)
    dask = os.path.join(bin_dir, "dask")
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    procs = [subprocess.Popen(
        [dask, "scheduler", "--host", "127.0.0.1", "--port", address.rsplit(":", 1)[1],
         "--no-dashboard"], **quiet)]
    procs += [subprocess.Popen(
        [dask, "worker", address, "--nthreads", "1", "--no-nanny", "--no-dashboard",
         "--host", "127.0.0.1"], **quiet) for _ in range(2)]
    try:
        # listening before the run connects: its connect timeout is short (below)
        wait_until(lambda: _accepts(address), 60, f"the scheduler at {address}")
        yield address, procs[0]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=30)


class _KillScheduler(keras.callbacks.Callback):
    def __init__(self, scheduler: subprocess.Popen, step: int) -> None:
        super().__init__()
        self.scheduler, self.step, self.seen = scheduler, step, 0

    def on_train_batch_end(self, batch, logs=None):
        self.seen += 1
        if self.seen == self.step:
            self.scheduler.send_signal(signal.SIGKILL)


def test_losing_the_scheduler_names_it_and_the_last_checkpoint(
    scheduler_and_workers, small_digits, tmp_path
):
    address, scheduler = scheduler_and_workers
    x, y = small_digits
    killer = _KillScheduler(scheduler, step=25)
    start = time.monotonic()
    # The client gives up reconnecting after dasktf.connect-timeout (10 s): the
    # scheduler is gone for good, so 3 s ends the same way, sooner.
    with dask.config.set({"dasktf.connect-timeout": "3s"}), \
            pytest.raises(dasktf.SchedulerUnreachableError) as info:
        dasktf.fit("mnist-mlp", x, y, scheduler=address, n_workers=2, epochs=50,
                   batch_size=32, checkpoint_dir=str(tmp_path), checkpoint_every=10,
                   callbacks=[killer], verbose=0)
    message = str(info.value)
    assert address in message and str(tmp_path) in message and "resume" in message
    assert killer.seen >= 25
    assert time.monotonic() - start < 120
    assert list(tmp_path.glob("*.npz")), "a checkpoint was written before the loss"
