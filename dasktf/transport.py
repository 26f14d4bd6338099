"""How a model leaves the client: whole, the way Keras itself saves it.

A :class:`ModelPackage` is the model as ``model.save("m.keras")`` writes it (its
config, its weights, its assets such as an adapted ``StringLookup``'s vocabulary,
each layer's own state, the optimizer's variables), written to memory, plus what
only the client's script defines (custom layers, activations, the model class:
:func:`dasktf.models.custom_objects`, shipped by value), plus the state of each
random layer's seed generator (Keras does not save it; a replica needs it to draw
the dropout masks a Keras ``fit`` of the same model would). Loading it runs
Keras' own loader, so every layer gets its ``load_own_variables`` /
``load_assets`` and finalizes its state (an adapted ``Normalization`` normalizes).

The package travels to the cluster once (:func:`share_model`: scattered, one copy
per worker); tasks carry a :class:`ModelRef`, a few dozen bytes naming it. On a
worker, ``ref.build(recipe)`` makes a fresh, compiled model (a training replica,
each its own), and ``ref.model()`` the process's one cached model for inference::

    package = ModelPackage.pack(model)            # on the client
    shared = share_model(client, package)         # one copy on each worker
    client.submit(task, shared.ref, ...)          # the graph carries the key
    # in the task, on the worker:
    model = ref.model()                           # built once per process, cached
    ...
    shared.release()                              # the run is over

Keras 3.15's public ``keras.saving.save_model`` / ``load_model`` take paths only
(``save_model`` checks the file name's extension); the functions they call,
``keras.src.saving.saving_lib.save_model`` / ``load_model`` (:mod:`dasktf.compat`), take file objects.
:func:`keras_archive` and :func:`_read` use those and fall back to a temporary
``.keras`` file where they are missing.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import tempfile
import threading
import warnings
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from dasktf.cluster.broadcast import broadcast
from dasktf.compat import constructor_arguments, flatten_layers, keras_saving_lib
from dasktf.models import custom_objects

if TYPE_CHECKING:
    from distributed import Client, Future

    from dasktf.models import CompileRecipe

#: The path of a seed generator's state among a model's variables.
_SEED_STATE = "seed_generator_state"
#: Replica ``i`` draws its own random stream: its seeds are offset by ``i`` times this.
_SEED_STRIDE = 1_000_003


@dataclass(frozen=True)
class ModelPackage:
    """A Keras model as bytes: what :meth:`pack` read from the client's model."""

    #: A content hash: equal packages are the same model in the same state.
    key: str
    #: The ``.keras`` archive (zip: config.json, model.weights.h5, assets/).
    archive: bytes
    #: ``{registered name: class or function}`` the config names and only the
    #: client's script defines; pickled by value with the package.
    custom_objects: dict[str, Any] = field(default_factory=dict)
    #: The optimizer config (``keras.optimizers.serialize``) whose variables the
    #: archive holds to be continued; ``None``: every build starts a fresh optimizer.
    optimizer: dict[str, Any] | None = None
    #: Every seed generator's state, in the model's variable order.
    seeds: tuple[np.ndarray, ...] = ()
    description: str = ""
    #: A subclassed model Keras cannot rebuild from its config (no get_config(),
    #: as the guides write them): made by this factory and called on ``probe``,
    #: then given the archive's weights (``model.load_weights``). ``None``: Keras'
    #: ``load_model`` rebuilds it.
    factory: Callable[[], Any] | None = None
    probe: Any = None

    @classmethod
    def pack(cls, model: Any, *, optimizer: dict[str, Any] | None = None,
             factory: Callable[[], Any] | None = None, probe: Any = None) -> ModelPackage:
        """Write ``model`` as Keras saves it.

        Parameters
        ----------
        model
            A built Keras model (compiled or not).
        optimizer
            The config of ``model.optimizer``, when its state is to be continued
            where the package is built (``model.fit`` on a trained model goes on
            with its optimizer's moments and ``iterations``); ``None``: not.
        factory, probe
            For a subclassed model only: what builds it again (the factory it came
            from; ``None``: its class, with the constructor arguments Keras
            recorded) and an input to call it on, should Keras' ``load_model`` not
            rebuild it from what it saves.

        Raises
        ------
        ValueError
            Keras cannot save the model (``model.save`` fails the same way).
        TypeError
            A subclassed model that neither Keras nor its factory rebuilds.
        """
        try:
            archive = keras_archive(model)
        except Exception as exc:
            raise ValueError(
                f"The model {getattr(model, 'name', '')!r} cannot be saved as Keras saves "
                f"it ({type(exc).__name__}: {str(exc).strip().splitlines()[0]}), and that is "
                "how it reaches the workers: model.save('model.keras') fails the same "
                "way. Give each custom layer a get_config() returning its constructor's "
                "arguments (keras.io/guides/serialization_and_saving)."
            ) from exc
        seeds = tuple(np.asarray(v.numpy()) for v in seed_states(model))
        digest = content_digest(archive)
        for seed in seeds:
            digest.update(seed.tobytes())
        package = cls(f"dasktf-model-{digest.hexdigest()[:20]}", archive,
                      custom_objects(model), optimizer, seeds, getattr(model, "name", ""))
        from dasktf.models import is_plain_graph

        if is_plain_graph(model) or _rebuilds(package, model) is None:
            return package
        package = replace(package, factory=factory or _class_factory(model), probe=probe)
        why = _rebuilds(package, model)
        if why is not None:
            name = type(model).__name__
            raise TypeError(
                f"The subclassed model {name} cannot be rebuilt on the workers{why}: "
                "Keras does not record a keras.Model subclass's constructor arguments. "
                f"Pass a factory as model= instead, e.g. model=lambda: {name}(...) or "
                f"model={name} when its defaults are right, or give the class "
                "get_config()/from_config()."
            )
        return package

    @property
    def nbytes(self) -> int:
        return len(self.archive)

    def build(self, recipe: CompileRecipe | None = None, *, stream: int = 0,
              policy: str | None = None, sliced: bool = False) -> Any:
        """A fresh model, in the state it was packed in.

        Parameters
        ----------
        recipe
            Compile it with this (and build its optimizer, continuing the packed
            optimizer's state where :attr:`optimizer` is the recipe's); ``None``:
            uncompiled (inference).
        stream
            Its random layers' stream: ``0`` the packed model's own, ``i`` another
            one for each replica ``i``, so replicas do not drop the same units.
        policy
            A Keras mixed precision policy (``"mixed_float16"``): given to every
            layer of a model packed in float32 before it is compiled.
        sliced
            The optimizer is cut into slices at the first step (``shard_state``):
            the whole one is not built (its slots would be the replica's largest
            transient, 8 bytes a parameter with Adam) unless it continues a packed
            state (its slices are cut from it) or scales the loss (the gradient
            function reads its scale). A state loaded into it builds it
            (:func:`built_optimizer`).
        """
        import keras

        with keras.saving.custom_object_scope(self.custom_objects):
            if self.factory is None:
                model = _read(self.archive, self.custom_objects)
            else:
                model = self.factory()
                model(self.probe)  # a subclassed model makes its weights on its first call
                _load_weights(model, self.archive)
        set_seed_states(model, self.seeds, stream)
        if policy is not None and _all_float32(model):
            for layer in flatten_layers(model):
                layer.dtype_policy = policy
        if recipe is not None:
            continued = _same_optimizer(self.optimizer, recipe.optimizer)
            recipe.compile(model)
            if continued or not sliced or hasattr(model.optimizer, "inner_optimizer"):
                model.optimizer.build(model.trainable_variables)
            if continued:
                self._restore_optimizer(model.optimizer)
        return model

    def _restore_optimizer(self, optimizer: Any) -> None:
        """The packed optimizer's variables into ``optimizer`` (built), as Keras'
        loader gives them to ``Optimizer.load_own_variables``."""
        target = getattr(optimizer, "inner_optimizer", optimizer)  # LossScaleOptimizer
        values = optimizer_values(self.archive)
        shapes = [tuple(v.shape) for v in target.variables]
        if [tuple(np.shape(v)) for v in values] != shapes:
            raise ValueError(
                f"The model's optimizer holds {len(values)} variables that do not match "
                f"the {len(shapes)} of the {type(target).__name__} compiled here; this "
                "is a dasktf bug (the packed and the compiled optimizer differ)."
            )
        for variable, value in zip(target.variables, values, strict=True):
            variable.assign(value)

    def ref(self, key: str | None = None) -> ModelRef:
        """A reference to this package, carrying it inline (for a process that no
        Dask worker's memory can reach) unless ``key`` names where it was scattered."""
        if key is not None:
            return ModelRef(key, self.description)
        return ModelRef(self.key, self.description, self)


