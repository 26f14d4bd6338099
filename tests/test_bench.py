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


@pytest.mark.timeout(300)
def test_bench_sharded_runners_train_as_p2p_does(tmp_path, monkeypatch):
    """``dasktf bench --runners p2p,p2p-sharded,p2p-zero2``: the sharded runners
    run side by side with p2p and, being exact, reach its validation accuracy."""
    from click.testing import CliRunner

    from dasktf.cli.bench import bench

    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(bench, [
        "--models", "mnist-mlp", "--workers", "2", "--runners", "p2p,p2p-sharded,p2p-zero2",
        "--data", "digits", "--train-size", "256", "--test-size", "128",
        "--batch-size", "64", "--epochs", "2", "--target", "0.0", "--out", "sharded"])
    assert result.exit_code == 0, result.output
    rows = {r["runner"]: r for r in json.loads((tmp_path / "sharded.json").read_text())["rows"]}
    assert set(rows) == {"p2p", "p2p-sharded", "p2p-zero2"}
    for name in ("p2p-sharded", "p2p-zero2"):
        assert rows[name]["examples_per_s"] > 0
        assert rows[name]["final_val_accuracy"] == pytest.approx(
            rows["p2p"]["final_val_accuracy"], abs=1e-6)
    assert "p2p-sharded" in result.output
