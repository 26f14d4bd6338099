"""scikit-learn estimators that train and predict on a Dask cluster.

:class:`KerasClassifier` and :class:`KerasRegressor` wrap a function that builds a
Keras model and the options of :func:`dasktf.fit`, with scikit-learn's estimator
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
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
from sklearn.base import BaseEstimator, ClassifierMixin, RegressorMixin
from sklearn.utils.multiclass import check_classification_targets
from sklearn.utils.validation import check_is_fitted, column_or_1d, validate_data

from dasktf.data.partitions import is_dask_frame
from dasktf.inference.predict import predict as dask_predict
from dasktf.models import BUILTIN_MODELS, ModelSpec
from dasktf.trainer import fit as dask_fit


def dense_model(input_shape: tuple[int, ...], num_outputs: int, *, hidden: int = 64,
                activation: str | None = None) -> Any:
    """The estimators' default model: flattened inputs, one ReLU layer of
    ``hidden`` units, ``num_outputs`` outputs (softmax for a classifier)."""
    import keras

    return keras.Sequential([
        keras.Input(tuple(input_shape)),
        keras.layers.Flatten(),
        keras.layers.Dense(hidden, activation="relu"),
        keras.layers.Dense(num_outputs, activation=activation),
    ], name="dense_model")


def _is_dask(x: Any) -> bool:
    return is_dask_frame(x) or type(x).__module__.startswith("dask.array")


class _KerasEstimator(BaseEstimator):
    """What the classifier and the regressor share: the parameters, ``fit``'s
    call of :func:`dasktf.fit` and the prediction of the raw model outputs."""

    #: The Dask client to train and predict on (default: the current one). An
    #: attribute, not a parameter: ``clone`` does not copy it.
    client: Any = None

    def __init__(
        self,
        model: Any = None,
        *,
        model_kwargs: dict[str, Any] | None = None,
        optimizer: Any = "adam",
        learning_rate: float | None = None,
        loss: Any = None,
        metrics: Any = None,
        epochs: int = 10,
        batch_size: int = 128,
        validation_split: float = 0.0,
        shuffle: bool = True,
        seed: int | None = None,
        n_workers: int | None = None,
        verbose: int = 0,
        predict_batch_size: int | None = None,
        fit_options: dict[str, Any] | None = None,
    ) -> None:
        self.model = model
        self.model_kwargs = model_kwargs
        self.optimizer = optimizer
        self.learning_rate = learning_rate
        self.loss = loss
        self.metrics = metrics
        self.epochs = epochs
        self.batch_size = batch_size
        self.validation_split = validation_split
        self.shuffle = shuffle
        self.seed = seed
        self.n_workers = n_workers
        self.verbose = verbose
        self.predict_batch_size = predict_batch_size
        self.fit_options = fit_options

    # -- what the subclasses decide ------------------------------------------------
    #: The default model's last activation.
    _output_activation: str | None = None
    #: Targets must be numbers (a regressor's), or any labels (a classifier's).
    _numeric_y = True

    def _targets(self, y: Any) -> tuple[Any, int]:  # pragma: no cover - abstract
        """``y`` as the model trains on it, and the model's output width."""
        raise NotImplementedError

    def _default_loss(self, model: Any) -> str:  # pragma: no cover - abstract
        raise NotImplementedError

    # -- fit -------------------------------------------------------------------------
    def fit(self, X: Any, y: Any, sample_weight: Any = None) -> Any:
        """Train a fresh model on ``X``, ``y`` with :func:`dasktf.fit`.

        Parameters
        ----------
        X, y
            Dask arrays or DataFrames/Series (trained on where they live), or
            NumPy-like arrays (scattered to the workers).
        sample_weight
            Per-row weights, as ``X``.

        Returns
        -------
        self
        """
        if _is_dask(X) or _is_dask(y):
            self.n_features_in_ = _n_features(X)
        else:
            X, y = validate_data(self, X, y, allow_nd=True, multi_output=True,
                                 y_numeric=self._numeric_y)
            X, y = np.asarray(X, dtype=np.float32), np.asarray(y)
            if sample_weight is not None:
                sample_weight = _row_weights(sample_weight, len(X))
        targets, outputs = self._targets(y)
        model = self._build(X, outputs)
        options = dict(self.fit_options or {})
        clash = sorted(set(options) & set(self.get_params()))
        if clash:
            raise ValueError(f"fit_options {clash} are parameters of {type(self).__name__}: "
                             "set them directly.")
        args = dict(
            epochs=self.epochs, batch_size=self.batch_size, optimizer=self.optimizer,
            learning_rate=self.learning_rate, metrics=self.metrics,
            validation_split=self.validation_split, shuffle=self.shuffle, seed=self.seed,
            n_workers=self.n_workers, verbose=self.verbose, sample_weight=sample_weight,
            loss=self.loss if self.loss is not None else (
                None if getattr(model, "compiled", False) else self._default_loss(model)),
        )
        history = _in_cluster(functools.partial(dask_fit, model, X, targets, **args,
                                                **options), self.client)
        self.model_ = history.model
        self.history_ = dict(history.history)
        return self

    def _build(self, X: Any, outputs: int) -> Any:
        """The model ``self.model`` builds for ``X``'s rows and ``outputs`` units."""
        import keras

        if self.seed is not None:
            keras.utils.set_random_seed(self.seed)
        factory = self.model
        if factory is None:
            factory = functools.partial(dense_model, activation=self._output_activation)
        elif isinstance(factory, str):
            if factory not in BUILTIN_MODELS:
                raise ValueError(f"Unknown model {factory!r}: a built-in name "
                                 f"({', '.join(BUILTIN_MODELS)}) or a function.")
            factory = BUILTIN_MODELS[factory]
        elif isinstance(factory, keras.Model) or not callable(factory):
            raise TypeError(
                f"model must be a function that builds a Keras model (it may take "
                f"input_shape= and num_outputs=), or a built-in name; got "
                f"{type(factory).__name__}. A function, because fit() builds a fresh "
                "model each time, as scikit-learn's clone() expects.")
        shape = _row_shape(X)
        built = ModelSpec(factory=functools.partial(factory, **(self.model_kwargs or {})),
                          input_shape=shape, num_outputs=outputs).build()
        if not isinstance(built, keras.Model):
            raise TypeError(f"model() returned a {type(built).__name__}, not a keras.Model.")
        return built

    # -- predict ---------------------------------------------------------------------
    def _outputs(self, X: Any) -> Any:
        """The model's raw outputs on ``X``: a lazy Dask array for Dask input, else
        NumPy computed here."""
        check_is_fitted(self, "model_")
        if _is_dask(X):
            n = _n_features(X)
            if n != self.n_features_in_:
                raise ValueError(f"X has {n} features, but {type(self).__name__} is "
                                 f"expecting {self.n_features_in_} features as input.")
            return dask_predict(self.model_, X, batch_size=self.predict_batch_size,
                                client=self.client or _current_client())
        X = validate_data(self, X, reset=False, allow_nd=True)
        out = self.model_.predict(X, batch_size=self.predict_batch_size or 1024, verbose=0)
        return np.asarray(out)

    def __sklearn_tags__(self) -> Any:
        tags = super().__sklearn_tags__()
        # Trained by SGD on several processes: the same seed gives the same model
        # on the same cluster, not across worker counts.
        tags.non_deterministic = self.seed is None
        tags.input_tags.allow_nan = False
        return tags


