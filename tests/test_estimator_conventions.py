"""dasktf.KerasClassifier / KerasRegressor with Keras' and SciKeras' conventions
(issue 36): ``model`` a compiled Model or a function taking ``X``/``y``/``meta``,
``model_kwargs``, ``fit_kwargs``, ``warm_start``, routed parameters
(``model__hidden``, ``optimizer__learning_rate``, ``fit__validation_split``) that a
grid searches by name, ``partial_fit``, ``history_``, pickling a fitted estimator.

Programs are Keras' and SciKeras' as their documentation writes them; where the
call differs (``shuffle=False`` and Keras' batch of 32, to compare weights), it says
why.
"""

from __future__ import annotations

import pickle

import keras
import numpy as np
import pytest
from keras.layers import Dense, Input
from keras.models import Model
from sklearn.base import clone
from sklearn.datasets import make_classification
from sklearn.model_selection import GridSearchCV

import dasktf
from dasktf.cluster.membership import alive_workers

RTOL = 1e-4  # one worker against Keras: float32 tolerance


def _assert_same_weights(got, want, rtol=RTOL):
    for g, w in zip(got.get_weights(), want.get_weights(), strict=True):
        np.testing.assert_allclose(g, w, rtol=rtol, atol=rtol * max(1.0, np.abs(w).max()))


# -- keras.wrappers.SKLearnClassifier's docstring example, as written ----------------------
def dynamic_model(X, y, loss, layers=[10]):  # noqa: B006 (the example's signature)
    # Creates a basic MLP model dynamically choosing the input and
    # output shapes.
    n_features_in = X.shape[1]
    inp = Input(shape=(n_features_in,))

    hidden = inp
    for layer_size in layers:
        hidden = Dense(layer_size, activation="relu")(hidden)

    n_outputs = y.shape[1] if len(y.shape) > 1 else 1
    out = Dense(n_outputs, activation="softmax")(hidden)
    model = Model(inp, out)
    model.compile(loss=loss, optimizer="rmsprop")

    return model


def test_keras_wrapper_example_matches_keras_sklearn_classifier(client):
    """Keras' own example: a function of X and y (one-hot: Keras' wrapper encodes
    so, and the model's categorical_crossentropy needs it), model_kwargs, and fit
    kwargs at the call. Both fits start from the same seed; Keras' batches in
    Keras' order (shuffle=False, batch_size=32) so the weights compare."""
    from keras.wrappers import SKLearnClassifier

    X, y = make_classification(n_samples=300, n_features=10, random_state=0)
    kwargs = {"loss": "categorical_crossentropy", "layers": [20, 20, 20]}
    keras.utils.set_random_seed(5)
    want = SKLearnClassifier(model=dynamic_model, model_kwargs=kwargs)
    want.fit(X, y, epochs=5, batch_size=32, shuffle=False, verbose=0)
    est = dasktf.KerasClassifier(model=dynamic_model, model_kwargs=kwargs, seed=5,
                                 n_workers=1)
    est.client = client
    est.fit(X, y, epochs=5, batch_size=32, shuffle=False)
    assert est.model_.loss == "categorical_crossentropy"
    assert type(est.model_.optimizer).__name__ == "RMSprop"  # the model's compile
    _assert_same_weights(est.model_, want.model_)
    np.testing.assert_array_equal(est.classes_, want.classes_)
    np.testing.assert_array_equal(est.predict(X), want.predict(X))
    assert len(est.history_["loss"]) == 5
    # Three workers: the same global batches, summed in another order.
    three = clone(est).set_params(n_workers=3)
    three.client = client
    three.fit(X, y, epochs=5, batch_size=32, shuffle=False)
    _assert_same_weights(three.model_, want.model_, rtol=1e-3)


