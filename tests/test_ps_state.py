"""Sharded parameter servers' state: checkpoints, resume, the optimizer layout.

A ``placement="ps"`` run's optimizer state lives on its servers, one flat slice
each; checkpoints merge the slices into the model optimizer's own layout, so a
checkpoint resumes with any number of servers or with the mirrored placement.
"""

from __future__ import annotations

import shutil

import keras
import numpy as np
import pytest

import dasktf
from dasktf.run.checkpoint import list_checkpoints, load_latest
from dasktf.runtime.servers import (
    SLICE_NAME,
    merge_server_states,
    optimizer_layout,
    split_server_states,
)
from dasktf.wire.packets import shard_plan

from .conftest import relative_error

OPTIMIZERS = [
    {"class_name": "SGD", "config": {}},
    {"class_name": "SGD", "config": {"momentum": 0.9}},
    {"class_name": "Adam", "config": {"amsgrad": True}},
    {"class_name": "Nadam", "config": {}},
    {"class_name": "RMSprop", "config": {"momentum": 0.5, "centered": True}},
    {"class_name": "Adagrad", "config": {}},
    {"class_name": "AdamW", "config": {}},
]


def _model():
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(3),
                             keras.layers.BatchNormalization(), keras.layers.Dense(2)])


@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=lambda o: o["class_name"] + (
    "-" + "-".join(o["config"]) if o["config"] else ""))
def test_server_slices_map_onto_the_model_optimizer_and_back(optimizer):
    """Every slot of every variable goes to its place in the flat slices, scalars are
    kept, and merging the split state gives the state back (Adam interleaves its
    kinds per variable, RMSprop does not: the layout goes by Keras' slot names)."""
    model = _model()
    variables = model.trainable_variables
    layout = optimizer_layout(optimizer, variables)
    full = keras.optimizers.deserialize(optimizer)
    full.build(variables)
    rng = np.random.default_rng(0)
    values = [rng.normal(size=v.shape).astype("float32") for v in full.variables]
    flat = layout.to_flat(values)
    np.testing.assert_equal(layout.from_flat(flat), values)
    # Against the real thing: a step of the model's optimizer on the model's
    # variables leaves the state a step of a slice optimizer on one flat variable
    # (what a server runs) leaves, once mapped by the layout.
    grads = [rng.normal(size=v.shape).astype("float32") for v in variables]
    stepped = keras.optimizers.deserialize(optimizer)
    stepped.build(variables)
    stepped.apply_gradients(zip(grads, variables, strict=False))
    flat_var = keras.Variable(np.concatenate([np.ravel(v.numpy()) for v in variables]) * 0,
                              name=SLICE_NAME)
    sliced = keras.optimizers.deserialize(optimizer)
    sliced.build([flat_var])
    sliced.apply_gradients([(np.concatenate([g.ravel() for g in grads]), flat_var)])
    mapped = layout.to_flat([np.asarray(v.numpy()) for v in stepped.variables])
    for got, want in zip(mapped, sliced.variables, strict=True):
        np.testing.assert_allclose(got, np.asarray(want.numpy()), rtol=1e-6, atol=1e-7)
    # split over 3 servers and merged again: the same state
    positions = {id(w): i for i, w in enumerate(model.weights)}
    trainable = [positions[id(v)] for v in variables]
    state = {"weights": [rng.normal(size=w.shape).astype("float32") for w in model.weights],
             "optimizer": values, "applied": 7}
    plan = shard_plan([tuple(v.shape) for v in variables], 3)
    parts = split_server_states(state, plan, layout, trainable)
    slices = [{"applied": 7, "values": v, "optimizer": o} for _, v, o in parts]
    merged = merge_server_states({**state, "weights": [w * 0 for w in state["weights"]]},
                                 slices, plan, layout, trainable)
    for a, b, p in zip(merged["weights"], state["weights"], range(len(state["weights"])), strict=False):
        if p in trainable:  # the servers' master copy; the rest is the replica's
            np.testing.assert_array_equal(a, b)
    np.testing.assert_equal(merged["optimizer"], values)


def _flat(weights):
    return np.concatenate([np.ravel(w) for w in weights])


def _fit(client, x, y, **kw):
    options = dict(client=client, n_workers=3, epochs=3, batch_size=64, optimizer="adam",
                   learning_rate=0.01, seed=5, verbose=0, num_ps=2)
    options.update(kw)
    return dasktf.fit("mnist-mlp", x, y, **options)


def test_a_sharded_checkpoint_resumes_with_other_servers_or_mirrored(client, digits, tmp_path):
    """num_ps=2 checkpoints mid-epoch; resumed with num_ps=3 it reaches the
    uninterrupted num_ps=2 run's weights (relative 1e-6), and with the mirrored
    placement to float32 tolerance: the Adam state moved with the weights."""
    x, y = digits.x_train, digits.y_train
    full = _fit(client, x, y, checkpoint_dir=str(tmp_path / "full"))
    saved = keras.models.load_model(tmp_path / "full" / "model.keras")
    np.testing.assert_array_equal(_flat(saved.get_weights()), _flat(full.model.get_weights()))
    # the final model holds the servers' Adam state, not the replicas' unused one
    assert int(np.asarray(saved.optimizer.iterations)) == len(full.applied_updates[0])
    part = tmp_path / "part"
    _fit(client, x, y, epochs=2, checkpoint_dir=str(part), checkpoint_every=7)
    # stop at a mid-epoch checkpoint: drop the epoch-end one
    newest = list_checkpoints(part)[0]
    newest.with_suffix(".npz").unlink()
    newest.unlink()
    state, manifest, _ = load_latest(part)
    assert manifest["next_step"] > 0 and manifest["next_epoch"] == 1
    assert int(np.asarray(state["optimizer"][0])) == state["applied"] + 1  # iterations
    mirrored = tmp_path / "mirrored"
    shutil.copytree(part, mirrored)
    three = _fit(client, x, y, checkpoint_dir=str(part), resume=True, num_ps=3)
    assert relative_error(_flat(three.model.get_weights()), _flat(full.model.get_weights())) < 1e-6
    assert three.applied_updates[0][-1] == full.applied_updates[0][-1]
    other = _fit(client, x, y, checkpoint_dir=str(mirrored), resume=True, num_ps=None)
    assert relative_error(_flat(other.model.get_weights()), _flat(full.model.get_weights())) < 1e-5


def test_an_optimizer_without_a_slot_layout_is_refused_before_any_work(client, small_digits):
    """Adafactor keeps factored (not element-wise) state: no server slice holds it."""
    x, y = small_digits
    with pytest.raises(ValueError, match="parameter servers"):
        dasktf.fit("mnist-mlp", x, y, client=client, n_workers=2, epochs=1, num_ps=2,
                   optimizer=keras.optimizers.Adafactor(), verbose=0)


def test_an_optimizer_excluding_variables_from_weight_decay_is_refused_on_servers(
        client, small_digits):
    """A server's slice is one flat variable, decayed alike: it cannot leave the
    biases out of AdamW's decay, so the run is refused before any work."""
    x, y = small_digits
    adamw = keras.optimizers.AdamW(0.01, weight_decay=0.05)
    adamw.exclude_from_weight_decay(var_names=["bias"])
    with pytest.raises(ValueError, match="exclude_from_weight_decay"):
        dasktf.fit("mnist-mlp", x, y, client=client, n_workers=2, epochs=1, num_ps=2,
                   optimizer=adamw, verbose=0)