class KerasClassifier(ClassifierMixin, _KerasEstimator):
    """A Keras classifier trained and applied on a Dask cluster.

    Parameters
    ----------
    model
        A function building the ``keras.Model`` to train: it gets
        ``input_shape`` (``X``'s per-row shape) and ``num_outputs`` (the number of
        classes) where it takes them, and ``model_kwargs``. ``None``: a dense
        network (:func:`dense_model`, softmax). A built-in name
        (``"mnist-mlp"``, ``"cnn"``) works too. It is called by every ``fit``.
    model_kwargs
        More keyword arguments for ``model`` (a search varies them:
        ``{"model_kwargs": [{"hidden": 32}, {"hidden": 128}]}``).
    optimizer, learning_rate, loss, metrics, epochs, batch_size, validation_split,
    shuffle, seed, n_workers, verbose
        As :func:`dasktf.fit` takes them (``batch_size`` is the global batch).
        ``loss`` ``None``: the model's own compile, else sparse categorical
        cross-entropy (binary cross-entropy for a one-unit output).
    predict_batch_size
        Rows per forward call in ``predict`` (see :func:`dasktf.predict`).
    fit_options
        Any other :func:`dasktf.fit` option, by name (``{"mode": "async"}``).

    Attributes
    ----------
    model_ : keras.Model
        The trained model.
    classes_ : numpy.ndarray
        The class labels, sorted; the model's outputs index into it.
    history_ : dict
        The training history (``History.history``).
    n_features_in_ : int

    Examples
    --------
    >>> clf = dasktf.KerasClassifier(epochs=5, seed=0)  # doctest: +SKIP
    >>> clf.fit(X, y).predict(X_new).compute()  # doctest: +SKIP
    """

    _output_activation = "softmax"
    _numeric_y = False

    def _targets(self, y: Any) -> tuple[Any, int]:
        if _is_dask(y):
            self.classes_ = _dask_classes(y)
            if is_dask_frame(y):
                encoded = y.map_partitions(_encode_series, self.classes_,
                                           meta=(y.name, np.int32))
            else:
                encoded = y.map_blocks(functools.partial(_encode, self.classes_),
                                       dtype=np.int32)
        else:
            check_classification_targets(y)
            y = column_or_1d(y, warn=True)  # a column vector, with scikit-learn's warning
            self.classes_ = np.unique(y)
            encoded = _encode(self.classes_, y)
        if len(self.classes_) < 2:
            raise ValueError(f"The classifier needs at least 2 classes in y; got one class "
                             f"({list(self.classes_)}).")
        return encoded, len(self.classes_)

    def _default_loss(self, model: Any) -> str:
        units = int(model.outputs[0].shape[-1]) if getattr(model, "outputs", None) else 0
        return "binary_crossentropy" if units == 1 else "sparse_categorical_crossentropy"

    def predict_proba(self, X: Any) -> Any:
        """Class probabilities, one column per class of :attr:`classes_` (a lazy
        Dask array for Dask ``X``)."""
        out = self._outputs(X)
        if out.ndim == 2 and out.shape[1] == 1:  # one sigmoid unit: P(classes_[1])
            if _is_dask(X):
                import dask.array as da

                return da.concatenate([1 - out, out], axis=1)
            return np.concatenate([1 - out, out], axis=1)
        return out

    def predict(self, X: Any) -> Any:
        """The most probable class of each row (a lazy Dask array for Dask ``X``)."""
        proba = self.predict_proba(X)
        best = proba.argmax(axis=1)
        if _is_dask(X):
            return best.map_blocks(functools.partial(np.take, self.classes_),
                                   dtype=self.classes_.dtype)
        return self.classes_[best]

    def score(self, X: Any, y: Any, sample_weight: Any = None) -> float:
        """Mean accuracy (weighted by ``sample_weight``), summed on the cluster for
        Dask inputs."""
        if not _is_dask(X):
            return float(super().score(X, y, sample_weight))
        hits = (self.predict(X) == _as_dask_array(y)).astype(np.float64)
        return _weighted_mean(hits, sample_weight)


