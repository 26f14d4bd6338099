"""``dasktf.fit`` takes what ``keras.Model.fit`` takes, with the same meaning.

Each test trains the same model with Keras in this process and with dasktf on the
session's LocalCluster (``shuffle=False``, so the global batches are Keras'), and
compares the weights and the history to float32 tolerance: compiled models, several
inputs and outputs (by position and by name) with a loss per output and
``loss_weights``, ``sample_weight``, ``class_weight``, ``validation_split`` and
weighted ``validation_data``. Models and custom objects defined in a user's script
(``__main__``) run as a script, where the workers cannot import them.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
import warnings

import dask.array as da
import keras
import numpy as np
import pytest

import dasktf
from tests.conftest import relative_error
from tests.test_quiet import _startup_lines, bare_import_lines


def _data(n: int = 230, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    image = rng.normal(size=(n, 12)).astype("float32")
    meta = rng.normal(size=(n, 3)).astype("float32")
    return {
        "image": image,
        "meta": meta,
        "label": ((image[:, 0] > 0).astype("int64") + (meta[:, 0] > 0)),
        "score": (image[:, :2].sum(axis=1, keepdims=True) + meta[:, 1:2]).astype("float32"),
    }


def _two_headed(seed: int = 3, dict_outputs: bool = True) -> keras.Model:
    keras.utils.set_random_seed(seed)
    image, meta = keras.Input((12,), name="image"), keras.Input((3,), name="meta")
    h = keras.layers.Dense(16, activation="tanh")(keras.layers.Concatenate()([image, meta]))
    label = keras.layers.Dense(3, activation="softmax", name="label")(h)
    score = keras.layers.Dense(1, name="score")(h)
    outputs = {"label": label, "score": score} if dict_outputs else [label, score]
    return keras.Model({"image": image, "meta": meta} if dict_outputs else [image, meta],
                       outputs)


def _mlp(seed: int = 7, inputs: int = 64, classes: int = 10) -> keras.Model:
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((inputs,)),
        keras.layers.Dense(24, activation="sigmoid"),
        keras.layers.Dense(classes, activation="softmax"),
    ])


def _twin(model: keras.Model) -> keras.Model:
    twin = keras.models.clone_model(model)
    twin.set_weights(model.get_weights())
    return twin


def _assert_same_weights(got: keras.Model, want: keras.Model, initial: list[np.ndarray]) -> None:
    moved = max(relative_error(w, w0) for w, w0 in zip(want.get_weights(), initial, strict=True))
    assert moved > 1e-3, "training must move the weights for the comparison to mean anything"
    for g, w in zip(got.get_weights(), want.get_weights(), strict=True):
        assert relative_error(g, w) < 2e-5


def _assert_same_history(got: dict, want: dict, keys: list[str]) -> None:
    for key in keys:
        np.testing.assert_allclose(got[key], want[key], rtol=2e-5, err_msg=key)


def test_compiled_model_trains_with_its_own_optimizer_loss_and_metrics(client, digits):
    x, y = digits.x_train[:300].reshape(300, -1), digits.y_train[:300]
    reference = _mlp()
    ours, initial = _twin(reference), [w.copy() for w in reference.get_weights()]
    for m in (reference, ours):
        m.compile(optimizer=keras.optimizers.Adam(1e-2, beta_1=0.8, clipnorm=1.0),
                  loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    want = reference.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = dasktf.fit(ours, x, y, client=client, n_workers=2, epochs=2,
                             batch_size=64, shuffle=False, verbose=0)
    _assert_same_weights(history.model, reference, initial)
    _assert_same_history(history.history, want.history, ["loss", "accuracy"])
    optimizer = history.model.optimizer
    assert type(optimizer) is keras.optimizers.Adam
    assert optimizer.get_config()["beta_1"] == pytest.approx(0.8)
    assert optimizer.get_config()["clipnorm"] == 1.0
    # The trained optimizer's state came back with the weights (5 steps x 2 epochs).
    assert int(optimizer.iterations.numpy()) == 10
    for got, want_v in zip(optimizer.variables, reference.optimizer.variables, strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want_v), rtol=1e-4, atol=1e-6)
    noisy = [str(w.message) for w in caught
             if "Skipping variable loading" in str(w.message) or "copy keyword" in str(w.message)]
    assert not noisy


def test_call_arguments_override_the_compiled_ones(client, digits):
    x, y = digits.x_train[:200].reshape(200, -1), digits.y_train[:200]
    reference = _mlp(seed=2)
    ours, initial = _twin(reference), [w.copy() for w in reference.get_weights()]
    ours.compile(optimizer="adam", loss="mse", metrics=["mae"])
    reference.compile(optimizer=keras.optimizers.SGD(0.3), loss="sparse_categorical_crossentropy",
                      metrics=["accuracy"])
    want = reference.fit(x, y, batch_size=50, epochs=1, shuffle=False, verbose=0)
    history = dasktf.fit(ours, x, y, client=client, n_workers=3, batch_size=50, shuffle=False,
                         optimizer=keras.optimizers.SGD(0.3), verbose=0,
                         loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    _assert_same_weights(history.model, reference, initial)
    _assert_same_history(history.history, want.history, ["loss", "accuracy"])
    assert "mae" not in history.history
    assert type(history.model.optimizer) is keras.optimizers.SGD


def test_a_model_neither_compiled_nor_given_a_loss_is_refused(client, digits):
    started = time.perf_counter()
    with pytest.raises(ValueError, match="not compiled and no loss was given"):
        dasktf.fit(_mlp(), digits.x_train[:100].reshape(100, -1), digits.y_train[:100],
                   client=client, n_workers=2, verbose=0)
    assert time.perf_counter() - started < 30


@pytest.mark.parametrize("by", ["name", "position"])
def test_multi_input_multi_output_with_weights_matches_keras(client, by):
    # 240 rows in batches of 40: Keras counts each batch's per-output loss once,
    # whatever its size, which equals the per-row mean only for equal batches.
    d = _data(n=240)
    dict_form = by == "name"
    reference = _two_headed(dict_outputs=dict_form)
    ours, initial = _twin(reference), [w.copy() for w in reference.get_weights()]
    weight_of_score = np.linspace(0.5, 2.0, len(d["label"])).astype("float32")
    if dict_form:
        x = {"image": d["image"], "meta": d["meta"]}
        y = {"label": d["label"], "score": d["score"]}
        sample_weight = {"label": np.ones_like(weight_of_score), "score": weight_of_score}
        compile_args = dict(loss={"label": "sparse_categorical_crossentropy", "score": "mse"},
                            loss_weights={"label": 1.0, "score": 0.3},
                            metrics={"label": ["accuracy"]})
    else:
        x, y = [d["image"], d["meta"]], [d["label"], d["score"]]
        sample_weight = [np.ones_like(weight_of_score), weight_of_score]
        compile_args = dict(loss=["sparse_categorical_crossentropy", "mse"],
                            loss_weights=[1.0, 0.3], metrics=[["accuracy"], []])
    for m in (reference, ours):
        m.compile(optimizer=keras.optimizers.Adam(0.02), **compile_args)
    want = reference.fit(x, y, sample_weight=sample_weight, batch_size=40, epochs=2,
                         shuffle=False, verbose=0)
    history = dasktf.fit(ours, x, y, sample_weight=sample_weight, client=client, n_workers=3,
                         batch_size=40, epochs=2, shuffle=False, verbose=0)
    _assert_same_weights(history.model, reference, initial)
    # the per-output losses and metrics, named as Keras names them
    _assert_same_history(history.history, want.history,
                         ["loss", "label_loss", "score_loss", "label_accuracy"])


def test_sample_weight_class_weight_and_weighted_validation_match_keras(client, digits):
    x, y = digits.x_train[:260].reshape(260, -1), digits.y_train[:260]
    x_val, y_val = digits.x_test[:90].reshape(90, -1), digits.y_test[:90]
    w_val = np.where(y_val % 2 == 0, 2.0, 0.5).astype("float32")
    sample_weight = np.random.default_rng(1).uniform(0.2, 3.0, len(y)).astype("float32")
    class_weight = {0: 4.0, 3: 0.25, 7: 2.0}
    for weighting in ({"sample_weight": sample_weight}, {"class_weight": class_weight}):
        reference = _mlp(seed=5)
        ours, initial = _twin(reference), [w.copy() for w in reference.get_weights()]
        for m in (reference, ours):
            m.compile(optimizer=keras.optimizers.SGD(0.4), loss="sparse_categorical_crossentropy",
                      weighted_metrics=["accuracy"])
        want = reference.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0,
                             validation_data=(x_val, y_val, w_val), **weighting)
        history = dasktf.fit(ours, x, y, client=client, n_workers=3, batch_size=64, epochs=2,
                             shuffle=False, verbose=0, validation_data=(x_val, y_val, w_val),
                             **weighting)
        _assert_same_weights(history.model, reference, initial)
        _assert_same_history(history.history, want.history,
                             ["loss", "accuracy", "val_loss", "val_accuracy"])


def test_validation_split_takes_the_last_rows_as_keras_does(client, digits):
    x, y = digits.x_train[:250].reshape(250, -1), digits.y_train[:250]
    reference = _mlp(seed=11)
    ours, initial = _twin(reference), [w.copy() for w in reference.get_weights()]
    for m in (reference, ours):
        m.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    want = reference.fit(x, y, batch_size=32, epochs=1, validation_split=0.3, shuffle=False,
                         verbose=0)
    history = dasktf.fit(ours, x, y, client=client, n_workers=2, batch_size=32,
                         validation_split=0.3, shuffle=False, verbose=0)
    _assert_same_weights(history.model, reference, initial)
    _assert_same_history(history.history, want.history,
                         ["loss", "accuracy", "val_loss", "val_accuracy"])


def test_nested_dask_arrays_with_sample_weights_match_keras(client):
    """One worker reads its Dask chunks in order: exactly Keras' batches."""
    d = _data(n=180, seed=4)
    reference = _two_headed(seed=9)
    ours, initial = _twin(reference), [w.copy() for w in reference.get_weights()]
    w = np.linspace(0.2, 1.8, 180).astype("float32")
    for m in (reference, ours):
        m.compile(optimizer="sgd", loss={"label": "sparse_categorical_crossentropy",
                                         "score": "mse"})
    want = reference.fit({"image": d["image"], "meta": d["meta"]},
                         {"label": d["label"], "score": d["score"]}, sample_weight=w,
                         batch_size=30, epochs=1, shuffle=False, verbose=0)

    def chunked(a: np.ndarray) -> da.Array:
        return da.from_array(a, chunks=(60, *a.shape[1:]))

    history = dasktf.fit(
        ours, {"image": chunked(d["image"]), "meta": chunked(d["meta"])},
        {"label": chunked(d["label"]), "score": chunked(d["score"])}, sample_weight=chunked(w),
        client=client, n_workers=1, batch_size=30, shuffle=False, verbose=0)
    _assert_same_weights(history.model, reference, initial)
    _assert_same_history(history.history, want.history, ["loss", "label_loss", "score_loss"])


