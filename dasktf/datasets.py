"""Built-in data sets that need no download, and loaders for the ones users have.

``digits`` (scikit-learn's 1,797 bundled 8x8 handwritten digits) is the default of
``dasktf fit``; ``exp`` is seed 000's ``y = e^x`` regression; ``mnist`` is read from
Keras' cache or from an ``.npz`` file the user names. Nothing here touches the network
except Keras' own MNIST loader, and only when the file is not cached.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

#: Names accepted by :func:`load_dataset` (besides a path to an ``.npz`` file).
DATASETS = ("digits", "exp", "mnist")


@dataclass
class Dataset:
    """A train/test split with the hyper-parameters that suit it.

    ``task`` is ``"classification"`` (integer labels) or ``"regression"``;
    ``defaults`` are the options ``dasktf fit`` uses when the user gives none.
    """

    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    task: str
    defaults: dict[str, Any] = field(default_factory=dict)

    @property
    def num_classes(self) -> int | None:
        if self.task != "classification":
            return None
        return int(max(self.y_train.max(), self.y_test.max())) + 1


def load_dataset(name: str, *, seed: int = 0) -> Dataset:
    """Load a built-in data set by name, or an ``.npz`` file by path.

    Parameters
    ----------
    name
        ``"digits"``, ``"exp"``, ``"mnist"``, or a path to an ``.npz`` file holding
        ``x_train``/``y_train`` (and optionally ``x_test``/``y_test``) or ``x``/``y``.
    seed
        Seed of the train/test split where the data set has none of its own.

    Raises
    ------
    ValueError
        The name is unknown, or the file lacks the arrays it needs.
    FileNotFoundError
        MNIST is neither cached nor reachable.
    """
    if name == "digits":
        return _digits(seed)
    if name == "exp":
        return _exp(seed)
    if name == "mnist":
        return _mnist_from_keras()
    if name.endswith(".npz") or os.path.exists(name):
        return _from_npz(name, seed)
    raise ValueError(
        f"Unknown data set {name!r}: choose one of {', '.join(DATASETS)}, "
        "or give the path of an .npz file with x_train/y_train (or x/y) arrays."
    )


_CLASSIFIER_DEFAULTS = {"optimizer": "adam", "learning_rate": 3e-3, "batch_size": 32}


def _digits(seed: int) -> Dataset:
    from sklearn.datasets import load_digits

    bunch = load_digits()
    x = (bunch.images / 16.0).astype("float32")  # pixel values are 0..16
    y = bunch.target.astype("int64")
    x_train, y_train, x_test, y_test = _split(x, y, test_fraction=0.2, seed=seed)
    return Dataset(
        "digits", x_train, y_train, x_test, y_test, "classification",
        dict(_CLASSIFIER_DEFAULTS, learning_rate=2e-2, epochs=5),
    )


def _exp(seed: int, n: int = 2000) -> Dataset:
    rng = np.random.default_rng(seed)
    x = rng.uniform(-1.0, 2.0, size=(n, 1)).astype("float32")
    y = np.exp(x).astype("float32")
    x_train, y_train, x_test, y_test = _split(x, y, test_fraction=0.2, seed=seed)
    return Dataset(
        "exp", x_train, y_train, x_test, y_test, "regression",
        {"optimizer": "adam", "learning_rate": 1e-2, "batch_size": 50, "epochs": 20},
    )


def load_mnist_npz(path: str) -> Dataset:
    """MNIST from a Keras-layout ``mnist.npz``, loaded without pickle, scaled to [0, 1]."""
    with np.load(path, allow_pickle=False) as f:
        arrays = {k: f[k] for k in ("x_train", "y_train", "x_test", "y_test")}
    return Dataset(
        "mnist",
        (arrays["x_train"] / 255.0).astype("float32"),
        arrays["y_train"].astype("int64"),
        (arrays["x_test"] / 255.0).astype("float32"),
        arrays["y_test"].astype("int64"),
        "classification",
        dict(_CLASSIFIER_DEFAULTS, learning_rate=1e-3, batch_size=128, epochs=2),
    )


def _mnist_from_keras() -> Dataset:
    cached = os.path.join(os.path.expanduser("~"), ".keras", "datasets", "mnist.npz")
    if os.path.exists(cached):
        return load_mnist_npz(cached)
    try:
        from keras.datasets import mnist

        mnist.load_data()  # downloads into the cache above
    except Exception as exc:
        raise FileNotFoundError(
            f"MNIST is not cached at {cached} and could not be downloaded ({exc}). "
            "Copy a Keras-layout mnist.npz there, or pass its path: "
            "dasktf fit --data /path/to/mnist.npz"
        ) from exc
    return load_mnist_npz(cached)


def _from_npz(path: str, seed: int) -> Dataset:
    if not os.path.exists(path):
        raise FileNotFoundError(f"No such data file: {path}")
    with np.load(path, allow_pickle=False) as f:
        keys = set(f.files)
        if {"x_train", "y_train"} <= keys and {"x_test", "y_test"} <= keys:
            if _looks_like_mnist(f):
                return load_mnist_npz(path)
            parts = [f[k] for k in ("x_train", "y_train", "x_test", "y_test")]
        elif {"x_train", "y_train"} <= keys:
            parts = list(_split(f["x_train"], f["y_train"], 0.2, seed))
        elif {"x", "y"} <= keys:
            parts = list(_split(f["x"], f["y"], 0.2, seed))
        else:
            raise ValueError(
                f"{path} holds arrays {sorted(keys)}; expected x_train and y_train "
                "(optionally x_test and y_test), or x and y."
            )
    x_train, y_train, x_test, y_test = parts
    task = "classification" if np.issubdtype(y_train.dtype, np.integer) else "regression"
    defaults = _CLASSIFIER_DEFAULTS if task == "classification" else {"optimizer": "adam"}
    name = os.path.basename(path)
    x_train, x_test = _as_float(x_train), _as_float(x_test)
    return Dataset(name, x_train, y_train, x_test, y_test, task, dict(defaults))


def _looks_like_mnist(f: Any) -> bool:
    x = f["x_train"]
    return x.dtype == np.uint8 and x.shape[1:] == (28, 28)


def _as_float(x: np.ndarray) -> np.ndarray:
    if np.issubdtype(x.dtype, np.integer):
        return x.astype("float32")
    return x


def _split(
    x: np.ndarray, y: np.ndarray, test_fraction: float, seed: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    order = np.random.default_rng(seed).permutation(len(x))
    n_test = round(len(x) * test_fraction)
    test, train = order[:n_test], order[n_test:]
    return x[train], y[train], x[test], y[test]
