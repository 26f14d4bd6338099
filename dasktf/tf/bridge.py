"""The ``tf.distribute`` bridge: TensorFlow's cluster runtime on Dask workers.

:func:`tf_config` gives every Dask worker a ``TF_CONFIG`` (one task per worker
picks a free port there; the addresses come back through Dask), so
``MultiWorkerMirroredStrategy`` or ``ParameterServerStrategy`` code runs on the
workers dasktf trains on. :func:`run_tf_distributed` runs a function under such a
cluster, one TensorFlow child process per worker (see :mod:`dasktf.tf.child` for
why a child). :func:`check_tf_config` validates a user's own ``TF_CONFIG``: the
mistakes it catches are the usual cause of TensorFlow's endless "CreateSession
still waiting for response from worker" at start-up.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from dasktf import config
from dasktf.exceptions import (
    DasktfError,
    SecurityWarning,
    StepTimeoutError,
    WorkerLostError,
)
from dasktf.tf.child import ChildProcess, call_and_reply

if TYPE_CHECKING:
    from distributed import Client

__all__ = ["check_tf_config", "run_tf_distributed", "tf_config"]

#: Job names TensorFlow's cluster resolvers know.
JOBS = ("chief", "worker", "ps", "evaluator")


def _pick_port(expected: str) -> dict[str, Any]:
    """On a worker: a free port on the interface its Dask address uses."""
    from distributed import get_worker

    address = get_worker().address
    if address != expected:
        raise ValueError(f"tf_config's task for {expected} ran on {address}.")
    host = address.split("://")[-1].rsplit(":", 1)[0].strip("[]")
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        port = s.getsockname()[1]
    return {"worker": address, "host": host, "port": port}


def tf_config(
    client: Client,
    workers: Sequence[str] | None = None,
    *,
    chief: bool = False,
    ps: int = 0,
    timeout: float | str | None = None,
) -> dict[str, dict[str, Any]]:
    """A ``TF_CONFIG`` for each Dask worker: ``{worker address: TF_CONFIG}``.

    One task per worker binds a free port on the worker's own interface; the
    ``"host:port"`` addresses, gathered through Dask, form one ``worker`` job in the
    worker order given (sorted addresses by default), so task index ``i`` is the
    ``i``-th worker and index 0 plays the chief's part, as
    ``MultiWorkerMirroredStrategy`` expects. For ``ParameterServerStrategy`` ask
    for ``chief=True`` and ``ps=k``: the first worker becomes the chief (the
    coordinator), the next ``k`` the parameter servers, the rest the ``worker``
    job. Set it in a process on that worker
    (``os.environ["TF_CONFIG"] = json.dumps(cfg)``) *before* creating a strategy.

    Parameters
    ----------
    client
        The Dask client.
    workers
        Worker addresses (default: every worker of the cluster).
    timeout
        How long the workers may take to answer (default ``dasktf.tf-cluster-timeout``).

    Raises
    ------
    StepTimeoutError
        A worker did not answer in time; the message names it.

    Examples
    --------
    >>> configs = dasktf.tf_config(client)  # doctest: +SKIP
    >>> configs["tcp://127.0.0.1:40331"]["task"]  # doctest: +SKIP
    {'type': 'worker', 'index': 0}
    """
    from distributed import wait

    from dasktf.cluster.deadline import Deadline
    from dasktf.cluster.membership import alive_workers

    seconds = config.get_seconds("tf-cluster-timeout", timeout)
    alive = alive_workers(client)
    workers = list(workers) if workers is not None else alive
    missing = [w for w in workers if w not in alive]
    if not workers or missing:
        raise ValueError(
            f"tf_config needs live workers; {missing or 'none'} are not in the cluster "
            f"(alive: {alive})."
        )
    roles = ["chief"] * bool(chief) + ["ps"] * int(ps)
    if ps < 0 or len(roles) >= len(workers) or (ps and not chief):
        raise ValueError(
            f"tf_config(chief={chief}, ps={ps}) with {len(workers)} worker(s): parameter "
            "servers need a chief, and at least one worker must be left to train."
        )
    roles += ["worker"] * (len(workers) - len(roles))
    futures = [
        # pure=False: every call must pick a fresh port; pinned: the port is the
        # worker's own.
        client.submit(_pick_port, w, workers=[w], allow_other_workers=False, pure=False,
                      key=f"dasktf-tf-port-{i}-{time.monotonic_ns()}")
        for i, w in enumerate(workers)
    ]
    # A poll at a time: a worker that leaves never runs its pinned task.
    deadline = Deadline(seconds)
    while True:
        try:
            wait(futures, timeout=min(config.get_seconds("poll-interval"),
                                      max(deadline.left(), 0.01)))
            break
        except TimeoutError:
            pass
        gone = [w for w in workers if w not in set(alive_workers(client))]
        late = [w for w, f in zip(workers, futures, strict=True) if f.status == "pending"]
        if gone or deadline.passed():
            client.cancel(futures)
        if gone:
            raise WorkerLostError(
                f"Worker(s) {gone} left the cluster while tf_config waited for their "
                "ports.", gone)
        if deadline.passed():
            raise StepTimeoutError(
                f"Worker(s) {late} did not answer tf_config within {seconds:g}s: they "
                "are busy or unreachable. Free them or leave them out (workers=...)."
            )
    answers = client.gather(futures)
    cluster: dict[str, list[str]] = {}
    tasks = []
    for role, a in zip(roles, answers, strict=False):
        cluster.setdefault(role, []).append(f"{_bracket(a['host'])}:{a['port']}")
        tasks.append({"type": role, "index": len(cluster[role]) - 1})
    return {w: {"cluster": cluster, "task": task} for w, task in zip(workers, tasks, strict=False)}


def tf_server_addresses(configs: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Every ``host:port`` a TensorFlow server of ``configs`` will listen on."""
    first = next(iter(configs.values()), {})
    return [a for addresses in first.get("cluster", {}).values() for a in addresses]


