"""The tree shows the architecture, and keeps showing it.

* import-linter holds the layers (cli -> trainer -> run -> engines -> runtime -> wire),
  the independence of the engine families, the side rooms and the absence of
  import cycles, function-level imports included (contracts in ``pyproject.toml``);
  grimp, with annotation-only imports counted too, that engines/, runtime/ and
  run/guard.py are in no circle and the guard imports only the engine contract;
  an AST scan of the whole package, every import counted, that there is no circle;
* no module takes a ``_private`` name from another dasktf module, and none but
  dasktf/compat.py another library's (``keras.src``, ``obj._name``: issue 37);
* one writer per state (issue 37): the run alone assigns its workers, the loss
  records are built in diagnostics/events.py alone, and run/ and trainer.py know
  the engines by their factory and their contract only;
* no module over 600 lines, no class over 300 unless listed here with the reason;
* ``fit`` and ``Trainer`` take the same options; the documented import paths work.
"""

from __future__ import annotations

import inspect
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

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
PUBLIC = {"_exit", "_asdict", "_replace", "_fields", "_make"}  # os._exit, namedtuples
# Private names dasktf.compat wraps that dasktf also uses for names of its own: on
# anything but ``self``, another library's.
WRAPPED = {"_gather"}
# Another library's private name used by ``node``: a ``keras.src`` (or any
# ``x._private``) module imported, an imported ``_name``, ``obj._name`` or
# ``getattr(obj, "_name")`` where dasktf defines no ``_name``.
def foreign(node, own):
    private = lambda n: n.startswith("_") and not n.startswith("__") and n not in PUBLIC
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        modules = ([a.name for a in node.names] if isinstance(node, ast.Import)
                   else [] if node.level or (node.module or "").startswith("dasktf")
                   else [node.module] + [f"{node.module}.{a.name}" for a in node.names])
        return [f"imports {m}" for m in modules
                if m.startswith("keras.src") or any(map(private, m.split(".")))][:1]
    if isinstance(node, ast.Attribute) and private(node.attr) and (
            node.attr not in own or node.attr in WRAPPED
            and not (isinstance(node.value, ast.Name) and node.value.id == "self")):
        return [f"uses .{node.attr}"]
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr", "setattr") and len(node.args) > 1
            and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
            and private(node.args[1].value) and node.args[1].value not in own):
        return [f"uses {node.func.id}(..., {node.args[1].value!r})"]
    return []
out = {"crossings": [], "modules": [], "classes": [], "foreign": []}
trees = {path: ast.parse(path.read_text()) for path in sorted(package.rglob("*.py"))}
# Underscore names dasktf itself defines (functions, classes, attributes it sets,
# parameters): any other ``obj._name`` belongs to another library.
own = {getattr(n, a) for t in trees.values() for n in ast.walk(t)
       for a in ("name", "attr", "id", "arg", "asname")
       if isinstance(getattr(n, a, None), str) and (
           isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.arg,
                          ast.alias))
           or isinstance(getattr(n, "ctx", None), ast.Store))}
for path in trees:
    parts = path.relative_to(root).with_suffix("").parts
    name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    text = path.read_text()
    where = str(path.relative_to(root))
    out["modules"].append([where, text.count("\n")])
    for node in ast.walk(trees[path]):
        if where != "dasktf/compat.py":
            out["foreign"] += [f"{where}:{node.lineno} {use}" for use in foreign(node, own)]
        if (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
                and node.module.startswith("dasktf") and node.module != name):
            out["crossings"] += [f"{where}:{node.lineno} takes {node.module}.{a.name}"
                                 for a in node.names if a.name.startswith("_")]
        if isinstance(node, ast.ClassDef):
            out["classes"].append([where, node.name, node.end_lineno - node.lineno])
print(json.dumps(out))
"""


# Every import inside the package, module to module: TYPE_CHECKING and function-level
# imports included (a circle of annotation-only imports is still two modules that
# cannot be read, or changed, apart). Prints the edges and the circles (strongly
# connected components); ``python tests/test_layout.py`` prints the figures.
_GRAPH = r"""
import ast, json, sys
from pathlib import Path
sys.setrecursionlimit(10000)
root = Path(sys.argv[1]); package = root / "dasktf"
modules = {}
for path in sorted(package.rglob("*.py")):
    parts = path.relative_to(root).with_suffix("").parts
    modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
