"""The dasktf training dashboard as a Bokeh directory app.

    bokeh serve dashboards/training --args --scheduler tcp://127.0.0.1:8786 [--run RUN]

Bokeh runs this file once per browser session; the client to the scheduler is
shared by all sessions of the server process.
"""

from __future__ import annotations

import argparse
import sys

from bokeh.io import curdoc

from dasktf.dashboard.app import client_fetcher, shared_client, training_doc

parser = argparse.ArgumentParser(prog="bokeh serve dashboards/training --args")
parser.add_argument("--scheduler", required=True, help="the Dask scheduler's address")
parser.add_argument("--run", default=None, help="a run id (default: the newest run)")
args = parser.parse_args(sys.argv[1:])

training_doc(curdoc(), client_fetcher(shared_client(args.scheduler)), run=args.run)
