"""What :class:`~dasktf.KerasClassifier` and :class:`~dasktf.KerasRegressor`
share: the parameters (Keras' wrappers' and SciKeras' conventions), the model's
forms, ``fit`` / ``partial_fit`` through :func:`dasktf.fit`, and the raw outputs.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from typing import Any

import numpy as np
from sklearn.base import BaseEstimator
from sklearn.utils.validation import check_is_fitted, validate_data

from dasktf import compat
from dasktf.data.structure import is_dask
from dasktf.estimators.routing import (
    build_loss,
    build_optimizer,
    extra_params,
    is_routed,
    refuse_unknown,
    routed,
)
from dasktf.estimators.targets import n_features, row_shape, row_weights
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


class KerasEstimator(BaseEstimator):
    """The estimators' common part (see :class:`~dasktf.KerasClassifier` for the
    parameters)."""

    #: The Dask client to train and predict on (default: the current one). An
    #: attribute, not a parameter: ``clone`` and pickling do not copy it.
    client: Any = None

    def __init__(
        self,
        model: Any = None,
        *,
        warm_start: bool = False,
        model_kwargs: dict[str, Any] | None = None,
        fit_kwargs: dict[str, Any] | None = None,
        optimizer: Any = None,
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
        **routed_params: Any,
    ) -> None:
        self.model = model
        self.warm_start = warm_start
        self.model_kwargs = model_kwargs
        self.fit_kwargs = fit_kwargs
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
        # Routed parameters, and plain arguments of the model function (SciKeras
        # takes both): kept as given and checked by fit, as scikit-learn's
        # estimators validate nothing in __init__ or set_params.
        vars(self).update(routed_params)

    # -- parameters: the signature's and the routed ones ------------------------------
    def get_params(self, deep: bool = True) -> dict[str, Any]:
        declared = super().get_params(deep)
        return {**declared, **extra_params(self, declared)}

    def set_params(self, **params: Any) -> Any:
        # Routed names, and (as __init__ does) unknown plain names, which fit
        # refuses; a nested name (``step__param``) is scikit-learn's to resolve.
        names = self.get_params(deep=False)
        kept = {k: v for k, v in params.items()
                if is_routed(k) or ("__" not in k and k not in names)}
        vars(self).update(kept)
        return super().set_params(**{k: v for k, v in params.items() if k not in kept})

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state.pop("client", None)  # a connection is not part of the estimator
        return state

    # -- what the subclasses decide -----------------------------------------------------
    #: The default model's last activation.
    _output_activation: str | None = None
    #: Targets must be numbers (a regressor's), or any labels (a classifier's).
    _numeric_y = True

    def _targets(self, y: Any, reset: bool, classes: Any = None) -> tuple[Any, int, Any]:
        """``(y as indices or numbers, the model's output width, y as a model
        function's ``y`` argument sees it)``."""
        raise NotImplementedError  # pragma: no cover

    def _default_loss(self, model: Any) -> str:
        raise NotImplementedError  # pragma: no cover

    def _encode_for(self, model: Any, loss: Any, targets: Any) -> Any:
        """``targets`` as ``model`` and ``loss`` train on them."""
        return targets

    def _meta(self) -> dict[str, Any]:
        return {"n_features_in_": self.n_features_in_}

    # -- fit ------------------------------------------------------------------------------
    def fit(self, X: Any, y: Any, sample_weight: Any = None, **kwargs: Any) -> Any:
        """Train on ``X``, ``y`` with :func:`dasktf.fit`: a fresh model, unless
        ``warm_start`` and fitted before (then ``model_`` trains on).

        Parameters
        ----------
        X, y
            Dask arrays or DataFrames/Series (trained on where they live), or
            NumPy-like arrays (scattered to the workers).
        sample_weight
            Per-row weights, as ``X``.
        **kwargs
            :func:`dasktf.fit` options for this call (``epochs=5``), over
            ``fit_kwargs`` and the ``fit__`` parameters, as Keras' wrappers take them.

        Returns
        -------
        self
        """
        return self._fit(X, y, sample_weight, kwargs, warm=self.warm_start)

    def _fit(self, X: Any, y: Any, sample_weight: Any, call: dict[str, Any], *,
             warm: bool, classes: Any = None) -> Any:
        factory, plain = self._factory_and_arguments()
        continuing = warm and hasattr(self, "model_")
        if is_dask(X) or is_dask(y):
            n = n_features(X)
            if continuing and n != self.n_features_in_:
                raise ValueError(f"X has {n} features, but {type(self).__name__} is "
                                 f"expecting {self.n_features_in_} features as input.")
            self.n_features_in_ = n
        else:
            X, y = validate_data(self, X, y, allow_nd=True, multi_output=True,
                                 y_numeric=self._numeric_y, reset=not continuing)
            X, y = np.asarray(X, dtype=np.float32), np.asarray(y)
            if sample_weight is not None:
                sample_weight = row_weights(sample_weight, len(X))
        targets, outputs, model_y = self._targets(y, reset=not continuing, classes=classes)
        if continuing:
            model = self.model_
            # the model's own optimizer (its moments, its step) and loss go on
            args: dict[str, Any] = {"optimizer": None, "loss": None}
        else:
            model = self._fresh_model(factory, plain, X, model_y, outputs)
            args = self._compile_args(model)
        args.update(epochs=self.epochs, batch_size=self.batch_size, metrics=self.metrics,
                    validation_split=self.validation_split, shuffle=self.shuffle,
                    seed=self.seed, n_workers=self.n_workers, verbose=self.verbose,
                    sample_weight=sample_weight)
        args.update({**(self.fit_kwargs or {}), **routed(self, "fit"), **call})
        loss = args["loss"] if args["loss"] is not None else getattr(model, "loss", None)
        targets = self._encode_for(model, loss, targets)
        history = in_cluster(functools.partial(dask_fit, model, X, targets, **args),
                             self.client)
        previous = self.history_ if continuing else {}
        self.model_ = history.model
        self.workers_ = list(history.workers)
        self.history_ = {k: [*previous.get(k, []), *v] for k, v in history.history.items()}
        return self

    def _compile_args(self, model: Any) -> dict[str, Any]:
        """The optimizer, learning rate and loss :func:`dasktf.fit` gets for a new
        ``model``: the estimator's where set, else the model's compile, else Adam
        and the default loss; ``optimizer__`` and ``loss__`` parameters build them."""
        compiled = bool(getattr(model, "compiled", False))
        optimizer, options = self.optimizer, routed(self, "optimizer")
        if options:
            base = optimizer if optimizer is not None else (
                model.optimizer if compiled else "adam")
            optimizer = build_optimizer(base, options)
        elif optimizer is None and not compiled:
            optimizer = "adam"
        loss, options = self.loss, routed(self, "loss")
        if loss is None and not compiled:
            loss = self._default_loss(model)
        if options:
            loss = build_loss(loss if loss is not None else model.loss, options)
        return {"optimizer": optimizer, "learning_rate": self.learning_rate, "loss": loss}

    def _factory_and_arguments(self) -> tuple[Any, dict[str, Any]]:
        """The model function (``None`` for a given ``keras.Model``), and the plain
        keyword arguments of the estimator it takes, as SciKeras passes them
        (``KerasClassifier(build, hidden=64)``); others are refused here."""
        import keras

        factory = self.model
        extra = extra_params(self, super().get_params(deep=False))
        plain = {k: v for k, v in extra.items() if not is_routed(k)}
        if isinstance(factory, keras.Model):
            factory = None
        elif factory is None:
            factory = functools.partial(dense_model, activation=self._output_activation)
        elif isinstance(factory, str):
            if factory not in BUILTIN_MODELS:
                raise ValueError(f"Unknown model {factory!r}: a built-in name "
                                 f"({', '.join(BUILTIN_MODELS)}), a function or a "
                                 "compiled keras.Model.")
            factory = BUILTIN_MODELS[factory]
        elif not callable(factory):
            raise TypeError(
                f"model must be a compiled keras.Model, a function that builds one "
                f"(it may take X=, y=, meta=, input_shape=, num_outputs=) or a built-in "
                f"name; got {type(factory).__name__}.")
        taken = inspect.signature(factory).parameters if factory is not None else {}
        takes_any = any(p.kind is p.VAR_KEYWORD for p in taken.values())
        refuse_unknown([k for k in plain if k not in taken and not takes_any],
                       type(self).__name__)
        return factory, plain

    def _fresh_model(self, factory: Any, plain: dict[str, Any], X: Any, y: Any,
                     outputs: int) -> Any:
        """The model to train: a clone of ``self.model`` (compiled as it is), or
        the given one itself with ``warm_start``, or what ``factory`` builds with
        ``model_kwargs``, the estimator's ``plain`` arguments and the ``model__``
        parameters (each over the one before)."""
        import keras

        # seeded as Keras' own would be, whatever the client's event loop draws
        seeded = contextlib.nullcontext() if self.seed is None else compat.keras_seeded(self.seed)
        with seeded:
            if factory is None:
                if self.warm_start:
                    return self.model  # trained in place, as Keras' wrappers do
                return clone_compiled(self.model)
            kwargs = {**(self.model_kwargs or {}), **plain, **routed(self, "model")}
            taken = inspect.signature(factory).parameters
            meta = {**self._meta(), "X_shape_": (X.shape[0], *row_shape(X)),
                    "X_dtype_": getattr(X, "dtype", None),  # None: a DataFrame's columns
                    "input_shape": row_shape(X), "num_outputs": outputs}
            data = {"X": X, "y": y, "meta": meta}
            kwargs.update({k: v for k, v in data.items() if k in taken and k not in kwargs})
            built = ModelSpec(factory=functools.partial(factory, **kwargs),
                              input_shape=row_shape(X), num_outputs=outputs).build()
            if not isinstance(built, keras.Model):
                raise TypeError(f"model() returned a {type(built).__name__}, not a keras.Model.")
            return built

    # -- predict ----------------------------------------------------------------------------
    def _outputs(self, X: Any) -> Any:
        """The model's raw outputs on ``X``: a lazy Dask array for Dask input, else
        NumPy computed here."""
        check_is_fitted(self, "model_")
        if is_dask(X):
            n = n_features(X)
            if n != self.n_features_in_:
                raise ValueError(f"X has {n} features, but {type(self).__name__} is "
                                 f"expecting {self.n_features_in_} features as input.")
            return dask_predict(self.model_, X, batch_size=self.predict_batch_size,
                                client=self.client or current_client())
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


def clone_compiled(model: Any) -> Any:
    """A fresh copy of ``model``: its architecture with new initial weights
    (``keras.models.clone_model``), compiled as it was, with a new optimizer."""
    import keras

    copy = keras.models.clone_model(model)
    if getattr(model, "compiled", False):
        copy.compile_from_config(model.get_compile_config())
    return copy


def current_client() -> Any:
    from distributed import get_client

    try:
        return get_client()
    except ValueError:
        return None


def in_cluster(call: Any, client: Any) -> Any:
    """``call(client=...)`` on the estimator's client, the current one or (none)
    an embedded cluster; inside a Dask task, seceded from the worker's pool, so
    the training's own tasks are not left waiting for the thread it holds."""
    from distributed import get_worker, worker_client

    try:
        get_worker()
    except ValueError:
        return call(client=client or current_client())
    if client is not None:
        return call(client=client)
    with worker_client() as inner:
        return call(client=inner)
