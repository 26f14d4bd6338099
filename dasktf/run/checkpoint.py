"""Checkpoints: a run's full training state on disk, written so a crash never
leaves a corrupt newest checkpoint.

A checkpoint is three files named by the global update it follows::

    ckpt-00000123.npz    weights, optimizer variables (np.savez); rounds of local
                         steps add the outer optimizer's and every replica's inner
                         optimizer's variables: what a resume reads
    ckpt-00000123.keras  the whole model as Keras saves it, its optimizer's trained
                         state included: ``keras.models.load_model`` opens it
    ckpt-00000123.json   manifest: SHA-256 of the .npz and the .keras, counters,
                         seed, run config (plain JSON: no pickled object, no class
                         path)

Each is written to a temporary name (``.ckpt-00000123.npz.tmp-PID``), flushed to
disk and renamed into place, the manifest last: a checkpoint exists only once its
manifest does, and the manifest's hashes prove the other two whole. A process
killed mid-write leaves the previous checkpoint as it was, and a temporary file or
a data file without a manifest, which nothing reads and the next
:func:`save_checkpoint` in that folder removes. The newest ``keep`` (3) are kept.
:func:`load_latest` returns the newest valid one and warns about each newer one it
had to skip. Format 1 (written before the ``.keras`` file was added: no ``keras``
in the manifest) still loads.
The shuffle order needs no state of its own: every permutation is drawn from
``(seed, epoch, shard)``, and the manifest holds the seed and the epoch and step.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import warnings
from pathlib import Path
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

KEEP = 3
_PREFIX = "ckpt-"
#: What a file being written is named after: ``.NAME.tmp-PID``.
_TMP = ".tmp-"
#: The manifest's ``format``: 2 holds the ``.keras`` model, 1 does not.
FORMAT = 2
#: The final model, in Keras' native format, next to the checkpoints.
FINAL_MODEL = "model.keras"


class CheckpointWarning(UserWarning):
    """A checkpoint was unreadable and an older one was used instead."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _temporary(path: Path) -> Path:
    return path.with_name(f".{path.name}{_TMP}{os.getpid()}")


def _write_atomic(path: Path, write: Any) -> None:
    tmp = _temporary(path)
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)  # atomic on POSIX: the old or the new file, never half


def write_file(path: str | os.PathLike[str], data: bytes) -> None:
    """``data`` to ``path`` as a checkpoint is written: whole or not at all."""
    _write_atomic(Path(path), lambda f: f.write(data))


