"""Static checks that catch real bugs before a test has to: undefined names, unused
imports and variables, syntax errors (ruff's pyflakes and E9 rules)."""

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_pyflakes_clean():
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    assert ruff is not None, "ruff is a test dependency: pip install -e '.[test]'"
    paths = ["dasktf", "dashboards", "tests", "benchmarks", "examples"]
    result = subprocess.run(
        [ruff, "check", "--no-cache", "--select", "F,E9", "--output-format", "concise",
         *paths],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
