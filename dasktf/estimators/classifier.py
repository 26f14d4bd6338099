"""The classifier: labels of any type, encoded as the model's loss takes them."""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
from sklearn.base import ClassifierMixin
from sklearn.utils.multiclass import check_classification_targets
from sklearn.utils.validation import column_or_1d

from dasktf.data.structure import is_dask
from dasktf.estimators.base import KerasEstimator
from dasktf.estimators.routing import takes_one_hot
from dasktf.estimators.targets import (
    as_dask_array,
    dask_classes,
    encode,
    encode_dask,
    one_hot,
    one_hot_dask,
    weighted_mean,
)


class KerasClassifier(ClassifierMixin, KerasEstimator):
    """A Keras classifier trained and applied on a Dask cluster.

    Keras' ``keras.wrappers.SKLearnClassifier`` and SciKeras' ``KerasClassifier``
    conventions, with :func:`dasktf.fit` doing the training.

    Parameters
    ----------
    model
        A compiled ``keras.Model`` (cloned, with new weights, for every ``fit``,
        unless ``warm_start``); or a function building the model, called by every
        ``fit`` with ``model_kwargs``, the ``model__`` parameters and, where it
        takes them, ``X`` and ``y`` (``y`` one-hot, as Keras' wrapper gives it),
        ``meta`` (``n_features_in_``, ``classes_``, ``n_classes_``,
        ``input_shape``, ``num_outputs``), ``input_shape`` (a row's shape) and
        ``num_outputs`` (the number of classes); ``None``: a dense network
        (:func:`~dasktf.estimators.dense_model`, softmax); or a built-in name
        (``"mnist-mlp"``, ``"cnn"``).
    warm_start
        ``fit`` trains the model of the previous ``fit`` on (the given model
        itself, on the first), instead of a fresh one.
    model_kwargs
        Keyword arguments for ``model`` when it is a function.
    fit_kwargs
        :func:`dasktf.fit` options (``{"epochs": 5}``, ``{"mode": "async"}``),
        over the parameters below.
    optimizer, learning_rate, loss, metrics, epochs, batch_size, validation_split,
    shuffle, seed, n_workers, verbose
        As :func:`dasktf.fit` takes them (``batch_size`` is the global batch).
        ``optimizer`` ``None``: the model's compile, else Adam. ``loss`` ``None``:
        the model's compile, else sparse categorical cross-entropy (binary
        cross-entropy for a one-unit output). Labels are one-hot for a
        categorical loss (``categorical_crossentropy``), class indices otherwise.
    predict_batch_size
        Rows per forward call in ``predict`` (see :func:`dasktf.predict`).
    **routed_params
        SciKeras' routed parameters: ``model__<name>`` (to the model function),
        ``optimizer__<name>`` (to the optimizer: ``optimizer__learning_rate``),
        ``loss__<name>`` (to the loss class), ``fit__<name>`` (to
        :func:`dasktf.fit`). Parameters like any other: a grid searches them.

    Attributes
    ----------
    model_ : keras.Model
        The trained model.
    classes_ : numpy.ndarray
        The class labels, sorted; the model's outputs index into it.
    history_ : dict
        The training history (``History.history``), epochs appended by
        ``partial_fit`` and warm fits.
    n_features_in_ : int
    workers_ : list of str
        The workers the last ``fit`` or ``partial_fit`` trained on.

    Examples
    --------
    >>> clf = dasktf.KerasClassifier(build, model__hidden=64, epochs=5)  # doctest: +SKIP
    >>> clf.fit(X, y).predict(X_new).compute()  # doctest: +SKIP
    """

    _output_activation = "softmax"
    _numeric_y = False

    def partial_fit(self, X: Any, y: Any, classes: Any = None, sample_weight: Any = None,
                    **kwargs: Any) -> Any:
        """One epoch of :func:`dasktf.fit` on ``X``, ``y``, going on from the last.

        ``classes`` (every label the calls will see) is needed on the first call
        where its ``y`` may lack some, as scikit-learn's ``partial_fit`` takes it;
        dask-ml's ``Incremental`` and ``HyperbandSearchCV`` call this block by block.
        """
        return self._fit(X, y, sample_weight, {**kwargs, "epochs": 1}, warm=True,
                         classes=classes)

    def _targets(self, y: Any, reset: bool, classes: Any = None) -> tuple[Any, int, Any]:
        if is_dask(y):
            seen = dask_classes(y)
        else:
            check_classification_targets(y)
            y = column_or_1d(y, warn=True)  # a column vector, with scikit-learn's warning
            seen = np.unique(y)
        if reset:
            self.classes_ = np.unique(np.asarray(classes)) if classes is not None else seen
        elif classes is not None and not np.array_equal(np.unique(np.asarray(classes)),
                                                        self.classes_):
            raise ValueError(f"classes={np.unique(classes).tolist()} is not the classes "
                             f"of the first call, {self.classes_.tolist()}.")
        unknown = np.setdiff1d(seen, self.classes_)
        if len(unknown):
            raise ValueError(f"y holds labels {unknown.tolist()} that are not in classes "
                             f"{self.classes_.tolist()}: give every class to the first "
                             "partial_fit (classes=...).")
        if len(self.classes_) < 2:
            raise ValueError(f"The classifier needs at least 2 classes in y; got one class "
                             f"({self.classes_.tolist()}).")
        n = len(self.classes_)
        if is_dask(y):
            indices = encode_dask(y, self.classes_)
            return indices, n, one_hot_dask(indices, n)
        indices = encode(self.classes_, y)
        return indices, n, one_hot(indices, n)

    def _meta(self) -> dict[str, Any]:
        return {**super()._meta(), "classes_": self.classes_,
                "n_classes_": len(self.classes_)}

    def _encode_for(self, model: Any, loss: Any, targets: Any) -> Any:
        if not takes_one_hot(loss):
            return targets
        if is_dask(targets):
            return one_hot_dask(targets, len(self.classes_))
        return one_hot(targets, len(self.classes_))

    def _default_loss(self, model: Any) -> str:
        units = int(model.outputs[0].shape[-1]) if getattr(model, "outputs", None) else 0
        return "binary_crossentropy" if units == 1 else "sparse_categorical_crossentropy"

    def predict_proba(self, X: Any) -> Any:
        """Class probabilities, one column per class of :attr:`classes_` (a lazy
        Dask array for Dask ``X``)."""
        out = self._outputs(X)
        if out.ndim == 2 and out.shape[1] == 1:  # one sigmoid unit: P(classes_[1])
            if is_dask(X):
                import dask.array as da

                return da.concatenate([1 - out, out], axis=1)
            return np.concatenate([1 - out, out], axis=1)
        return out

    def predict(self, X: Any) -> Any:
        """The most probable class of each row (a lazy Dask array for Dask ``X``)."""
        proba = self.predict_proba(X)
        best = proba.argmax(axis=1)
        if is_dask(X):
            return best.map_blocks(functools.partial(np.take, self.classes_),
                                   dtype=self.classes_.dtype)
        return self.classes_[best]

    def score(self, X: Any, y: Any, sample_weight: Any = None) -> float:
        """Mean accuracy (weighted by ``sample_weight``), summed on the cluster for
        Dask inputs."""
        if not is_dask(X):
            return float(super().score(X, y, sample_weight))
        hits = (self.predict(X) == as_dask_array(y)).astype(np.float64)
        return weighted_mean(hits, sample_weight)