def save_checkpoint(
    directory: str | os.PathLike[str], state: dict[str, Any], meta: dict[str, Any],
    keep: int = KEEP, model: bytes | None = None,
) -> Path:
    """Write ``state`` (``weights``, ``optimizer``, ``applied``), ``meta`` (epoch,
    step, seed, config: JSON-able) and ``model`` (the model holding ``state`` as a
    ``.keras`` archive; ``None``: none, format 1); return the manifest's path."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    update = int(state["applied"])
    stem = d / f"{_PREFIX}{update + 1:09d}"
    arrays = {f"w{i}": np.asarray(w) for i, w in enumerate(state["weights"])}
    arrays.update({f"o{i}": np.asarray(v) for i, v in enumerate(state["optimizer"])})
    outer = state.get("outer") or []
    inner = state.get("inner") or {}
    arrays.update({f"u{i}": np.asarray(v) for i, v in enumerate(outer)})
    for index, variables in inner.items():
        arrays.update({f"i{index}_{j}": np.asarray(v) for j, v in enumerate(variables)})
    unsent = state.get("unsent") or {}  # rounds with a sparse codec: per worker
    arrays.update({f"n{index}": np.asarray(v) for index, v in unsent.items()})
    data = stem.with_suffix(".npz")
    _write_atomic(data, lambda f: np.savez(f, **arrays))
    files: dict[str, Any] = {"format": 1}
    if model is not None:
        archive = stem.with_suffix(".keras")
        write_file(archive, model)
        files = {"format": FORMAT, "keras": archive.name,
                 "keras_sha256": hashlib.sha256(model).hexdigest()}
    manifest = {
        **files, "file": data.name, "sha256": _sha256(data),
        "applied": update, "n_weights": len(state["weights"]),
        "n_optimizer": len(state["optimizer"]), "n_outer": len(outer),
        "n_inner": {str(index): len(v) for index, v in inner.items()},
        "unsent": sorted(int(index) for index in unsent), **meta,
    }
    path = stem.with_suffix(".json")
    _write_atomic(path, lambda f: f.write(json.dumps(manifest, indent=1).encode()))
    for old in list_checkpoints(d)[keep:]:
        for p in (old, *_data_files(old)):
            p.unlink(missing_ok=True)
    _clean(d)
    return path


def _data_files(manifest: Path) -> list[Path]:
    return [manifest.with_suffix(".npz"), manifest.with_suffix(".keras")]


def _clean(directory: Path) -> None:
    """Remove what a writer killed mid-checkpoint left: temporary files of other
    processes, and data files whose manifest was never written. Called by a writer
    after its own manifest is in place (a folder has one writer at a time)."""
    mine = f"{_TMP}{os.getpid()}"
    for pattern in (f".{_PREFIX}*{_TMP}*", f".{FINAL_MODEL}{_TMP}*"):
        for tmp in directory.glob(pattern):
            if not tmp.name.endswith(mine):
                tmp.unlink(missing_ok=True)
    for pattern in (f"{_PREFIX}*.npz", f"{_PREFIX}*.keras"):
        for data in directory.glob(pattern):
            if not data.with_suffix(".json").exists():
                data.unlink(missing_ok=True)


def list_checkpoints(directory: str | os.PathLike[str]) -> list[Path]:
    """Manifests in ``directory``, newest first."""
    d = Path(directory)
    if not d.is_dir():
        return []
    return sorted(d.glob(f"{_PREFIX}*.json"), reverse=True)


def read_checkpoint(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(state, manifest) of one checkpoint; ``ValueError`` if it is not whole."""
    try:
        manifest = json.loads(path.read_text())
        data = path.with_name(manifest["file"])
        digest = _sha256(data)
    except (OSError, ValueError, KeyError) as exc:
        raise ValueError(f"{path}: unreadable ({type(exc).__name__}: {exc})") from exc
    if digest != manifest["sha256"]:
        raise ValueError(f"{data}: SHA-256 mismatch (the file was altered or cut short)")
    archive = keras_file(path, manifest)
    if archive is not None:
        try:
            whole = _sha256(archive) == manifest["keras_sha256"]
        except (OSError, KeyError) as exc:
            raise ValueError(f"{archive}: unreadable ({type(exc).__name__}: {exc})") from exc
        if not whole:
            raise ValueError(
                f"{archive}: SHA-256 mismatch (the file was altered or cut short)")
    with np.load(data) as z:
        state = {
            "weights": [z[f"w{i}"] for i in range(manifest["n_weights"])],
            "optimizer": [z[f"o{i}"] for i in range(manifest["n_optimizer"])],
            "applied": int(manifest["applied"]),
        }
        if manifest.get("n_outer"):
            state["outer"] = [z[f"u{i}"] for i in range(manifest["n_outer"])]
        if manifest.get("n_inner"):
            state["inner"] = {int(k): [z[f"i{k}_{j}"] for j in range(n)]
                              for k, n in manifest["n_inner"].items()}
        if manifest.get("unsent"):
            state["unsent"] = {int(k): z[f"n{k}"] for k in manifest["unsent"]}
    return state, manifest


def keras_file(path: Path, manifest: dict[str, Any] | None = None) -> Path | None:
    """The ``.keras`` model of the checkpoint whose manifest is ``path``; ``None``
    for a format 1 checkpoint, which has none."""
    if manifest is None:
        manifest = json.loads(Path(path).read_text())
    name = manifest.get("keras")
    return Path(path).with_name(name) if name else None


def load_latest(
    directory: str | os.PathLike[str],
) -> tuple[dict[str, Any], dict[str, Any], Path] | None:
    """The newest valid checkpoint as (state, manifest, path), or ``None`` if there
    is none; a newer invalid one is skipped with a :class:`CheckpointWarning`."""
    for path in list_checkpoints(directory):
        try:
            state, manifest = read_checkpoint(path)
        except ValueError as exc:
            warnings.warn(
                f"Checkpoint {path.name} is corrupt ({exc}); falling back to the "
                "previous one.", CheckpointWarning, stacklevel=2,
            )
            continue
        return state, manifest, path
    return None
