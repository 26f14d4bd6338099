"""``dasktf dashboard``: serve the live dashboard of a run on an existing cluster."""

from __future__ import annotations

import click

from dasktf.cli.common import CONTEXT, configure_logging, run_or_exit


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
    from dasktf.dashboard.cli import attach

    configure_logging()
    run_or_exit(lambda: attach(scheduler, run, address, port, report))
