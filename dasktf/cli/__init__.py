"""The ``dasktf`` command line (entry point :func:`dasktf.cli.main`)."""

from dasktf.cli.app import main

__all__ = ["main"]
