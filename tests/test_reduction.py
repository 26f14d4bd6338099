"""The sync step graph's two shapes: the reduction tree and the direct exchange."""

from __future__ import annotations

import numpy as np

import dask

import dasktf


def test_direct_exchange_and_tree_give_identical_weights(client, small_digits):
    x, y = small_digits
    weights = {}
    for limit in (0, 3):  # 0: always the tree; 3: direct exchange for 3 workers
        with dask.config.set({"dasktf.direct-exchange-max-workers": limit}):
            history = dasktf.fit("mnist-mlp", x, y, client=client, n_workers=3,
                                 engine="graph", epochs=2, batch_size=48,
                                 optimizer="adam", seed=1, verbose=0)
        weights[limit] = history.model.get_weights()
    # Both add the same parts in worker order: not close, the same numbers.
    for a, b in zip(weights[0], weights[3]):
        np.testing.assert_array_equal(a, b)
    assert any(np.abs(w).max() > 0 for w in weights[0])
