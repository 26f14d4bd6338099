"""The client's model: how a run builds it and compiles its replicas, as a
re-``compile`` would decide it, and the helpers the run writes its state with.

The call's ``optimizer=``, ``loss=`` (with ``loss_weights=``), ``metrics=`` and
``weighted_metrics=`` win; what the call leaves out comes from the model's own
``compile`` (:func:`~dasktf.models.compiled_args`); a model that has neither a
loss given nor one compiled is refused, except dasktf's built-in models, whose loss
follows the labels. The labels of every output trained with a sparse categorical
loss are checked against that output's units here, on the client.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import numpy as np

from dasktf import compat
from dasktf.data.shards import ShardStats, check_labels
from dasktf.data.structure import is_nested, leaves, map_nest
from dasktf.models import (
    BUILTIN_MODELS,
    CompileRecipe,
    check_trainable_by_dasktf,
    compiled_args,
    model_spec,
    overrides_compute_loss,
    portable_metrics,
)
from dasktf.run.engine import check_staleness_lr, plan_engine
from dasktf.run.inputs import ClientModel
from dasktf.run.options import (
    TrainOptions,
    resolve_metrics,
    resolve_optimizer,
)
from dasktf.runtime.statistics import non_trainable_floats

if TYPE_CHECKING:
    from dasktf.data.base import Source
    from dasktf.run.inputs import RunInputs

logger = logging.getLogger(__name__)

_SPARSE_LOSSES = ("sparse_categorical_crossentropy", "SparseCategoricalCrossentropy")


def client_model(inputs: RunInputs, stats: list[ShardStats]) -> ClientModel:
    """Build (or take) the client's model and check it against the data's
    ``stats``: its ``train_step``, its inputs, its compile recipe, the sparse labels
    against its outputs and the engine's needs (:func:`plan_engine`). Nothing here
    contacts the cluster."""
    o = inputs.options
    model, y_pred, factory = reference_model(inputs, stats)
    builtin = isinstance(o.model, str) and o.model in BUILTIN_MODELS
    recipe = compile_recipe(o, model, stats[0], y_pred, builtin)
    check_sparse_labels(recipe.loss, model, y_pred, stats)
    return ClientModel(model, y_pred, factory, recipe, plan_engine(o, model, recipe))


def check_before_placing(inputs: RunInputs) -> ClientModel | None:
    """Every check of the model that needs no worker, run before the cluster is
    contacted, so that a refusal comes at once rather than after the workers
    have imported TensorFlow and received the data (issue 36).

    Data the client holds (NumPy arrays, a dataset read here) has its stats now:
    the whole :class:`ClientModel` is built and returned, and the run uses it. The
    stats of data built on the workers (Dask collections, loaders) come from
    there: a ``keras.Model`` instance is still checked now (``train_step``, its
    loss and compile arguments), while a model built from a name or a factory,
    whose ``input_shape`` and ``num_outputs`` are those stats, is built and
    checked after placement (``None`` is returned).
    """
    stats = client_stats(inputs.source)
    if stats is not None:
        return client_model(inputs, [stats])
    model = given_model(inputs)
    if model is not None:
        check_trainable_by_dasktf(model)
        compile_recipe(inputs.options, model, None, None, builtin=False)
    return None


def client_stats(source: Source) -> ShardStats | None:
    """The stats of data the client holds (an array source's, computed when it
    was made); ``None`` where the workers compute them on placement."""
    stats = getattr(source, "stats", None)
    return stats if isinstance(stats, ShardStats) else None


def given_model(inputs: RunInputs) -> Any:
    """The ``keras.Model`` instance the run trains, if it was given one (or an
    earlier ``fit`` of the trainer trained one); ``None`` for a name or factory."""
    import keras

    if inputs.model is not None:
        return inputs.model
    return inputs.options.model if isinstance(inputs.options.model, keras.Model) else None


def compile_recipe(options: TrainOptions, model: Any, stats: ShardStats | None,
                   y_pred: Any, builtin: bool) -> CompileRecipe:
    """The optimizer, loss, loss weights and metrics every replica compiles with
    (``stats`` and ``y_pred`` are only read for a built-in model's default loss)."""
    o = options
    compiled = compiled_args(model) or {}
    if o.optimizer is not None:
        optimizer = o.optimizer_config
    else:
        optimizer = resolve_optimizer(compiled.get("optimizer") or "sgd", o.learning_rate)
    # The model's own optimizer goes on with its state (moments, iterations: a
    # schedule's position), as model.fit on a trained model does.
    continues = o.optimizer is None and model_optimizer(model) is not None
    loss_weights = o.loss_weights
    if o.loss is not None:
        loss = o.loss
    elif compiled.get("loss") is not None:
        loss = compiled["loss"]
        if loss_weights is None:
            loss_weights = compiled.get("loss_weights")
    elif builtin and stats is not None:
        loss = default_loss(stats, y_pred)
        logger.info("No loss given; using %s", loss)
    elif overrides_compute_loss(model):
        loss = None  # its compute_loss makes the loss, as Keras' fit lets it
    else:
        raise ValueError(
            f"The model {getattr(model, 'name', '')!r} is not compiled and no loss was "
            "given: compile it first (model.compile(optimizer=..., loss=..., "
            "metrics=[...])) or pass loss= (e.g. 'sparse_categorical_crossentropy'; "
            "dasktf fit: --loss)."
        )
    check_loss_names(loss)
    metrics = o.metric_configs if o.metrics is not None else portable_metrics(
        compiled.get("metrics"))
    weighted = (resolve_metrics(o.weighted_metrics) if o.weighted_metrics is not None
                else portable_metrics(compiled.get("weighted_metrics")))
    check_staleness_lr(o.staleness_lr, optimizer)
    # the instance that trains: its exclusions from weight decay are not in its config
    source = o.optimizer if o.optimizer is not None else compiled.get("optimizer")
    excluded = (compat.weight_decay_excluded(source, model.trainable_variables)
                if not isinstance(source, str) and source is not None else ())
    return CompileRecipe(optimizer, loss, loss_weights, metrics, weighted, continues,
                         excluded)


def model_optimizer(model: Any) -> Any:
    """The optimizer ``model`` was compiled with (``None``: none, or one wrapped in
    a ``LossScaleOptimizer``, whose state is the wrapper's as much as its own)."""
    import keras

    optimizer = getattr(model, "optimizer", None) if getattr(model, "compiled", False) else None
    return None if isinstance(optimizer, keras.optimizers.LossScaleOptimizer) else optimizer


def compile_reference(recipe: CompileRecipe, model: Any, learning_rate: float | None) -> None:
    """Compile the client's model with ``recipe``: its own optimizer instance kept
    when the recipe continues it (``learning_rate``, if given, set on it)."""
    optimizer = model_optimizer(model) if recipe.continues else None
    if optimizer is not None and learning_rate is not None:
        optimizer.learning_rate = learning_rate
    recipe.compile(model, optimizer)


def default_loss(stats: ShardStats, y_pred: Any) -> str:
    """A built-in model's loss: sparse cross-entropy for class labels, else MSE."""
    label = stats.y if not is_nested(stats.y) else None
    units = int(y_pred.shape[-1]) if not is_nested(y_pred) else 1
    if label is not None and label.integral and not label.shape and units > 1:
        return "sparse_categorical_crossentropy"
    return "mse"


def check_loss_names(loss: Any) -> None:
    import keras

    for path, leaf in leaves(loss, "loss"):
        if isinstance(leaf, str):
            try:
                keras.losses.get(leaf)
            except ValueError:
                raise ValueError(
                    f"Unknown loss {leaf!r}" + (f" at {path}" if path != "loss" else "")
                    + "; use a Keras loss name (e.g. sparse_categorical_crossentropy, "
                    "categorical_crossentropy, mse, mae) or a keras.losses.Loss instance."
                ) from None


def check_sparse_labels(loss: Any, model: Any, y_pred: Any, stats: list[ShardStats]) -> None:
    """Labels of every output trained with a sparse categorical loss must be class
    indices below that output's unit count (matched as Keras matches ``y``: by
    position, or by output name)."""
    y = stats[0].y
    names = list(getattr(model, "output_names", None) or [])
    if isinstance(y_pred, dict):
        outputs = dict(y_pred)
    elif isinstance(y_pred, (list, tuple)):
        outputs = dict(zip(names or range(len(y_pred)), y_pred, strict=False))
    else:
        outputs = {names[0] if names else 0: y_pred}
    order = list(outputs)
    for path, name, index in _label_paths(y, names):
        pred = outputs.get(name)
        if pred is None and index < len(order):
            pred = outputs[order[index]]
        if pred is not None and _is_sparse(_loss_of(loss, name, index)):
            check_labels(stats, path, int(pred.shape[-1]))


def _label_paths(y: Any, names: list[str]) -> list[tuple[str, Any, int]]:
    """``(path, output name, position)`` of each label array."""
    if isinstance(y, dict):
        return [(f"y[{k!r}]", k, i) for i, k in enumerate(y)]
    if isinstance(y, (list, tuple)):
        return [(f"y[{i}]", names[i] if i < len(names) else None, i) for i in range(len(y))]
    return [("y", names[0] if names else None, 0)]


def _loss_of(loss: Any, name: Any, index: int) -> Any:
    if isinstance(loss, dict):
        return loss.get(name)
    if isinstance(loss, (list, tuple)):
        return loss[index] if index < len(loss) else None
    return loss


def _is_sparse(loss: Any) -> bool:
    if loss is None:
        return False
    name = loss if isinstance(loss, str) else type(loss).__name__
    return name in _SPARSE_LOSSES


def factory_input_shape(stats: ShardStats) -> Any:
    """What a factory's ``input_shape`` gets: ``x``'s per-sample shape (a nest of
    them for several inputs)."""
    return map_nest(lambda leaf: leaf.shape, stats.x)


def num_outputs(stats: list[ShardStats]) -> int | None:
    """What a factory's ``num_outputs`` gets: the class count of integer labels,
    else the label width (``None`` for several outputs)."""
    y = stats[0].y
    if is_nested(y):
        return None
    if y.integral and not y.shape:
        return int(max(s.y.high for s in stats if s.n)) + 1
    return int(np.prod(y.shape or (1,)))


def reference_model(inputs: RunInputs, stats: list[ShardStats]) -> tuple[Any, Any, Any]:
    """The client-side model, built (or taken) and checked against the data: the
    model, its outputs on a probe batch, and what rebuilds a subclassed model it
    made (``None``: none)."""

    o, first, factory = inputs.options, stats[0], None
    model = given_model(inputs)  # a second fit() continues from its weights
    if model is None:
        # Keras' seeds are the process's: two fits in threads of one client must
        # not draw one's initial weights from the other's seed (nor from the
        # draws of the client's event loop).
        with compat.keras_seeded(o.seed):
            spec = model_spec(o.model, factory_input_shape(first), num_outputs(stats))
            model = spec.build()
        factory = spec.build
    check_trainable_by_dasktf(model)
    probe_x = first.probe(2)[0]
    try:
        # Builds a subclassed model's weights: only then can it be saved.
        y_pred = model(probe_x)
    except Exception as exc:
        shapes = ", ".join(f"{leaf.name}: {(None, *leaf.shape)}"
                           for _, leaf in leaves(first.x, "x"))
        raise ValueError(
            f"The model does not accept inputs of shape {shapes} "
            f"({type(exc).__name__}: {str(exc).splitlines()[0]}). Check x's shape "
            "(and its structure: one array, or a list/dict matching the model's "
            "inputs by position or name) against the model's input."
        ) from exc
    return model, y_pred, factory


def adopt_optimizer(model: Any, values: list[Any], learning_rate: bool = True) -> bool:
    """Give the client's model's optimizer the trained one's variables (``values``,
    in ``optimizer.variables``' order: ``iterations``, the learning rate, the
    slots), so it saves and goes on as the optimizer Keras' ``fit`` would have
    trained; ``learning_rate=False`` leaves its learning rate. Whether it could: a
    ``LossScaleOptimizer`` on the workers (``mixed_float16``) has other variables."""
    optimizer = model.optimizer
    if not optimizer.built:
        optimizer.build(model.trainable_variables)
    variables = optimizer.variables
    if len(variables) != len(values):
        logger.debug("optimizer state not copied: %d variables against %d",
                     len(variables), len(values))
        return False
    for v, value in zip(variables, values, strict=True):
        if learning_rate or not v.path.endswith("learning_rate"):
            v.assign(value)
    return True


def model_statistics(model: Any, weights: list[np.ndarray]) -> list[np.ndarray] | None:
    """``model``'s moving statistics as ``weights`` (its ``get_weights()``) hold them."""
    position = {id(v): i for i, v in enumerate(model.weights)}
    return [np.asarray(weights[position[id(v)]])
            for v in non_trainable_floats(model)] or None
