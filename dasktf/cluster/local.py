"""Where the workers come from: an embedded LocalCluster or an existing scheduler.

The embedded cluster binds to loopback, starts real worker processes (one Dask thread
each: a replica runs one step at a time) and gives each the TensorFlow thread counts
that keep N workers from oversubscribing the cores. On a machine with GPUs it starts
one worker per GPU (:class:`GPUCluster`), pinned at spawn through its own
``CUDA_VISIBLE_DEVICES`` and advertising the Dask resource ``GPU=1``. On a cluster the
user brought, the same settings are applied by a :class:`TensorFlowSetup` worker
plugin, and GPU workers are recognised by the ``GPU`` resource they advertise.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import dask
from distributed import Client, LocalCluster
from distributed.diagnostics.plugin import WorkerPlugin
from distributed.system import MEMORY_LIMIT

from dasktf import compat, config
from dasktf.cluster import quiet
from dasktf.cluster.devices import (
    GPU,
    GpusArg,
    gpu_worker_env,
    select_gpus,
    split_gpu_workers,
)
from dasktf.cluster.malloc import malloc_env
from dasktf.cluster.membership import described_workers
from dasktf.exceptions import SchedulerUnreachableError, WorkerLostError

logger = logging.getLogger(__name__)


#: TensorFlow's C++ log level for the processes dasktf starts when the user set none:
#: warnings and errors stay, the INFO lines every process prints at import
#: (``cpu_feature_guard``, oneDNN, absl's "before InitializeLog") go.
QUIET_TF_LOG_LEVEL = "1"


def tf_log_level() -> str:
    """``TF_CPP_MIN_LOG_LEVEL`` for a process dasktf starts: the user's, if set."""
    return os.environ.get("TF_CPP_MIN_LOG_LEVEL", QUIET_TF_LOG_LEVEL)


@contextmanager
def spawn_environment() -> Iterator[None]:
    """Spawn the worker processes started inside this context with TensorFlow quiet
    from their first instruction on (:mod:`dasktf.cluster.quiet`) and glibc's malloc
    keeping TensorFlow's tensors in its heap (:func:`malloc_env`).

    A Nanny applies its ``env=`` only once the spawned process is running, after
    ``multiprocessing`` re-imported the user's ``__main__``; a script that imports
    keras at its top (as every Keras script does) has loaded TensorFlow by then, and
    TensorFlow reads the level at import. distributed's ``pre-spawn-environ`` is set
    in the environment the process is spawned with (and on every restart of the
    Nanny), so the level, and the ``sitecustomize`` on ``PYTHONPATH`` that holds the
    import's lines to it, are there before ``__main__`` runs. Like every entry
    there they land in this process's environment too (distributed sets them
    there; a variable already in the environment wins over the config, so
    ``PYTHONPATH`` is extended here, ahead of what it held). A level the user set
    wins.

    The same ``pre-spawn-environ`` of distributed's sets ``MALLOC_TRIM_THRESHOLD_``
    to 64 KiB (freed memory goes back to the system at once), and setting any of
    glibc's thresholds turns its adaptive mmap threshold off: every buffer of 128
    KiB or more is then mapped afresh, or trimmed and grown again, and its pages
    faulted in and zeroed by the kernel, each step, for every tensor TensorFlow
    allocates that large. The workers dasktf spawns get the adaptive policy's
    ceilings instead (``dasktf.local-cluster.malloc``: tensors up to 32 MiB stay in
    the heap, 64 MiB of free memory kept at its top): a p2p step of the MNIST MLP
    took 2.2-2.3 ms instead of 3.6-3.8 (benchmarks/RESULTS.md). A variable set in
    the environment wins, as for every entry there.
    """
    key = "distributed.nanny.pre-spawn-environ"
    spawn = quiet.spawn_env(tf_log_level())
    os.environ["PYTHONPATH"] = spawn["PYTHONPATH"]
    malloc = {k: v for k, v in malloc_env().items() if v is not None}
    with dask.config.set({key: {**(dask.config.get(key, None) or {}), **malloc, **spawn}}):
        yield


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
        "TF_CPP_MIN_LOG_LEVEL": tf_log_level(),
    }


