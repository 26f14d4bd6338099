"""``dasktf.predict``: a model's predictions on data that lives in Dask, lazily.

The model travels once: :func:`~dasktf.transport.share_model` scatters its package
(the model as Keras saves it) to every worker, and each partition's task takes the
package's future as a dependency, so the graph carries a key of a few dozen bytes
whatever the model's size (the ``map_blocks(model.predict)`` workaround pickles the
model into every task, and the scheduler holds ``npartitions`` copies). Each
worker builds the model once and keeps it (:mod:`dasktf.runtime.inference`).

As in ``xgboost.dask.predict``: arrays map block by block (the row blocks of
``x``), DataFrames partition by partition (their index and divisions kept where
the result is a frame), and the result is a Dask collection nothing has computed.
``dasktf predict`` writes it with :func:`write_parquet`: each partition by the
worker that computed it, as ``part.<i>.parquet``, and only a row count comes back
to the client (data larger than the client's memory).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import numpy as np

from dasktf import compat, config
from dasktf.data.structure import Nest
from dasktf.engines.base import check_integer
from dasktf.inference.inputs import InputPlan, plan_inputs, probe_outputs
from dasktf.runtime.inference import pick_output, predict_frame_part, predict_part
from dasktf.transport import ModelPackage, SharedModel, share_model

if TYPE_CHECKING:
    from distributed import Client, Future


def predict(model: Any, x: Any, *, batch_size: int | None = None, as_frame: bool = False,
            client: Client | None = None) -> Any:
    """Predict ``model`` on ``x`` where ``x``'s partitions live; nothing is computed.

    Parameters
    ----------
    model
        A built ``keras.Model`` (or the path of a ``.keras`` file). It reaches each
        worker once and is built there once, whatever the number of partitions.
    x
        A Dask array, DataFrame or Series, or a list/tuple/dict of them matching the
        model's inputs by position or by name, as :func:`dasktf.fit` takes it;
        NumPy arrays are cut into blocks for convenience. A DataFrame feeds a
        one-input model whole (its columns as the features) and a model with
        named inputs column by column (string and categorical columns feed string
        inputs such as a ``StringLookup``'s).
    batch_size
        Rows per forward call on a worker (as in Keras' ``predict``; it does not
        change the result beyond float32 rounding). Default
        ``dasktf.inference.batch-size`` (1024): Keras' 32 costs a fixed overhead
        per call that large batches spread.
    as_frame
        Return a Dask DataFrame on ``x``'s index and divisions (``x`` must be a
        DataFrame or hold them), one column per output unit: ``"0" .. "k-1"`` for a
        single output, ``"name"`` or ``"name_i"`` per output otherwise (strings,
        so ``to_parquet`` takes the frame). Off by default, as Keras' ``predict``
        returns arrays whatever it is given.
    client
        The Dask client (default: the current one, ``distributed.getclient_of()``).

    Returns
    -------
    dask.array.Array, or a dict/list of them, or dask.dataframe.DataFrame
        One Dask array per output of the model, in the model's output structure
        (rows in ``x``'s order; blocks of unknown length where ``x`` is a
        DataFrame), or a DataFrame with ``as_frame=True``.

    Raises
    ------
    ValueError, TypeError
        ``x`` does not match the model's inputs (a missing input, a wrong per-row
        shape or kind), named before any task runs.

    Examples
    --------
    >>> y_prob = dasktf.predict(model, X)  # doctest: +SKIP
    >>> y_prob.argmax(axis=1).compute()  # doctest: +SKIP
    """
    model = load_model(model)
    batch_size = positive_batch_size(batch_size)
    client = client_of(client)
    plan = plan_inputs(model, x)
    outputs = probe_outputs(model, plan)
    if as_frame and plan.kind != "frame":
        raise ValueError(
            "as_frame=True needs x to be a Dask DataFrame (or hold DataFrames or Series): "
            "the result takes its index and divisions. For an array x, wrap the result: "
            "dd.from_dask_array(dasktf.predict(model, x)).")
    shared = share_model(client, ModelPackage.pack(model))
    if as_frame:
        return _as_frame(plan, shared, batch_size, outputs)
    return _as_arrays(plan, shared, batch_size, outputs)


def load_model(model: Any) -> Any:
    """A built ``keras.Model``: ``model`` itself, or the ``.keras`` file it names."""
    import keras

    if isinstance(model, (str, bytes)) or hasattr(model, "__fspath__"):
        return keras.saving.load_model(model, compile=True, safe_mode=True)
    if not isinstance(model, keras.Model):
        raise TypeError(f"model must be a keras.Model or the path of a .keras file; got "
                        f"{type(model).__name__}.")
    if not model.built:
        raise ValueError(f"The model {model.name!r} is not built: call it on data (or "
                         "fit it) first, so its weights exist.")
    return model


def positive_batch_size(batch_size: int | None) -> int:
    """``batch_size``, else ``dasktf.inference.batch-size``; refused unless positive."""
    value = config.get("inference.batch-size", batch_size)
    check_integer("batch_size", value)
    return int(value)


def client_of(client: Client | None) -> Client:
    """``client``, else the current Dask client; a clear error where there is none."""
    if client is not None:
        return client
    from distributed import get_client

    try:
        return get_client()
    except ValueError:
        raise ValueError(
            "No Dask client: dasktf.predict and evaluate run where the data lives, "
            "on a cluster. Create one first (distributed.Client(...), or "
            "dasktf.make_local_cluster()) or pass client=.") from None


def output_paths(outputs: Nest) -> list[tuple[tuple[Any, ...], np.ndarray]]:
    """``(path of keys and positions, probe array)`` per output, in order."""
    if isinstance(outputs, np.ndarray):
        return [((), outputs)]
    out: list[tuple[tuple[Any, ...], np.ndarray]] = []
    items = outputs.items() if isinstance(outputs, dict) else enumerate(outputs)
    for key, value in items:
        out += [((key, *path), a) for path, a in output_paths(value)]
    return out


def _rebuild(outputs: Nest, made: dict[tuple[Any, ...], Any], path: tuple[Any, ...] = ()
             ) -> Any:
    if isinstance(outputs, np.ndarray):
        return made[path]
    if isinstance(outputs, dict):
        return {k: _rebuild(v, made, (*path, k)) for k, v in outputs.items()}
    return type(outputs)(_rebuild(v, made, (*path, i)) for i, v in enumerate(outputs))


def _as_arrays(plan: InputPlan, shared: SharedModel, batch_size: int, outputs: Nest) -> Any:
    """One Dask array per output: a task per partition, and per output a pick of
    its array where the model has several."""
    from dask.base import tokenize

    paths = output_paths(outputs)
    single = len(paths) == 1 and paths[0][0] == ()
    token = tokenize(shared.ref.key, plan.x, batch_size, *plan.collections)
    raw = _map_partitions(plan, predict_part, shared, plan.x, batch_size, None,
                          meta=outputs if single else None, name=f"dasktf-predict-{token}")
    if single:
        return raw
    made = {}
    for path, probe in paths:
        shape = probe.shape[1:]
        made[path] = raw.map_blocks(
            pick_output, path, dtype=probe.dtype, meta=np.empty((0, *shape), probe.dtype),
            chunks=(raw.chunks[0], *((n,) for n in shape)),
            new_axis=list(range(1, 1 + len(shape))) or None,
            name=f"dasktf-predict-{'-'.join(map(str, path))}-{token}")
    return _rebuild(outputs, made)


def _map_partitions(plan: InputPlan, func: Any, shared: SharedModel, *args: Any,
                    meta: np.ndarray | None, name: str) -> Any:
    """``func(package, *args, *blocks)`` per partition, as a Dask array: of
    ``meta``'s dtype and row shape, else of objects (a nest per partition)."""
    import dask.array as da
    import dask.dataframe as dd

    dtype = object if meta is None else meta.dtype
    shape = () if meta is None else meta.shape[1:]
    empty = np.empty((0, *shape), dtype)
    if plan.kind == "frame":
        return dd.map_partitions(func, shared.future, *args, *plan.collections, meta=empty,
                                 align_dataframes=False, enforce_metadata=False)
    # Blockwise over the row axis "i"; every other axis of an input has its own
    # index and one chunk (concatenate=True hands the task the whole row block).
    pairs: list[Any] = []
    for j, c in enumerate(plan.collections):
        pairs += [c, ("i", *(f"x{j}_{k}" for k in range(1, c.ndim)))]
    new_axes = {f"out_{k}": n for k, n in enumerate(shape)}
    literal = [part for a in (shared.future, *args) for part in (a, None)]
    return da.blockwise(func, ("i", *new_axes), *literal, *pairs, new_axes=new_axes,
                        concatenate=True, dtype=dtype, meta=empty, name=name)


