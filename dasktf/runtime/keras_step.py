"""The Keras side of a replica's step: the compiled step's input signature, and
the compiled loss and metric variables a replica builds, weighs and merges.

Kept apart from :mod:`dasktf.runtime.replica` (the replica's lifecycle) because the
collective engine's children and the client's model use them too.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import numpy as np

from dasktf import compat
from dasktf.data.structure import map_nest

if TYPE_CHECKING:
    from dasktf.data.shards import Shard


def weigh_output_losses(trackers: list[Any], before: list[Any], n: Any) -> None:
    """Count each output's loss of this batch ``n`` times, as one sample per row.

    Keras weighs a multi-output model's per-output loss means by the batch's
    *static* size, which a step traced for every batch size (``None``) lacks, so
    each batch counted once whatever its rows; the replicas' batches differ in
    size, and their merged means would not be the global batch's."""
    import tensorflow as tf

    extra = tf.cast(n, tf.float32) - 1.0
    for tracker, total in zip(trackers, before, strict=True):
        tracker.total.assign_add((tracker.total - total) * tf.cast(extra, tracker.total.dtype))
        tracker.count.assign_add(tf.cast(extra, tracker.count.dtype))


def flat_gradient(grads: list[Any], variables: list[Any]) -> Any:
    """The gradients of ``variables`` as one flat float32 tensor, in order (zeros
    for a variable the loss does not reach; a TF body)."""
    import tensorflow as tf

    return tf.concat([tf.reshape(tf.zeros_like(v) if g is None else tf.cast(g, v.dtype), [-1])
                      for g, v in zip(grads, variables, strict=True)], axis=0)


@functools.lru_cache(maxsize=64)
def step_dtype(dtype: np.dtype) -> np.dtype:
    """The dtype a step takes an array of ``dtype`` as: Keras' data adapters cast
    every float array that is not ``floatx`` (float64 NumPy, a float16 frame) to
    ``floatx`` before ``fit`` sees it (``array_slicing.convert_to_sliceable``), so
    a model's own ``compute_loss`` may mix ``y`` and ``y_pred`` freely; other
    dtypes (integer labels, strings) pass unchanged."""
    import keras

    if dtype.kind == "O" or not keras.backend.is_float_dtype(dtype):
        return dtype
    floatx = np.dtype(keras.backend.floatx())
    return dtype if dtype == floatx else floatx


def as_step_dtypes(nest: Any) -> Any:
    """``nest``'s arrays in :func:`step_dtype` (no copy where they already are)."""
    def cast(a: Any) -> Any:
        if a is None or not hasattr(a, "dtype"):
            return a
        want = step_dtype(np.dtype(a.dtype))
        return a if want == a.dtype else np.asarray(a, dtype=want)

    return map_nest(cast, nest)


def batch_signature(shard: Shard) -> list[Any]:
    """The ``tf.function`` input signature of a step on ``shard``'s batches: the
    nests of ``x``, ``y`` (and ``w`` if weighted) with a free batch axis, so a short
    last batch does not retrace; floats in ``floatx``, as Keras feeds them."""
    import tensorflow as tf

    def spec(a: np.ndarray) -> Any:
        return tf.TensorSpec((None, *a.shape[1:]), tf.as_dtype(step_dtype(a.dtype)))

    parts = [shard.x, shard.y] + ([] if shard.w is None else [shard.w])
    return [map_nest(spec, part) for part in parts]


class SignatureFunction:
    """``tf.function(fn, input_signature=signature)``, called the short way.

    TensorFlow's own call binds every argument to the signature in Python, call
    after call: on a small model's step that binding took about as long as the
    step's TensorFlow work (0.55 of 1.5 ms on the MNIST MLP here). A full input
    signature fixes the one concrete function every call runs, so its arguments
    are converted to the signature's dtypes and handed to it flat (what the
    binding ends with). Where this TensorFlow lacks that entry, or the arguments
    do not flatten to the signature, the ordinary call runs.
    """

    def __init__(self, fn: Any, signature: list[Any]) -> None:
        import tensorflow as tf

        self.function = tf.function(fn, input_signature=signature)
        self._concrete: Any = None  # traced on the first call, as tf.function does
        self._specs: list[Any] = []

    def __call__(self, *args: Any) -> Any:
        import tensorflow as tf

        concrete = self._concrete
        if concrete is None:
            concrete = self.function.get_concrete_function()
            if compat.can_call_flat(concrete):
                # A parameter the signature leaves out (``w=None``: unweighted
                # batches) flattens to a ``None`` that no argument fills.
                self._specs = [spec for spec
                               in tf.nest.flatten(concrete.structured_input_signature)
                               if spec is not None]
            else:
                concrete = False
            self._concrete = concrete
        flat = tf.nest.flatten(args)
        if concrete is False or len(flat) != len(self._specs):
            return self.function(*args)
        tensors = [tf.convert_to_tensor(a, spec.dtype)
                   for a, spec in zip(flat, self._specs, strict=True)]
        return compat.call_flat(concrete, tensors)


