"""What ``dasktf fit --dashboard/--report`` and ``dasktf dashboard`` do."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

import click

from dasktf.dashboard.report import write_report
from dasktf.dashboard.server import DashboardServer

if TYPE_CHECKING:
    from distributed import Client


@contextlib.contextmanager
def serve_dashboard(
    client: Client | None, address: str | None, port: int | None
) -> Iterator[DashboardServer | None]:
    """Serve the dashboard for the block when ``client`` is given; print the URL."""
    if client is None:
        yield None
        return
    with DashboardServer(client, address=address, port=port) as server:
        click.echo(f"dashboard: {server.url}")
        yield server


def write_run_report(client: Client, run: str | None, path: str) -> None:
    # The workers' last records may still be in flight: give them a flush interval.
    from dasktf import config

    time.sleep(config.get_seconds("metrics-interval"))
    click.echo(f"report: {write_report(path, client, run)}")


def attach(scheduler: str, run: str | None, address: str | None, port: int | None,
           report: str | None) -> None:
    """``dasktf dashboard``: serve (or write the report of) a run on a cluster."""
    from dasktf.cluster.local import connect
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
