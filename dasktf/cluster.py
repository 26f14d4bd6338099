"""Where the workers come from: an embedded LocalCluster or an existing scheduler.

The embedded cluster binds to loopback, starts real worker processes (one Dask thread
each: a replica runs one step at a time) and gives each the TensorFlow thread counts
that keep N workers from oversubscribing the cores. On a cluster the user brought,
the same settings are applied by a :class:`TensorFlowSetup` worker plugin.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from distributed import Client, LocalCluster
from distributed.diagnostics.plugin import WorkerPlugin

from dasktf import config
from dasktf.exceptions import SchedulerUnreachableError, WorkerLostError

logger = logging.getLogger(__name__)


def default_tf_threads(n_workers: int, cores: int | None = None) -> int:
    """TensorFlow intra-op threads per worker: the cores shared out, at least one."""
    cores = cores or os.cpu_count() or 1
    return max(1, cores // max(1, n_workers))


def worker_env(tf_threads: int) -> dict[str, str]:
    """Environment for a worker process, read by TensorFlow when it starts."""
    return {
        "TF_NUM_INTRAOP_THREADS": str(tf_threads),
        "TF_NUM_INTEROP_THREADS": "1",
        "OMP_NUM_THREADS": str(tf_threads),
        "TF_CPP_MIN_LOG_LEVEL": os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2"),
    }


def make_local_cluster(
    n_workers: int,
    *,
    tf_threads: int | None = None,
    host: str | None = None,
    security: Any = None,
    **kwargs: Any,
) -> LocalCluster:
    """Start a loopback ``LocalCluster`` of worker processes set up for TensorFlow.

    Parameters
    ----------
    n_workers
        Worker processes to start, each holding one replica.
    tf_threads
        TensorFlow intra-op threads per worker; default: cores // n_workers.
    host
        Interface to bind; default ``dasktf.local-cluster.host`` (127.0.0.1).
    security
        A ``distributed.security.Security`` for TLS, passed through to Dask.
    """
    if n_workers < 1:
        raise ValueError(f"n_workers must be at least 1; got {n_workers}.")
    threads = tf_threads or default_tf_threads(n_workers)
    kwargs.setdefault("dashboard_address", config.get("local-cluster.dashboard-address"))
    return LocalCluster(
        n_workers=n_workers,
        threads_per_worker=1,
        processes=True,
        host=config.get("local-cluster.host", host),
        env=worker_env(threads),
        security=security,
        protocol="tls://" if security is not None and security.require_encryption else None,
        **kwargs,
    )


def connect(address: str, *, timeout: float | str | None = None, security: Any = None) -> Client:
    """Connect to an existing scheduler, failing fast with the address in the message."""
    seconds = config.get_seconds("connect-timeout", timeout)
    try:
        return Client(address, timeout=seconds, security=security)
    except (OSError, TimeoutError) as exc:
        raise SchedulerUnreachableError(
            f"Could not reach a Dask scheduler at {address} within {seconds:g}s ({exc}). "
            "Check that `dask scheduler` is running there and that the address and "
            "port are right (and the TLS settings, if the cluster uses TLS)."
        ) from exc


@contextmanager
def cluster_client(
    client: Client | None = None,
    scheduler: str | None = None,
    n_workers: int | None = None,
    tf_threads: int | None = None,
    security: Any = None,
) -> Iterator[tuple[Client, bool]]:
    """Yield ``(client, owned)``; close only what this context created."""
    if client is not None:
        yield client, False
        return
    if scheduler is not None:
        c = connect(scheduler, security=security)
        try:
            yield c, True
        finally:
            c.close()
        return
    cluster = make_local_cluster(n_workers or 2, tf_threads=tf_threads, security=security)
    c = Client(cluster, security=security)
    try:
        yield c, True
    finally:
        c.close()
        cluster.close()


def alive_workers(client: Client) -> list[str]:
    """Addresses of the workers the scheduler knows now, sorted."""
    return sorted(client.scheduler_info(n_workers=-1)["workers"])


def choose_workers(client: Client, n_workers: int | None, timeout: float = 30.0) -> list[str]:
    """The workers a run uses: the first ``n_workers`` (all if None), waiting briefly
    for a cluster that is still starting."""
    deadline = time.monotonic() + timeout
    workers = alive_workers(client)
    while not workers or (n_workers and len(workers) < n_workers):
        if time.monotonic() > deadline:
            break
        time.sleep(0.2)
        workers = alive_workers(client)
    if not workers:
        raise WorkerLostError(
            f"The cluster at {client.scheduler.address} has no workers; start some "
            "(`dask worker ADDRESS`) or let dasktf start a local cluster."
        )
    if n_workers is not None and n_workers > len(workers):
        raise ValueError(
            f"Asked for {n_workers} workers but the cluster has {len(workers)}; "
            "lower n_workers or add workers to the cluster."
        )
    return workers[: n_workers or len(workers)]


class TensorFlowSetup(WorkerPlugin):
    """Sets TensorFlow's thread counts on workers of a cluster dasktf did not start.

    Thread counts can only be set before TensorFlow runs its first operation in the
    process; on a worker where that already happened the setting is logged and left.
    """

    name = "dasktf-tensorflow-setup"

    def __init__(self, intra_op_threads: int) -> None:
        self.intra_op_threads = intra_op_threads

    def setup(self, worker: Any) -> None:
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        import tensorflow as tf

        try:
            tf.config.threading.set_intra_op_parallelism_threads(self.intra_op_threads)
            tf.config.threading.set_inter_op_parallelism_threads(1)
        except RuntimeError:
            logger.info(
                "TensorFlow already running on %s; keeping its thread settings",
                worker.address,
            )