def built_optimizer(model: Any) -> Any:
    """``model``'s optimizer, built over its trainable variables if it was not (a
    sliced replica's, before its first step: see :meth:`ModelPackage.build`)."""
    optimizer = model.optimizer
    if not optimizer.built:
        optimizer.build(model.trainable_variables)
    return optimizer


def _same_optimizer(packed: dict[str, Any] | None, compiled: dict[str, Any]) -> bool:
    """Whether the packed optimizer state belongs to the optimizer compiled now
    (Keras' deserializer lower-cases a config's class name in place)."""
    def canonical(config: dict[str, Any]) -> dict[str, Any]:
        return {**config, "class_name": str(config.get("class_name", "")).lower()}

    return packed is not None and canonical(packed) == canonical(compiled)


def _rebuilds(package: ModelPackage, model: Any) -> str | None:
    """``None`` if ``package`` builds a model with ``model``'s weight shapes here,
    else why not (said after the model's name)."""
    try:
        rebuilt = package.build()
    except Exception as exc:  # noqa: BLE001 - any failure means: cannot rebuild
        return f" ({type(exc).__name__}: {str(exc).strip().splitlines()[0]})"
    if [tuple(w.shape) for w in rebuilt.weights] != [tuple(w.shape) for w in model.weights]:
        return " (its weights come out with other shapes)"
    return None


