"""Canaries for the private names dasktf.compat uses (issue 37): one test per name,
failing with the installed version when a release renames or drops it. Before
raising a bound in pyproject.toml, run this file on the new version (docs/compat.md).
No cluster: each test builds the smallest object that has the name."""

from __future__ import annotations

import asyncio
import socket
from importlib.metadata import version

import numpy as np
import pytest

from dasktf import compat


def gone(library: str, name: str) -> str:
    return (f"{library} {version(library)} has no {name}: dasktf.compat's fallback "
            "now runs (see its docstring); fix compat.py, or keep the bound in "
            "pyproject.toml below this version (docs/compat.md)")


@pytest.fixture(scope="module")
def keras():
    import keras

    return keras


@pytest.fixture
def nested(keras):
    inner = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, name="inner_dense")],
                             name="inner")
    inputs = keras.Input((3,))
    model = keras.Model(inputs, keras.layers.Dense(1, name="head")(inner(inputs)))
    return model


# -- TensorFlow -------------------------------------------------------------------
def test_concrete_function_call_flat():
    import tensorflow as tf

    f = tf.function(lambda x: x * 2.0, input_signature=[tf.TensorSpec((2,), tf.float32)])
    concrete = f.get_concrete_function()
    assert compat.can_call_flat(concrete), gone("tensorflow-cpu", "ConcreteFunction._call_flat")
    out = compat.call_flat(concrete, [tf.constant([1.0, 2.0])])
    assert np.allclose(np.asarray(out), [2.0, 4.0])


# -- Tornado ----------------------------------------------------------------------
def _tornado_leftover() -> tuple[object, bytes | None]:
    from tornado.iostream import IOStream

    async def read() -> tuple[object, bytes | None]:
        ours, theirs = socket.socketpair()
        stream = IOStream(ours)
        try:
            theirs.sendall(b"hello world")
            assert await stream.read_bytes(5) == b"hello"
            return stream, compat.unread_bytes(stream)
        finally:
            stream.close()
            theirs.close()

    return asyncio.run(read())


@pytest.mark.parametrize("name", ["_read_buffer", "_read_buffer_size"])
def test_iostream_read_buffer(name):
    """The p2p direct path keeps what Tornado read past a message; without these,
    every pair falls back to the event loop path."""
    stream, unread = _tornado_leftover()
    assert hasattr(stream, name), gone("tornado", f"IOStream.{name}")
    assert unread == b" world", gone("tornado", "the IOStream read buffer dasktf reads")


# -- distributed and dask ---------------------------------------------------------
def test_client_gather():
    from distributed import Client

    assert hasattr(Client, "_gather"), gone("distributed", "Client._gather")


def test_client_register_worker_plugin():
    import inspect

    from distributed import Client

    register = getattr(Client, "_register_worker_plugin", None)
    assert register is not None, gone("distributed", "Client._register_worker_plugin")
    params = list(inspect.signature(register).parameters)
    assert params == ["self", "plugin", "name", "idempotent"], gone(
        "distributed", f"Client._register_worker_plugin(plugin, name, idempotent): {params}")
    assert inspect.iscoroutinefunction(register)


def test_worker_cvar():
    """What :func:`dasktf.compat.run_in_worker_thread` sets for ``get_worker()``:
    distributed's ``_worker_cvar``, the context variable ``get_worker`` reads."""
    import contextvars
    import inspect

    from distributed import get_worker, worker

    cvar = getattr(worker, "_worker_cvar", None)
    assert isinstance(cvar, contextvars.ContextVar), gone("distributed", "worker._worker_cvar")
    assert "_worker_cvar.get()" in inspect.getsource(get_worker), gone(
        "distributed", "get_worker() reading _worker_cvar")


def test_client_scatter_names():
    """What :func:`dasktf.compat.scatter_each` does as ``Client._scatter`` does: the
    client's ``rpc`` pool and ``futures`` states, ``FutureState.finish(type=)``."""
    import inspect

    from distributed import Client
    from distributed.client import FutureState

    source = inspect.getsource(Client._scatter)
    for name in ("self.rpc", "self.futures[key].finish(type=typ)",
                 "self.scheduler.update_data("):
        assert name in source, gone("distributed", f"{name} in Client._scatter")
    assert "type" in inspect.signature(FutureState.finish).parameters, gone(
        "distributed", "FutureState.finish(type=)")


