"""A short smoke run of the peers benchmark: every runner, all three outputs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_peers_benchmark_runs_every_runner_and_writes_its_outputs(tmp_path):
    out = tmp_path / "peers"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "peers.py"),
         "--models", "mnist-mlp", "--workers", "1", "--data", "digits",
         "--train-size", "256", "--test-size", "128", "--batch-size", "64",
         "--epochs", "2", "--target", "0.0", "--out", str(out)],
        capture_output=True, text=True, timeout=280, cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads((tmp_path / "peers.json").read_text())["rows"]
    assert {r["runner"] for r in rows} == {"keras", "mwms", "graph", "p2p", "collective",
                                          "async", "async-k2"}
    for r in rows:
        assert r["examples_per_s"] > 0 and 0.0 <= r["final_val_accuracy"] <= 1.0
        assert r["time_to_target_s"] is not None  # target 0: reached at epoch 1
    assert (tmp_path / "peers.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = proc.stdout
    assert "vs mwms" in table and "collective" in table
