"""``dasktf info``: the cluster's workers and the devices each one sees."""

from __future__ import annotations

from typing import Any

import click

from dasktf.cli import common


@click.command(context_settings=common.CONTEXT)
@click.option("--workers", "-w", "n_workers", type=click.IntRange(min=1), default=None,
              help="Start a local cluster of this many workers (default: one per GPU, "
              "else 2).")
@click.option("--scheduler", default=None, metavar="ADDRESS",
              help="Inspect an existing Dask cluster instead of starting one.")
@common.gpus_option
@click.option("--no-tensorflow", is_flag=True,
              help="Do not import TensorFlow on the workers (faster; no TF device list).")
def info(n_workers: int | None, scheduler: str | None, gpus: str | None,
         no_tensorflow: bool) -> None:
    """List the cluster's workers and the devices each one sees.

    \b
    Columns: address, name, pid, threads, memory limit, GPU name and memory (from
    nvidia-smi, restricted to the worker's CUDA_VISIBLE_DEVICES), the
    CUDA_VISIBLE_DEVICES it was started with, and TensorFlow's physical devices.

    \b
    Examples:
      dasktf info --workers 2
      dasktf info --scheduler tcp://10.0.0.5:8786
    """
    common.configure_logging()
    gpu_arg = common.parse_gpus(gpus)
    common.run_or_exit(lambda: _info(n_workers, scheduler, gpu_arg, not no_tensorflow))


def _info(n_workers: int | None, scheduler: str | None, gpus: Any, with_tf: bool) -> None:
    from dasktf.cluster.devices import (
        cluster_info,
        discover_gpus,
        format_worker_table,
        local_gpu_problem,
        split_gpu_workers,
    )
    from dasktf.cluster.local import choose_workers, cluster_client

    if scheduler is not None and (n_workers is not None or gpus is not None):
        raise common.BadArgument("--workers and --gpus start a local cluster; "
                           "they cannot be combined with --scheduler.")
    with cluster_client(None, scheduler, n_workers, None, None, gpus) as (client, _):
        choose_workers(client, n_workers)  # a starting cluster: wait for its workers
        rows = cluster_info(client, with_tensorflow=with_tf)
        where = scheduler or f"local cluster at {client.scheduler.address}"
        click.echo(f"{len(rows)} worker(s), {where}")
        click.echo(format_worker_table(rows))
        workers = {r.address: {"resources": {"GPU": r.gpu_resource}} for r in rows}
        with_gpu, without = split_gpu_workers(workers)
        if with_gpu and without:
            click.echo(f"workers without a GPU resource (left out of GPU runs): "
                       f"{', '.join(without)}")
        problems = {p for p in (r.gpu_problem() for r in rows) if p}
        if scheduler is None:  # this machine's GPUs, which the local workers share
            problems.add(local_gpu_problem(discover_gpus()) or "")
        for problem in sorted(p for p in problems if p):
            click.echo(f"Warning: {problem}")