def warn_tf_servers(configs: Mapping[str, Mapping[str, Any]], who: str) -> None:
    """Warn (:class:`~dasktf.exceptions.SecurityWarning`) that ``who`` is about to
    start TensorFlow servers, naming their ports.

    TensorFlow's gRPC server binds ``0.0.0.0:<port>`` whatever host ``TF_CONFIG``
    names (``grpc_server_lib.cc``) and offers no authentication in its open-source
    build, so anyone who reaches such a port can run computation in that process.
    dasktf cannot narrow that; it can only say so, every time.
    """
    addresses = tf_server_addresses(configs)
    ports = ", ".join(str(a).rsplit(":", 1)[-1] for a in addresses)
    warnings.warn(
        f"{who} starts {len(addresses)} TensorFlow gRPC server(s) ({', '.join(addresses)}). "
        f"TensorFlow binds each on every interface (0.0.0.0/[::], port(s) {ports}), "
        "not only on the host named, and they accept unauthenticated connections: "
        "anyone who can reach these ports can run code in those processes. Use it "
        "only on a trusted network or behind a firewall (README: Security).",
        SecurityWarning, stacklevel=3,
    )


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _run_child_task(cfg: dict[str, Any], fn: Callable[..., Any], args: tuple[Any, ...],
                    timeout: float) -> Any:
    from distributed import get_worker

    name = f"worker {get_worker().address} (task {cfg['task']['index']})"
    child = ChildProcess(cfg, name, connect_timeout=timeout)
    try:
        child.call(call_and_reply, fn, *args)
        return child.wait_reply(timeout, f"running {getattr(fn, '__name__', fn)}")
    finally:
        child.kill()


