from __future__ import annotations

import os

import dask
import yaml

import dasktf.config

HERE = os.path.dirname(dasktf.config.__file__)


def _keys(tree: dict, schema: bool, prefix: str = "") -> set[str]:
    out = set()
    items = tree.get("properties", {}) if schema else tree
    for key, value in items.items():
        name = f"{prefix}{key}"
        nested = value.get("properties") if schema else value if isinstance(value, dict) else None
        if nested:
            out |= _keys(value, schema, name + ".")
        else:
            out.add(name)
    return out


def test_schema_describes_every_default():
    with open(os.path.join(HERE, "dasktf.yaml")) as f:
        defaults = yaml.safe_load(f)
    with open(os.path.join(HERE, "dasktf-schema.yaml")) as f:
        schema = yaml.safe_load(f)
    assert _keys(defaults, schema=False) == _keys(schema, schema=True)


def test_config_precedence():
    assert dasktf.config.get_seconds("step-timeout") == 600
    with dask.config.set({"dasktf.step-timeout": "2 minutes"}):
        assert dasktf.config.get_seconds("step-timeout") == 120
        assert dasktf.config.get_seconds("step-timeout", 5) == 5
