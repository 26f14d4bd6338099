"""Run at interpreter start in the processes dasktf spawns (dasktf/cluster/quiet.py).

``dasktf.cluster.quiet.spawn_env`` puts this directory first on their ``PYTHONPATH``, so
Python's ``site`` imports this module before the process runs anything else: before
``multiprocessing`` re-imports a user script that imports keras at its top. It
installs the filter of TensorFlow's start-up lines (loading ``quiet.py`` by path:
no dasktf, no dask), spares it the last garbage collection at exit (below), leaves
Keras' optional integrations out (``lean_keras.py``, loaded the same way), then
hands over to the ``sitecustomize`` it shadows, if any.
Nothing here may fail a process: the variable may reach other Pythons.
"""

import os
import sys

_here = os.path.dirname(os.path.abspath(__file__))


def _install(filename, name):
    """Load ``dasktf/cluster/<filename>`` by path and call its ``install()``."""
    try:
        import importlib.util

        spec = importlib.util.spec_from_file_location(
            name, os.path.join(os.path.dirname(_here), filename))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        module.install()
    except Exception:  # noqa: BLE001 - never fail a process over quiet logs or speed
        pass


if os.environ.get("DASKTF_QUIET_TF_IMPORT") == "1":
    # At exit, after every other exit handler (registered first, run last): keep
    # the objects alive then out of the interpreter's last cyclic collection. With
    # TensorFlow loaded it walks a heap of millions of objects for 3-4 s, past a
    # Nanny's 4 s wait for its worker to exit (it then SIGKILLs it, which skips the
    # rest of the shutdown anyway). Exit handlers run and the standard streams are
    # flushed as before; only finalizers of objects in reference cycles, which
    # Python never promises at exit, are skipped.
    import atexit
    import gc

    atexit.register(gc.freeze)
    _install("quiet.py", "_dasktf_tf_quiet")

if os.environ.get("DASKTF_LEAN_KERAS") == "1":
    _install("lean_keras.py", "_dasktf_lean_keras")

# This directory served its purpose; the next sitecustomize on the path (a
# distribution's own, a user's) runs as it would have.
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _here]
_self = sys.modules.pop("sitecustomize")
try:
    import sitecustomize  # noqa: F401
except ImportError:
    sys.modules["sitecustomize"] = _self  # site's import of this module completes