class KerasRegressor(RegressorMixin, _KerasEstimator):
    """A Keras regressor trained and applied on a Dask cluster.

    The parameters are :class:`KerasClassifier`'s; ``model`` gets
    ``num_outputs`` = the number of targets (1 for a 1-d ``y``), ``loss`` defaults
    to the mean squared error, and ``predict`` returns one value per row for a
    1-d ``y`` (a column per target otherwise). ``score`` is R².

    Attributes
    ----------
    model_ : keras.Model
    history_ : dict
    n_features_in_ : int
    """

    def _targets(self, y: Any) -> tuple[Any, int]:
        self.n_outputs_ = 1 if y.ndim == 1 else int(y.shape[1])
        self._ravel = y.ndim == 1
        if _is_dask(y):
            return y, self.n_outputs_
        return y.astype(np.float32), self.n_outputs_

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
        if not _is_dask(X):
            return float(super().score(X, y, sample_weight))
        import dask

        pred = self.predict(X).astype(np.float64)
        truth = _as_dask_array(y).astype(np.float64)
        if pred.ndim == 1:
            pred, truth = pred[:, None], truth.reshape((-1, 1))
        w = (1.0 if sample_weight is None
             else _as_dask_array(sample_weight).astype(np.float64)[:, None])
        weights = w * (truth * 0 + 1)
        total, mean_num = dask.compute(weights.sum(axis=0), (weights * truth).sum(axis=0))
        mean = mean_num / total
        residual, spread = dask.compute((weights * (truth - pred) ** 2).sum(axis=0),
                                        (weights * (truth - mean) ** 2).sum(axis=0))
        r2 = np.where(spread > 0, 1 - residual / np.where(spread > 0, spread, 1), 0.0)
        return float(np.mean(r2))