class MetricEvaluator:
    """The compiled loss and metric states ``model.evaluate`` leaves, without its
    per-call data pipeline.

    Keras' ``evaluate`` builds a ``tf.data`` pipeline, an epoch iterator and a
    callback list on every call: about 100 ms for a replica's few hundred
    validation rows on a loaded 2-core machine, most of a p2p epoch end. This runs
    the same ``model.test_step`` (a model's own override included) on the same
    batches, compiled once per input signature with a free batch axis and fed NumPy
    slices, so the states are Keras' own.
    """

    def __init__(self, model: Any) -> None:
        self.model = model
        self._steps: dict[str, SignatureFunction] = {}

    def states(self, data: Shard, batch_size: int) -> list[np.ndarray]:
        """The metric states after evaluating ``data`` (reset first), ``batch_size``
        rows per ``test_step``."""
        signature = batch_signature(data)
        key = repr(signature)
        step = self._steps.get(key)
        if step is None:
            step = self._steps[key] = SignatureFunction(self._test_step, signature)
        self.model.reset_metrics()
        for start in range(0, len(data), batch_size):
            step(*batch_args(data.take(slice(start, start + batch_size))))
        return metric_states(self.model)

    def _test_step(self, x: Any, y: Any, w: Any = None) -> None:
        self.model.test_step((x, y) if w is None else (x, y, w))


def metric_states(model: Any) -> list[np.ndarray]:
    """``model``'s compiled loss and metric variables, in ``model.metrics`` order."""
    return [np.asarray(v.numpy()) for m in model.metrics for v in m.variables]


def batch_args(batch: Shard) -> tuple[Any, ...]:
    """A batch as the arguments of a function with :func:`batch_signature`."""
    args = (batch.x, batch.y) if batch.w is None else (batch.x, batch.y, batch.w)
    return as_step_dtypes(args)


def build_metrics(model: Any, x: Any, y: Any, w: Any = None) -> None:
    """Create the compiled loss and metric variables (Keras builds them lazily).

    Raises
    ------
    ValueError
        ``y`` (or ``w``) does not fit the model's outputs and loss: what Keras said,
        and the forms ``y`` can take.
    """
    x, y, w = as_step_dtypes((x, y, w))
    try:
        y_pred = model(x, training=False)
        model.compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=w, training=False)
        model.compute_metrics(x, y, y_pred, sample_weight=w)
    except Exception as exc:
        names = list(getattr(model, "output_names", []) or [])
        raise ValueError(
            "The labels y (or sample_weight) do not match the model's outputs and "
            f"loss: {type(exc).__name__}: {str(exc).strip().splitlines()[0]} Give y "
            "as one array per output, in a list (by position) or a dict (by output "
            f"name: {names})."
        ) from exc
    model.reset_metrics()


def merge_metric_states(model: Any, states: list[list[np.ndarray]]) -> dict[str, float]:
    """Sum the replicas' metric variables into ``model``'s metrics and read them.

    Keras metrics keep additive states (totals and counts, confusion matrices), so
    the sum of the replicas' states is the state one process would have reached on
    the union of their data: exact, not an average of averages.
    """
    variables = [v for m in model.metrics for v in m.variables]
    for i, v in enumerate(variables):
        v.assign(np.sum([s[i] for s in states], axis=0))
    result = {k: float(np.asarray(v)) for k, v in model.get_metrics_result().items()}
    model.reset_metrics()
    return result