def _class_factory(model: Any) -> Callable[[], Any]:
    """``model``'s class with the constructor arguments Keras recorded: for a
    ``keras.Model`` subclass, only its defaults (``keras.Model.__new__`` drops the
    arguments before they are recorded); :func:`_rebuilds` checks the result."""
    import functools

    return functools.partial(type(model), **constructor_arguments(model))


@dataclass(frozen=True)
class ModelRef:
    """What a task graph carries for a model: the key of its package.

    On a worker, :meth:`package` finds the package (see there); :meth:`build`
    makes a fresh model of it, :meth:`model` the process's cached one. ``inline``:
    the package itself, for a process that is no Dask worker (the collective
    engine's TensorFlow child).
    """

    key: str
    description: str = ""
    inline: ModelPackage | None = None

    def package(self) -> ModelPackage:
        """The package, on a worker: inline, this process's copy, the worker's
        memory (where :func:`share_model` put it), or fetched once through the
        scheduler (a worker that joined later, or whose copy Dask's active memory
        manager dropped as a spare replica); kept in this process until
        :func:`forget_model`."""
        if self.inline is not None:
            return self.inline
        with _LOCK:
            package = _PACKAGES.get(self.key)
        if package is None:
            fetched = _fetch(self.key)
            with _LOCK:
                package = _PACKAGES.setdefault(self.key, fetched)
        return package

    def carried(self) -> ModelRef:
        """This reference with the package inline (resolved here, on a worker)."""
        return self if self.inline is not None else replace(self, inline=self.package())

    def build(self, recipe: CompileRecipe | None = None, *, stream: int = 0,
              policy: str | None = None, sliced: bool = False) -> Any:
        """A fresh model (:meth:`ModelPackage.build`): a replica's own."""
        return self.package().build(recipe, stream=stream, policy=policy, sliced=sliced)

    def model(self) -> Any:
        """This process's model of this package, built on first use and cached
        (uncompiled: for inference). :func:`forget_model` drops it."""
        with _LOCK:
            model = _MODELS.get(self.key)
        if model is None:
            built = self.build()  # two threads may both build: one model is kept
            with _LOCK:
                model = _MODELS.setdefault(self.key, built)
        return model


_MODELS: dict[str, Any] = {}
_PACKAGES: dict[str, ModelPackage] = {}
_LOCK = threading.Lock()


def forget_model(key: str) -> bool:
    """Drop this process's package ``key`` and its cached model; whether it had one."""
    with _LOCK:
        had = _PACKAGES.pop(key, None) is not None
        return (_MODELS.pop(key, None) is not None) or had


def _fetch(key: str) -> ModelPackage:
    """Package ``key`` from this worker's memory, else through the scheduler (a
    ``Future`` made from a key inside a task is never told the key is ready)."""
    from distributed import get_worker
    from distributed.utils import sync

    from dasktf import config

    worker = get_worker()
    try:
        return worker.data[key]  # type: ignore[no-any-return]
    except KeyError:
        pass
    timeout = config.get_seconds("step-timeout")
    out = sync(worker.loop, worker.scheduler.gather, keys=[key], callback_timeout=timeout)
    if out.get("status") != "OK":
        raise RuntimeError(
            f"The model package {key} is on no worker any more (status {out.get('status')}): "
            "its run released it, or every worker holding it was lost.")
    return out["data"][key]  # type: ignore[no-any-return]


@dataclass
class SharedModel:
    """A package placed on the cluster: ``ref`` for the tasks; the future keeps
    the package in the workers' memory until :meth:`release`."""

    ref: ModelRef
    future: Future | None
    nbytes: int

    def release(self) -> None:
        if self.future is not None:
            self.future.release()
            self.future = None


