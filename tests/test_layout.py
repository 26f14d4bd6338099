"""The tree shows the architecture, and keeps showing it.

* import-linter holds the layers (cli -> trainer -> run -> engines -> runtime -> wire),
  the independence of the engine families, the side rooms and the absence of
  import cycles, function-level imports included (contracts in ``pyproject.toml``);
  grimp, with annotation-only imports counted too, that engines/, runtime/ and
  run/guard.py are in no circle and the guard imports only the engine contract;
* no module takes a ``_private`` name from another dasktf module;
* no module over 600 lines, no class over 300 unless listed here with the reason;
* ``fit`` and ``Trainer`` take the same options; the documented import paths work.
"""

from __future__ import annotations

import inspect
import json
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
    "AsyncEngine": "the client side of one async run: the I/O its state asks for",
    "AsyncState": "the async run's state machine: its transitions together keep every "
                  "batch applied once",
    "ParameterHolder": "the holder actor: its apply, gate, snapshot and restore share "
                       "one lock and one version counter",
    "Run": "one fit: the epoch loop and the set-up it needs, in order",
    "Replica": "the worker-side model: gradient, apply and their compiled functions",
    "Trainer": "mostly its public docstring (every option, once)",
}


# The AST checks run in a fresh interpreter: CPython 3.11.7's ast.parse can fail with
# "AST constructor recursion depth mismatch" deep inside a long pytest session.
_SCAN = r"""
import ast, json, sys
from pathlib import Path
root = Path(sys.argv[1]); package = root / "dasktf"
out = {"crossings": [], "modules": [], "classes": []}
for path in sorted(package.rglob("*.py")):
    parts = path.relative_to(root).with_suffix("").parts
    name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    text = path.read_text()
    where = str(path.relative_to(root))
    out["modules"].append([where, text.count("\n")])
    for node in ast.walk(ast.parse(text)):
        if (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
                and node.module.startswith("dasktf") and node.module != name):
            out["crossings"] += [f"{where}:{node.lineno} takes {node.module}.{a.name}"
                                 for a in node.names if a.name.startswith("_")]
        if isinstance(node, ast.ClassDef):
            out["classes"].append([where, node.name, node.end_lineno - node.lineno])
print(json.dumps(out))
"""


def _scan() -> dict:
    result = subprocess.run([sys.executable, "-c", _SCAN, str(ROOT)], capture_output=True,
                            text=True, timeout=120, check=True)
    return json.loads(result.stdout)


def test_import_contracts_hold():
    lint = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    assert lint is not None, "import-linter is a test dependency: pip install -e '.[test]'"
    result = subprocess.run([lint, "--no-cache"], cwd=ROOT, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]


def test_annotation_imports_keep_the_engines_and_the_guard_apart():
    """import-linter leaves ``TYPE_CHECKING`` imports out (they never run), but a
    circle of them still means modules that cannot be read, or changed, apart. With
    them counted: no circle through engines/, runtime/ or run/guard.py; no arrow
    from a lower room to a higher one; and the guard knows the engines only by
    their contract (engines/base.py), so a new engine changes nothing in run/."""
    import grimp

    graph = grimp.build_graph("dasktf", exclude_type_checking_imports=False, cache_dir=None)
    layers = ["dasktf.cli", "dasktf.trainer", "dasktf.run", "dasktf.engines",
              "dasktf.runtime", "dasktf.wire"]

    def layer(module: str) -> int | None:
        return next((i for i, name in enumerate(layers)
                     if module == name or module.startswith(name + ".")), None)

    scope = sorted(m for m in graph.modules
                   if (layer(m) or 0) >= layers.index("dasktf.engines")
                   or m == "dasktf.run.guard")
    circles, upward = [], []
    for module in scope:
        for imported in sorted(graph.find_modules_directly_imported_by(module)):
            if imported == module or module.startswith(imported + "."):  # itself, its package
                continue
            back = graph.find_shortest_chain(importer=imported, imported=module)
            if back is not None:
                circles.append(" -> ".join((module, *back)))
            if (layer(imported) or 99) < (layer(module) or 0):
                upward.append(f"{module} -> {imported}")
    assert not circles, "import circles, annotation-only imports counted:\n" + "\n".join(circles)
    assert not upward, "imports from a lower room to a higher one:\n" + "\n".join(upward)
    engines = sorted(m for m in graph.find_modules_directly_imported_by("dasktf.run.guard")
                     if m.startswith("dasktf.engines"))
    assert engines == ["dasktf.engines.base"], engines


def test_no_private_name_crosses_a_module():
    crossings = _scan()["crossings"]
    assert not crossings, "\n".join(crossings)


def test_modules_and_classes_stay_readable():
    scan = _scan()
    too_long = [f"{where}: {lines} lines" for where, lines in scan["modules"]
                if lines > MAX_MODULE_LINES]
    too_long += [f"{where}: class {name}, {size} lines" for where, name, size in scan["classes"]
                 if size > MAX_CLASS_LINES and name not in LARGE_CLASSES]
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


def test_readme_opens_with_the_commands_and_stays_short():
    """The README is the first minute: its two commands first, the rest in docs/."""
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    assert len(readme) <= 12_000, f"README.md has {len(readme):,} characters"
    first_block = readme.split("```")[1]
    assert 'pip install -e ".[cpu]" && dasktf fit --workers 3' in first_block
    assert 'pip install -e ".[gpu]"' in first_block
    assert "bash .ci/run" in first_block