def run_tf_distributed(
    client: Client,
    fn: Callable[..., Any],
    *args: Any,
    workers: Sequence[str] | None = None,
    timeout: float | str | None = None,
) -> list[Any]:
    """Run ``fn(*args)`` on every worker under one TensorFlow cluster.

    Each worker starts a child process with its ``TF_CONFIG`` (from
    :func:`tf_config`) in the environment, so ``fn`` can create a
    ``tf.distribute.MultiWorkerMirroredStrategy()`` and train. Returns the values
    in worker order. ``fn`` must be importable by the child (a module-level
    function) and its result picklable.

    Raises
    ------
    DasktfError
        A child failed (its traceback is in the message), died, or the run took
        longer than ``timeout`` (default ``dasktf.tf-cluster-timeout``); the
        children are killed, nothing is left waiting.
    """
    from distributed import wait

    seconds = config.get_seconds("tf-cluster-timeout", timeout)
    configs = tf_config(client, workers, timeout=seconds)
    warn_tf_servers(configs, "run_tf_distributed")
    futures = [
        client.submit(_run_child_task, cfg, fn, args, seconds, workers=[w],
                      allow_other_workers=False, pure=False,
                      key=f"dasktf-tf-run-{i}-{time.monotonic_ns()}")
        for i, (w, cfg) in enumerate(configs.items())
    ]
    # The children enforce `seconds`; the margin covers their start and clean-up.
    _done, pending = wait(futures, timeout=seconds + 30)
    for w, f in zip(configs, futures, strict=False):
        if f.status == "error":
            raise DasktfError(f"run_tf_distributed failed on {w}: {f.exception()}")
    if pending:
        late = [w for w, f in zip(configs, futures, strict=False) if f in pending]
        client.cancel(list(pending))
        raise StepTimeoutError(f"run_tf_distributed: worker(s) {late} did not finish.")
    return client.gather(futures)  # type: ignore[no-any-return]


# -- validation of a user's TF_CONFIG ------------------------------------------
def _is_local(host: str) -> bool:
    if host in ("localhost", socket.gethostname()):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _split(address: Any) -> tuple[str, int] | None:
    if not isinstance(address, str) or ":" not in address:
        return None
    host, _, port = address.rpartition(":")
    try:
        number = int(port)
    except ValueError:
        return None
    return (host.strip("[]"), number) if 0 < number < 65536 else None


def check_tf_config(
    configs: Mapping[str, Any] | Sequence[Mapping[str, Any]], *, check_ports: bool = True
) -> list[str]:
    """Problems in one ``TF_CONFIG`` or in the set of all processes' ones.

    Pass a single ``TF_CONFIG`` dict, a list of them (one per process), or the
    ``{worker: TF_CONFIG}`` dict :func:`tf_config` returns. Checks: the cluster
    spec's shape and job names, ``host:port`` syntax, duplicated addresses, each
    task's type and index against the cluster, the same cluster in every process,
    unique task indices across processes (and every cluster task covered by one),
    a single chief, a chief when there are parameter servers, at most one
    evaluator and not inside the training jobs, and (``check_ports``) that each
    host resolves and that local ports are free to bind.

    Returns
    -------
    list of str
        One sentence per problem, each naming the fix; empty when all is well.
    """
    if isinstance(configs, Mapping) and "cluster" not in configs and "task" not in configs:
        configs = list(configs.values())  # tf_config()'s {worker: TF_CONFIG}
    many = not isinstance(configs, Mapping)
    items: list[Any] = list(configs) if many else [configs]  # type: ignore[arg-type]
    problems: list[str] = []
    if not items:
        return ["No TF_CONFIG given."]
    clusters = []
    for n, cfg in enumerate(items):
        where = f"TF_CONFIG #{n}: " if many else ""
        if not isinstance(cfg, Mapping) or not isinstance(cfg.get("cluster"), Mapping):
            got = cfg.get("cluster") if isinstance(cfg, Mapping) else cfg
            problems.append(f"{where}needs a 'cluster' mapping of job name to "
                            f"['host:port', ...]; got {type(got).__name__}.")
            continue
        clusters.append(cfg["cluster"])
        task = cfg.get("task")
        if not isinstance(task, Mapping) or "type" not in task:
            problems.append(f"{where}needs 'task': {{'type': ..., 'index': ...}}.")
            continue
        kind, index = task.get("type"), task.get("index", 0)
        jobs = cfg["cluster"]
        if kind not in JOBS:
            problems.append(f"{where}task type {kind!r} is not one of {JOBS}.")
        elif kind != "evaluator" and kind not in jobs:
            problems.append(f"{where}task type {kind!r} has no job in the cluster "
                            f"(jobs: {sorted(jobs)}).")
        elif kind in jobs and not (isinstance(index, int) and 0 <= index < len(jobs[kind])):
            problems.append(f"{where}task index {index!r} is out of range for job "
                            f"{kind!r}, which has {len(jobs[kind])} task(s).")
    if not clusters:
        return problems
    first = clusters[0]
    if any(dict(c) != dict(first) for c in clusters[1:]):
        problems.append("The processes disagree on the cluster spec: every process "
                        "needs the same 'cluster', only 'task' differs.")
    problems += _check_cluster(first, check_ports)
    if many:
        problems += _check_tasks(items, first)
    return problems


