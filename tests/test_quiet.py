"""Quiet by default: no TensorFlow start-up lines from the client or the workers.

Every process that imports TensorFlow prints INFO lines at import (``cpu_feature_guard``
on CPUs with instructions the build does not use, oneDNN on some builds, absl's
"before InitializeLog" header) unless ``TF_CPP_MIN_LOG_LEVEL`` is set before the
import. These tests run real processes with the variable unset, as a user's shell
would have it (conftest.py sets it for the test session itself).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

#: The lines TensorFlow's C++ logging prints when a process imports it.
TF_STARTUP = re.compile(r"onednn|absl::InitializeLog|cpu_feature_guard|^I0000 ", re.I)


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    return {**env, **extra}


def _run(args: list[str], timeout: float = 240, **env: str) -> str:
    proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout,
                          env=_env(**env))
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-3000:]
    return output


def _startup_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if TF_STARTUP.search(line)]


@pytest.fixture(scope="module")
def import_lines():
    """What one process prints importing TensorFlow unconfigured on this machine:
    the yardstick (a CPU whose features the build uses fully prints nothing)."""
    output = _run([sys.executable, "-c", "import tensorflow"], timeout=120)
    lines = _startup_lines(output)
    if not lines:
        pytest.skip("TensorFlow prints no start-up lines on this machine: nothing to hide")
    return lines


def _cli_fit(*extra: str) -> str:
    return _run([sys.executable, "-m", "dasktf.cli", "fit", "--workers", "2",
                 "--epochs", "1", "--quiet", "--no-validation", *extra])


@pytest.mark.slow
def test_cli_fit_on_an_embedded_cluster_prints_no_tensorflow_startup_lines(import_lines):
    output = _cli_fit()
    assert "done:" in output, output[-3000:]
    assert _startup_lines(output) == [], output[-3000:]


def test_verbose_sets_the_level_workers_are_spawned_with(monkeypatch):
    """``--verbose`` sets level 0 before anything imports TensorFlow, and the
    embedded cluster spawns its workers with the level of this process (a level the
    user set wins). The end-to-end check of the mechanism is the test above."""
    import dask

    from dasktf.cli.common import configure_logging
    from dasktf.cluster.local import quiet_tf_at_spawn

    monkeypatch.delenv("TF_CPP_MIN_LOG_LEVEL", raising=False)
    configure_logging(verbose=True)
    assert os.environ["TF_CPP_MIN_LOG_LEVEL"] == "0"
    with quiet_tf_at_spawn():
        spawn = dask.config.get("distributed.nanny.pre-spawn-environ")
    assert spawn["TF_CPP_MIN_LOG_LEVEL"] == "0"
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "3")
    configure_logging(verbose=True)
    with quiet_tf_at_spawn():
        assert dask.config.get("distributed.nanny.pre-spawn-environ")[
            "TF_CPP_MIN_LOG_LEVEL"] == "3"
