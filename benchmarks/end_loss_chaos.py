"""Issue 35's chaos case, repeated: 2 of 4 workers SIGKILLed near the end of a p2p run.

Each try starts a scheduler and 4 ``dask worker --no-nanny`` processes on 127.0.0.1
(Dask's CLI, as the issue's run did), trains the digits MLP for 2 epochs with
``engine="p2p"``, validation and a ``checkpoint_dir``, and SIGKILLs two random
workers near the end: from a callback at one of the last epoch's last steps, or from
a thread a random 0-0.2 s after the last epoch's callbacks, which lands in the
run's end (its checkpoint, the applied updates, the final state). A try passes when
``fit`` returns the model equal (rtol 1e-4) to the uninterrupted run's, the losses
it noticed in ``history.recoveries``; it fails on any error.
A kill that came after the run had returned is counted apart (``late``).

    python benchmarks/end_loss_chaos.py --tries 8 [--seed 0]

Prints one line per try and the count of passes.
"""

from __future__ import annotations

import argparse
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras
import numpy as np
from distributed import Client

import dasktf

EPOCHS, BATCH = 2, 48


def cli_cluster(n: int) -> tuple[str, list[subprocess.Popen]]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dask = os.path.join(os.path.dirname(sys.executable), "dask")
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    address = f"tcp://127.0.0.1:{port}"
    procs = [subprocess.Popen([dask, "scheduler", "--host", "127.0.0.1", "--port",
                               str(port), "--no-dashboard"], **quiet)]
    procs += [subprocess.Popen([dask, "worker", address, "--nthreads", "1", "--no-nanny",
                                "--no-dashboard", "--host", "127.0.0.1"], **quiet)
              for _ in range(n)]
    return address, procs


class Killer(keras.callbacks.Callback):
    """SIGKILL ``pids`` at the last epoch's step ``step`` or, with ``step=None``,
    ``delay`` seconds after its ``on_epoch_end``."""

    def __init__(self, pids: list[int], step: int | None, delay: float) -> None:
        super().__init__()
        self.pids, self.step, self.delay = pids, step, delay
        self.epoch = 0
        self.killed_at: float | None = None
        self.timer: threading.Timer | None = None
        self.lock = threading.Lock()

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if self.epoch == EPOCHS - 1 and self.step is not None and batch >= self.step:
            self.kill()

    def on_epoch_end(self, epoch, logs=None):
        if epoch == EPOCHS - 1 and self.step is None:
            self.timer = threading.Timer(self.delay, self.kill)
            self.timer.start()

    def kill(self):
        with self.lock:
            if self.killed_at is None:
                for pid in self.pids:
                    os.kill(pid, 9)  # workers this script started
                self.killed_at = time.time()

    def disarm(self) -> bool:
        """No kill from now on; whether one happened."""
        with self.lock:
            if self.timer is not None:
                self.timer.cancel()
            self.killed_at = self.killed_at or -1.0
            return self.killed_at > 0


def one(x, y, val, rng, reference, tries_dir) -> tuple[str, list[np.ndarray] | None]:
    address, procs = cli_cluster(4)
    try:
        with Client(address, timeout=60) as client:
            client.wait_for_workers(4, timeout=120)
            options = dict(client=client, n_workers=4, epochs=EPOCHS, batch_size=BATCH,
                           engine="p2p", seed=5, shuffle=False, validation_data=val,
                           verbose=0, checkpoint_dir=tempfile.mkdtemp(dir=tries_dir))
            if reference is None:
                return "reference", dasktf.fit("mnist-mlp", x, y, **options
                                               ).model.get_weights()
            pids = client.run(os.getpid)
            victims = rng.sample(sorted(pids), 2)
            steps = -(-len(x) // BATCH)
            step = rng.choice([steps - 1, None, None, None])
            delay = rng.uniform(0, 0.2)
            killer = Killer([pids[v] for v in victims], step, delay)
            where = f"step {step}" if step is not None else f"end+{delay:.2f}s"
            try:
                history = dasktf.fit("mnist-mlp", x, y, callbacks=[killer], **options)
            except Exception as exc:  # noqa: BLE001 - what the try reports
                return f"FAIL ({where}): {type(exc).__name__}: {str(exc)[:300]}", None
            finally:
                killed = killer.disarm()
            if not killed:
                return f"late ({where})", None
            lost = sorted(w for r in history.recoveries for w in r["lost"])
            phases = [r.get("phase") for r in history.recoveries]
            weights = history.model.get_weights()
            same = all(np.allclose(a, b, rtol=1e-4, atol=1e-6)
                       for a, b in zip(weights, reference, strict=True))
            # a kill in the last instants (after the final state was read) may
            # leave a victim unnoticed: the run had nothing left to read from it
            ok = same and set(lost) <= set(victims)
            return (f"{'pass' if ok else 'FAIL'} ({where}): lost {len(lost)} in "
                    f"{phases}, same weights: {same}"), None
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tries", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    data = dasktf.load_dataset("digits")
    x, y = data.x_train[:500], data.y_train[:500]
    val = (data.x_test[:200], data.y_test[:200])
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as tries_dir:
        _, reference = one(x, y, val, rng, None, tries_dir)
        outcomes = []
        for i in range(args.tries):
            line, _ = one(x, y, val, rng, reference, tries_dir)
            outcomes.append(line.split()[0])
            print(f"try {i + 1}: {line}  (load {os.getloadavg()[0]:.1f})", flush=True)
    counted = [o for o in outcomes if o != "late"]
    print(f"passed {counted.count('pass')} of {len(counted)} "
          f"({outcomes.count('late')} kill(s) after the run returned, not counted)")


if __name__ == "__main__":
    main()
