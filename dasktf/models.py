"""Model recipes: how every worker builds (and compiles) the same Keras model.

What the user passes as ``model`` becomes one Keras model on the client: an
instance as it is, or the model a :class:`ModelSpec` builds (a built-in name
``mnist-mlp``, ``cnn``, ``exp-mlp``, a factory or ``keras.Model`` subclass, an
importable ``"module:function"``). That model reaches the workers whole, as Keras
saves it (:mod:`dasktf.transport`), with the classes and functions only the user's
script defines (:func:`custom_objects`) shipped by value.

:class:`CompileRecipe` is the other half: the optimizer, loss, loss weights and
metrics every replica compiles with, taken from the call or from the model's own
``compile`` (:func:`compiled_args`).
"""

from __future__ import annotations

import copy
import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dasktf import compat
from dasktf.data.structure import map_nest

ModelLike = Any  # keras.Model | Callable[..., keras.Model] | str


def mnist_mlp(input_shape: tuple[int, ...], num_outputs: int = 10) -> Any:
    """Seed 001's MLP: flattened input, 100 sigmoid units, a softmax over the classes."""
    import keras

    return keras.Sequential(
        [
            keras.Input(input_shape),
            keras.layers.Flatten(),
            keras.layers.Dense(100, activation="sigmoid"),
            keras.layers.Dense(num_outputs, activation="softmax"),
        ],
        name="mnist_mlp",
    )


def cnn(input_shape: tuple[int, ...], num_outputs: int = 10) -> Any:
    """conv32-conv64-maxpool-dense128 (1,199,882 parameters on 28x28 inputs)."""
    import keras

    layers: list[Any] = [keras.Input(input_shape)]
    if len(input_shape) == 2:  # grey images without a channel axis
        layers.append(keras.layers.Reshape((*input_shape, 1)))
    layers += [
        keras.layers.Conv2D(32, 3, activation="relu"),
        keras.layers.Conv2D(64, 3, activation="relu"),
        keras.layers.MaxPooling2D(2),
        keras.layers.Flatten(),
        keras.layers.Dense(128, activation="relu"),
        keras.layers.Dense(num_outputs, activation="softmax"),
    ]
    return keras.Sequential(layers, name="cnn")


def exp_mlp(input_shape: tuple[int, ...] = (1,), num_outputs: int = 1) -> Any:
    """Seed 000's regressor for ``y = e^x``: one hidden layer of 16 sigmoid units."""
    import keras

    return keras.Sequential(
        [
            keras.Input(input_shape),
            keras.layers.Dense(16, activation="sigmoid"),
            keras.layers.Dense(num_outputs),
        ],
        name="exp_mlp",
    )


BUILTIN_MODELS: dict[str, Callable[..., Any]] = {
    "mnist-mlp": mnist_mlp,
    "cnn": cnn,
    "exp-mlp": exp_mlp,
}


@dataclass(frozen=True)
class ModelSpec:
    """A recipe for a Keras model from a name or a factory; :meth:`build` runs on
    the client, and the model it builds is what the workers receive."""

    factory: Callable[..., Any] | None = None
    import_path: str | None = None
    input_shape: tuple[int, ...] | None = None
    num_outputs: int | None = None
    description: str = ""

    def build(self) -> Any:
        """Build a fresh model (weights are whatever its initializers give; a
        subclassed model has none until it is first called)."""
        factory = self.factory or _import_factory(self.import_path or "")
        return _call_factory(factory, self.input_shape, self.num_outputs)


def is_plain_graph(model: Any) -> bool:
    """A ``keras.Sequential`` or ``keras.Model(inputs, outputs)``, not a subclass:
    its config alone rebuilds it (a subclass may build itself in ``__init__``)."""
    import keras

    return type(model) in (keras.Sequential, compat.functional_class())


def custom_objects(model: Any) -> dict[str, Any]:
    """Classes and functions of ``model`` that Keras does not define (custom layers,
    activations, initializers, the model class), by the name Keras' serializer
    records for them."""
    import keras

    found: dict[str, Any] = {}

    def add(obj: Any) -> None:
        target = obj if inspect.isfunction(obj) or inspect.isclass(obj) else type(obj)
        module = getattr(target, "__module__", "") or ""
        if module.split(".")[0] in ("keras", "builtins", "tensorflow", "numpy"):
            return
        found[keras.saving.get_registered_name(target)] = target

    for layer in compat.flatten_layers(model):
        add(layer)
        for value in vars(layer).values():
            if inspect.isfunction(value) or isinstance(
                value, (keras.initializers.Initializer, keras.regularizers.Regularizer,
                        keras.constraints.Constraint)):
                add(value)
    return found


def check_trainable_by_dasktf(model: Any) -> None:
    """Refuse a model whose class overrides ``train_step``: dasktf computes every
    gradient itself (it honours an overridden ``compute_loss``)."""
    import keras

    own = type(model).train_step
    if own is not keras.Model.train_step:
        raise ValueError(
            f"{type(model).__name__} overrides train_step, which dasktf cannot run: "
            "each worker computes the gradient of its batch itself and the step graph "
            "averages them, so a custom train_step would be skipped. Move the loss into "
            "compute_loss (dasktf calls it) or into the model's call via add_loss()."
        )


def overrides_compute_loss(model: Any) -> bool:
    """Whether ``model``'s class makes its own loss (``compute_loss`` overridden):
    Keras' ``fit`` then needs no compiled loss, and neither does dasktf."""
    import keras

    return type(model).compute_loss is not keras.Model.compute_loss


