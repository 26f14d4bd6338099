"""dasktf's configuration: defaults in ``dasktf.yaml``, read through ``dask.config``.

Every knob lives under the ``dasktf`` namespace, so users set them as they set Dask's
own: in a YAML file under ``~/.config/dask/``, with ``DASK_DASKTF__STEP_TIMEOUT=60s``
in the environment, or with ``dask.config.set({"dasktf.step-timeout": "60s"})``.
"""

from __future__ import annotations

import os
from typing import Any

import dask.config
import yaml
from dask.utils import parse_timedelta

_HERE = os.path.dirname(__file__)

with open(os.path.join(_HERE, "dasktf.yaml")) as f:
    defaults = yaml.safe_load(f)

dask.config.update_defaults(defaults)


def get(key: str, value: Any = None) -> Any:
    """``value`` if given, else the configured ``dasktf.<key>``."""
    if value is not None:
        return value
    return dask.config.get(f"dasktf.{key}")


def get_seconds(key: str, value: float | str | None = None) -> float:
    """A duration from the config (``"30s"``, ``"2 minutes"`` or a number) in seconds."""
    seconds = parse_timedelta(get(key, value), default="seconds")
    assert seconds is not None
    return float(seconds)
