"""Inference on a worker: the cached model of a package, and the partition tasks.

A prediction's task graph carries the scattered :class:`~dasktf.transport.ModelPackage`
as a dependency (a key; every worker holds one copy), so a task gets the package
object from its worker's memory, never through the scheduler. The model it builds
is kept per process in a small LRU keyed by the package's content hash
(:func:`inference_model`): the thousand tasks of a prediction build it once per
worker, a second prediction of the same model builds nothing, and a worker that
serves a few models in turn keeps the last ``dasktf.inference.cache-size`` of them.

The tasks are pure (same blocks, same package: same arrays), so Dask may run one
again after a worker is lost and the result does not change.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import numpy as np

from dasktf import config
from dasktf.cluster.devices import compute_device
from dasktf.data.feeds import read_feeds
from dasktf.data.shards import Shard
from dasktf.data.structure import Nest, concat, first_leaf, leaves, map_nest, take
from dasktf.runtime.keras_step import MetricEvaluator

if TYPE_CHECKING:
    from dasktf.models import CompileRecipe
    from dasktf.transport import ModelPackage


class InferenceModel:
    """A model built from a package on this worker, with its forward function.

    The forward function is a ``tf.function`` over batches with a free batch axis
    (one trace per input signature, not one per batch size), called with
    ``training=False``: what Keras' ``predict_step`` computes, without Keras'
    per-call data pipeline and progress bar.
    """

    def __init__(self, package: ModelPackage, recipe: CompileRecipe | None = None) -> None:
        import tensorflow as tf

        self.device = compute_device()
        with tf.device(self.device):
            self.model = package.build(recipe)
        self.evaluator = MetricEvaluator(self.model)
        self._forwards: dict[Any, Any] = {}
        #: Metric states live in the model: one evaluation at a time per model.
        self.lock = threading.Lock()

    def _forward(self, x: Nest) -> Any:
        import tensorflow as tf

        def spec(a: np.ndarray) -> Any:
            dtype = tf.string if a.dtype.kind in "OUS" else tf.as_dtype(a.dtype)
            return tf.TensorSpec((None, *a.shape[1:]), dtype)

        signature = map_nest(spec, x)
        key = repr(signature)
        forward = self._forwards.get(key)
        if forward is None:
            model = self.model
            forward = tf.function(lambda inputs: model(inputs, training=False),
                                  input_signature=[signature])
            self._forwards[key] = forward
        return forward

    def predict(self, x: Nest, batch_size: int) -> Nest:
        """The model's outputs on ``x``'s rows, ``batch_size`` rows per call."""
        import tensorflow as tf

        n = len(first_leaf(x))
        forward = self._forward(x)
        outputs = []
        with tf.device(self.device):
            for start in range(0, max(n, 1), batch_size):
                batch = map_nest(_tensor, take(x, slice(start, start + batch_size)))
                outputs.append(map_nest(lambda t: t.numpy(), forward(batch)))
        return outputs[0] if len(outputs) == 1 else concat(outputs)

    def metric_states(self, x: Nest, y: Nest, w: Nest, batch_size: int) -> list[np.ndarray]:
        """The compiled loss and metric states on these rows, as Keras' ``evaluate``
        leaves them (additive totals: :func:`~dasktf.runtime.keras_step.merge_metric_states`
        sums them across partitions)."""
        import tensorflow as tf

        with self.lock, tf.device(self.device):
            return self.evaluator.states(Shard(x, y, w), batch_size)


def _tensor(a: np.ndarray) -> Any:
    """Text as ``tf.string`` (Keras refuses NumPy text arrays); numbers as they are
    (the model casts them, as Keras' ``predict`` lets it)."""
    if a.dtype.kind in "OUS":
        import tensorflow as tf

        return tf.constant(a.astype(str))
    return a


_CACHE: OrderedDict[tuple[str, Any], InferenceModel] = OrderedDict()
_CACHE_LOCK = threading.Lock()


def inference_model(package: ModelPackage, recipe: CompileRecipe | None = None
                    ) -> InferenceModel:
    """This process's model of ``package`` (compiled with ``recipe`` for
    evaluation), built on first use; the last ``dasktf.inference.cache-size``
    models are kept, the least recently used dropped."""
    key = (package.key, None if recipe is None else repr(recipe))
    with _CACHE_LOCK:
        found = _CACHE.get(key)
        if found is not None:
            _CACHE.move_to_end(key)
            return found
    built = InferenceModel(package, recipe)  # two threads may both build: one is kept
    with _CACHE_LOCK:
        found = _CACHE.setdefault(key, built)
        _CACHE.move_to_end(key)
        while len(_CACHE) > max(1, int(config.get("inference.cache-size"))):
            _CACHE.popitem(last=False)
    return found


def cached_models() -> list[str]:
    """The package keys this process holds models of, oldest first (tests)."""
    with _CACHE_LOCK:
        return [key for key, _ in _CACHE]


# -- the tasks ------------------------------------------------------------------------
def predict_part(package: ModelPackage, feeds: Nest, batch_size: int, pick: Any,
                 *parts: Any) -> Any:
    """The model's outputs on one partition (its ``parts``: a block per leaf of
    ``x``); ``pick``: ``None`` for the nest of outputs, else the one output's path
    (see :func:`pick_output`)."""
    model = inference_model(package)
    out = model.predict(read_feeds(feeds, list(parts)), batch_size)
    return out if pick is None else pick_output(out, pick)


def predict_frame_part(package: ModelPackage, feeds: Nest, batch_size: int,
                       columns: list[Any], *parts: Any) -> Any:
    """A partition's outputs as a pandas DataFrame on its index (``columns``: one
    name per output column, outputs in order)."""
    import pandas as pd

    out = predict_part(package, feeds, batch_size, None, *parts)
    flat = [np.asarray(a).reshape(len(a), -1) for a in _leaves(out)]
    data = np.concatenate(flat, axis=1) if len(flat) > 1 else flat[0]
    index = next(p.index for p in parts if hasattr(p, "index"))
    return pd.DataFrame(data, index=index, columns=columns)


def pick_output(out: Nest, path: tuple[Any, ...]) -> np.ndarray:
    """One output of a nest of outputs, by its path of keys and positions."""
    for step in path:
        out = out[step]
    return out  # type: ignore[no-any-return]


def _leaves(nest: Nest) -> list[np.ndarray]:
    return [leaf for _, leaf in leaves(nest)]


def evaluate_part(package: ModelPackage, recipe: CompileRecipe, feeds: tuple[Nest, Nest, Nest],
                  batch_size: int, *parts: Any) -> list[np.ndarray] | None:
    """The metric states of one partition (``None`` for an empty one)."""
    x, y, w = (read_feeds(f, list(parts)) for f in feeds)
    if len(first_leaf(x)) == 0:
        return None
    model = inference_model(package, recipe)
    return model.metric_states(x, y, w, batch_size)


def sum_states(*states: list[np.ndarray] | None) -> list[np.ndarray] | None:
    """Partitions' metric states added up (a node of the reduction tree)."""
    present = [s for s in states if s is not None]
    if not present:
        return None
    return [np.sum([s[i] for s in present], axis=0) for i in range(len(present[0]))]
