"""The one module that touches other libraries' private names (issue 37).

TensorFlow, Keras, Tornado, distributed and dask may rename any of these in a
release. Each is used here only, behind a function whose docstring says which name,
why dasktf needs it, and what happens without it: a fallback that keeps dasktf
working (slower, or with a smaller feature), or an error naming the installed
version and the fix. ``tests/test_compat.py`` has one canary per name, and
``tests/test_layout.py`` refuses these names (and ``keras.src``) anywhere else.
``pyproject.toml`` bounds the libraries at the newest versions the suite passed
on; docs/compat.md says how to raise a bound. As ``distributed/compatibility.py``.

A leaf: it imports no dasktf module, and TensorFlow or Keras only inside the
functions that need them (the scheduler imports dasktf without TensorFlow).
"""

from __future__ import annotations

import contextlib
import random
import threading
from collections.abc import Awaitable, Iterator
from importlib.metadata import version
from typing import Any


def _missing(library: str, name: str, needed_for: str) -> RuntimeError:
    return RuntimeError(
        f"dasktf needs {name} ({needed_for}), which {library} {version(library)} does "
        f"not have. Install the {library} version pyproject.toml allows "
        f"(pip install -e .), or see docs/compat.md to support this one."
    )


# -- TensorFlow -------------------------------------------------------------------
def can_call_flat(concrete: Any) -> bool:
    """Whether ``concrete`` (a ``ConcreteFunction``) has TensorFlow's private
    ``_call_flat``: the call :class:`~dasktf.runtime.keras_step.SignatureFunction`
    makes to skip the argument binding of every call (a small model's step is
    dominated by it). Without it the ordinary ``tf.function`` call runs."""
    return callable(getattr(concrete, "_call_flat", None))


def call_flat(concrete: Any, tensors: list[Any]) -> Any:
    """``concrete`` called with ``tensors`` already flat and converted: TensorFlow's
    ``ConcreteFunction._call_flat`` (only where :func:`can_call_flat`)."""
    return concrete._call_flat(tensors, concrete.captured_inputs)


# -- Tornado ----------------------------------------------------------------------
def unread_bytes(stream: Any) -> bytes | None:
    """What Tornado read from ``stream``'s socket and nobody consumed (an idle
    Tornado stream reads what arrives, to notice a close; under TLS: decrypted):
    ``IOStream._read_buffer`` and ``_read_buffer_size`` (Tornado 6). The p2p
    direct path takes the socket from Tornado and must keep these bytes (the
    peer's handshake may be among them). ``None`` where this Tornado keeps them
    otherwise: the pair then uses the event loop path, and says so."""
    try:
        buf, size = stream._read_buffer, stream._read_buffer_size
        if not isinstance(buf, bytearray | memoryview) or not isinstance(size, int):
            return None
        return bytes(buf[:size])
    except AttributeError:
        return None


# -- distributed and dask ---------------------------------------------------------
def gather(client: Any, futures: list[Any]) -> Awaitable[Any]:
    """A coroutine gathering ``futures``, to run on ``client``'s loop from another
    thread (the holder engine awaits it a poll at a time): ``Client._gather``.
    Without it: ``client.gather(futures, asynchronous=True)``, which returns the
    same coroutine in the distributed releases that have ``_gather``."""
    if hasattr(client, "_gather"):
        return client._gather(futures)
    return client.gather(futures, asynchronous=True)


async def copy_on_worker(client: Any, worker: str, who_has: dict[str, list[str]]
                         ) -> dict[str, Any]:
    """Have ``worker`` copy each key of ``who_has`` from one of the workers listed
    for it: the worker's ``gather`` handler, called over the client's ``rpc`` pool,
    as ``Scheduler.replicate`` calls it for each copy (distributed; the worker does
    not tell the scheduler of the copy: :func:`tell_scheduler_held`). Its answer:
    ``{"status": "OK"}``, or
    ``"partial-fail"`` with the keys it found nowhere. dasktf calls it instead of
    ``replicate`` (``client.scatter(broadcast=True)``) because that holds one lock
    of the scheduler's, for every replicate, while it waits on a lost worker for
    distributed's connect timeout (:mod:`dasktf.cluster.broadcast`). Without it:
    ``replicate`` (a lost worker may then hold the next copy for 30 s)."""
    if not hasattr(client, "rpc"):
        await client.replicate(list(who_has), workers=[worker], asynchronous=True)
        return {"status": "OK"}
    return await client.rpc(worker).gather(who_has=who_has)  # type: ignore[no-any-return]


