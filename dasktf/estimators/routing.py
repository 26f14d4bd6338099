"""Routed parameters, as SciKeras names them: ``<route>__<name>``.

``KerasClassifier(model__hidden=32, optimizer__learning_rate=0.01,
fit__validation_split=0.1)`` sends ``hidden=32`` to the function that builds the
model, ``learning_rate=0.01`` to the optimizer's constructor and
``validation_split=0.1`` to :func:`dasktf.fit`. They are ordinary parameters to
scikit-learn (``get_params``, ``set_params``, ``clone``, a grid over
``{"model__hidden": [16, 64]}``), which would otherwise read ``model__hidden`` as
the parameter ``hidden`` of a nested estimator ``model``.
"""

from __future__ import annotations

from typing import Any

from dasktf import compat

#: The routes: what each prefix's parameters are given to.
ROUTES = {
    "model": "the function that builds the model (with model_kwargs)",
    "optimizer": "the optimizer's constructor",
    "loss": "the loss's constructor",
    "fit": "dasktf.fit (with fit_kwargs)",
}


def is_routed(name: str) -> bool:
    """``name`` is ``<route>__<something>`` for one of :data:`ROUTES`."""
    route, sep, rest = name.partition("__")
    return bool(sep and rest) and route in ROUTES


def refuse_unknown(names: list[str], owner: str) -> None:
    """Refuse keyword arguments that are neither parameters, routed ones nor
    arguments of the model function."""
    if names:
        routes = ", ".join(f"{r}__ ({what})" for r, what in ROUTES.items())
        raise TypeError(f"{owner} got unexpected keyword arguments {sorted(names)}: "
                        "neither its parameters nor arguments of its model function; a "
                        f"routed parameter starts with one of {routes}.")


def routed(owner: Any, route: str) -> dict[str, Any]:
    """The parameters of ``owner`` routed to ``route``, without their prefix."""
    prefix = f"{route}__"
    return {name[len(prefix):]: value for name, value in vars(owner).items()
            if name.startswith(prefix) and is_routed(name)}


def extra_params(owner: Any, declared: Any) -> dict[str, Any]:
    """The keyword arguments ``owner`` was given beyond its ``declared``
    parameters: routed ones, and (SciKeras') plain names of the model function's
    arguments. Not fitted attributes (``model_``), private ones or ``client``."""
    return {name: value for name, value in vars(owner).items()
            if name not in declared and name != "client"
            and not name.endswith("_") and not name.startswith("_")}


def build_optimizer(spec: Any, params: dict[str, Any]) -> Any:
    """The optimizer ``spec`` (a name, class or instance) with ``params`` set:
    a new instance, so a search's candidates never share one."""
    import keras

    if isinstance(spec, str):
        spec = keras.optimizers.get(spec)
    if isinstance(spec, type):
        return spec(**params)
    if not isinstance(spec, keras.optimizers.Optimizer):
        raise TypeError(f"optimizer__ parameters need an optimizer given as a name, class "
                        f"or instance; got {type(spec).__name__}.")
    built = type(spec).from_config({**spec.get_config(), **params})
    compat.copy_weight_decay_exclusions(spec, built)  # not in the config
    return built


def build_loss(spec: Any, params: dict[str, Any]) -> Any:
    """The loss ``spec`` (a name such as ``"sparse_categorical_crossentropy"``,
    a ``keras.losses.Loss`` class or instance) constructed with ``params``."""
    import keras

    if isinstance(spec, str):
        name = "".join(part.capitalize() for part in spec.split("_"))
        cls = getattr(keras.losses, name, None)
        if not (isinstance(cls, type) and issubclass(cls, keras.losses.Loss)):
            raise ValueError(f"loss__ parameters need a loss class; {spec!r} names none "
                             f"(keras.losses.{name}): give loss=keras.losses.<Class>.")
        return cls(**params)
    if isinstance(spec, type):
        return spec(**params)
    if isinstance(spec, keras.losses.Loss):
        return type(spec).from_config({**spec.get_config(), **params})
    raise TypeError(f"loss__ parameters need a loss given as a name, class or instance; "
                    f"got {type(spec).__name__}.")


#: Losses that take one-hot targets (a classifier encodes its labels so).
_ONE_HOT_LOSSES = {"categoricalcrossentropy", "categoricalfocalcrossentropy",
                   "categoricalhinge"}


def takes_one_hot(loss: Any) -> bool:
    """``loss`` compares the outputs with one-hot targets (Keras' wrappers give a
    classifier's model one-hot ``y``; its ``categorical_crossentropy`` needs it)."""
    if isinstance(loss, str):
        name = loss
    elif isinstance(loss, type):
        name = loss.__name__
    elif callable(loss):
        name = getattr(loss, "__name__", None) or type(loss).__name__
    else:
        return False
    return name.replace("_", "").lower() in _ONE_HOT_LOSSES