def test_worker_gather_handler():
    """What :func:`dasktf.compat.copy_on_worker` calls: the worker's ``gather``
    handler, as ``Scheduler.replicate`` calls it, telling the scheduler of the copy."""
    import inspect

    from distributed import Worker
    from distributed.scheduler import Scheduler

    assert "who_has" in inspect.signature(Worker.gather).parameters, gone(
        "distributed", "Worker.gather(who_has=)")
    assert '"gather": self.gather' in inspect.getsource(Worker.__init__), gone(
        "distributed", "the worker's gather handler")
    assert "self.update_data(data" in inspect.getsource(Worker.gather), gone(
        "distributed", "Worker.gather reporting its copies")
    assert "gather_on_worker" in inspect.getsource(Scheduler.replicate), gone(
        "distributed", "Scheduler.replicate copying through the workers' gather")


def test_spec_cluster_correct_state():
    from distributed import SpecCluster

    assert hasattr(SpecCluster, "_correct_state"), gone("distributed",
                                                        "SpecCluster._correct_state")


def test_dask_collection_meta():
    import dask.array as da
    import dask.dataframe as dd
    import pandas as pd

    frame = dd.from_pandas(pd.DataFrame({"a": [1.0, 2.0], "b": ["x", "y"]}), npartitions=1)
    assert hasattr(frame, "_meta"), gone("dask", "DataFrame._meta")
    assert len(compat.meta(frame)) == 0 and list(compat.meta(frame).columns) == ["a", "b"]
    array = da.ones((4, 3), dtype="float32", chunks=2)
    assert hasattr(array, "_meta"), gone("dask", "Array._meta")
    assert compat.meta(array).dtype == np.float32 and compat.meta(array).size == 0


def _echo(*args, **kwargs):
    return args, kwargs


def test_dask_task_spec():
    """A batch's task is the one submit builds: references (in lists too) are
    dependencies; tuples, and strings equal to a key, stay values."""
    ref = compat.task_ref("a-1")
    task = compat.graph_task("b-1", _echo, (ref, [ref, 1], ("a-1", 2), "a-1"), {"k": ref})
    assert task.key == "b-1" and set(task.dependencies) == {"a-1"}, gone(
        "dask", "dask._task_spec.Task, TaskRef and parse_input")
    assert task({"a-1": 3}) == ((3, [3, 1], ("a-1", 2), "a-1"), {"k": 3})


# -- Keras --------------------------------------------------------------------------
def test_layer_flatten_layers(keras, nested):
    model = nested
    assert hasattr(model, "_flatten_layers"), gone("keras", "Layer._flatten_layers")
    names = [layer.name for layer in compat.flatten_layers(model)]
    assert names[0] == model.name and {"inner", "inner_dense", "head"} <= set(names)


def test_layer_auto_config(keras):
    class Wide(keras.layers.Layer):
        def __init__(self, units=2, **kwargs):
            super().__init__(**kwargs)
            self.units = units

    layer = Wide(units=5)
    assert hasattr(layer, "_auto_config"), gone("keras", "Layer._auto_config")
    assert compat.constructor_arguments(layer)["units"] == 5


def test_saving_lib_save_model_to_fileobj(keras, nested):
    lib = compat.keras_saving_lib()
    assert lib is not None, gone("keras", "keras.src.saving.saving_lib._save_model_to_fileobj")
    from dasktf.transport import keras_archive

    assert keras_archive(nested)[:2] == b"PK"  # a .keras file: a zip


def test_model_compile_loss(keras):
    inputs = keras.Input((3,))
    model = keras.Model(inputs, [keras.layers.Dense(1, name="a")(inputs),
                                 keras.layers.Dense(1, name="b")(inputs)])
    model.compile(optimizer="sgd", loss=["mse", "mae"])
    model.evaluate(np.zeros((2, 3)), [np.zeros((2, 1)), np.zeros((2, 1))], verbose=0)
    assert hasattr(model, "_compile_loss"), gone("keras", "Trainer._compile_loss")
    assert len(compat.output_loss_metrics(model)) == 2, gone(
        "keras", "Trainer._compile_loss.metrics (one per output)")