async def tell_scheduler_held(client: Any, key: str, workers: list[str], nbytes: int
                              ) -> None:
    """Tell the scheduler that ``workers`` hold ``key`` (``nbytes``), as
    ``Client._scatter`` tells it of what it placed (``Scheduler.update_data``): a
    worker's ``gather`` (:func:`copy_on_worker`) does not, and a copy the
    scheduler does not know of is never freed."""
    if workers:
        await client.scheduler.update_data(who_has={key: workers}, nbytes={key: nbytes},
                                           client=client.id)


async def scatter_each(client: Any, values: list[Any], workers: list[str]) -> list[Any]:
    """Futures of ``values[i]`` placed on ``workers[i]`` (each under a fresh key),
    with one message to the scheduler for all of them.

    ``client.scatter(value, workers=[w], direct=True)`` once per worker costs the
    scheduler two messages each (``ncores_running``, ``update_data``): 2N of a
    short fit's. Here each worker gets its values straight from the client (its
    ``update_data``, concurrently) and the scheduler hears of all of them in one
    ``update_data``, as ``Client._scatter`` tells it of its own; the futures are
    made as it makes them: ``Client.rpc``, ``Client.futures`` and
    ``FutureState.finish`` (distributed). Without them: one ``client.scatter`` per
    value, as before."""
    import asyncio
    import uuid

    from distributed import Future
    from distributed.protocol import to_serialize

    if not (hasattr(client, "rpc") and hasattr(client, "futures")
            and hasattr(getattr(client, "scheduler", None), "update_data")):
        return [await client.scatter(v, workers=[w], direct=True, hash=False,
                                     asynchronous=True)
                for v, w in zip(values, workers, strict=True)]
    keys = [f"{type(v).__name__}-{uuid.uuid4().hex}" for v in values]
    by_worker: dict[str, dict[str, Any]] = {}
    for key, value, worker in zip(keys, values, workers, strict=True):
        by_worker.setdefault(worker, {})[key] = to_serialize(value)
    answers = await asyncio.gather(*[client.rpc(w).update_data(data=data)
                                     for w, data in by_worker.items()])
    nbytes = {k: n for answer in answers for k, n in answer["nbytes"].items()}
    await client.scheduler.update_data(
        who_has={k: [w] for k, w in zip(keys, workers, strict=True)}, nbytes=nbytes,
        client=client.id)
    futures = [Future(k, client) for k in keys]
    for key, value in zip(keys, values, strict=True):
        client.futures[key].finish(type=type(value))
    return futures


def register_worker_plugin(client: Any, plugin: Any, name: str,
                           idempotent: bool) -> Awaitable[Any]:
    """A coroutine registering ``plugin`` on every worker: distributed's
    ``Client._register_worker_plugin``. The public ``register_plugin`` blocks the
    calling thread; dasktf awaits this one a poll at a time on the client's loop
    (``call_watched``), so that a worker lost meanwhile ends the wait. Without it:
    a ``RuntimeError`` naming the installed distributed."""
    register = getattr(client, "_register_worker_plugin", None)
    if register is None:
        raise _missing("distributed", "Client._register_worker_plugin",
                       "registering a worker plugin while watching the workers")
    return register(plugin, name, idempotent)


async def run_in_worker_thread(worker: Any, func: Any, *args: Any) -> Any:
    """``func(*args)`` in ``worker``'s thread pool (its ``"default"`` executor, where
    its tasks run), with ``get_worker()`` answering ``worker`` there as in a task:
    distributed's ``_worker_cvar`` set for the call, as ``Worker.execute`` sets it
    (:mod:`dasktf.cluster.calls`: a call made over the client's connection to the
    worker, which costs the scheduler nothing where a task costs it about 1 ms).
    Without it: the call runs in the pool, and code of it that asks
    ``get_worker()`` fails with distributed's "No worker found"."""
    from distributed.utils import run_in_executor_with_context

    try:
        from distributed.worker import _worker_cvar
    except ImportError:
        _worker_cvar = None
    token = None if _worker_cvar is None else _worker_cvar.set(worker)
    try:
        return await run_in_executor_with_context(worker.executors["default"], func,
                                                  *args)
    finally:
        if token is not None:
            _worker_cvar.reset(token)


