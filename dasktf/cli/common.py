"""What every ``dasktf`` subcommand shares: click settings, the exit-code mapping
and the quiet logging set-up.

Exit codes: 0 success, 2 bad arguments (an unknown model, data set or option value),
1 a training failure (a lost worker, an unreachable scheduler, a failing replica),
always with a one-line reason on stderr.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import click

CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


class BadArgument(click.UsageError):
    """Exit code 2 with click's usual 'Error: ...' line."""


def parse_gpus(text: str | None) -> Any:
    """``--gpus`` as the API's ``gpus=``; a malformed value exits with code 2."""
    from dasktf.cluster.devices import parse_gpus as parse

    try:
        return parse(text)
    except ValueError as exc:
        raise BadArgument(str(exc)) from exc


gpus_option = click.option(
    "--gpus", default=None, metavar="all|none|N|0,2,3",
    help="GPUs to start one worker each on: all, none, a count N, or indices (a single "
    "index as '3,'). Default: every visible GPU, else CPU workers. With --scheduler, "
    "the workers advertising a GPU resource.",
)


def run_or_exit(fn: Any) -> None:
    """Run ``fn``; map errors to exit codes with a one-line reason."""
    from dasktf.exceptions import DasktfError

    try:
        fn()
    except click.ClickException:
        raise
    except ModuleNotFoundError as exc:
        if exc.name != "tensorflow":
            raise
        from dasktf.cluster.tfbuild import INSTALL_HINT

        click.echo(f"Error: TensorFlow is not installed: {INSTALL_HINT}.", err=True)
        sys.exit(1)
    except (ValueError, TypeError) as exc:
        raise BadArgument(first_line(exc)) from exc
    except (DasktfError, FileNotFoundError, OSError, TimeoutError) as exc:
        click.echo(f"Error: {first_line(exc)}", err=True)
        echo_detail(exc)
        sys.exit(1)
    except KeyboardInterrupt:
        click.echo("Interrupted.", err=True)
        sys.exit(130)


def first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0]


def echo_detail(exc: BaseException) -> None:
    """A worker's traceback, if any, after the one-line reason."""
    lines = str(exc).strip().splitlines()
    if len(lines) > 1:
        click.echo("\n".join(lines[1:]), err=True)


def configure_logging(verbose: bool = False) -> None:
    """Quiet by default: warnings and errors only, from Python and TensorFlow's C++.

    ``verbose`` brings back TensorFlow's INFO lines (in this process and, through the
    environment, in the workers of an embedded cluster) and dasktf's INFO logging. A
    ``TF_CPP_MIN_LOG_LEVEL`` the user set wins either way.
    """
    import os

    from dasktf.cluster import quiet
    from dasktf.cluster.local import QUIET_TF_LOG_LEVEL

    # Before anything imports TensorFlow: it reads the level once, at import, and
    # the lines it prints before its logging is up are held to the level here.
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "0" if verbose else QUIET_TF_LOG_LEVEL)
    quiet.install()
    # distributed configures its loggers (INFO) when first imported; with the lazy
    # public API that can happen after this function, so import it first.
    import distributed  # noqa: F401

    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    for noisy in ("distributed", "tensorflow", "absl"):
        logging.getLogger(noisy).setLevel(logging.WARNING if verbose else logging.ERROR)
