"""``dasktf tf-cluster`` and ``dasktf check-tf-config``: the command-line face of
the ``tf.distribute`` bridge (:mod:`dasktf.tf.bridge`).
"""

from __future__ import annotations

import json
import sys
from typing import Any

import click

from dasktf.cli.common import CONTEXT, configure_logging, run_or_exit


@click.command("tf-cluster", context_settings=CONTEXT)
@click.option("--workers", "-w", "n_workers", type=click.IntRange(min=1), default=2,
              show_default=True, help="Workers of the embedded local cluster.")
@click.option("--scheduler", default=None, metavar="ADDRESS",
              help="An existing Dask cluster instead of an embedded one.")
@click.option("--ps", type=click.IntRange(min=0), default=0, show_default=True,
              help="ParameterServerStrategy layout: the first worker is the chief, the "
              "next PS workers parameter servers, the rest workers.")
@click.option("--probe", is_flag=True,
              help="Also run one MultiWorkerMirroredStrategy step through the TF "
              "cluster and print what each worker saw.")
@click.option("--timeout", default=None, metavar="SECONDS",
              help="How long the workers may take (default dasktf.tf-cluster-timeout).")
def tf_cluster(n_workers: int, scheduler: str | None, ps: int, probe: bool,
               timeout: str | None) -> None:
    """Print the TF_CONFIG of every Dask worker (JSON: {worker: TF_CONFIG}).

    \b
    Examples:
      dasktf tf-cluster --scheduler tcp://10.0.0.5:8786 > tf_configs.json
      dasktf tf-cluster --workers 2 --probe
      dasktf tf-cluster --workers 3 --ps 1
    """
    configure_logging()
    if probe and ps:
        raise click.UsageError("--probe runs a MultiWorkerMirroredStrategy step; "
                               "it does not combine with --ps.")
    run_or_exit(lambda: _tf_cluster(n_workers, scheduler, ps, probe, timeout))


def _tf_cluster(n_workers: int, scheduler: str | None, ps: int, probe: bool,
                timeout: str | None) -> None:
    from dasktf.cluster.local import cluster_client
    from dasktf.tf.bridge import mwms_probe, run_tf_distributed, tf_config

    with cluster_client(None, scheduler, n_workers, None, None, "none") as (client, _):
        client.wait_for_workers(1 if scheduler else n_workers, timeout=120)
        configs = tf_config(client, chief=bool(ps), ps=ps, timeout=timeout)
        click.echo(json.dumps(configs, indent=2))
        click.echo("note: a TensorFlow server started with these configs listens on "
                   "every interface (0.0.0.0) without authentication; keep these "
                   "ports on a trusted network (README: Security).", err=True)
        if probe:
            for row in run_tf_distributed(client, mwms_probe, timeout=timeout):
                click.echo(f"probe: {json.dumps(row)}", err=True)


@click.command("check-tf-config", context_settings=CONTEXT)
@click.argument("source", type=click.File("r"), default="-")
@click.option("--no-ports", is_flag=True,
              help="Skip resolving hosts and test-binding local ports.")
def check_tf_config_command(source: Any, no_ports: bool) -> None:
    """Check a TF_CONFIG (a JSON file, or - for stdin) before starting TensorFlow.

    SOURCE holds one TF_CONFIG, a list of them (one per process), or the
    {worker: TF_CONFIG} object `dasktf tf-cluster` prints. Checks task indices,
    the chief, evaluator placement, addresses and (unless --no-ports) that hosts
    resolve and local ports are free. Exit code 0: fine; 1: problems (one line
    each); 2: not JSON.

    \b
    Examples:
      dasktf check-tf-config tf_configs.json
      echo "$TF_CONFIG" | dasktf check-tf-config -
    """
    from dasktf.tf.bridge import check_tf_config, load_tf_config_text

    try:
        configs = load_tf_config_text(source.read())
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    if not isinstance(configs, (dict, list)):
        raise click.UsageError("Expected a JSON object or list of TF_CONFIGs.")
    problems = check_tf_config(configs, check_ports=not no_ports)
    if not problems:
        click.echo("TF_CONFIG OK")
        return
    for p in problems:
        click.echo(f"Error: {p}", err=True)
    sys.exit(1)
