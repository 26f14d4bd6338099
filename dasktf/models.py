"""Model recipes: how every worker builds the same Keras model.

A live Keras model cannot be shared between processes, so dasktf ships a
:class:`ModelSpec`, a small picklable recipe, and each worker builds its replica from
it. A spec is made from a built-in name (``mnist-mlp``, ``cnn``, ``exp-mlp``), a
callable, an importable ``"module:function"`` string, or a Keras model instance
(shipped in Keras' own serialized form).
"""

from __future__ import annotations

import importlib
import inspect
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

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
    """A picklable recipe for a Keras model; :meth:`build` runs on each worker."""

    factory: Callable[..., Any] | None = None
    import_path: str | None = None
    keras_bytes: bytes | None = None
    input_shape: tuple[int, ...] | None = None
    num_outputs: int | None = None
    description: str = ""

    def build(self) -> Any:
        """Build a fresh model (weights are whatever its initializers give)."""
        if self.keras_bytes is not None:
            return pickle.loads(self.keras_bytes)  # Keras 3 models pickle as .keras
        factory = self.factory or _import_factory(self.import_path or "")
        return _call_factory(factory, self.input_shape, self.num_outputs)


def model_spec(
    model: ModelLike, input_shape: tuple[int, ...], num_outputs: int | None
) -> ModelSpec:
    """Turn what the user passed as ``model`` into a :class:`ModelSpec`.

    Raises
    ------
    ValueError
        An unknown built-in name, or a ``module:function`` that cannot be imported.
    TypeError
        ``model`` is none of the accepted kinds.
    """
    import keras

    if isinstance(model, keras.Model):
        return ModelSpec(keras_bytes=pickle.dumps(model), description=model.name)
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
