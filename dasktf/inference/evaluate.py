"""``dasktf.evaluate``: Keras' ``evaluate`` on data that lives in Dask.

Each partition is evaluated where it lives by the model compiled as the client's
(its loss, loss weights, metrics and weighted metrics); what comes back are the
metrics' *states* (totals and counts, confusion matrices: additive), summed up a
tree on the cluster and read once on the client
(:func:`~dasktf.runtime.keras_step.merge_metric_states`). So the result is what
one process would compute on all the rows, not a mean of per-partition metrics
(which would be wrong for AUC, and for unequal partitions).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from dasktf.data.named_inputs import label_columns
from dasktf.inference.inputs import plan_inputs, probe_outputs
from dasktf.inference.predict import client_of, load_model, positive_batch_size
from dasktf.models import CompileRecipe, compiled_args, portable_metrics
from dasktf.runtime.inference import evaluate_part, sum_states
from dasktf.runtime.keras_step import build_metrics, merge_metric_states
from dasktf.transport import ModelPackage, share_model

if TYPE_CHECKING:
    from distributed import Client

#: Partitions' states summed per task of the reduction tree.
_FAN_IN = 8


def evaluate(model: Any, x: Any, y: Any = None, *, batch_size: int | None = None,
             sample_weight: Any = None, client: Client | None = None) -> dict[str, float]:
    """Evaluate a compiled ``model`` on ``x``, ``y`` where their partitions live.

    Parameters
    ----------
    model
        A compiled ``keras.Model`` (or the path of a ``.keras`` file saved
        compiled): its loss and metrics are what is computed.
    x, y, sample_weight
        As :func:`dasktf.predict` takes ``x``; ``y`` and ``sample_weight`` with
        the same rows (Dask arrays with ``x``'s, or frames/Series with its
        partitions; ``y`` may name columns of a DataFrame ``x``), nested per
        output as Keras takes them.
    batch_size
        Rows per Keras ``evaluate`` batch on a worker (default
        ``dasktf.inference.batch-size``); it does not change the result beyond
        float32 rounding.
    client
        The Dask client (default: the current one).

    Returns
    -------
    dict
        What Keras' ``model.evaluate(x, y, return_dict=True)`` returns on the same
        rows: ``{"loss": ..., "accuracy": ..., ...}``.

    Raises
    ------
    ValueError
        The model is not compiled, or ``x``/``y`` do not match it (named before
        any task runs).
    """
    model = load_model(model)
    if not getattr(model, "compiled", False) or compiled_args(model) is None:
        raise ValueError(
            f"The model {model.name!r} is not compiled: dasktf.evaluate computes the "
            "loss and metrics it was compiled with. Call model.compile(loss=..., "
            "metrics=[...]) first.")
    if y is None:
        raise ValueError("y is required: dasktf.evaluate compares the model's outputs "
                         "with it (as Keras' evaluate does).")
    batch_size = positive_batch_size(batch_size)
    client = client_of(client)
    x, y, sample_weight = label_columns(x, y, sample_weight)
    plan = plan_inputs(model, x, y, sample_weight)
    probe_outputs(model, plan)
    recipe = evaluation_recipe(model)
    probe_x, probe_y, probe_w = plan.probe(1)
    build_metrics(model, probe_x, probe_y, probe_w)
    shared = share_model(client, ModelPackage.pack(model))
    try:
        states = _states(plan, shared.future, recipe, batch_size)
        total = client.compute(states).result()
    finally:
        shared.release()
    if total is None:
        raise ValueError("x has no rows to evaluate.")
    return merge_metric_states(model, [total])


def evaluation_recipe(model: Any) -> CompileRecipe:
    """The model's own compile, to rebuild it on the workers (the optimizer is
    never used: SGD, which has no state to build)."""
    import keras

    given = compiled_args(model) or {}
    return CompileRecipe(
        keras.optimizers.serialize(keras.optimizers.SGD()), given.get("loss"),
        given.get("loss_weights"), portable_metrics(given.get("metrics")),
        portable_metrics(given.get("weighted_metrics")))


def _states(plan: Any, package: Any, recipe: CompileRecipe, batch_size: int) -> Any:
    """A Delayed: the sum of every partition's metric states (a tree of
    ``_FAN_IN`` per task, on the cluster)."""
    import dask
    import dask.array as da
    import dask.dataframe as dd
    from dask.base import tokenize

    feeds = (plan.x, plan.y, plan.w)
    empty = np.empty((0,), object)
    if plan.kind == "frame":
        parts = dd.map_partitions(evaluate_part, package, recipe, feeds, batch_size,
                                  *plan.collections, meta=empty, align_dataframes=False,
                                  enforce_metadata=False)
    else:
        pairs: list[Any] = []
        for j, c in enumerate(plan.collections):
            pairs += [c, ("i", *(f"x{j}_{k}" for k in range(1, c.ndim)))]
        parts = da.blockwise(
            evaluate_part, "i", package, None, recipe, None, feeds, None, batch_size, None,
            *pairs, concatenate=True, dtype=object, meta=empty,
            name=f"dasktf-evaluate-{tokenize(package.key, feeds, batch_size, *plan.collections)}")
    level = list(parts.to_delayed().ravel())
    add = dask.delayed(sum_states, pure=True)
    while len(level) > 1:
        level = [add(*level[i:i + _FAN_IN]) for i in range(0, len(level), _FAN_IN)]
    return level[0]
