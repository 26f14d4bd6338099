"""``dasktf dashboard`` (serve the live dashboard of a run on an existing cluster),
and what ``dasktf fit --dashboard/--report`` do. Bokeh is imported only when used."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

import click

from dasktf.cli.common import CONTEXT, configure_logging, run_or_exit

if TYPE_CHECKING:
    from distributed import Client

    from dasktf.dashboard.server import DashboardServer


@click.command(context_settings=CONTEXT)
@click.option("--scheduler", required=True, metavar="ADDRESS",
              help="The Dask scheduler of the cluster the run trains on.")
@click.option("--run", "run", default=None, metavar="RUN_ID",
              help="The run to show (default: the newest; the page follows new runs).")
@click.option("--port", type=click.IntRange(0, 65535), default=None,
              help="The dashboard's port (default 5006; 0 picks a free one).")
@click.option("--address", default=None, metavar="HOST",
              help="The address the dashboard binds to (default 127.0.0.1).")
@click.option("--report", type=click.Path(dir_okay=False), default=None,
              help="Write the run's plots to this standalone HTML file and exit.")
def dashboard(scheduler: str, run: str | None, port: int | None, address: str | None,
              report: str | None) -> None:
    """Serve the live training dashboard of a run on an existing cluster.

    It shows the whole run so far (the scheduler keeps a downsampled history),
    then follows it. Stop it with Ctrl-C.

    \b
    Examples:
      dasktf dashboard --scheduler tcp://127.0.0.1:8786
      dasktf dashboard --scheduler tcp://10.0.0.5:8786 --run 3f2a9c01de --port 5007
      dasktf dashboard --scheduler tcp://10.0.0.5:8786 --report run.html
    """
    configure_logging()
    run_or_exit(lambda: attach(scheduler, run, address, port, report))


@contextlib.contextmanager
def serve_dashboard(
    client: Client | None, address: str | None, port: int | None
) -> Iterator[DashboardServer | None]:
    """Serve the dashboard for the block when ``client`` is given; print the URL."""
    from dasktf.dashboard.server import DashboardServer

    if client is None:
        yield None
        return
    with DashboardServer(client, address=address, port=port) as server:
        click.echo(f"dashboard: {server.url}")
        yield server


def write_run_report(client: Client, run: str | None, path: str) -> None:
    # The workers' last records may still be in flight: give them a flush interval.
    from dasktf import config
    from dasktf.dashboard.app import write_report

    time.sleep(config.get_seconds("metrics-interval"))
    click.echo(f"report: {write_report(path, client, run)}")


def attach(scheduler: str, run: str | None, address: str | None, port: int | None,
           report: str | None) -> None:
    """``dasktf dashboard``: serve (or write the report of) a run on a cluster."""
    from dasktf.cluster.local import connect
    from dasktf.dashboard.app import write_report
    from dasktf.dashboard.server import DashboardServer
    from dasktf.diagnostics.metrics import fetch

    with connect(scheduler) as client:
        first = fetch(client, run)
        if run is not None and first.get("run") is None:
            raise ValueError(first.get("error", f"unknown run {run!r}"))
        if report:
            click.echo(f"report: {write_report(report, snapshot=first)}")
            return
        with DashboardServer(client, run=run, address=address, port=port) as server:
            shown = first.get("run") or "the first run to start"
            click.echo(f"dashboard: {server.url} (run {shown})", nl=True)
            while True:
                time.sleep(3600)
