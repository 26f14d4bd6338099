"""``dasktf.testing.kill_worker`` kills a worker, and its nanny only when the cluster
says it has one (issue 40): never the Python program that started a nanny-less
worker (a script, a test harness, a job runner), which once died with its worker.

Each test starts its own loopback cluster (it kills workers) and is bounded.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

import dasktf
from dasktf.cluster.membership import alive_workers, described_workers
from dasktf.testing import (
    KillWorkerAt,
    kill_worker,
    own_cluster,
    wait_until,
    worker_pids,
)

#: A harness as a test runner or a job script writes it: it starts a nanny-less
#: worker and stays alive after it (bounded: it exits by itself).
HARNESS = """
import subprocess, sys, time
dask = sys.argv[1]
worker = subprocess.Popen([dask, "worker", sys.argv[2], "--nthreads", "1", "--no-nanny",
                           "--no-dashboard", "--host", "127.0.0.1"],
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
worker.wait()
time.sleep(300)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie is dead
    except OSError:
        return False


@pytest.mark.slow
def test_kill_worker_spares_the_python_parent_of_a_worker_without_nanny(small_digits):
    """A worker started by a Python harness with ``--no-nanny``: it dies mid-run
    (``KillWorkerAt``), the harness lives on, and the dasktf run recovers on the
    other worker."""
    x, y = small_digits
    start = time.monotonic()
    dask = os.path.join(os.path.dirname(sys.executable), "dask")
    with own_cluster(1) as (cluster, client):
        (nannied,) = described_workers(client)
        harness = subprocess.Popen([sys.executable, "-c", HARNESS, dask,
                                    cluster.scheduler_address])
        try:
            client.wait_for_workers(2, timeout=120)
            (bare,) = set(alive_workers(client)) - {nannied}
            # the scenario: a Python parent that is not a nanny
            assert worker_pids(client, bare)[1] == harness.pid
            assert not client.run(os.getpid, nanny=True, workers=[bare])  # no nanny
            killer = KillWorkerAt(client, bare, step=7)
            history = dasktf.fit("mnist-mlp", x, y, client=client, n_workers=2,
                                 epochs=3, batch_size=48, callbacks=[killer], seed=1,
                                 engine="graph", verbose=0)
            assert killer.killed_at is not None
            assert [r["lost"] for r in history.recoveries] == [[bare]]
            assert history.workers == [nannied]
            assert harness.poll() is None and _alive(harness.pid)
        finally:
            harness.kill()
            harness.wait(timeout=30)
    assert time.monotonic() - start < 240


@pytest.mark.slow
def test_kill_worker_leaves_no_nanny_to_restart_it_unless_told_to():
    """With a nanny: ``restart=False`` ends it too (a `dask worker` process exits;
    a ``LocalCluster``'s nanny, in this very process, closes); ``restart=True``
    leaves it, and it starts a fresh worker that joins."""
    start = time.monotonic()
    dask = os.path.join(os.path.dirname(sys.executable), "dask")
    with own_cluster(1) as (cluster, client):
        (local,) = described_workers(client)
        procs = [subprocess.Popen([dask, "worker", cluster.scheduler_address,
                                   "--nthreads", "1", "--no-dashboard", "--host",
                                   "127.0.0.1"], stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL) for _ in range(2)]
        try:
            client.wait_for_workers(3, timeout=120)
            workers = described_workers(client)
            parent = {w: worker_pids(client, w)[1] for w in workers}
            stopped, restarted = (next(w for w in workers if parent[w] == p.pid)
                                  for p in procs)
            assert parent[local] == os.getpid()  # a LocalCluster's nanny: ours

            pid = worker_pids(client, stopped)[0]
            kill_worker(client, stopped)
            assert procs[0].wait(timeout=60) is not None  # the nanny's process ended
            assert not _alive(pid)

            pid = worker_pids(client, local)[0]
            kill_worker(client, local)
            (nanny,) = cluster.workers.values()
            wait_until(lambda: nanny.status.name == "closed" and not _alive(pid), 60,
                       "the LocalCluster's nanny closed and its worker gone")

            pid = worker_pids(client, restarted)[0]
            kill_worker(client, restarted, restart=True)
            wait_until(lambda: not _alive(pid), 30, "the worker gone")
            (fresh,) = wait_until(
                lambda: set(alive_workers(client))
                - {stopped, local, restarted}, 120, "the nanny's fresh worker")
            assert worker_pids(client, fresh)[1] == procs[1].pid
            assert procs[1].poll() is None
            wait_until(lambda: set(alive_workers(client))
                       == {fresh}, 30, "the killed workers dropped")
        finally:
            for p in procs:
                p.kill()
                p.wait(timeout=30)
    assert time.monotonic() - start < 240
