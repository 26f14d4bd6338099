"""TensorFlow's start-up lines, held to the level ``TF_CPP_MIN_LOG_LEVEL`` asks for.

While ``import tensorflow`` runs, TensorFlow 2.21 loads its shared libraries before
it sets up its own logging, and on some CPUs (those with AVX-512 VNNI/BF16, where
its oneDNN custom operations switch on) each library prints absl's header
``WARNING: All log messages before absl::InitializeLog() is called are written to
STDERR`` and an INFO record ``I0000 ... port.cc:153] oneDNN custom operations are
on ...``, whatever ``TF_CPP_MIN_LOG_LEVEL`` says. No environment variable governs
them (``GLOG_minloglevel`` and ``ABSL_MIN_LOG_LEVEL`` are not read;
``TF_ENABLE_ONEDNN_OPTS=0`` silences the record by switching oneDNN off, which
changes the kernels that run).

So the import runs with file descriptor 2 pointed at a temporary file, and what it
wrote is then written to the real stderr less the records below the level
(``I`` < 1, ``W`` < 2, ``E`` < 3) and absl's header: exactly what TensorFlow's level
would have let through had its logging been up. Level 0 (TensorFlow's default,
``dasktf fit --verbose``) keeps every line, and a level the user set always wins
(dasktf only ever sets one with ``os.environ.setdefault``). Nothing else changes:
the same libraries load, the same kernels run.

Where it is installed: by :func:`install` in the processes dasktf's commands run in
(``dasktf fit`` and the other subcommands), and, for the worker processes of an
embedded cluster and the collective engine's TensorFlow children, at interpreter
start: :func:`spawn_env` puts a ``sitecustomize`` (``dasktf/cluster/startup/``) on their
``PYTHONPATH``, which runs before ``multiprocessing`` re-imports a user script that
imports keras at its top. On workers you start yourself, ``dask worker
--preload dasktf.cluster.quiet`` does the same.

This module imports nothing but the standard library (the ``sitecustomize`` loads
it by path, without importing dasktf or dask into every process it starts).
"""

from __future__ import annotations

import contextlib
import importlib.abc
import os
import re
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

#: The variable TensorFlow reads its C++ log level from (0 INFO, 1 WARNING, 2 ERROR,
#: 3 FATAL: records below it are not printed).
LEVEL_ENV = "TF_CPP_MIN_LOG_LEVEL"
#: Set in the environment of the processes dasktf spawns: their ``sitecustomize``
#: installs the filter only where it is "1".
ENABLE_ENV = "DASKTF_QUIET_TF_IMPORT"
#: The directory holding the ``sitecustomize`` that :func:`spawn_env` puts first on
#: a spawned process's ``PYTHONPATH``.
STARTUP_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "startup")

_SEVERITY = {"I": 0, "W": 1, "E": 2, "F": 3}
#: absl/glog's record prefix: severity, MMDD, time (absl's before its set-up:
#: ``00:00:<epoch seconds>``), thread id, file:line]
_RECORD = re.compile(r"^([IWEF])\d{4} \d\d:\d\d:\d+\.\d+\s+\d+ \S+:\d+\] ")
_ABSL_HEADER = "WARNING: All log messages before absl::InitializeLog() is called"
#: Lines that continue a record on the next line (cpu_feature_guard's).
_CONTINUATIONS = ("To enable the following instructions:",)


def level() -> int:
    """The level TensorFlow will use in this process: ``TF_CPP_MIN_LOG_LEVEL``, 0 if
    unset or not a number (as TensorFlow reads it)."""
    try:
        return int(os.environ.get(LEVEL_ENV, "0"))
    except ValueError:
        return 0