@dataclass(frozen=True)
class MetricRecipe:
    """A metric instance as its class and config: the instance holds variables,
    and a class from the user's script is unknown to the workers' Keras registry."""

    cls: type
    config: dict[str, Any]

    def build(self) -> Any:
        return self.cls.from_config(self.config)


def portable_metrics(metrics: Any) -> Any:
    """``metrics`` as ``compile`` takes them (names, functions, instances; in lists
    or per-output dicts) with every instance turned into a :class:`MetricRecipe`."""
    import keras

    return map_nest(lambda m: MetricRecipe(type(m), m.get_config())
                    if isinstance(m, keras.metrics.Metric) else m, metrics)


def live_metrics(metrics: Any) -> Any:
    """The inverse of :func:`portable_metrics`: fresh instances."""
    return map_nest(lambda m: m.build() if isinstance(m, MetricRecipe) else m, metrics)


@dataclass(frozen=True)
class CompileRecipe:
    """What every replica (and the client's model) compiles with."""

    optimizer: dict[str, Any]  # keras.optimizers.serialize(...) output
    loss: Any
    loss_weights: Any = None
    metrics: Any = None  # portable_metrics(...) output
    weighted_metrics: Any = None
    #: The optimizer is the model's own compiled one (no ``optimizer=`` in the
    #: call): it goes on with its state, as a second ``model.fit`` would.
    continues: bool = False
    #: The positions, in ``model.trainable_variables``, of the variables the
    #: optimizer leaves out of its weight decay (``exclude_from_weight_decay``,
    #: which :attr:`optimizer`'s config does not carry)
    decay_excluded: tuple[int, ...] = ()

    def compile(self, model: Any, optimizer: Any = None) -> None:
        """Compile ``model``; ``optimizer``: this instance (the model's own, with
        its state) rather than a fresh one from :attr:`optimizer`."""
        import keras

        model.compile(
            # Keras' deserializer consumes the config it is given: a copy
            optimizer=optimizer if optimizer is not None
            else keras.optimizers.deserialize(copy.deepcopy(self.optimizer)),
            loss=self.loss,
            loss_weights=self.loss_weights,
            metrics=live_metrics(self.metrics),
            weighted_metrics=live_metrics(self.weighted_metrics),
        )
        if optimizer is None:  # a fresh one, not built yet
            compat.exclude_from_weight_decay(model.optimizer, model.trainable_variables,
                                             self.decay_excluded)


def compiled_args(model: Any) -> dict[str, Any] | None:
    """The arguments ``model`` was compiled with (``None`` if it was not): the
    optimizer as the instance that trains (its class and full config), the rest as
    given to ``compile``."""
    import keras

    if not getattr(model, "compiled", False):
        return None
    # Keras keeps the compile arguments as given (what .keras files save);
    # get_compile_config() would serialize them and lose functions from the script.
    given = compat.compile_arguments(model)
    optimizer = model.optimizer
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        optimizer = optimizer.inner_optimizer
    given["optimizer"] = optimizer
    given.setdefault("loss", getattr(model, "loss", None))
    return given


def model_spec(
    model: ModelLike, input_shape: tuple[int, ...], num_outputs: int | None
) -> ModelSpec:
    """Turn a built-in name, a factory or an importable path into a
    :class:`ModelSpec` (a model instance needs none: it is the model).

    Raises
    ------
    ValueError
        An unknown built-in name, or a ``module:function`` that cannot be imported.
    TypeError
        ``model`` is none of the accepted kinds.
    """
    if isinstance(model, str):
        if model in BUILTIN_MODELS:
            return ModelSpec(
                factory=BUILTIN_MODELS[model],
                input_shape=input_shape,
                num_outputs=num_outputs,
                description=model,
            )
        if ":" in model:
            _import_factory(model)  # fail here, on the client, not on every worker
            return ModelSpec(
                import_path=model,
                input_shape=input_shape,
                num_outputs=num_outputs,
                description=model,
            )
        raise ValueError(
            f"Unknown model {model!r}: choose a built-in model "
            f"({', '.join(BUILTIN_MODELS)}) or give an importable 'module:function'."
        )
    if callable(model):
        return ModelSpec(
            factory=model,
            input_shape=input_shape,
            num_outputs=num_outputs,
            description=getattr(model, "__name__", repr(model)),
        )
    raise TypeError(
        "model must be a keras.Model, a callable returning one, a built-in name "
        f"({', '.join(BUILTIN_MODELS)}) or a 'module:function' string; "
        f"got {type(model).__name__}."
    )


def _import_factory(path: str) -> Callable[..., Any]:
    module_name, _, attr = path.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(
            f"Cannot import model factory {path!r} ({exc}); "
            "give it as 'package.module:function' importable on every worker."
        ) from exc
    if not callable(factory):
        raise ValueError(f"{path!r} is not callable.")
    return factory  # type: ignore[no-any-return]


def _call_factory(
    factory: Callable[..., Any],
    input_shape: tuple[int, ...] | None,
    num_outputs: int | None,
) -> Any:
    """Call a factory, passing ``input_shape`` / ``num_outputs`` if it takes them."""
    params = inspect.signature(factory).parameters
    kwargs: dict[str, Any] = {}
    if "input_shape" in params and input_shape is not None:
        kwargs["input_shape"] = input_shape
    if "num_outputs" in params and num_outputs is not None:
        kwargs["num_outputs"] = num_outputs
    return factory(**kwargs)