def start_workers(cluster: Any) -> None:
    """Wait until ``cluster`` (a ``SpecCluster``) started the workers its spec
    names: distributed's ``SpecCluster._correct_state``, as ``LocalCluster`` does
    on creation (``GPUCluster`` scales after it). Without it: the public
    ``wait_for_workers``, for as many workers as the spec names."""
    if hasattr(cluster, "_correct_state"):
        cluster.sync(cluster._correct_state)
    else:
        cluster.wait_for_workers(len(cluster.worker_spec))


def meta(collection: Any) -> Any:
    """The empty pandas or NumPy object that stands for a dask collection's
    partitions (its columns, dtypes, index): dask's ``_meta``, read to match a
    collection to a model's inputs without computing anything. Without it: a
    ``RuntimeError`` naming the installed dask."""
    try:
        return collection._meta
    except AttributeError:
        raise _missing("dask", "a collection's _meta", "its dtypes without computing "
                       "it") from None


def graph_task(key: str, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The task ``func(*args, **kwargs)`` of key ``key`` exactly as
    ``Client.submit`` builds it: dask's ``Task`` with every argument through
    ``parse_input`` (``dask._task_spec``), where futures and :func:`task_ref`
    references, in lists and dicts too, are dependencies, and tuples and strings
    stay values (a legacy tuple task would run a tuple that starts with a callable,
    and read a string equal to a key as that task). :class:`dasktf.cluster.batch.
    TaskBatch` sends many in one graph. Without it: a ``RuntimeError`` naming the
    installed dask."""
    try:
        from dask._task_spec import Task, parse_input
    except ImportError:
        raise _missing("dask", "dask._task_spec.Task and parse_input",
                       "sending many tasks as one graph") from None
    return Task(key, func, *(parse_input(a) for a in args),
                **{k: parse_input(v) for k, v in kwargs.items()})


def task_ref(key: str) -> Any:
    """A reference to task ``key`` (of the same graph or one sent before) as an
    argument of a :func:`graph_task`: dask's ``TaskRef``, as a future is. Without
    it: a ``RuntimeError`` naming the installed dask."""
    try:
        from dask._task_spec import TaskRef
    except ImportError:
        raise _missing("dask", "dask._task_spec.TaskRef",
                       "sending many tasks as one graph") from None
    return TaskRef(key)


# -- Keras --------------------------------------------------------------------------
def flatten_layers(model: Any) -> list[Any]:
    """``model`` and all its layers, nested ones included: Keras'
    ``Layer._flatten_layers(include_self=True, recursive=True)`` (custom objects,
    the dtype policy of every layer). Without it: ``model`` and its ``layers``,
    walked down (the layers Keras lists publicly; a layer held otherwise is missed)."""
    if hasattr(model, "_flatten_layers"):
        return list(model._flatten_layers(include_self=True, recursive=True))
    found: dict[int, Any] = {}

    def walk(layer: Any) -> None:
        if id(layer) not in found:
            found[id(layer)] = layer
            for inner in getattr(layer, "layers", None) or []:
                walk(inner)

    walk(model)
    return list(found.values())


def constructor_arguments(model: Any) -> dict[str, Any]:
    """The constructor arguments Keras recorded for ``model``: ``_auto_config``
    (dasktf rebuilds a subclassed model from its class). Without it: none (the
    class's defaults; ``_rebuilds`` in transport.py checks the rebuilt model)."""
    auto = getattr(model, "_auto_config", None)
    return dict(auto.config) if auto else {}


def compile_arguments(model: Any) -> dict[str, Any]:
    """The arguments ``model`` was compiled with, as given: Keras'
    ``_compile_config.config`` (``get_compile_config()`` serializes them, losing
    the script's functions). Without it: none (the caller takes the optimizer and
    the loss from the model)."""
    return dict(getattr(getattr(model, "_compile_config", None), "config", None) or {})


def replace_optimizer(model: Any, optimizer: Any) -> None:
    """Make ``optimizer`` the compiled ``model``'s optimizer. Keras' ``compile``
    keeps the instance it was given in ``_compile_config`` as well (for
    ``get_compile_config()``): left there, a replaced optimizer, all its slots
    included, lives as long as the model. Without it: the attribute only."""
    model.optimizer = optimizer
    config = getattr(getattr(model, "_compile_config", None), "config", None)
    if isinstance(config, dict) and "optimizer" in config:
        config["optimizer"] = optimizer


def weight_decay_excluded(optimizer: Any, variables: list[Any]) -> tuple[int, ...]:
    """The positions in ``variables`` of those ``optimizer`` leaves out of its
    weight decay (``exclude_from_weight_decay``: by variable or by name). Keras
    keeps that choice out of ``get_config()``, so every optimizer dasktf makes
    from a config must be told again (:func:`exclude_from_weight_decay`). Uses
    Keras' ``Optimizer._use_weight_decay``; without it: none."""
    inner = getattr(optimizer, "inner_optimizer", optimizer)  # a LossScaleOptimizer's
    use = getattr(inner, "_use_weight_decay", None)
    if not getattr(inner, "weight_decay", None) or use is None:
        return ()
    return tuple(i for i, v in enumerate(variables) if not use(v))


def exclude_from_weight_decay(optimizer: Any, variables: list[Any],
                              excluded: tuple[int, ...]) -> None:
    """Leave ``variables[i]`` for each ``i`` of ``excluded`` out of ``optimizer``'s
    weight decay (before it is built), as :func:`weight_decay_excluded` read them."""
    if excluded:
        inner = getattr(optimizer, "inner_optimizer", optimizer)
        inner.exclude_from_weight_decay(var_list=[variables[i] for i in excluded])


def copy_weight_decay_exclusions(source: Any, target: Any) -> None:
    """Give ``target``, a fresh optimizer made from ``source``'s config (before it
    is built), ``source``'s exclusions from weight decay, which the config leaves
    out: Keras' ``Optimizer._exclude_from_weight_decay`` (by variable) and
    ``_exclude_from_weight_decay_pattern`` (by name). Without them: none."""
    copied = False
    for name in ("_exclude_from_weight_decay", "_exclude_from_weight_decay_pattern"):
        if getattr(source, name, None):
            setattr(target, name, getattr(source, name))
            copied = True
    if copied:
        target._exclude_from_weight_decay_cache = {}


#: held while a thread seeds Keras and builds from the seed (:func:`keras_seeded`)
_SEEDING = threading.RLock()


@contextlib.contextmanager
def keras_seeded(seed: int) -> Iterator[None]:
    """``keras.utils.set_random_seed(seed)`` for the block, with Keras' own draws
    of Python seeds (an initializer's or a dropout layer's default seed) taken
    from a private ``random.Random(seed)``: the weights a quiet process's
    ``set_random_seed(seed)`` then build gives, whatever other threads draw from
    Python's global ``random`` meanwhile. distributed's event loop does draw
    from it (``dask.sizeof`` samples the messages it writes, the scheduler's
    ``gather`` picks workers), so without this two runs of one seed could start
    from different weights. One block at a time per process. Uses Keras'
    ``keras.src.random.seed_generator.python_random``; without it: the global
    seeding alone."""
    import keras

    with _SEEDING:
        keras.utils.set_random_seed(seed)
        source = _keras_seed_source()
        if source is None:
            yield
            return
        shared, source.python_random = source.python_random, random.Random(seed)
        try:
            yield
        finally:
            source.python_random = shared


@contextlib.contextmanager
def keras_seeds_apart() -> Iterator[None]:
    """For the block, Keras' default seeds come from a generator of their own,
    seeded whenever ``keras.utils.set_random_seed`` seeds Python's: what
    :func:`keras_seeded` does for one build, for code that seeds Keras and builds
    models itself (a test's reference models, built while its cluster's event
    loop, in the same process, draws from Python's ``random``). The same seed
    gives the same weights as without it. Uses Keras'
    ``seed_generator.python_random``; without it: nothing changes."""
    import keras

    source = _keras_seed_source()
    if source is None:
        yield
        return
    shared, own, seed_everything = source.python_random, random.Random(), keras.utils.set_random_seed

    def set_random_seed(seed: int) -> None:
        seed_everything(seed)
        own.seed(seed)

    source.python_random, keras.utils.set_random_seed = own, set_random_seed
    try:
        yield
    finally:
        source.python_random, keras.utils.set_random_seed = shared, seed_everything


def _keras_seed_source() -> Any:
    """Keras' ``keras.src.random.seed_generator``, whose ``python_random`` gives
    the default seeds (``None``: not in this Keras)."""
    try:
        from keras.src.random import seed_generator
    except ImportError:
        return None
    return seed_generator if hasattr(seed_generator, "python_random") else None


def output_loss_metrics(model: Any) -> list[Any]:
    """The per-output loss trackers of a compiled model: Keras'
    ``_compile_loss.metrics`` (each output's loss in the logs, as ``fit`` gives
    them). Without it: none (only the total ``loss``)."""
    return list(getattr(getattr(model, "_compile_loss", None), "metrics", None) or [])


def holds_learning_rate(optimizer: Any) -> bool:
    """Whether ``optimizer``'s learning rate is a variable (not a schedule or a
    callable): Keras' ``Optimizer._learning_rate``. Without it: whether the public
    ``learning_rate`` is a variable (Keras 3 gives a schedule's value as a tensor)."""
    import keras

    if hasattr(optimizer, "_learning_rate"):
        return isinstance(optimizer._learning_rate, keras.Variable)
    return isinstance(getattr(optimizer, "learning_rate", None), keras.Variable)


def improvement_check(checkpoint: Any) -> Any:
    """``ModelCheckpoint``'s ``_is_improvement(current, best)`` (it changes
    nothing): whether a ``save_best_only`` checkpoint will save this epoch, so the
    run fetches the optimizer's state only then. Without it: ``None``, and the run
    fetches it at every epoch end (the checkpoint is always right)."""
    return getattr(checkpoint, "_is_improvement", None)


def functional_class() -> type:
    """Keras' class of ``keras.Model(inputs, outputs)`` models:
    ``keras.src.models.functional.Functional`` (their config alone rebuilds them;
    their inputs are known). Without it: the ``keras.Model`` subclass named
    ``Functional`` that Keras defines."""
    try:
        from keras.src.models.functional import Functional
    except ImportError:
        import keras

        stack, seen = [keras.Model], set()
        while stack:
            cls = stack.pop()
            if cls.__name__ == "Functional" and cls.__module__.startswith("keras"):
                return cls
            seen.add(cls)
            stack += [c for c in cls.__subclasses__() if c not in seen]
        raise _missing("keras", "keras.src.models.functional.Functional",
                       "telling a functional model from a subclassed one") from None
    return Functional


def functional_calls(model: Any) -> list[tuple[Any, tuple[Any, ...], dict[str, Any],
                                              list[Any]]] | None:
    """A functional model's operations in the order it runs them, each with the
    arguments of its call in the model's graph and its outputs (Keras'
    ``Functional._operations``, ``Operation._inbound_nodes`` and ``Node.arguments``):
    how the staged backward pass finds where a functional model can be cut
    (:func:`dasktf.runtime.staged.model_blocks`). ``None`` for any other model, an
    operation called more than once (its calls are not told apart here), or where
    the names are gone: then only a ``keras.Sequential`` is staged."""
    try:
        functional = functional_class()
    except RuntimeError:
        return None
    operations = getattr(model, "_operations", None)
    if not isinstance(model, functional) or operations is None:
        return None
    calls = []
    for operation in operations:
        nodes = getattr(operation, "_inbound_nodes", None)
        if not nodes or len(nodes) != 1 or not hasattr(nodes[0], "arguments"):
            return None
        arguments = nodes[0].arguments
        calls.append((operation, tuple(arguments.args), dict(arguments.kwargs),
                      list(nodes[0].output_tensors)))
    return calls


def keras_saving_lib() -> Any:
    """Keras' saving library where it writes and reads file objects
    (``keras.src.saving.saving_lib`` with ``_save_model_to_fileobj``): a model's
    ``.keras`` archive in memory. Without it: ``None``, and transport.py goes
    through a temporary file."""
    try:
        from keras.src.saving import saving_lib
    except ImportError:
        return None
    return saving_lib if hasattr(saving_lib, "_save_model_to_fileobj") else None