def filter_startup(text: str, min_level: int) -> str:
    """``text`` less the records TensorFlow would not print at ``min_level``.

    Records whose severity is below the level go, with their continuation line and
    absl's header (which only announces them); everything else (Python's warnings,
    a traceback, records at or above the level, any line not in TensorFlow's
    format) stays, in order.
    """
    if min_level <= 0:
        return text
    kept: list[str] = []
    dropping = False
    for line in text.splitlines(keepends=True):
        record = _RECORD.match(line)
        if record is not None:
            dropping = _SEVERITY[record.group(1)] < min_level
        elif line.startswith(_ABSL_HEADER):
            dropping = True
        elif not (dropping and line.startswith(_CONTINUATIONS)):
            dropping = False
        if not dropping:
            kept.append(line)
    return "".join(kept)


@contextlib.contextmanager
def filtered_stderr(min_level: int) -> Iterator[None]:
    """Run the body with file descriptor 2 captured; write back what
    :func:`filter_startup` keeps once it ends (raised or not).

    A temporary file rather than a pipe: the import holds the interpreter lock
    while a library writes, so a pipe's reader thread could never drain it.
    Other threads' stderr output during the body is delayed, not lost.
    """
    _flush()
    saved = os.dup(2)
    try:
        with tempfile.TemporaryFile() as capture:
            os.dup2(capture.fileno(), 2)
            try:
                yield
            finally:
                _flush()
                os.dup2(saved, 2)
                capture.seek(0)
                text = capture.read().decode("utf-8", errors="replace")
                kept = filter_startup(text, min_level)
                if kept:
                    os.write(2, kept.encode("utf-8", errors="replace"))
    finally:
        os.close(saved)


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()


class _FilteredLoader(importlib.abc.Loader):
    """The real loader of ``tensorflow``, its ``exec_module`` run in
    :func:`filtered_stderr`; everything else is the real loader's."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        try:
            with filtered_stderr(level()):
                self._loader.exec_module(module)
        finally:
            uninstall()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


class QuietTensorFlowImport(importlib.abc.MetaPathFinder):
    """Finds ``tensorflow`` with the other finders and wraps its loader."""

    target = "tensorflow"

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != self.target:
            return None
        for finder in sys.meta_path:
            if isinstance(finder, QuietTensorFlowImport) or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _FilteredLoader(spec.loader)
                return spec
        return None


def _installed() -> list[Any]:
    # By class name: the sitecustomize loads this file under another module name.
    return [f for f in sys.meta_path if type(f).__name__ == QuietTensorFlowImport.__name__]


def install(target: str = "tensorflow") -> bool:
    """Filter the start-up lines of this process's first import of ``target``.

    Does nothing (and returns False) if ``target`` is already imported, the level
    is 0, or the filter is installed already. Call it before anything imports
    TensorFlow. ``target`` is for tests.
    """
    if target in sys.modules or level() <= 0 or _installed():
        return False
    finder = QuietTensorFlowImport()
    finder.target = target
    sys.meta_path.insert(0, finder)
    return True


def uninstall() -> None:
    """Remove the filter (done by itself once the import ran)."""
    for finder in _installed():
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(finder)


def spawn_env(tf_level: str) -> dict[str, str]:
    """Environment for a process dasktf spawns: TensorFlow's level, and the
    ``sitecustomize`` that filters its start-up lines from the first instruction
    on (ahead of any ``PYTHONPATH`` the process would have had) and leaves Keras'
    optional integrations out (:mod:`dasktf.cluster.lean_keras`, unless this
    process's environment says ``0``)."""
    from dasktf.cluster import lean_keras  # (not at the top: see the module)

    path = [STARTUP_DIR, *[p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                           if p and p != STARTUP_DIR]]
    return {LEVEL_ENV: tf_level, ENABLE_ENV: "1", "PYTHONPATH": os.pathsep.join(path),
            lean_keras.ENABLE_ENV: os.environ.get(lean_keras.ENABLE_ENV, "1")}


def dask_setup(worker: Any) -> None:
    """``dask worker --preload dasktf.cluster.quiet``: quiet the worker's TensorFlow import
    (at the level of its environment, 1 if unset)."""
    os.environ.setdefault(LEVEL_ENV, "1")
    install()