@pytest.mark.parametrize(
    ("x", "y", "kwargs", "match"),
    [
        ({"image": np.ones((50, 12)), "meta": np.ones((49, 3))}, np.zeros(50), {},
         r"x\['meta'\]: 49"),
        (np.ones((50, 12)), {"label": np.zeros(50), "score": np.full((50, 1), np.nan)}, {},
         r"NaN or infinite values in y\['score'\]"),
        (np.ones((50, 12)), np.zeros(50), {"sample_weight": np.ones(40)},
         r"sample_weight: 40"),
        (np.ones((50, 12)), [np.zeros(50), np.zeros(50)], {"class_weight": {0: 2.0}},
         "single output"),
        (np.ones((50, 12)), np.zeros(50), {"class_weight": {0: 1.0},
                                           "sample_weight": np.ones(50)},
         "not both"),
        (np.ones((50, 12)), np.zeros(50), {"steps_per_epoch": 3}, "steps_per_epoch"),
        (np.ones((50, 12)), np.zeros(50), {"validation_split": 1.5}, "validation_split"),
    ],
)
def test_bad_structured_inputs_name_the_array_at_fault(x, y, kwargs, match):
    """Refused on the client, before any cluster starts (``client`` is not needed)."""
    started = time.perf_counter()
    with pytest.raises((ValueError, TypeError), match=match):
        dasktf.Trainer(_mlp(inputs=12), n_workers=1).fit(x, y, verbose=0, **kwargs)
    assert time.perf_counter() - started < 5


