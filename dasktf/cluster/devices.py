"""GPUs: finding them, choosing them, and what each worker ends up using.

The client never imports TensorFlow to learn about GPUs (that would cost seconds and,
on a GPU machine, take a CUDA context in the client): it asks ``nvidia-smi``. Tests and
CPU machines can pretend to have GPUs with ``dasktf.gpu.simulate`` (for example
``DASK_DASKTF__GPU__SIMULATE=2``) or by passing their own ``discover`` function.

Worker-side helpers (:func:`probe_worker`, :func:`placement_summary`,
:func:`precision_policy`) run inside worker processes, after the cluster helper has
pinned each one to its GPU through ``CUDA_VISIBLE_DEVICES``.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from dasktf import config
from dasktf.cluster.membership import described_workers
from dasktf.cluster.tfbuild import gpu_problem, installed_build

logger = logging.getLogger(__name__)

#: What ``gpus=`` accepts: ``None`` (auto), ``"all"``, ``"none"``, a count, or indices.
GpusArg = None | str | int | Sequence[int]

_QUERY = "index,name,memory.total,uuid"


@dataclass(frozen=True)
class GPU:
    """One GPU as ``nvidia-smi`` lists it."""

    index: int
    name: str
    memory_mib: int | None = None
    uuid: str = ""

    def __str__(self) -> str:
        memory = f", {self.memory_mib:,} MiB" if self.memory_mib else ""
        return f"{self.index}: {self.name}{memory}"


# -- discovery (client side, no TensorFlow) ---------------------------------
def discover_gpus() -> list[GPU]:
    """The GPUs this process may use, without importing TensorFlow.

    ``dasktf.gpu.simulate`` wins when set (a count or a list of names). Otherwise
    ``nvidia-smi`` is asked; no ``nvidia-smi`` or a failing one means no GPUs. If
    ``CUDA_VISIBLE_DEVICES`` is set to indices, only those GPUs are returned, since
    the user has already narrowed what this process (and so its workers) may use.

    Returns
    -------
    list of GPU
        Sorted by index; empty on a machine without (usable) NVIDIA GPUs.
    """
    simulated = config.get("gpu.simulate")
    if simulated is not None:
        return simulated_gpus(simulated)
    gpus = query_nvidia_smi()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        wanted = _indices(visible)
        if wanted is not None:
            gpus = [g for g in gpus if g.index in wanted]
    return gpus


def local_gpu_problem(found: list[GPU]) -> str | None:
    """Why this machine's GPUs (``found`` by :func:`discover_gpus`) cannot be used
    by its TensorFlow, or ``None``; simulated GPUs have no problem."""
    if not found or config.get("gpu.simulate") is not None:
        return None
    return gpu_problem(len(found), installed_build())


def simulated_gpus(spec: int | str | Sequence[str]) -> list[GPU]:
    """A made-up device list: ``2``, ``"2"`` or ``["Tesla T4", "Tesla T4"]``."""
    if isinstance(spec, str) and not spec.strip().isdigit():
        spec = [s.strip() for s in spec.split(",") if s.strip()]
    if isinstance(spec, (int, str)):
        return [GPU(i, "Simulated GPU", 16384) for i in range(int(spec))]
    return [GPU(i, str(name), 16384) for i, name in enumerate(spec)]


def query_nvidia_smi(gpu_ids: str | None = None) -> list[GPU]:
    """Parse ``nvidia-smi --query-gpu``; ``[]`` when it is missing or fails.

    ``nvidia-smi`` ignores ``CUDA_VISIBLE_DEVICES`` and always lists every GPU of the
    machine; ``gpu_ids`` (the variable's value) keeps the ones it names, by index or
    UUID, in its order.
    """
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return []
    try:
        out = subprocess.run(
            [exe, f"--query-gpu={_QUERY}", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=20, check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        logger.info("nvidia-smi failed (%s); assuming no GPUs", exc)
        return []
    gpus = []
    for line in out.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 4 or not parts[0].isdigit():
            continue
        memory = int(parts[2]) if parts[2].isdigit() else None
        gpus.append(GPU(int(parts[0]), parts[1], memory, parts[3]))
    if gpu_ids is None:
        return gpus
    by_id = {str(g.index): g for g in gpus} | {g.uuid: g for g in gpus}
    return [by_id[i] for i in (s.strip() for s in gpu_ids.split(",")) if i in by_id]


def _indices(value: str) -> set[int] | None:
    items = [s.strip() for s in value.split(",") if s.strip()]
    if not all(s.isdigit() for s in items):
        return None  # UUIDs or MIG names: leave the list alone
    return {int(s) for s in items}


# -- choosing (client side) -------------------------------------------------
def parse_gpus(text: str | None) -> GpusArg:
    """The CLI's ``--gpus`` value: ``all``, ``none``, a count ``N`` or indices ``0,2``.

    A lone integer is a count, as in ``docker run --gpus 2``; to pick one GPU by
    index, add a comma (``--gpus 3,``).
    """
    if text is None:
        return None
    text = text.strip().lower()
    if text in ("all", "none"):
        return text
    if text.isdigit():
        return int(text)
    items = [s.strip() for s in text.split(",") if s.strip()]
    if not items or not all(s.isdigit() for s in items):
        raise ValueError(
            f"--gpus must be 'all', 'none', a count (2) or GPU indices (0,2,3); "
            f"got {text!r}."
        )
    return [int(s) for s in items]


def select_gpus(
    gpus: GpusArg,
    n_workers: int | None = None,
    discover: Callable[[], list[GPU]] | None = None,
) -> list[GPU]:
    """The GPUs a local cluster starts one worker for; ``[]`` means CPU workers.

    Parameters
    ----------
    gpus
        ``None``: every visible GPU if there are any (the first ``n_workers`` if
        given), else CPUs. ``"all"``: every visible GPU. ``"none"`` or ``0``: CPUs.
        An integer ``N``: the first ``N`` GPUs. A list: those GPU indices.
    n_workers
        Workers asked for. With GPUs there is one worker per GPU, so it may not
        exceed the GPUs selected.
    discover
        Returns the visible GPUs; default :func:`discover_gpus`.

    Raises
    ------
    ValueError
        GPUs were asked for that this machine does not have, or ``n_workers`` does
        not fit the GPUs; the message lists the GPUs found and what to pass instead.
        GPUs that ``nvidia-smi`` lists but the installed TensorFlow cannot use
        (:func:`dasktf.cluster.tfbuild.gpu_problem`): refused with the command that fixes
        the install when asked for, a warning and CPU workers when ``gpus=None``.
    """
    if gpus in ("none", 0):
        return []
    if isinstance(gpus, bool) or not (
        gpus is None or gpus == "all" or isinstance(gpus, (int, list, tuple))
    ):
        raise ValueError(
            f"gpus must be None, 'all', 'none', a count or a list of GPU indices; "
            f"got {gpus!r}."
        )
    found = (discover or discover_gpus)()
    if discover is None:
        problem = local_gpu_problem(found)
        if problem is not None:  # GPU workers would compute on their CPU
            if gpus is not None:
                raise ValueError(problem)
            logger.warning("%s. Training on CPU workers.", problem)
            return []
    listing = "; ".join(map(str, found)) or "none"
    if gpus is None:
        if not found:
            return []
        if n_workers is not None and n_workers > len(found):
            raise ValueError(
                f"Asked for {n_workers} workers, but dasktf starts one worker per GPU "
                f"and this machine has {len(found)} ({listing}). Ask for at most "
                f"{len(found)} workers, or pass --gpus none (gpus='none') to train on "
                f"{n_workers} CPU workers."
            )
        return found[: n_workers or len(found)]
    if not found:
        raise ValueError(
            f"Asked for GPUs (gpus={gpus!r}), but none were found: nvidia-smi is "
            "missing or lists no GPU (or CUDA_VISIBLE_DEVICES hides them). Leave "
            "--gpus out (or pass --gpus none) to train on CPU workers."
        )
    if gpus == "all":
        chosen = list(found)
    elif isinstance(gpus, int):
        if gpus > len(found):
            raise ValueError(
                f"Asked for {gpus} GPUs but this machine has {len(found)} ({listing})."
            )
        chosen = found[:gpus]
    else:
        by_index = {g.index: g for g in found}
        missing = [i for i in gpus if i not in by_index]
        if missing or len(set(gpus)) != len(gpus):
            raise ValueError(
                f"GPU indices {list(gpus)} are not all distinct GPUs of this machine "
                f"(missing: {missing}); it has: {listing}."
            )
        chosen = [by_index[i] for i in gpus]
    if n_workers is not None and n_workers != len(chosen):
        raise ValueError(
            f"Asked for {n_workers} workers on {len(chosen)} GPU(s) ({gpus!r}); dasktf "
            f"starts exactly one worker per GPU. Leave --workers out, or select "
            f"{n_workers} GPUs."
        )
    return chosen


def gpu_worker_env(gpu: GPU | None) -> dict[str, str]:
    """The spawn-time environment that pins a worker process to ``gpu``.

    It must be in place before TensorFlow loads in the worker: TensorFlow reads
    ``CUDA_VISIBLE_DEVICES`` and ``TF_FORCE_GPU_ALLOW_GROWTH`` once, when it first
    touches CUDA. A CPU worker gets an empty device list so that TensorFlow there
    never takes memory on a GPU that another worker owns.
    """
    if gpu is None:
        return {"CUDA_VISIBLE_DEVICES": ""}
    return {
        "CUDA_VISIBLE_DEVICES": str(gpu.index),
        # CUDA numbers GPUs fastest first by default, nvidia-smi by PCI bus; on a
        # machine with mixed GPUs index i would then name another card.
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "TF_FORCE_GPU_ALLOW_GROWTH": "true",
    }


def split_gpu_workers(workers: dict[str, dict[str, Any]]) -> tuple[list[str], list[str]]:
    """``(with_gpu, without_gpu)`` addresses, from the scheduler's description of each worker
    (:func:`dasktf.cluster.membership.described_workers`)."""
    with_gpu = sorted(
        a for a, w in workers.items() if (w.get("resources") or {}).get("GPU")
    )
    without = sorted(a for a in workers if a not in with_gpu)
    return with_gpu, without


# -- worker side --------------------------------------------------------------
def probe_worker(with_tensorflow: bool = True) -> dict[str, Any]:
    """What this worker process can see; run through ``Client.run``.

    TensorFlow's view is reported only if it imports; a worker without TensorFlow
    says so rather than failing, so ``dasktf info`` works on any Dask cluster.
    """
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = query_nvidia_smi(visible) if visible != "" else []
    info: dict[str, Any] = {
        "pid": os.getpid(),
        "cuda_visible_devices": visible,
        "gpus": [
            {"name": g.name, "memory_mib": g.memory_mib, "index": g.index} for g in gpus
        ],
        "tf_devices": None,
        "tf_error": None,
        "tf_build": installed_build(),
    }
    if with_tensorflow:
        try:
            import tensorflow as tf

            info["tf_devices"] = [d.name for d in tf.config.list_physical_devices()]
        except ImportError as exc:
            info["tf_error"] = f"TensorFlow not installed ({exc})"
    return info


def placement_summary(model: Any, device: str) -> str:
    """One line on where a replica lives: variables per device, batching on the CPU."""
    counts = Counter(_short(v.value.device if hasattr(v, "value") else v.device)
                     for v in model.variables)
    where = ", ".join(f"{n} on {d}" for d, n in sorted(counts.items()))
    policy = getattr(getattr(model, "dtype_policy", None), "name", "float32")
    return f"variables: {where}; step: {device}; batching: numpy on CPU; policy: {policy}"


def _short(device: str) -> str:
    # "/job:localhost/replica:0/task:0/device:GPU:0" -> "GPU:0"
    return device.rsplit("device:", 1)[-1] if device else "default"


def compute_device() -> str:
    """The device a replica's model and step run on: its one GPU if it has one."""
    import tensorflow as tf

    return "/GPU:0" if tf.config.list_logical_devices("GPU") else "/CPU:0"


@contextmanager
def precision_policy(mixed: bool) -> Iterator[str]:
    """Build Keras layers under the mixed precision policy for this worker's device.

    ``mixed_float16`` on a GPU (and ``Model.compile`` then wraps the optimizer in a
    ``LossScaleOptimizer``); ``mixed_bfloat16`` on a CPU, whose range needs no loss
    scaling. Keras' policy is process-global, so it is restored on exit: a worker
    may host later runs without mixed precision.
    """
    import keras

    before = keras.config.dtype_policy()
    if not mixed:
        yield before.name
        return
    import tensorflow as tf

    name = "mixed_float16" if tf.config.list_logical_devices("GPU") else "mixed_bfloat16"
    keras.config.set_dtype_policy(name)
    try:
        yield name
    finally:
        keras.config.set_dtype_policy(before)


# -- dasktf info (client side) --------------------------------------------------
@dataclass
class WorkerInfo:
    """One row of ``dasktf info``: a worker as the scheduler and the worker see it."""

    address: str
    name: str
    pid: int | None
    threads: int
    memory_limit: int
    gpu_resource: float
    cuda_visible_devices: str | None
    gpus: list[dict[str, Any]]
    tf_devices: list[str] | None
    tf_error: str | None = None
    tf_build: tuple[str, str] | None = None

    def gpu_problem(self) -> str | None:
        """Why this worker's GPUs go unused by its TensorFlow, if they do."""
        if self.tf_devices is None and self.tf_build is not None:
            return None  # TensorFlow not asked (--no-tensorflow)
        seen = sum(":GPU:" in d for d in self.tf_devices or [])
        return gpu_problem(len(self.gpus), self.tf_build, seen)


def cluster_info(client: Any, with_tensorflow: bool = True) -> list[WorkerInfo]:
    """Describe every worker of ``client``'s cluster, sorted by address.

    The scheduler gives threads, memory and resources; :func:`probe_worker`, run in
    each worker process through ``Client.run``, gives the pid, the
    ``CUDA_VISIBLE_DEVICES`` it was spawned with, its GPUs (from ``nvidia-smi``,
    restricted to that variable) and the physical devices TensorFlow lists there.
    """
    sched = described_workers(client)
    probes = client.run(probe_worker, with_tensorflow, on_error="return")
    rows = []
    for address in sorted(sched):
        w = sched[address]
        p = probes.get(address)
        if isinstance(p, BaseException) or p is None:
            p = {"pid": None, "cuda_visible_devices": None, "gpus": [],
                 "tf_devices": None, "tf_error": f"probe failed: {p!r}"}
        rows.append(WorkerInfo(
            address=address,
            name=str(w.get("name", "")),
            pid=p["pid"],
            threads=int(w.get("nthreads", 0)),
            memory_limit=int(w.get("memory_limit") or 0),
            gpu_resource=float((w.get("resources") or {}).get("GPU", 0)),
            cuda_visible_devices=p["cuda_visible_devices"],
            gpus=p["gpus"],
            tf_devices=p["tf_devices"],
            tf_error=p["tf_error"],
            tf_build=tuple(p["tf_build"]) if p.get("tf_build") else None,
        ))
    return rows


def format_worker_table(rows: Sequence[WorkerInfo]) -> str:
    """``dasktf info``'s table: one line per worker, columns aligned."""
    from dask.utils import format_bytes

    header = ["address", "name", "pid", "threads", "memory", "GPU", "GPU memory",
              "CUDA_VISIBLE_DEVICES", "TensorFlow devices"]
    lines = [header]
    for r in rows:
        gpu = ", ".join(g["name"] for g in r.gpus) or "-"
        if r.gpu_resource and not r.gpus:
            gpu = f"(resource GPU={r.gpu_resource:g}; nvidia-smi sees none)"
        gpu_mem = ", ".join(
            f"{g['memory_mib']:,} MiB" if g.get("memory_mib") else "?" for g in r.gpus
        ) or "-"
        cvd = r.cuda_visible_devices
        cvd = "(unset)" if cvd is None else ("''" if cvd == "" else cvd)
        tf = ", ".join(_short(d) for d in r.tf_devices) if r.tf_devices is not None else (
            r.tf_error or "-"
        )
        lines.append([r.address, r.name, str(r.pid or "?"), str(r.threads),
                      format_bytes(r.memory_limit) if r.memory_limit else "-",
                      gpu, gpu_mem, cvd, tf])
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=False)).rstrip() for line in lines
    )