# -- helpers ----------------------------------------------------------------------------
def _n_features(X: Any) -> int:
    if is_dask_frame(X):
        return len(X.columns) if X.ndim == 2 else 1
    return int(X.shape[1]) if X.ndim > 1 else 1


def _row_shape(X: Any) -> tuple[int, ...]:
    if is_dask_frame(X):
        return (_n_features(X),)
    return tuple(int(n) for n in X.shape[1:]) or (1,)


def _row_weights(sample_weight: Any, n: int) -> np.ndarray:
    """One float32 weight per row, else a ValueError saying what came."""
    weights = np.asarray(sample_weight, dtype=np.float32)
    if weights.ndim == 0:
        return np.full(n, weights, dtype=np.float32)
    if weights.shape != (n,):
        raise ValueError(f"sample_weight must hold one weight per row of X: shape ({n},); "
                         f"got shape {weights.shape}.")
    if n and not weights.any():
        raise ValueError("sample_weight is zero for every row: there is nothing to train on.")
    return weights


def _encode(classes: np.ndarray, y: Any) -> np.ndarray:
    """Labels as their index in the sorted ``classes``."""
    values = np.asarray(y)
    return np.searchsorted(classes, values).astype(np.int32)


def _encode_series(part: Any, classes: np.ndarray) -> Any:
    """A partition of a label Series as class indices, on its index."""
    import pandas as pd

    return pd.Series(_encode(classes, part), index=part.index, name=part.name)


def _dask_classes(y: Any) -> np.ndarray:
    """The sorted distinct labels of a Dask collection (computed: ``fit`` is eager)."""
    import dask.array as da

    if is_dask_frame(y):
        return np.sort(np.asarray(y.unique().compute()))
    return np.asarray(da.unique(y).compute())


def _as_dask_array(y: Any) -> Any:
    return y.to_dask_array() if is_dask_frame(y) else y


def _weighted_mean(values: Any, sample_weight: Any) -> float:
    if sample_weight is None:
        return float(values.mean().compute())
    w = _as_dask_array(sample_weight).astype(np.float64)
    import dask

    num, den = dask.compute((values * w).sum(), w.sum())
    return float(num / den)


def _current_client() -> Any:
    from distributed import get_client

    try:
        return get_client()
    except ValueError:
        return None


def _in_cluster(call: Any, client: Any) -> Any:
    """``call(client=...)`` on the estimator's client, the current one or (none)
    an embedded cluster; inside a Dask task, seceded from the worker's pool."""
    from distributed import get_worker, worker_client

    try:
        get_worker()
    except ValueError:
        return call(client=client or _current_client())
    if client is not None:
        return call(client=client)
    with worker_client() as inner:
        return call(client=inner)
