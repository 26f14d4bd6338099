"""dasktf: data-parallel TensorFlow/Keras training on a Dask cluster.

Each Dask worker holds a data shard and a model replica; each training step sums
the workers' gradients, worker to worker. Start with :func:`fit`, or :class:`Trainer` for more control; then
:func:`predict` and :func:`evaluate` where the data lives, or the scikit-learn
estimators :class:`KerasClassifier` and :class:`KerasRegressor`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from dasktf import config  # noqa: F401  (loads dasktf.yaml into dask.config first)

# The public names load on first use (PEP 562): ``dasktf --help`` and the worker-side
# imports of small modules must not pay TensorFlow's ~3 s import.
_EXPORTS = {
    "UpdateRecord": "dasktf.engines.holder.records",
    "History": "dasktf.callbacks",
    "make_local_cluster": "dasktf.cluster.local",
    "Dataset": "dasktf.datasets",
    "load_dataset": "dasktf.datasets",
    "AllWorkersLostError": "dasktf.exceptions",
    "DasktfError": "dasktf.exceptions",
    "ReplicaError": "dasktf.exceptions",
    "SchedulerUnreachableError": "dasktf.exceptions",
    "StepTimeoutError": "dasktf.exceptions",
    "WorkerLostError": "dasktf.exceptions",
    "check_tf_config": "dasktf.tf.bridge",
    "run_tf_distributed": "dasktf.tf.bridge",
    "tf_config": "dasktf.tf.bridge",
    "Trainer": "dasktf.trainer",
    "fit": "dasktf.trainer",
    "predict": "dasktf.inference.predict",
    "evaluate": "dasktf.inference.evaluate",
    "KerasClassifier": "dasktf.estimators",
    "KerasRegressor": "dasktf.estimators",
}

if TYPE_CHECKING:
    from dasktf.callbacks import History
    from dasktf.cluster.local import make_local_cluster
    from dasktf.datasets import Dataset, load_dataset
    from dasktf.engines.holder.records import UpdateRecord
    from dasktf.estimators import KerasClassifier, KerasRegressor
    from dasktf.exceptions import (
        AllWorkersLostError,
        DasktfError,
        ReplicaError,
        SchedulerUnreachableError,
        StepTimeoutError,
        WorkerLostError,
    )
    from dasktf.inference.evaluate import evaluate
    from dasktf.inference.predict import predict
    from dasktf.tf.bridge import check_tf_config, run_tf_distributed, tf_config
    from dasktf.trainer import Trainer, fit


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'dasktf' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


__version__ = "0.1.0"

__all__ = [
    "AllWorkersLostError",
    "DasktfError",
    "Dataset",
    "History",
    "KerasClassifier",
    "KerasRegressor",
    "ReplicaError",
    "SchedulerUnreachableError",
    "StepTimeoutError",
    "Trainer",
    "UpdateRecord",
    "WorkerLostError",
    "check_tf_config",
    "evaluate",
    "fit",
    "load_dataset",
    "make_local_cluster",
    "predict",
    "run_tf_distributed",
    "tf_config",
]