def _as_frame(plan: InputPlan, shared: SharedModel, batch_size: int, outputs: Nest) -> Any:
    import dask.dataframe as dd
    import pandas as pd

    paths = output_paths(outputs)
    for path, probe in paths:
        if probe.ndim > 2:
            raise ValueError(
                f"as_frame=True: the model's output {list(path) or ''} has rows of shape "
                f"{probe.shape[1:]}; a DataFrame holds one row of numbers per example. "
                "Predict arrays instead (as_frame=False).")
    columns = frame_columns(paths)
    dtypes = np.result_type(*[p.dtype for _, p in paths])
    first = plan.collections[0]
    meta = pd.DataFrame({c: np.empty(0, dtypes) for c in columns}, columns=columns,
                        index=compat.meta(first).index)
    return dd.map_partitions(predict_frame_part, shared.future, plan.x, batch_size, columns,
                             *plan.collections, meta=meta, align_dataframes=False,
                             enforce_metadata=False)


def frame_columns(paths: list[tuple[tuple[Any, ...], np.ndarray]]) -> list[str]:
    """A frame's column names: ``"0".."k-1"`` for one output, ``name`` /
    ``name_i`` for the outputs of a model with several (outputs of one unit keep
    their name). Strings, as Parquet and Arrow name columns: Dask's
    ``to_parquet`` refuses integer names (issue 36)."""
    if len(paths) == 1 and paths[0][0] == ():
        width = int(np.prod(paths[0][1].shape[1:]))
        return [str(i) for i in range(width)]
    columns: list[str] = []
    for path, probe in paths:
        name = "_".join(map(str, path))
        width = int(np.prod(probe.shape[1:]))
        columns += [name] if width == 1 else [f"{name}_{i}" for i in range(width)]
    return columns


def write_part(frame: Any, path: str) -> int:
    """Write one partition's predictions to ``path``; its row count."""
    frame.to_parquet(path, index=True)
    return len(frame)


def write_parquet(frame: Any, directory: str, client: Client) -> list[Future]:
    """One task per partition of ``frame`` writing ``directory/part.<i>.parquet``;
    the futures of their row counts, in partition order."""
    import dask

    os.makedirs(directory, exist_ok=True)
    width = len(str(max(frame.npartitions - 1, 0)))
    tasks = [dask.delayed(write_part, pure=True)(part, os.path.join(
        directory, f"part.{i:0{width}d}.parquet"))
        # As declared: an optimized read may fuse small files into fewer partitions.
        for i, part in enumerate(frame.to_delayed(optimize_graph=False))]
    return client.compute(tasks)  # type: ignore[no-any-return]