def make_local_cluster(
    n_workers: int | None = None,
    *,
    tf_threads: int | None = None,
    host: str | None = None,
    security: Any = None,
    gpus: GpusArg = None,
    discover: Callable[[], list[GPU]] | None = None,
    **kwargs: Any,
) -> LocalCluster:
    """Start a loopback ``LocalCluster`` of worker processes set up for TensorFlow.

    Parameters
    ----------
    n_workers
        Worker processes to start, each holding one replica. Default: one per
        selected GPU, or 2 CPU workers where there are none.
    tf_threads
        TensorFlow intra-op threads per worker; default: cores // n_workers.
    host
        Interface to bind; default ``dasktf.local-cluster.host`` (127.0.0.1).
    security
        A ``distributed.security.Security`` for TLS, passed through to Dask.
    gpus
        Which GPUs get a worker each (see :func:`dasktf.cluster.devices.select_gpus`):
        ``None`` (every visible GPU, else CPUs), ``"all"``, ``"none"``, a count, or
        a list of indices.
    discover
        Returns the machine's GPUs; default :func:`dasktf.cluster.devices.discover_gpus`
        (``nvidia-smi``, or ``dasktf.gpu.simulate``). Tests pass a fake.

    Raises
    ------
    ValueError
        Bad ``n_workers``, GPUs this machine lacks, more workers than GPUs, or GPUs
        with ``processes=False`` (threads share one ``CUDA_VISIBLE_DEVICES``).
    """
    if n_workers is not None and n_workers < 1:
        raise ValueError(f"n_workers must be at least 1; got {n_workers}.")
    if kwargs.pop("processes", True) is False and gpus not in (None, "none", 0):
        raise ValueError(
            "GPU workers need processes=True: CUDA_VISIBLE_DEVICES is per process, "
            "so threads of one process cannot each own a GPU."
        )
    chosen = select_gpus(gpus, n_workers, discover)
    n = len(chosen) or n_workers or 2
    threads = tf_threads or default_tf_threads(n)
    kwargs.setdefault("dashboard_address", config.get("local-cluster.dashboard-address"))
    options: dict[str, Any] = dict(
        threads_per_worker=1,
        processes=True,
        host=config.get("local-cluster.host", host),
        env=worker_env(threads),
        security=security,
        protocol="tls://" if security is not None and security.require_encryption else None,
    )
    with spawn_environment():
        if chosen:
            logger.info("Starting one worker per GPU: %s", "; ".join(map(str, chosen)))
            return GPUCluster(chosen, **options, **kwargs)
        options["env"].update(gpu_worker_env(None))
        return LocalCluster(n_workers=n, **options, **kwargs)


