"""Rounds with a sparse codec (issue 39): what a round's cut leaves out is kept in the
worker's start, exactly, and one local step with ``topk`` is a round (the
optimizer's update is cut, not the gradient), on the session's LocalCluster.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

import dasktf

from .test_local_steps import _data, _mlp


def test_one_worker_cut_to_a_few_percent_trains_as_keras_does(client):
    """One worker, ``local_steps=3``, ``topk:0.05``: the outer step applies only the
    cut change, the rest stays in the worker's next start, so its inner steps follow
    Keras' own ``fit`` exactly (losses equal) while the weights it holds lag by what
    was not sent yet."""
    x, y = _data()
    model = _mlp()
    model.compile(keras.optimizers.Adam(0.01), "sparse_categorical_crossentropy")
    initial = model.get_weights()
    twin = keras.models.clone_model(model)
    twin.set_weights(initial)
    twin.compile(keras.optimizers.Adam(0.01), "sparse_categorical_crossentropy")
    want = twin.fit(x, y, batch_size=48, epochs=2, shuffle=False, verbose=0)
    got = dasktf.fit(model, x, y, client=client, n_workers=1, epochs=2, batch_size=48,
                     shuffle=False, local_steps=3, seed=1, verbose=0,
                     compression="topk:0.05")
    assert got.history["rounds"] == [2.0, 2.0]
    np.testing.assert_allclose(got.history["loss"], want.history["loss"], rtol=2e-5)
    lag = max(float(np.abs(a - b).max()) for a, b in
              zip(got.model.get_weights(), twin.get_weights(), strict=True))
    assert lag > 1e-3  # (5% of a change sent a round: most of the last one is held)


@pytest.mark.parametrize("options, codec", [
    (dict(compression="topk:0.01"), "topk:0.01"),
    (dict(compression="topk:0.01", local_steps=8, outer_optimizer="nesterov"),
     "topk:0.01"),
    (dict(compression="int8"), None),
    (dict(compression=None), None),
    (dict(compression="topk:0.01", mode="async"), None),
    (dict(compression="topk:0.01", num_ps=2), None),
])
def test_a_sparse_codec_makes_synced_steps_rounds_and_nothing_else(options, codec):
    """Sync, no quorum, no servers: one local step with ``topk`` is a round whose
    change is cut; quantised codecs and the other modes keep their steps."""
    local = dasktf.Trainer("mnist-mlp", n_workers=2, **options).options.local
    if codec is None and options.get("local_steps", 1) == 1:
        assert local is None
    else:
        assert local is not None and local.codec == codec
