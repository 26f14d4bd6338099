"""Keras without its optional scikit-learn and matplotlib integrations, in the
worker processes dasktf starts.

``import keras`` imports scikit-learn (for ``keras.wrappers``) and matplotlib (for
``keras.visualization``) whenever they are installed, and dasktf's estimators need
scikit-learn installed: together they were 2.0 s of Keras' 5.7 s import here (about
1 s of its 4.2 s of CPU), paid by every worker process at its first replica, and
by 3 workers at once on a 2-core machine. No worker uses either: the wrappers and
the plots are APIs of the process that drives the training.

So in the processes dasktf spawns (an embedded cluster's workers, the collective
engine's TensorFlow children: their ``sitecustomize``, see :mod:`dasktf.cluster.quiet`,
installs :class:`LeanKerasFinder`), an import of those packages made by Keras'
own modules fails as if they were not installed, unless something else imported
them first. Keras guards both imports
(``try: import sklearn except ImportError``), so there its scikit-learn wrappers
and its image plots say they need the package; any other code importing them (a
user's, ``dasktf.estimators``, dask-ml) gets them as always.
``DASKTF_LEAN_KERAS=0`` in the environment keeps all of Keras.

This module imports nothing but the standard library (the ``sitecustomize`` loads it
by path, without importing dasktf or dask into every process it starts).
"""

from __future__ import annotations

import importlib.abc
import inspect
import sys
from typing import Any

#: Set to "1" in the environment of the processes dasktf spawns (``0``: keep them)
ENABLE_ENV = "DASKTF_LEAN_KERAS"
#: The top-level packages Keras imports only for optional integrations
OPTIONAL = frozenset({"sklearn", "matplotlib"})


class LeanKerasFinder(importlib.abc.MetaPathFinder):
    """Refuses :data:`OPTIONAL` packages to Keras' own modules (see the module)."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        top = fullname.partition(".")[0]
        if top not in OPTIONAL or top in sys.modules or not imported_by_keras():
            return None
        raise ModuleNotFoundError(
            f"No module named {fullname!r} for Keras in this process dasktf started "
            f"(Keras' optional integrations are left out: set {ENABLE_ENV}=0 in the "
            "environment you run dasktf from to keep them)", name=fullname)


def imported_by_keras() -> bool:
    """Whether the import being resolved is written in a Keras module: the first
    frame out of the import machinery."""
    frame = inspect.currentframe()
    while frame is not None:
        name = frame.f_globals.get("__name__") or ""
        if name != __name__ and not name.startswith("importlib"):
            return name == "keras" or name.startswith("keras.")
        frame = frame.f_back
    return False


def install() -> bool:
    """Put the finder first on ``sys.meta_path`` (once); False if it was there."""
    # By class name: the sitecustomize loads this file under another module name.
    if any(type(f).__name__ == LeanKerasFinder.__name__ for f in sys.meta_path):
        return False
    sys.meta_path.insert(0, LeanKerasFinder())
    return True
