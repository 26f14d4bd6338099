"""The environment dasktf spawns its workers with (dasktf.cluster.local.spawn_environment):
glibc's malloc keeps TensorFlow's tensors of up to 32 MiB in its heap, and the heap's
free top up to 64 MiB.

distributed's nanny spawns workers with ``MALLOC_TRIM_THRESHOLD_`` set, which turns
glibc's adaptive mmap threshold off: every buffer of 128 KiB or more is then a fresh
mapping, and a heap's free top is handed back at 64 KiB: the kernel faults the pages
in and zeroes them again every step (a p2p step of the MNIST MLP 1.6x as long,
benchmarks/RESULTS.md). The quiet-import half of the
environment is tests/test_quiet.py's.
"""

from __future__ import annotations

import dask
import pytest

from dasktf.cluster.local import spawn_environment

KEY = "distributed.nanny.pre-spawn-environ"


def test_workers_are_spawned_with_the_adaptive_ceilings_and_the_users_values_win(monkeypatch):
    for variable in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"):
        monkeypatch.delenv(variable, raising=False)
    assert dask.config.get(KEY)["MALLOC_TRIM_THRESHOLD_"] == 65536  # distributed's
    with spawn_environment():
        spawn = dask.config.get(KEY)
    assert spawn["MALLOC_MMAP_THRESHOLD_"] == str(32 << 20)
    assert spawn["MALLOC_TRIM_THRESHOLD_"] == str(64 << 20)
    with dask.config.set({"dasktf.local-cluster.malloc.mmap-threshold": "1MiB",
                          "dasktf.local-cluster.malloc.trim-threshold": None}), \
            spawn_environment():
        spawn = dask.config.get(KEY)
    assert spawn["MALLOC_MMAP_THRESHOLD_"] == str(1 << 20)
    assert spawn["MALLOC_TRIM_THRESHOLD_"] == 65536  # null: distributed's left
    # (a variable in the environment wins: distributed reads it over the config)


def test_a_malformed_threshold_is_named_before_any_worker_starts():
    with dask.config.set({"dasktf.local-cluster.malloc.mmap-threshold": "lots"}), \
            pytest.raises(ValueError, match=r"dasktf\.local-cluster\.malloc\.mmap-threshold"), \
            spawn_environment():
        pass


def _page_faults_of_reallocating(nbytes: int, times: int) -> int:
    """Minor page faults of this process while a buffer of ``nbytes`` is allocated,
    written and freed ``times`` times (once before, untimed: the heap grown)."""
    import resource

    import numpy as np

    def once() -> None:
        buffer = np.ones(nbytes // 4, np.float32)  # written: its pages touched
        del buffer

    once()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(times):
        once()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def test_a_worker_reuses_its_heap_for_a_tensor_sized_buffer(client):
    """In the real worker processes: a 1 MiB buffer made 50 times faults its 256
    pages in once (the heap's), not 50 times (with distributed's settings: a fresh
    mapping each time, or the heap trimmed and grown again: 11,200-12,850)."""
    faults = client.run(_page_faults_of_reallocating, 1 << 20, 50)
    assert len(faults) == 3
    for worker, count in faults.items():
        assert count < 1_000, (worker, count)


@pytest.mark.parametrize("environ, libc, found", [
    ({"MALLOC_TRIM_THRESHOLD_": "65536"}, "glibc", "MALLOC_TRIM_THRESHOLD_=65536"),
    ({"MALLOC_TOP_PAD_": "0", "MALLOC_MMAP_MAX_": "0"}, "glibc",
     "MALLOC_TOP_PAD_=0, MALLOC_MMAP_MAX_=0"),
    ({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=65536"}, "glibc",
     "GLIBC_TUNABLES=glibc.malloc.trim_threshold=65536"),
    # the threshold itself set: the user chose it
    ({"MALLOC_TRIM_THRESHOLD_": "65536", "MALLOC_MMAP_THRESHOLD_": "131072"}, "glibc", None),
    ({"MALLOC_TRIM_THRESHOLD_": "65536",
      "GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=33554432"}, "glibc", None),
    ({}, "glibc", None),
    ({"MALLOC_TRIM_THRESHOLD_": "65536"}, "", None),  # not glibc: its variables mean nothing
])
def test_what_fixes_the_mmap_threshold_is_named(environ, libc, found):
    from dasktf.cluster.malloc import fixed_mmap_threshold

    assert fixed_mmap_threshold(environ, libc) == found


def test_workers_not_spawned_by_dasktf_are_named_once_with_the_fix(monkeypatch, small_digits,
                                                                  client):
    """Workers a plain distributed LocalCluster spawns (as `dask worker` does: its
    nanny sets MALLOC_TRIM_THRESHOLD_=65536) are named by the run, once per process,
    with the variables to start them with; nothing is said of dasktf's own."""
    import platform
    import warnings

    from distributed import Client, LocalCluster

    import dasktf
    from dasktf.exceptions import WorkerEnvironmentWarning

    if platform.libc_ver()[0] != "glibc":
        pytest.skip("glibc's malloc only")
    # (an earlier cluster of dasktf's left its values in this process's environment,
    # which the nanny would pass on: distributed's own setting is what is tested)
    for variable in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"):
        monkeypatch.delenv(variable, raising=False)
    x, y = small_digits
    fit = dict(epochs=1, batch_size=64, verbose=0, seed=0)
    with dask.config.set({KEY: {"MALLOC_TRIM_THRESHOLD_": 65536}}), \
            LocalCluster(n_workers=1, threads_per_worker=1, processes=True,
                         dashboard_address=":0", host="127.0.0.1") as cluster, \
            Client(cluster) as plain:
        plain.wait_for_workers(1, timeout=60)
        with pytest.warns(WorkerEnvironmentWarning) as caught:
            dasktf.fit("mnist-mlp", x, y, client=plain, n_workers=1, **fit)
        (said,) = [str(w.message) for w in caught]
        for worker in cluster.workers.values():
            assert f"{worker.worker_address} (MALLOC_TRIM_THRESHOLD_=65536)" in said, said
        assert "MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=67108864" in said
        with warnings.catch_warnings():
            warnings.simplefilter("error", WorkerEnvironmentWarning)
            dasktf.fit("mnist-mlp", x, y, client=plain, n_workers=1, **fit)  # said once
    with warnings.catch_warnings():  # ``client``: the workers dasktf spawned
        warnings.simplefilter("error", WorkerEnvironmentWarning)
        dasktf.fit("mnist-mlp", x, y, client=client, n_workers=3, **fit)