edges = set()
for name, path in modules.items():
    package_name = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package_name.split(".")[:len(package_name.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                       for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name and not name.startswith(target + "."):
                edges.add((name, target))
out = {m: sorted(b for a, b in edges if a == m) for m in modules}
index, low, stack, on, circles = {}, {}, [], set(), []
def visit(v):
    index[v] = low[v] = len(index); stack.append(v); on.add(v)
    for w in out[v]:
        if w not in index:
            visit(w); low[v] = min(low[v], low[w])
        elif w in on:
            low[v] = min(low[v], index[w])
    if low[v] == index[v]:
        component = []
        while not component or component[-1] != v:
            component.append(stack.pop()); on.discard(component[-1])
        if len(component) > 1:
            circles.append(sorted(component))
for m in modules:
    if m not in index:
        visit(m)
print(json.dumps({"modules": len(modules), "edges": len(edges), "circles": circles}))
"""


def import_graph() -> dict:
    """The package's import figures: modules, edges, circles (see ``_GRAPH``)."""
    result = subprocess.run([sys.executable, "-c", _GRAPH, str(ROOT)], capture_output=True,
                            text=True, timeout=120, check=True)
    return json.loads(result.stdout)


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


def test_no_import_circle_annotation_only_imports_included():
    """The whole package, every import counted (TYPE_CHECKING and function-level):
    no two modules import each other, directly or around a circle. The run and
    its Trainer used to (``run/run.py`` <-> ``trainer.py``, through annotations)."""
    graph = import_graph()
    assert graph["edges"] > 100, graph  # the scan found the package's imports
    assert not graph["circles"], "import circles:\n" + "\n".join(
        " <-> ".join(c) for c in graph["circles"])


def test_no_private_name_crosses_a_module():
    crossings = _scan()["crossings"]
    assert not crossings, "\n".join(crossings)


def test_only_compat_touches_other_libraries_private_names():
    """TensorFlow's, Keras', Tornado's, distributed's and dask's private names (and
    ``keras.src``) are used in dasktf/compat.py only, each behind a function with a
    fallback or an error naming the installed version, and a canary in
    tests/test_compat.py; anywhere else a release could rename them unnoticed
    (issue 37). A name dasktf defines itself is its own, whatever object holds it."""
    foreign = _scan()["foreign"]
    assert not foreign, "use dasktf.compat (docs/compat.md):\n" + "\n".join(foreign)


def test_worker_lists_come_from_the_scheduler_not_the_clients_cache():
    """``client.scheduler_info()["workers"]`` returns the client's cached identity,
    which its periodic refresh (asking for no workers) can overwrite between the
    fetch and the return: a check that a killed worker has gone then passes at once
    (CI: a kill hook went on before the kill was noticed). Lists of workers come from
    ``dasktf.cluster.membership`` (``alive_workers``, ``described_workers``)."""
    subscripted = re.compile(r"scheduler_info\([^)]*\)\s*\[")
    found = [f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
             for folder in ("dasktf", "tests", "benchmarks", "examples", "dashboards")
             for path in sorted((ROOT / folder).rglob("*.py"))
             for n, line in enumerate(path.read_text().splitlines(), 1)
             if subscripted.search(line) and "``" not in line
             and not line.lstrip().startswith("#")]
    assert not found, "use dasktf.cluster.membership.alive_workers:\n" + "\n".join(found)


def test_one_writer_per_state():
    """Engines report a change of the run's workers (``RunHooks.workers_changed``)
    and run/run.py assigns it; the ``worker_lost`` and ``recovered`` records come
    from :mod:`dasktf.diagnostics.events`; run/ and trainer.py reach the engines
    through run/engine.py (the factory, with each family's option rules) and
    ``engines.base`` (the contract) only."""
    found: dict[str, list[str]] = {"writers": [], "records": [], "engines": []}
    record = re.compile(r"""["']kind["']\s*:\s*["'](worker_lost|recovered)["']""")
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        names_engines = (rel.startswith("run/") or rel == "trainer.py") and (
            rel != "run/engine.py")
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"\bctx\.workers\s*=[^=]", line) and rel != "run/run.py":
                found["writers"].append(f"{rel}:{n}")
            if record.search(line) and rel != "diagnostics/events.py":
                found["records"].append(f"{rel}:{n}")
            if names_engines and re.search(r"engines\.(?!base\b)", line):
                found["engines"].append(f"{rel}:{n}")
    assert found == {"writers": [], "records": [], "engines": []}, found


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


def test_the_three_signatures_are_the_declared_options():
    """``fit``, ``Trainer`` and ``Trainer.fit`` show every option the dataclasses of
    dasktf.run.options declare, with its default and type, in one order, and
    nothing else: the options are declared once."""
    import dasktf
    from dasktf.run.options import (
        CONSTRUCTION,
        FIT_ORDER,
        PER_CALL,
        option_fields,
    )

    def keywords(func):
        return [(p.name, p.default, p.annotation)
                for p in inspect.signature(func).parameters.values()
                if p.kind is p.KEYWORD_ONLY]

    def declared(classes):
        fields = option_fields(*classes)
        return [(name, fields[name].default, fields[name].type)
                for name in FIT_ORDER if name in fields]

    assert sorted(FIT_ORDER) == sorted(option_fields(*CONSTRUCTION, *PER_CALL))
    assert keywords(dasktf.Trainer) == declared(CONSTRUCTION)
    assert keywords(dasktf.Trainer.fit) == declared(PER_CALL)
    assert keywords(dasktf.fit) == declared([*CONSTRUCTION, *PER_CALL])
    positional = {f.__qualname__: [p.name for p in inspect.signature(f).parameters.values()
                                   if p.kind is p.POSITIONAL_OR_KEYWORD]
                  for f in (dasktf.fit, dasktf.Trainer, dasktf.Trainer.fit)}
    assert positional == {"fit": ["model", "x", "y"], "Trainer": ["model"],
                          "Trainer.fit": ["self", "x", "y"]}
    with pytest.raises(TypeError, match="did you mean 'epochs'"):
        dasktf.fit("mnist-mlp", None, epoch=2)


def test_readme_opens_with_the_commands_and_stays_short():
    """The README is a five-minute read: its two commands first, the rest in docs/,
    and every page it links to exists."""
    root = Path(__file__).parent.parent
    readme = (root / "README.md").read_text()
    assert len(readme) <= 8_000, f"README.md has {len(readme):,} characters"
    for page in re.findall(r"\]\((docs/[^)#]+)", readme):
        assert (root / page).exists(), page
    first_block = readme.split("```")[1]
    assert 'pip install -e ".[cpu]" && dasktf fit --workers 3' in first_block
    assert 'pip install -e ".[gpu]"' in first_block
    assert "bash .ci/run" in first_block


def test_data_is_one_factory_over_small_adapters():
    """data/ in the shape of Keras' ``data_adapters`` (issue 37): every module small,
    and the probes of what ``x`` is in the factory alone."""
    sizes = {p.name: len(p.read_text().splitlines()) for p in (PACKAGE / "data").glob("*.py")}
    assert max(sizes.values()) <= 300, sizes
    probes = ("def is_tf_dataset", "def is_py_dataset", "def is_generator",
              "def reads_on_client", "def input_kind", "def accepts_context")
    homes = {probe: [p.name for p in (PACKAGE / "data").glob("*.py") if probe in p.read_text()]
             for probe in probes}
    assert all(home == ["sources.py"] for home in homes.values()), homes


def test_architecture_names_only_modules_that_exist():
    """docs/ARCHITECTURE.md stays true to the code: every module path it names
    (``run/engine.py``, ``runtime/p2p/segment.py``, ...) is a file of the package."""
    root = Path(__file__).parent.parent
    text = (root / "docs" / "ARCHITECTURE.md").read_text()
    named = set(re.findall(r"(?<![\w/.])((?:[a-z_0-9]+/)+[a-z_0-9]+\.py)", text))
    assert len(named) > 20
    missing = sorted(p for p in named
                     if not any((root / base / p).exists() for base in ("dasktf", ".")))
    assert not missing, f"docs/ARCHITECTURE.md names modules that do not exist: {missing}"


if __name__ == "__main__":
    print(json.dumps(import_graph(), indent=1))
