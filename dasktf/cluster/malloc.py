"""glibc's malloc in the worker processes: the thresholds dasktf spawns them with,
and a check of workers it did not spawn.

distributed's nanny spawns its workers with ``MALLOC_TRIM_THRESHOLD_=65536``, and
setting any of glibc's thresholds turns its adaptive mmap threshold off: every
buffer of 128 KiB or more (most of TensorFlow's tensors) is then mapped afresh, or
the heap trimmed and grown again, and its pages faulted in and zeroed by the kernel
at every step. A p2p step of the MNIST MLP on 3 workers took 3.5-3.6 ms so, 2.2
with the adaptive policy's ceilings (``benchmarks/RESULTS.md``). The workers dasktf
spawns get those ceilings (:func:`malloc_env`, through
:func:`dasktf.cluster.local.spawn_environment`); workers started by hand are
checked when a run builds its replicas (:func:`fixed_mmap_threshold`), and the run
says once which of them to restart, and with what.
"""

from __future__ import annotations

import os
import platform
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

import dask

from dasktf import config
from dasktf.exceptions import WorkerEnvironmentWarning

#: the workers already warned of in this process: a run's every fit need not repeat it
_warned: set[str] = set()

#: glibc's malloc variables and the ``dasktf.local-cluster.malloc`` keys they come from
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "mmap-threshold",
              "MALLOC_TRIM_THRESHOLD_": "trim-threshold"}

#: The settings that turn glibc's adaptive mmap threshold off (mallopt(3)), as
#: variables and as ``GLIBC_TUNABLES`` names
_FIXING = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")
_FIXING_TUNABLES = ("glibc.malloc.trim_threshold", "glibc.malloc.top_pad",
                    "glibc.malloc.mmap_max")


def malloc_env() -> dict[str, str | None]:
    """glibc's malloc thresholds for the workers dasktf spawns, in bytes, from
    ``dasktf.local-cluster.malloc`` (``None``: distributed's, see
    :func:`~dasktf.cluster.local.spawn_environment`)."""
    out: dict[str, str | None] = {}
    for variable, key in MALLOC_ENV.items():
        value = config.get(f"local-cluster.malloc.{key}")
        try:
            out[variable] = None if value is None else str(dask.utils.parse_bytes(value))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"dasktf.local-cluster.malloc.{key} must be a size such "
                             f"as '32MiB' (or null); got {value!r}.") from exc
    return out


def fixed_mmap_threshold(environ: Mapping[str, str] | None = None,
                         libc: str | None = None) -> str | None:
    """What fixed glibc's mmap threshold at its 128 KiB default in a process started
    with ``environ`` (default: this one's), e.g. ``"MALLOC_TRIM_THRESHOLD_=65536"``;
    ``None`` when nothing did, when the threshold itself was set (the user chose
    it), or off glibc."""
    environ = os.environ if environ is None else environ
    if (libc if libc is not None else platform.libc_ver()[0]) != "glibc":
        return None
    tunables = [t.strip() for t in environ.get("GLIBC_TUNABLES", "").split(":") if t.strip()]
    if "MALLOC_MMAP_THRESHOLD_" in environ or any(
            t.startswith("glibc.malloc.mmap_threshold=") for t in tunables):
        return None
    found = [f"{name}={environ[name]}" for name in _FIXING if name in environ]
    found += [f"GLIBC_TUNABLES={t}" for t in tunables
              if t.split("=", 1)[0] in _FIXING_TUNABLES]
    return ", ".join(found) or None


def malloc_advice(fixed: Mapping[str, str]) -> str:
    """What to tell the user of the workers in ``fixed`` (address: what
    :func:`fixed_mmap_threshold` found there)."""
    ceilings = {k: v for k, v in malloc_env().items() if v is not None} or {
        "MALLOC_MMAP_THRESHOLD_": "33554432", "MALLOC_TRIM_THRESHOLD_": "67108864"}
    settings = " ".join(f"{k}={v}" for k, v in ceilings.items())
    named = ", ".join(f"{w} ({why})" for w, why in sorted(fixed.items()))
    return (f"{len(fixed)} worker(s) run glibc's malloc with its mmap threshold fixed "
            f"at 128 KiB: {named}. TensorFlow's tensors are then mapped and zeroed "
            f"afresh at every step (a p2p step of the MNIST MLP took 1.6x as long). "
            f"Start those workers with {settings} in their environment, or set "
            f"distributed.nanny.pre-spawn-environ to the same in their Dask config "
            f"(docs/deploy.md); nothing was changed for this run.")


def warn_fixed_malloc(replica_info: Iterable[Mapping[str, Any]]) -> None:
    """Warn once per process of the workers whose replica task found glibc's mmap
    threshold fixed (``replica_info``: :func:`~dasktf.runtime.tasks.create_replica_task`'s
    answers)."""
    fixed = {str(i["worker"]): str(i["malloc"]) for i in replica_info
             if i.get("malloc") and str(i["worker"]) not in _warned}
    if fixed:
        _warned.update(fixed)
        warnings.warn(malloc_advice(fixed), WorkerEnvironmentWarning, stacklevel=2)