def test_models_functional(keras):
    try:
        from keras.src.models.functional import Functional
    except ImportError:
        pytest.fail(gone("keras", "keras.src.models.functional.Functional"))
    inputs = keras.Input((3,))
    model = keras.Model(inputs, keras.layers.Dense(1)(inputs))
    assert compat.functional_class() is Functional and type(model) is Functional


def test_functional_calls(keras, nested):
    calls = compat.functional_calls(nested)
    assert calls is not None, gone(
        "keras", "Functional._operations, Operation._inbound_nodes or Node.arguments")
    (_, none, _, (tensor,)), inner, head = calls
    assert [c[0].name for c in calls[1:]] == ["inner", "head"] and none == ()
    assert inner[1] == (tensor,) and head[1] == tuple(inner[3]) and head[3] == nested.outputs
    assert compat.functional_calls(nested.layers[1]) is None  # a Sequential


def test_model_compile_config(keras):
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])

    def loss(y, p):
        return keras.ops.mean(keras.ops.abs(y - p))

    model.compile(optimizer="sgd", loss=loss, metrics=["mae"])
    assert hasattr(model, "_compile_config"), gone("keras", "Trainer._compile_config")
    given = compat.compile_arguments(model)
    assert given["loss"] is loss and given["metrics"] == ["mae"]


def test_optimizer_learning_rate(keras):
    optimizer = keras.optimizers.SGD(0.1)
    assert hasattr(optimizer, "_learning_rate"), gone("keras", "Optimizer._learning_rate")
    assert compat.holds_learning_rate(optimizer)
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.9)
    assert not compat.holds_learning_rate(keras.optimizers.SGD(schedule))


def test_model_checkpoint_is_improvement(keras, nested, tmp_path):
    checkpoint = keras.callbacks.ModelCheckpoint(str(tmp_path / "m.keras"), monitor="loss",
                                                 save_best_only=True, mode="min")
    checkpoint.set_model(nested)
    checkpoint.on_epoch_end(0, {"loss": 2.0})  # Keras sets its comparison here
    improvement = compat.improvement_check(checkpoint)
    assert improvement is not None, gone("keras", "ModelCheckpoint._is_improvement")
    assert improvement(1.0, 2.0) and not improvement(3.0, 2.0)


def test_the_fallbacks_where_a_name_is_gone():
    """What dasktf does where a release dropped a name (an object without any)."""
    bare = object()
    assert not compat.can_call_flat(bare)
    assert compat.unread_bytes(bare) is None  # the p2p pair takes the event loop path
    assert compat.improvement_check(bare) is None
    assert compat.constructor_arguments(bare) == {}
    assert compat.compile_arguments(bare) == {}
    assert compat.output_loss_metrics(bare) == []
    assert compat.functional_calls(bare) is None  # only a Sequential is staged
    assert not compat.holds_learning_rate(bare)
    assert compat.weight_decay_excluded(bare, [1, 2]) == ()
    with pytest.raises(RuntimeError, match=rf"distributed {version('distributed')}"):
        compat.register_worker_plugin(bare, None, "p", True)
    with pytest.raises(RuntimeError, match=rf"dask {version('dask')}"):
        compat.meta(bare)

    class Layer:
        def __init__(self, *layers):
            self.layers = list(layers)

    leaf = Layer()
    top = Layer(Layer(leaf), leaf)
    assert [id(x) for x in compat.flatten_layers(top)] == [
        id(top), id(top.layers[0]), id(leaf)]