def test_labels_out_of_range_name_the_output(client):
    d = _data(n=60)
    model = _two_headed()
    model.compile(optimizer="sgd", loss={"label": "sparse_categorical_crossentropy",
                                         "score": "mse"})
    bad = d["label"].copy()
    bad[5] = 7  # the label head has 3 units
    with pytest.raises(ValueError, match=r"Labels y\['label'\] must lie in \[0, 3\)"):
        dasktf.fit(model, {"image": d["image"], "meta": d["meta"]},
                   {"label": bad, "score": d["score"]}, client=client, n_workers=2, verbose=0)


def test_a_model_overriding_train_step_is_refused(client, digits):
    class OwnStep(keras.Sequential):
        def train_step(self, data):  # pragma: no cover - never run
            raise AssertionError

    keras.utils.set_random_seed(0)
    model = OwnStep([keras.Input((64,)), keras.layers.Dense(10, activation="softmax")])
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    with pytest.raises(ValueError, match=r"overrides train_step.*compute_loss"):
        dasktf.fit(model, digits.x_train[:64].reshape(64, -1), digits.y_train[:64],
                   client=client, n_workers=2, verbose=0)


USER_SCRIPT = '''
import keras, numpy as np, dasktf

class Residual(keras.layers.Layer):            # a custom layer, only in this script
    def __init__(self, units, **kwargs):
        super().__init__(**kwargs)
        self.units = units
        self.dense = keras.layers.Dense(units, activation="tanh")
    def call(self, x):
        return x + self.dense(x)
    def get_config(self):
        return {**super().get_config(), "units": self.units}

class Classifier(keras.Model):                 # a subclassed model, as the guides write it
    def __init__(self):
        super().__init__()
        self.hidden = keras.layers.Dense(32, activation="relu")
        self.out = keras.layers.Dense(10, activation="softmax")
    def call(self, inputs, training=False):
        return self.out(self.hidden(inputs))

class TruePositives(keras.metrics.Metric):     # a custom metric
    def __init__(self, name="true_positives", **kwargs):
        super().__init__(name=name, **kwargs)
        self.count = self.add_variable(shape=(), initializer="zeros", name="count")
    def update_state(self, y_true, y_pred, sample_weight=None):
        hit = keras.ops.cast(keras.ops.equal(keras.ops.cast(keras.ops.reshape(y_true, (-1,)),
              "int64"), keras.ops.argmax(y_pred, axis=-1)), "float32")
        self.count.assign_add(keras.ops.sum(hit))
    def result(self):
        return self.count

def smooth_loss(y_true, y_pred):               # a plain-Python loss
    return keras.losses.sparse_categorical_crossentropy(y_true, y_pred) * 1.0

if __name__ == "__main__":
    from distributed import Client

    d = dasktf.load_dataset("digits")
    x, y = d.x_train.reshape(len(d.x_train), -1), d.y_train
    runs = {}
    with dasktf.make_local_cluster(2) as cluster, Client(cluster) as client:
        net = Classifier()
        net.compile(optimizer=keras.optimizers.Adam(1e-2), loss=smooth_loss,
                    metrics=["accuracy", TruePositives()])
        h = dasktf.fit(net, x, y, client=client, epochs=3, batch_size=64, verbose=0)
        runs["subclassed"] = h.history["accuracy"][-1], h.history["true_positives"][-1]
        h = dasktf.fit(Classifier, x, y, client=client, epochs=1, batch_size=64, verbose=0,
                       loss="sparse_categorical_crossentropy", optimizer="adam", seed=0)
        runs["factory"] = h.history["loss"][-1], 0
        inputs = keras.Input((64,))
        outputs = keras.layers.Dense(10, activation="softmax")(Residual(64)(inputs))
        functional = keras.Model(inputs, outputs)
        functional.compile(optimizer=keras.optimizers.Adam(1e-2),
                           loss="sparse_categorical_crossentropy", metrics=["accuracy"])
        h = dasktf.fit(functional, x, y, client=client, epochs=3, batch_size=64, verbose=0)
        runs["custom_layer"] = h.history["accuracy"][-1], 0
    for name, (value, extra) in runs.items():
        print(f"RESULT {name} {value:.4f} {extra:.0f}")
'''


