"""The ``dasktf`` command line (entry point :func:`main`): ``dasktf fit`` and friends,
one click group. Every subcommand lives in a module of its own here and shares
:mod:`.common` (click settings, exit codes, logging).
"""

from __future__ import annotations

import atexit
import gc

import click

from dasktf.cli.bench import bench
from dasktf.cli.common import CONTEXT
from dasktf.cli.dashboard import dashboard
from dasktf.cli.fit import fit
from dasktf.cli.info import info
from dasktf.cli.predict import predict
from dasktf.cli.tf import check_tf_config_command, tf_cluster


@click.group(context_settings=CONTEXT)
@click.version_option(package_name="dasktf")
def main() -> None:
    """Data-parallel TensorFlow/Keras training on a Dask cluster."""
    # The command exits without the interpreter's last cyclic collection: with
    # TensorFlow loaded it walks millions of objects for 3-7 s after the result is
    # printed (as the workers do: dasktf/cluster/startup/sitecustomize.py)
    atexit.register(gc.freeze)


for _command in (fit, predict, info, dashboard, tf_cluster, check_tf_config_command,
                 bench):
    main.add_command(_command)


__all__ = ["main"]
