"""Static checks that catch real bugs before a test has to: ruff with the rule set
``pyproject.toml`` declares (pyflakes, bugbear, blind excepts, import order,
pyupgrade, ruff's own), over every tree the project ships."""

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_ruff_clean_with_the_declared_rules():
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    assert ruff is not None, "ruff is a test dependency: pip install -e '.[test]'"
    paths = ["dasktf", "dashboards", "tests", "benchmarks", "examples"]
    result = subprocess.run(
        [ruff, "check", "--no-cache", "--output-format", "concise", *paths],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
