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
import textwrap

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


@pytest.mark.slow
def test_cli_verbose_brings_the_lines_back_from_client_and_workers(import_lines):
    output = _cli_fit("--verbose")
    # Three processes import TensorFlow: the client and the two workers.
    assert len(_startup_lines(output)) >= 3 * len(import_lines), output[-3000:]


@pytest.mark.slow
def test_workers_stay_quiet_when_the_users_script_imports_keras_first(
        import_lines, tmp_path):
    """The case the Nanny's ``env=`` misses: a spawned worker re-imports the script's
    ``__main__`` (and so TensorFlow) before that environment is applied."""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import keras  # noqa: F401  (TensorFlow loads here, in every spawned worker too)

        import dasktf

        if __name__ == "__main__":
            d = dasktf.load_dataset("digits")
            h = dasktf.fit("mnist-mlp", d.x_train[:256], d.y_train[:256], n_workers=2,
                           epochs=1, batch_size=64, verbose=0)
            print("trained", h.history["loss"])
    """))
    output = _run([sys.executable, str(script)])
    assert "trained" in output, output[-3000:]
    # Only the client's own import, before dasktf could set anything, may print.
    assert len(_startup_lines(output)) == len(import_lines), output[-3000:]
