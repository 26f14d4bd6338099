"""``dasktf fit`` end to end in a subprocess, and its argument errors."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner

from dasktf.cli import main


def _dasktf(*args: str, timeout: float = 240, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "dasktf.cli", *args],
        capture_output=True, text=True, timeout=timeout, env={**os.environ, **env},
    )


@pytest.mark.slow
def test_fit_two_workers_two_epochs_reaches_090_test_accuracy():
    proc = _dasktf("fit", "--workers", "2", "--epochs", "2", "--quiet")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert re.search(r"epoch 1/2 .*loss .*val_accuracy .*examples/s", out)
    assert re.search(r"epoch 2/2 ", out)
    accuracy = float(re.search(r"test accuracy (\d\.\d+)", out).group(1))
    assert accuracy >= 0.9, out
    assert "wall time" in out and "examples/s" in out


def test_help_documents_every_option():
    result = CliRunner().invoke(main, ["fit", "--help"])
    assert result.exit_code == 0
    for option in ["--workers", "--model", "--data", "--epochs", "--batch-size",
                   "--optimizer", "--lr", "--seed", "--scheduler", "--threads-per-worker"]:
        assert option in result.output


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "nope"], "Unknown model 'nope'"),
        (["--data", "nope"], "Unknown data set 'nope'"),
        (["--workers", "0"], "--workers"),
        (["--optimizer", "adamm"], "Unknown optimizer 'adamm'"),
    ],
)
def test_bad_arguments_exit_2_with_a_reason(args, message):
    result = CliRunner().invoke(main, ["fit", *args])
    assert result.exit_code == 2, result.output
    assert message in result.output


@pytest.mark.slow
def test_unreachable_scheduler_exits_1_naming_it():
    start = time.monotonic()
    # Nothing listens there: any connect timeout ends the same way; a short one
    # spares the test the default's 10 s of retries (the message names the one used).
    proc = _dasktf("fit", "--scheduler", "tcp://127.0.0.1:1", "--epochs", "1", timeout=60,
                   DASK_DASKTF__CONNECT_TIMEOUT="1s")
    assert proc.returncode == 1
    errors = [line for line in proc.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "tcp://127.0.0.1:1" in errors[0], proc.stderr
    assert "within 1s" in errors[0], proc.stderr  # the setting reached the command
    assert time.monotonic() - start < 30  # includes the interpreter and TF import
