"""scikit-learn estimators that train and predict on a Dask cluster.

:class:`KerasClassifier` and :class:`KerasRegressor` wrap a Keras model (or a
function that builds one) and the options of :func:`dasktf.fit`, with scikit-learn's estimator
API (``fit``, ``predict``, ``predict_proba``, ``score``, ``get_params`` /
``set_params``, ``clone``), so they go into a ``Pipeline`` and a grid search as
``xgboost.dask.DaskXGBClassifier`` and ``lightgbm.DaskLGBMClassifier`` do.

Dask collections in, Dask collections out: ``fit`` trains data-parallel where the
data lives, ``predict`` returns a lazy Dask array (:func:`dasktf.predict`) and
``score`` computes its sums on the cluster. NumPy in, NumPy out: ``fit`` scatters
the arrays to the cluster, ``predict`` and ``score`` run in this process, as any
scikit-learn estimator (scikit-learn's own searches and checks pass NumPy).

The cluster is the current Dask client's (``distributed.get_client()``), or the one
set on the estimator's ``client`` attribute (not a parameter: ``clone`` and
pickling must not copy a connection); where there is none, ``fit`` starts an
embedded cluster for the call, as :func:`dasktf.fit` does. Inside a Dask task (a
dask-ml search runs each candidate's ``fit`` as one), the task secedes from its
worker's thread pool while the training runs, so the training's own tasks are
not left waiting for the thread it holds.

The parameters follow Keras' ``keras.wrappers.SKLearnClassifier`` (``model`` a
compiled Model or a function, ``model_kwargs``, ``fit_kwargs``, ``warm_start``)
and SciKeras (routed ``model__`` / ``optimizer__`` / ``loss__`` / ``fit__``
parameters, ``partial_fit``, ``history_``), so the programs of their users run
as written, and dask-ml's ``Incremental`` and ``HyperbandSearchCV`` drive them.
"""

from __future__ import annotations

from dasktf.estimators.base import dense_model
from dasktf.estimators.classifier import KerasClassifier
from dasktf.estimators.regressor import KerasRegressor

__all__ = ["KerasClassifier", "KerasRegressor", "dense_model"]