def _compiled(seed=0, units=3):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((10,)), keras.layers.Dense(8, activation="relu"),
                              keras.layers.Dense(units, activation="softmax")])
    model.compile(optimizer=keras.optimizers.SGD(0.2),
                  loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


def _three_classes(n=240, seed=1):
    X, y = make_classification(n_samples=n, n_features=10, n_informative=6, n_classes=3,
                               random_state=seed)
    return X.astype(np.float32), y


def test_a_compiled_model_is_cloned_per_fit_unless_warm_start(client):
    X, y = _three_classes()
    model = _compiled()
    given = [w.copy() for w in model.get_weights()]
    est = dasktf.KerasClassifier(model, epochs=2, batch_size=40, seed=3, shuffle=False)
    est.client = client
    first = est.fit(X, y).model_
    assert first is not model and type(first.optimizer).__name__ == "SGD"
    assert "accuracy" in est.history_
    for w, w0 in zip(model.get_weights(), given, strict=True):  # the given model untouched
        np.testing.assert_array_equal(w, w0)
    second = est.fit(X, y).model_  # a fresh clone, the same seed: the same training
    assert second is not first
    _assert_same_weights(second, first)
    # warm_start: the given model trains in place, and goes on at the next fit
    warm = dasktf.KerasClassifier(model, warm_start=True, epochs=2, batch_size=40,
                                  seed=3, shuffle=False)
    warm.client = client
    assert warm.fit(X, y).model_ is model
    steps = int(model.optimizer.iterations)
    assert steps == 12 and warm.fit(X, y).model_ is model
    assert int(model.optimizer.iterations) == 2 * steps  # its optimizer went on
    assert len(warm.history_["loss"]) == 4


def _mlp(meta, hidden=8):
    """SciKeras' style: the model function reads meta and takes routed arguments."""
    return keras.Sequential([keras.Input(meta["input_shape"]),
                             keras.layers.Dense(hidden, activation="relu"),
                             keras.layers.Dense(meta["n_classes_"], activation="softmax")])


def test_routed_parameters_round_trip_and_reach_their_targets(client):
    X, y = _three_classes()
    est = dasktf.KerasClassifier(_mlp, model__hidden=5, optimizer="sgd",
                                 optimizer__learning_rate=0.05, optimizer__momentum=0.5,
                                 fit__validation_split=0.25, epochs=2, seed=0)
    params = est.get_params()
    assert params["model__hidden"] == 5 and params["optimizer__learning_rate"] == 0.05
    assert params["fit__validation_split"] == 0.25
    copy = clone(est)
    assert copy.get_params() == params
    again = dasktf.KerasClassifier().set_params(**params)
    assert again.get_params() == params
    copy.set_params(model__hidden=7, optimizer__learning_rate=0.2)
    assert est.get_params()["model__hidden"] == 5
    copy.client = client
    copy.fit(X, y)
    assert copy.model_.layers[0].units == 7
    optimizer = copy.model_.optimizer
    assert type(optimizer).__name__ == "SGD" and float(optimizer.momentum) == 0.5
    assert float(optimizer.learning_rate) == pytest.approx(0.2)
    assert "val_loss" in copy.history_  # fit__validation_split
    # fit_kwargs (Keras' name) and a fit call's own arguments reach dasktf.fit too
    copy.set_params(fit_kwargs={"epochs": 3})
    assert len(copy.fit(X, y).history_["loss"]) == 3
    assert len(copy.fit(X, y, epochs=1).history_["loss"]) == 1


def test_grid_search_over_routed_parameters(client):
    X, y = _three_classes(180)
    search = GridSearchCV(dasktf.KerasClassifier(_mlp, epochs=2, seed=0, n_workers=2),
                          {"model__hidden": [2, 16], "optimizer__learning_rate": [0.01]},
                          cv=2)
    search.fit(X, y)
    assert search.best_params_["model__hidden"] in (2, 16)
    assert search.best_estimator_.model_.layers[0].units == search.best_params_[
        "model__hidden"]
    assert float(search.best_estimator_.model_.optimizer.learning_rate) == pytest.approx(
        0.01)


def test_partial_fit_one_epoch_a_call_and_pickle(client):
    X, y = _three_classes()
    est = dasktf.KerasClassifier(_mlp, model__hidden=16, optimizer__learning_rate=0.05,
                                 batch_size=40, seed=0)
    est.client = client
    first = y < 2  # the first block lacks class 2: classes= names every class
    with pytest.raises(ValueError, match=r"labels \[2\] that are not in classes \[0, 1\]"):
        clone(est).partial_fit(X[first], y[first]).partial_fit(X, y)
    est.partial_fit(X[first], y[first], classes=[0, 1, 2])
    model = est.model_
    np.testing.assert_array_equal(est.classes_, [0, 1, 2])
    assert len(est.history_["loss"]) == 1 and est.n_features_in_ == 10
    for _ in range(3):
        est.partial_fit(X, y)
    assert est.model_ is model and len(est.history_["loss"]) == 4
    assert int(model.optimizer.iterations) == 4 + 3 * 6  # one epoch a call, Adam going on
    assert sorted(est.workers_) == alive_workers(client)
    with pytest.raises(ValueError, match="X has 4 features, but KerasClassifier is "
                                         "expecting 10"):
        est.partial_fit(X[:, :4], y)
    # a fitted estimator pickles (not its client) and predicts after unpickling
    back = pickle.loads(pickle.dumps(est))
    assert back.client is None and back.get_params() == est.get_params()
    np.testing.assert_allclose(back.predict_proba(X), est.predict_proba(X), rtol=1e-6)
    np.testing.assert_array_equal(back.predict(X), est.predict(X))
    back.client = client
    back.partial_fit(X, y)  # and trains on
    assert len(back.history_["loss"]) == 5


def test_regressor_with_a_compiled_model_and_partial_fit(client):
    rng = np.random.default_rng(0)
    X = rng.normal(size=(200, 3)).astype(np.float32)
    y = X @ np.array([1.0, -1.0, 0.5]) + 0.1  # float64, as NumPy makes it
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    reg = dasktf.KerasRegressor(model, epochs=20, batch_size=50, seed=1)
    reg.client = client
    assert reg.fit(X, y).score(X, y) > 0.95
    inc = dasktf.KerasRegressor(model, batch_size=50, seed=1)
    inc.client = client
    for _ in range(3):
        inc.partial_fit(X, y)
    assert len(inc.history_["loss"]) == 3 and inc.predict(X).shape == (200,)
    assert inc.history_["loss"][-1] < inc.history_["loss"][0]


# -- SciKeras' quickstart, as written (scikeras.readthedocs.io) -------------------------
def get_model(hidden_layer_dim, meta):
    # note that meta is a special argument that will be
    # handed a dict containing input metadata
    n_features_in_ = meta["n_features_in_"]
    X_shape_ = meta["X_shape_"]
    n_classes_ = meta["n_classes_"]

    model = keras.models.Sequential()
    model.add(keras.layers.Dense(n_features_in_, input_shape=X_shape_[1:]))
    model.add(keras.layers.Activation("relu"))
    model.add(keras.layers.Dense(hidden_layer_dim))
    model.add(keras.layers.Activation("relu"))
    model.add(keras.layers.Dense(n_classes_))
    model.add(keras.layers.Activation("softmax"))
    return model


@pytest.mark.filterwarnings("ignore:Do not pass an `input_shape`")
def test_scikeras_quickstart_matches_keras_fit(client):
    """SciKeras' quickstart: a plain argument of the model function
    (hidden_layer_dim=100) and meta. Against Keras' fit of the same model from
    the same seed, with the estimator's defaults (Adam, 10 epochs of 128) and
    Keras' batch order (shuffle=False, one worker) so the weights compare."""
    X, y = make_classification(1000, 20, n_informative=10, random_state=0)
    X = X.astype(np.float32)
    y = y.astype(np.int64)

    clf = dasktf.KerasClassifier(
        get_model,
        loss="sparse_categorical_crossentropy",
        hidden_layer_dim=100,
        seed=2, shuffle=False, n_workers=1,  # dasktf's: the comparison's
    )
    clf.client = client
    clf.fit(X, y)
    y_proba = clf.predict_proba(X)
    assert clf.get_params()["hidden_layer_dim"] == 100
    assert clone(clf).get_params()["hidden_layer_dim"] == 100

    keras.utils.set_random_seed(2)
    reference = get_model(100, {"n_features_in_": 20, "X_shape_": X.shape, "n_classes_": 2})
    reference.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    reference.fit(X, y, epochs=10, batch_size=128, shuffle=False, verbose=0)
    _assert_same_weights(clf.model_, reference)
    np.testing.assert_allclose(y_proba, reference.predict(X, verbose=0), rtol=1e-3,
                               atol=1e-5)
