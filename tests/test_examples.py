"""Every example runs as a (slow) test and prints what its docstring promises."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..")


def _run(args, tmp_path):
    proc = subprocess.run([sys.executable, *args], cwd=tmp_path, capture_output=True,
                          text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.slow
def test_exp_regression_curves_match(tmp_path):
    out = _run([os.path.join(ROOT, "examples", "exp_regression.py"), "--epochs", "8",
                "--out", str(tmp_path / "exp.png")], tmp_path)
    single = float(re.search(r"single process:\s+([\d.]+)", out).group(1))
    parallel = float(re.search(r"data-parallel \(2 workers\):\s+([\d.]+)", out).group(1))
    assert abs(single - parallel) <= 1e-4 * max(single, 1e-6) + 1e-7
    assert (tmp_path / "exp.png").stat().st_size > 1000


@pytest.mark.slow
def test_mnist_mlp_prints_the_seed_report(tmp_path):
    out = _run([os.path.join(ROOT, "examples", "mnist_mlp.py")], tmp_path)
    assert re.search(r"Step: \d+,  Epoch:  \d,  Batch: +\d+ of +\d+,  Cost: [\d.]+,  AvgTime:", out)
    accuracy = float(re.search(r"Test-Accuracy: ([\d.]+)", out).group(1))
    assert accuracy > 0.9
    assert "Total Time:" in out and "Final Cost:" in out
