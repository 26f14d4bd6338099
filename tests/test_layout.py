"""The tree shows the architecture, and keeps showing it.

* import-linter holds the layers (cli -> trainer -> run -> engines -> runtime -> wire),
  the independence of the engine families, the side rooms and the absence of
  import cycles, function-level imports included (contracts in ``pyproject.toml``);
* no module takes a ``_private`` name from another dasktf module;
* no module over 600 lines, no class over 300 unless listed here with the reason;
* ``fit`` and ``Trainer`` take the same options; the documented import paths work.
"""

from __future__ import annotations

import ast
import inspect
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "dasktf"

MAX_MODULE_LINES = 600
MAX_CLASS_LINES = 300
#: Classes kept whole, and why (splitting them would scatter one idea).
LARGE_CLASSES = {
    "AsyncEngine": "the client side of one async run: submit, gather, account, recover",
    "ParameterHolder": "the holder actor: its apply, gate, snapshot and restore share "
                       "one lock and one version counter",
    "Run": "one fit: the epoch loop and the set-up it needs, in order",
    "Replica": "the worker-side model: gradient, apply and their compiled functions",
    "Trainer": "mostly its public docstring (every option, once)",
}


def _modules() -> list[tuple[str, Path]]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out.append((name, path))
    return out


def test_import_contracts_hold():
    lint = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    assert lint is not None, "import-linter is a test dependency: pip install -e '.[test]'"
    result = subprocess.run([lint, "--no-cache"], cwd=ROOT, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]


def test_no_private_name_crosses_a_module():
    crossings = []
    for name, path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
                    and node.module.startswith("dasktf") and node.module != name):
                crossings += [f"{path.relative_to(ROOT)}:{node.lineno} takes "
                              f"{node.module}.{a.name}"
                              for a in node.names if a.name.startswith("_")]
    assert not crossings, "\n".join(crossings)


def test_modules_and_classes_stay_readable():
    too_long = []
    for _, path in _modules():
        text = path.read_text()
        if text.count("\n") > MAX_MODULE_LINES:
            too_long.append(f"{path.relative_to(ROOT)}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            size = getattr(node, "end_lineno", 0) - getattr(node, "lineno", 0)
            if (isinstance(node, ast.ClassDef) and size > MAX_CLASS_LINES
                    and node.name not in LARGE_CLASSES):
                too_long.append(f"{path.relative_to(ROOT)}: class {node.name}, {size} lines")
    assert not too_long, "\n".join(too_long)


def test_documented_import_paths_still_work():
    import dasktf
    from dasktf.asynchronous import UpdateRecord
    from dasktf.diagnostics import metrics as moved
    from dasktf.metrics import fetch

    assert fetch is moved.fetch and UpdateRecord is dasktf.UpdateRecord
    for name in dasktf.__all__:
        assert getattr(dasktf, name) is not None, name
    from dasktf.cli import main

    assert main.name == "main" and "fit" in main.commands and "bench" in main.commands


def test_fit_trainer_and_the_options_declare_the_same_names():
    import dasktf
    from dasktf.run.options import FaultOptions, TrainOptions

    fit = set(inspect.signature(dasktf.fit).parameters)
    construction = set(inspect.signature(dasktf.Trainer).parameters)
    per_call = set(inspect.signature(dasktf.Trainer.fit).parameters) - {"self"}
    assert fit == construction | per_call, sorted(fit ^ (construction | per_call))
    connection = {"client", "scheduler", "security"}
    assert construction - connection == set(TrainOptions.names())
    faults = {f for f in FaultOptions.__dataclass_fields__}
    assert faults <= per_call