def test_models_and_objects_defined_in_the_users_script(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(USER_SCRIPT))
    # TF_CPP_MIN_LOG_LEVEL unset, as in a user's shell: the workers, spawned after
    # the script's own `import keras`, must still start quiet (tests/test_quiet.py).
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=240, cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    results = {line.split()[1]: [float(v) for v in line.split()[-2:]]
               for line in done.stdout.splitlines() if line.startswith("RESULT")}
    assert results["subclassed"][0] > 0.85  # Adam 1e-2 as compiled: SGD 0.01 gets ~0.1
    assert results["subclassed"][1] > 0.85 * 1437  # the custom metric, summed over replicas
    assert results["factory"][0] < 2.35  # one epoch at Adam 1e-3: Keras reaches ~2.27
    assert results["custom_layer"][0] > 0.85
    assert "Skipping variable loading" not in done.stderr
    # Only the client's own import (before dasktf could set anything) may print
    # TensorFlow's start-up lines, as a bare import does on this CPU (0, 2 or 4);
    # none come from the 2 workers.
    printed = _startup_lines(done.stdout + done.stderr)
    assert len(printed) <= len(bare_import_lines()), done.stderr[-3000:]


def test_embedding_text_model_with_integer_inputs_matches_keras(client):
    """The keras.io text classification shape: token ids into an Embedding."""
    rng = np.random.default_rng(6)
    tokens = rng.integers(1, 200, size=(192, 20)).astype("int32")
    labels = (tokens[:, :5].mean(axis=1) > 100).astype("int64")
    keras.utils.set_random_seed(4)
    reference = keras.Sequential([
        keras.Input((20,), dtype="int32"),
        keras.layers.Embedding(200, 8),
        keras.layers.GlobalAveragePooling1D(),
        keras.layers.Dense(2, activation="softmax"),
    ])
    ours, initial = _twin(reference), [w.copy() for w in reference.get_weights()]
    for m in (reference, ours):
        m.compile(optimizer=keras.optimizers.SGD(2.0), loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    want = reference.fit(tokens, labels, batch_size=32, epochs=2, shuffle=False, verbose=0)
    history = dasktf.fit(ours, tokens, labels, client=client, n_workers=3, batch_size=32,
                         epochs=2, shuffle=False, verbose=0)
    _assert_same_weights(history.model, reference, initial)
    _assert_same_history(history.history, want.history, ["loss", "accuracy"])
    # (Adam trains too, though not bit-equal: Keras applies an Embedding's sparse
    # gradient lazily, dasktf averages dense gradients; docs/api.md.)


# Every sync topology and placement runs the same gradient task (tested here through
# the default tree and the collective engine); async and quorum run their own.
@pytest.mark.parametrize("options", [{"mode": "async"}, {"sync_quorum": 2}])
def test_structured_weighted_inputs_train_on_every_engine(client, options):
    d = _data(n=240, seed=8)
    model = _two_headed(seed=1)
    model.compile(optimizer=keras.optimizers.Adam(0.02),
                  loss={"label": "sparse_categorical_crossentropy", "score": "mse"},
                  metrics={"label": ["accuracy"]})
    history = dasktf.fit(model, {"image": d["image"], "meta": d["meta"]},
                         {"label": d["label"], "score": d["score"]},
                         sample_weight=np.linspace(0.5, 1.5, 240), client=client, n_workers=3,
                         batch_size=48, epochs=3, verbose=0, seed=0, **options)
    loss = history.history["loss"]
    assert loss[-1] < loss[0]
    assert {"label_loss", "score_loss", "label_accuracy"} <= set(history.history)
    if options == {"mode": "async"}:  # the holder's optimizer state came back
        assert int(history.model.optimizer.iterations.numpy()) == len(history.updates)


class Penalised(keras.Sequential):
    """A model that overrides compute_loss (an L2 penalty on the first kernel), as
    the Keras guide on customising fit shows: dasktf calls it for every gradient."""

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        loss = super().compute_loss(x, y, y_pred, sample_weight, training)
        return loss + 0.05 * keras.ops.sum(keras.ops.square(self.layers[0].kernel))


def test_an_overridden_compute_loss_is_honoured(client, digits):
    x, y = digits.x_train[:240].reshape(240, -1), digits.y_train[:240]
    keras.utils.set_random_seed(12)
    reference = Penalised([keras.Input((64,)), keras.layers.Dense(12, activation="relu"),
                           keras.layers.Dense(10, activation="softmax")])
    ours = Penalised.from_config(reference.get_config())
    ours.set_weights(reference.get_weights())
    initial = [w.copy() for w in reference.get_weights()]
    for m in (reference, ours):
        m.compile(optimizer=keras.optimizers.SGD(0.3), loss="sparse_categorical_crossentropy")
    want = reference.fit(x, y, batch_size=60, epochs=2, shuffle=False, verbose=0)
    history = dasktf.fit(ours, x, y, client=client, n_workers=3, batch_size=60, epochs=2,
                         shuffle=False, verbose=0)
    _assert_same_weights(history.model, reference, initial)
    _assert_same_history(history.history, want.history, ["loss"])