def share_model(client: Client, package: ModelPackage,
                workers: list[str] | None = None) -> SharedModel:
    """Place one copy of ``package`` on each of ``workers`` (all by default).

    Tasks then take ``shared.ref`` (a key), never the package: the scheduler and
    the task graph see a few dozen bytes whatever the model's size. The client
    sends it to one worker and the workers copy it among themselves
    (:func:`dasktf.cluster.broadcast.broadcast`): the package never passes through
    the scheduler.
    """
    future = broadcast(client, package, workers)
    return SharedModel(package.ref(future.key), future, package.nbytes)


# -- seed generators -------------------------------------------------------------
def seed_states(model: Any) -> list[Any]:
    """The model's seed generators' state variables (dropout, noise, augmentation
    layers), in a stable order."""
    return [v for v in model.variables if v.path.endswith(_SEED_STATE)]


def set_seed_states(model: Any, seeds: tuple[np.ndarray, ...], stream: int) -> None:
    """Give the model's seed generators ``seeds``, shifted for ``stream`` > 0."""
    variables = seed_states(model)
    if len(variables) != len(seeds):
        return  # a model that makes its generators in call(): its own draws
    for v, seed in zip(variables, seeds, strict=True):
        value = np.array(seed, copy=True)
        if stream:
            value[0] = (int(value[0]) + stream * _SEED_STRIDE) % (2**31 - 1)
        v.assign(value.astype(v.dtype))


def _all_float32(model: Any) -> bool:
    return all(layer.dtype_policy.name == "float32"
               for layer in flatten_layers(model))


# -- Keras' .keras files, in memory --------------------------------------------------
@contextlib.contextmanager
def _quiet_keras() -> Iterator[None]:
    """Keras' own saving warns where nothing is wrong: NumPy 2's ``copy keyword``
    deprecation on every TensorFlow tensor it writes (``np.array(tensor)``)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*copy keyword",
                                category=DeprecationWarning)
        yield


def keras_archive(model: Any) -> bytes:
    """``model`` as ``model.save("m.keras")`` writes it (its optimizer's variables
    included), in memory."""
    lib = keras_saving_lib()
    with _quiet_keras():
        if lib is not None:
            buffer = io.BytesIO()
            lib.save_model(model, buffer)
            return buffer.getvalue()
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "model.keras")
            model.save(path)
            with open(path, "rb") as f:
                return f.read()


def content_digest(archive: bytes) -> Any:
    """A sha256 of what a ``.keras`` archive holds, not of when it was written:
    Keras stamps its ``metadata.json`` with the second it saved, and the zip its
    members with their times, so two saves of one model a second apart differ in
    bytes, and a key made of those would have the workers fetch and build the same
    model again (or a cached one looked for under another key)."""
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(io.BytesIO(archive)) as z:
            for name in sorted(z.namelist()):
                data = z.read(name)
                if name == "metadata.json":
                    meta = json.loads(data)
                    meta.pop("date_saved", None)
                    data = json.dumps(meta, sort_keys=True).encode()
                digest.update(f"{name}\0{len(data)}\0".encode())
                digest.update(data)
    except (zipfile.BadZipFile, ValueError):  # not a zip: its bytes, as they are
        return hashlib.sha256(archive)
    return digest


def _read(archive: bytes, objects: dict[str, Any]) -> Any:
    """Keras' ``load_model`` of the archive, uncompiled (a run compiles its own);
    ``safe_mode=False``: the archive is the client's own model (a ``Lambda``
    layer's function travels as code, as the script's classes do)."""
    import keras

    lib = keras_saving_lib()
    with _quiet_keras():
        if lib is not None:
            return lib.load_model(io.BytesIO(archive), custom_objects=objects,
                                  compile=False, safe_mode=False)
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "model.keras")
            with open(path, "wb") as f:
                f.write(archive)
            return keras.saving.load_model(path, custom_objects=objects, compile=False,
                                           safe_mode=False)


def _load_weights(model: Any, archive: bytes) -> None:
    """The archive's weights into ``model`` by Keras' ``load_weights`` (which reads
    ``.keras`` files by path only)."""
    with tempfile.TemporaryDirectory() as tmp, _quiet_keras():
        path = os.path.join(tmp, "model.keras")
        with open(path, "wb") as f:
            f.write(archive)
        model.load_weights(path)


def optimizer_values(archive: bytes) -> list[np.ndarray]:
    """The optimizer variables a ``.keras`` archive holds (Keras writes them to
    ``model.weights.h5`` under ``optimizer/vars/<i>``); ``[]`` for none."""
    import h5py

    with zipfile.ZipFile(io.BytesIO(archive)) as zf, \
            h5py.File(io.BytesIO(zf.read("model.weights.h5")), "r") as f:
        group = f.get("optimizer/vars")
        if group is None:
            return []
        return [np.asarray(group[str(i)][()]) for i in range(len(group))]