def _check_cluster(cluster: Mapping[str, Any], check_ports: bool) -> list[str]:
    problems = []
    seen: dict[str, str] = {}
    for job, tasks in cluster.items():
        if job not in JOBS:
            problems.append(f"Unknown job {job!r} in the cluster; use {JOBS}.")
        if not isinstance(tasks, (list, tuple)) or not tasks:
            problems.append(f"Job {job!r} must list at least one 'host:port'.")
            continue
        for i, address in enumerate(tasks):
            parsed = _split(address)
            if parsed is None:
                problems.append(f"{job}[{i}] = {address!r} is not 'host:port' with a "
                                "port in 1-65535.")
                continue
            if address in seen:
                problems.append(f"{job}[{i}] and {seen[address]} share the address "
                                f"{address}: every task needs its own port.")
            seen[address] = f"{job}[{i}]"
            if check_ports:
                problems += _check_port(f"{job}[{i}]", *parsed)
    if len(cluster.get("chief", [])) > 1:
        problems.append("More than one chief: a cluster has at most one.")
    if cluster.get("ps") and not cluster.get("chief"):
        problems.append("Parameter servers ('ps') need a 'chief' job to coordinate "
                        "(ParameterServerStrategy); add one.")
    if len(cluster.get("evaluator", [])) > 1:
        problems.append("More than one evaluator: TensorFlow runs at most one.")
    return problems


def _check_port(name: str, host: str, port: int) -> list[str]:
    try:
        socket.getaddrinfo(host, port)
    except OSError:
        return [f"{name}: host {host!r} does not resolve from here."]
    if not _is_local(host):
        return []
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            s.bind((host, port))
    except OSError:
        return [f"{name}: port {port} on {host} is already in use; pick a free one "
                "(or stop the process holding it) before starting TensorFlow."]
    return []


def _check_tasks(items: Sequence[Any], cluster: Mapping[str, Any]) -> list[str]:
    problems = []
    owners: dict[tuple[str, int], int] = {}
    for n, cfg in enumerate(items):
        task = cfg.get("task") if isinstance(cfg, Mapping) else None
        if not isinstance(task, Mapping):
            continue
        key = (task.get("type"), task.get("index", 0))
        if key in owners:
            problems.append(f"TF_CONFIG #{owners[key]} and #{n} are both task "
                            f"{key[0]}:{key[1]}: task indices must be unique.")
        owners[key] = n
    for job, tasks in cluster.items():
        if job == "evaluator" or not isinstance(tasks, (list, tuple)):
            continue
        for i in range(len(tasks)):
            if (job, i) not in owners:
                problems.append(f"No process is task {job}:{i}; the others would wait "
                                "for it forever ('CreateSession still waiting').")
    return problems


def load_tf_config_text(text: str) -> Any:
    """Parse ``dasktf check-tf-config`` input: JSON, one TF_CONFIG or a list."""
    import json

    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"Not JSON: {exc}.") from None


def mwms_probe() -> dict[str, Any]:
    """One tiny ``MultiWorkerMirroredStrategy`` training step; run in a child.

    Every worker feeds the constant ``task index + 1``, so after the all-reduce
    every worker must hold the same variable: proof that the ring ran. Used by
    ``dasktf tf-cluster --probe`` and the tests.
    """
    import json

    import tensorflow as tf

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    with strategy.scope():
        w = tf.Variable(0.0)

    @tf.function
    def step() -> Any:
        def replica_fn() -> Any:
            with tf.GradientTape() as tape:
                loss = w * float(index + 1)
            grad = tape.gradient(loss, w)
            total = tf.distribute.get_replica_context().all_reduce("SUM", grad)
            w.assign_sub(total)
            return total

        return strategy.run(replica_fn)

    total = step()
    return {
        "index": index,
        "replicas": strategy.num_replicas_in_sync,
        "reduced": float(strategy.experimental_local_results(total)[0]),
        "weight": float(w.numpy()),
    }