def test_exclusions_from_weight_decay_are_read_and_given_to_a_fresh_optimizer():
    """Keras' ``Optimizer._use_weight_decay``: the variables an optimizer leaves out
    of its weight decay, by variable and by name; a compile recipe gives them to
    the fresh optimizer every replica compiles (the config does not carry them)."""
    import keras

    from dasktf.models import CompileRecipe

    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, name="a"),
                              keras.layers.Dense(2, name="b")])
    adamw = keras.optimizers.AdamW(0.01, weight_decay=0.1)
    adamw.exclude_from_weight_decay(var_list=[model.layers[0].kernel], var_names=["bias"])
    excluded = compat.weight_decay_excluded(adamw, model.trainable_variables)
    assert excluded == (0, 1, 3), gone("keras", "Optimizer._use_weight_decay")
    assert compat.weight_decay_excluded(keras.optimizers.AdamW(0.01, weight_decay=0.1),
                                        model.trainable_variables) == ()
    assert compat.weight_decay_excluded(keras.optimizers.Adam(0.01),
                                        model.trainable_variables) == ()
    replica = keras.models.clone_model(model)
    CompileRecipe(keras.optimizers.serialize(adamw), "mse",
                  decay_excluded=excluded).compile(replica)
    assert compat.weight_decay_excluded(replica.optimizer,
                                        replica.trainable_variables) == excluded


@pytest.mark.keras_global_seeds
def test_seed_generator_python_random(keras):
    """Keras' ``seed_generator.python_random``: a seeded build takes its default
    seeds from a private generator, so another thread's draws from Python's global
    ``random`` between the seeding and the build (the client's event loop does:
    ``dask.sizeof`` samples the messages it writes) change no weight."""
    import random

    from keras.src.random import seed_generator

    assert seed_generator.python_random is random, gone(
        "keras", "keras.src.random.seed_generator.python_random")

    def build():
        return keras.Sequential([keras.Input((4,)), keras.layers.Dense(3),
                                 keras.layers.Dropout(0.5), keras.layers.Dense(2)])

    keras.utils.set_random_seed(3)
    quiet = build().get_weights()
    with compat.keras_seeded(3):
        random.random()  # what the event loop may draw meanwhile
        seeded = build().get_weights()
    assert seed_generator.python_random is random  # given back
    for a, b in zip(quiet, seeded, strict=True):
        np.testing.assert_array_equal(a, b)
    keras.utils.set_random_seed(3)
    random.random()
    disturbed = build().get_weights()  # the bare seeding is not immune: the test can fail
    assert any(not np.array_equal(a, b) for a, b in zip(quiet, disturbed, strict=True))


def test_optimizer_exclude_from_weight_decay_copied(keras):
    """Keras' ``_exclude_from_weight_decay`` and ``_exclude_from_weight_decay_pattern``:
    an estimator's ``optimizer__`` parameters make a fresh optimizer from the given
    one's config, which leaves its exclusions out; they are copied over (they were
    dropped: every variable decayed)."""
    from dasktf.estimators.routing import build_optimizer

    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, name="a"),
                              keras.layers.Dense(2, name="b")])
    adamw = keras.optimizers.AdamW(0.01, weight_decay=0.1)
    adamw.exclude_from_weight_decay(var_list=[model.layers[0].kernel], var_names=["bias"])
    for name in ("_exclude_from_weight_decay", "_exclude_from_weight_decay_pattern"):
        assert hasattr(adamw, name), gone("keras", f"Optimizer.{name}")
    built = build_optimizer(adamw, {"learning_rate": 0.5})
    assert built is not adamw and float(built.learning_rate) == 0.5
    assert compat.weight_decay_excluded(built, model.trainable_variables) == (0, 1, 3)
    by_class = build_optimizer(keras.optimizers.AdamW, {"weight_decay": 0.1})
    assert compat.weight_decay_excluded(by_class, model.trainable_variables) == ()


@pytest.mark.keras_global_seeds
def test_keras_seeds_apart_for_a_block(keras):
    """Under ``keras_seeds_apart`` (every other test's, tests/conftest.py) a draw
    from Python's ``random`` between ``set_random_seed`` and a build changes no
    weight, and one seed gives the weights it gives outside; after it, Keras draws
    from Python's ``random`` again."""
    import random

    from keras.src.random import seed_generator

    def build():
        return keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)]).get_weights()

    keras.utils.set_random_seed(4)
    quiet = build()
    with compat.keras_seeds_apart():
        keras.utils.set_random_seed(4)
        random.random()
        apart = build()
        with compat.keras_seeded(4):  # dasktf's own builds inside it
            seeded = build()
    for a, b, c in zip(quiet, apart, seeded, strict=True):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, c)
    assert seed_generator.python_random is random