class GPUCluster(LocalCluster):
    """A ``LocalCluster`` with one worker process per GPU, as ``dask_cuda`` does it.

    Worker ``gpu-<i>`` is spawned with ``CUDA_VISIBLE_DEVICES=<i>`` (so the process
    sees exactly that one GPU, as its device 0) and advertises the resource
    ``GPU=1``, which dasktf's step tasks request. Scaling adds workers for the GPUs
    that have none, and never more than there are GPUs.

    Parameters
    ----------
    gpus
        The GPUs to start workers on, from :func:`dasktf.cluster.devices.select_gpus`.
    **kwargs
        As for ``LocalCluster`` (``env`` is merged into every worker's).
    """

    def __init__(self, gpus: list[GPU], **kwargs: Any) -> None:
        if not gpus:
            raise ValueError("GPUCluster needs at least one GPU; use LocalCluster.")
        self.gpus = list(gpus)
        # Started empty, then scaled: LocalCluster would give every worker one shared
        # spec, and each of ours needs its own environment.
        kwargs.setdefault("memory_limit", MEMORY_LIMIT // len(gpus))
        super().__init__(n_workers=0, **kwargs)
        self.scale(len(gpus))
        compat.start_workers(self)

    def new_worker_spec(self) -> dict[str, dict[str, Any]]:
        free = [g for g in self.gpus if f"gpu-{g.index}" not in self.worker_spec]
        if not free:
            raise ValueError(
                f"Cannot start more workers than GPUs ({len(self.gpus)}): dasktf pins "
                "one worker to each GPU."
            )
        gpu = free[0]
        spec = copy.deepcopy(self.new_spec)
        options = spec["options"]
        options["env"] = {**(options.get("env") or {}), **gpu_worker_env(gpu)}
        options["resources"] = {**(options.get("resources") or {}), "GPU": 1}
        return {f"gpu-{gpu.index}": spec}


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
    gpus: GpusArg = None,
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
    cluster = make_local_cluster(
        n_workers, tf_threads=tf_threads, security=security, gpus=gpus
    )
    c = Client(cluster, security=security)
    try:
        yield c, True
    finally:
        c.close()
        cluster.close()


def _all_requested_up(client: Client, workers: list[str]) -> bool:
    """True when the client's own cluster object (a LocalCluster, ...) has started
    every worker it was asked for: waiting longer would not bring more."""
    cluster = getattr(client, "cluster", None)
    requested = getattr(cluster, "requested", None)
    return bool(workers) and requested is not None and len(requested) <= len(workers)


def choose_workers(client: Client, n_workers: int | None, timeout: float = 30.0) -> list[str]:
    """The workers a run uses: the first ``n_workers`` (all if None), waiting briefly
    for a cluster that is still starting."""
    return _choose(client, n_workers, timeout)[0]


def _choose(client: Client, n_workers: int | None, timeout: float
            ) -> tuple[list[str], dict[str, Any]]:
    """:func:`choose_workers`, and the scheduler's last description of every worker
    (:func:`described_workers`), which the caller may read instead of asking again."""
    from dasktf.cluster.deadline import Deadline

    deadline = Deadline(timeout)
    info = described_workers(client)
    workers = sorted(info)
    while not workers or (n_workers and len(workers) < n_workers):
        if deadline.passed() or _all_requested_up(client, workers):
            break
        time.sleep(0.2)
        info = described_workers(client)
        workers = sorted(info)
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
    return workers[: n_workers or len(workers)], info


def choose_run_workers(
    client: Client, n_workers: int | None, gpus: GpusArg = None, timeout: float = 30.0
) -> tuple[list[str], dict[str, float] | None]:
    """The workers a run uses and the Dask resources its tasks must request.

    Workers that advertise a ``GPU`` resource are GPU workers. If the cluster has
    any (and ``gpus`` is not ``"none"``/``0``), the run uses only those and its
    tasks request ``{"GPU": 1}``; the workers left out are logged by address. A
    cluster without GPU workers trains on its CPU workers, unless GPUs were asked
    for explicitly, which is an error.

    Parameters
    ----------
    n_workers
        Workers to use (default: all eligible ones).
    gpus
        ``None`` (auto), ``"all"``, ``"none"``/``0``, a count, or a list (its
        length is the count: which physical GPUs is the cluster's business).

    Raises
    ------
    ValueError
        GPUs asked for where no worker advertises one, or more than there are.
    """
    if gpus in ("none", 0):
        return choose_workers(client, n_workers, timeout), None
    count = n_workers
    if count is None and isinstance(gpus, int) and not isinstance(gpus, bool):
        count = gpus
    elif count is None and isinstance(gpus, (list, tuple)):
        count = len(gpus)
    # One description of the workers for their addresses and their resources (each
    # is the scheduler describing every worker: O(cluster) of its CPU a fit).
    alive, info = _choose(client, None, timeout)
    with_gpu, without = split_gpu_workers({a: info[a] for a in alive if a in info})
    if not with_gpu:
        if gpus is not None:
            raise ValueError(
                f"Asked for GPUs (gpus={gpus!r}), but no worker of the cluster at "
                f"{client.scheduler.address} advertises a GPU resource. Start one "
                "worker per GPU with `CUDA_VISIBLE_DEVICES=i dask worker ADDRESS "
                "--nworkers 1 --resources GPU=1`, or leave gpus out to train on the "
                "CPU workers."
            )
        if n_workers is None or n_workers <= len(alive):  # no need to wait for more
            return alive[: n_workers or len(alive)], None
        return choose_workers(client, n_workers, timeout), None
    if count is not None and count > len(with_gpu):
        raise ValueError(
            f"Asked for {count} GPU workers but only {len(with_gpu)} advertise a GPU "
            f"resource ({', '.join(with_gpu)}); lower the count or add GPU workers."
        )
    if without:
        logger.warning(
            "Training on the %d GPU worker(s) only; these workers advertise no GPU "
            "resource and are left out: %s", len(with_gpu), ", ".join(without)
        )
    return with_gpu[: count or len(with_gpu)], {"GPU": 1}


class TensorFlowSetup(WorkerPlugin):
    """Sets TensorFlow up on workers of a cluster dasktf did not start.

    Sets the thread counts and turns GPU memory growth on, so that a worker takes
    GPU memory as it needs it rather than all of it up front. Both can only be set
    before TensorFlow initializes its devices in the process; on a worker where that
    already happened the setting is logged and left.
    """

    name = "dasktf-tensorflow-setup"

    def __init__(self, intra_op_threads: int) -> None:
        self.intra_op_threads = intra_op_threads

    async def setup(self, worker: Any) -> None:
        """In a thread of its own: Dask calls a plugin's ``setup`` on the worker's
        event loop, and importing TensorFlow there held it for the whole import
        (seconds; minutes with 32 workers on 2 cores), no heartbeat answered, so the
        scheduler's liveness detector, which watches a run from its set-up on,
        would take the worker for a frozen one."""
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", QUIET_TF_LOG_LEVEL)
        quiet.install()  # a worker of the user's that has not imported TensorFlow yet
        await asyncio.get_running_loop().run_in_executor(None, self._set_up, worker)

    def _set_up(self, worker: Any) -> None:
        import tensorflow as tf

        try:
            tf.config.threading.set_intra_op_parallelism_threads(self.intra_op_threads)
            tf.config.threading.set_inter_op_parallelism_threads(1)
        except RuntimeError:
            logger.info(
                "TensorFlow already running on %s; keeping its thread settings",
                worker.address,
            )
        for gpu in tf.config.list_physical_devices("GPU"):
            try:
                tf.config.experimental.set_memory_growth(gpu, True)
            except RuntimeError:
                logger.info("GPUs already initialized on %s; memory growth left as is",
                            worker.address)
        logger.info(
            "Worker %s: CUDA_VISIBLE_DEVICES=%r, TensorFlow sees %s",
            worker.address, os.environ.get("CUDA_VISIBLE_DEVICES"),
            [d.name for d in tf.config.list_physical_devices()],
        )
