"""dasktf: data-parallel TensorFlow/Keras training on a Dask cluster.

Each Dask worker holds a data shard and a model replica; each training step is a Dask
task graph. Start with :func:`fit`, or :class:`Trainer` for more control.
"""

from __future__ import annotations

from dasktf import config  # noqa: F401  (loads dasktf.yaml into dask.config first)
from dasktf.asynchronous import UpdateRecord
from dasktf.callbacks import History
from dasktf.cluster import make_local_cluster
from dasktf.datasets import Dataset, load_dataset
from dasktf.exceptions import (
    AllWorkersLostError,
    DasktfError,
    ReplicaError,
    SchedulerUnreachableError,
    StepTimeoutError,
    WorkerLostError,
)
from dasktf.tfconfig import check_tf_config, run_tf_distributed, tf_config
from dasktf.trainer import Trainer, fit

__version__ = "0.1.0"

__all__ = [
    "AllWorkersLostError",
    "DasktfError",
    "Dataset",
    "History",
    "ReplicaError",
    "SchedulerUnreachableError",
    "StepTimeoutError",
    "Trainer",
    "UpdateRecord",
    "WorkerLostError",
    "check_tf_config",
    "fit",
    "load_dataset",
    "make_local_cluster",
    "run_tf_distributed",
    "tf_config",
]
