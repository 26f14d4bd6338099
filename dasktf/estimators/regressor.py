"""The regressor: numeric targets, R² as the score."""

from __future__ import annotations

from typing import Any

import numpy as np
from sklearn.base import RegressorMixin

from dasktf.data.structure import is_dask
from dasktf.estimators.base import KerasEstimator
from dasktf.estimators.targets import as_dask_array


class KerasRegressor(RegressorMixin, KerasEstimator):
    """A Keras regressor trained and applied on a Dask cluster.

    The parameters are :class:`~dasktf.KerasClassifier`'s; ``model`` gets
    ``num_outputs`` = the number of targets (1 for a 1-d ``y``) and ``y`` as it
    is, ``loss`` defaults to the mean squared error, and ``predict`` returns one
    value per row for a 1-d ``y`` (a column per target otherwise). ``score`` is R².

    Attributes
    ----------
    model_ : keras.Model
    history_ : dict
    n_features_in_ : int
    workers_ : list of str
    """

    def partial_fit(self, X: Any, y: Any, sample_weight: Any = None, **kwargs: Any) -> Any:
        """One epoch of :func:`dasktf.fit` on ``X``, ``y``, going on from the last
        (dask-ml's ``Incremental`` calls it block by block)."""
        return self._fit(X, y, sample_weight, {**kwargs, "epochs": 1}, warm=True)

    def _targets(self, y: Any, reset: bool, classes: Any = None) -> tuple[Any, int, Any]:
        outputs = 1 if y.ndim == 1 else int(y.shape[1])
        if reset:
            self.n_outputs_ = outputs
            self._ravel = y.ndim == 1
        elif outputs != self.n_outputs_:
            raise ValueError(f"y has {outputs} targets, but {type(self).__name__} was "
                             f"fitted on {self.n_outputs_}.")
        targets = y if is_dask(y) else y.astype(np.float32)
        return targets, outputs, targets

    def _meta(self) -> dict[str, Any]:
        return {**super()._meta(), "n_outputs_": self.n_outputs_}

    def _default_loss(self, model: Any) -> str:
        return "mse"

    def __sklearn_tags__(self) -> Any:
        tags = super().__sklearn_tags__()
        tags.target_tags.multi_output = True  # y of shape (n, k): k outputs
        return tags

    def predict(self, X: Any) -> Any:
        """Predicted targets (a lazy Dask array for Dask ``X``)."""
        # scikit-learn's regressors predict float64 (its checks say so)
        out = self._outputs(X).astype(np.float64)
        return out[:, 0] if getattr(self, "_ravel", False) and out.ndim == 2 else out

    def score(self, X: Any, y: Any, sample_weight: Any = None) -> float:
        """R² (uniform average over the targets), summed on the cluster for Dask
        inputs."""
        if not is_dask(X):
            return float(super().score(X, y, sample_weight))
        import dask

        pred = self.predict(X).astype(np.float64)
        truth = as_dask_array(y).astype(np.float64)
        if pred.ndim == 1:
            pred, truth = pred[:, None], truth.reshape((-1, 1))
        w = (1.0 if sample_weight is None
             else as_dask_array(sample_weight).astype(np.float64)[:, None])
        weights = w * (truth * 0 + 1)
        total, mean_num = dask.compute(weights.sum(axis=0), (weights * truth).sum(axis=0))
        mean = mean_num / total
        residual, spread = dask.compute((weights * (truth - pred) ** 2).sum(axis=0),
                                        (weights * (truth - mean) ** 2).sum(axis=0))
        r2 = np.where(spread > 0, 1 - residual / np.where(spread > 0, spread, 1), 0.0)
        return float(np.mean(r2))
