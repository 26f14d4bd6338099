"""Checkpoints: a run's full training state on disk, written so a crash never
leaves a corrupt newest checkpoint.

A checkpoint is two files named by the global update it follows::

    ckpt-00000123.npz    weights, optimizer variables (np.savez); rounds of local
                         steps add the outer optimizer's and every replica's inner
                         optimizer's variables
    ckpt-00000123.json   manifest: SHA-256 of the .npz, counters, seed, run config

Each is written to a temporary name, flushed to disk and renamed into place, the
manifest last: a checkpoint exists only once its manifest does, and the manifest's
hash proves the data whole. The newest ``keep`` (3) are kept. :func:`load_latest`
returns the newest valid one and warns about each newer one it had to skip.
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


def _write_atomic(path: Path, write: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)  # atomic on POSIX: the old or the new file, never half


def save_checkpoint(
    directory: str | os.PathLike[str], state: dict[str, Any], meta: dict[str, Any],
    keep: int = KEEP,
) -> Path:
    """Write ``state`` (``weights``, ``optimizer``, ``applied``) and ``meta`` (epoch,
    step, seed, config: JSON-able); return the manifest's path."""
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
    data = stem.with_suffix(".npz")
    _write_atomic(data, lambda f: np.savez(f, **arrays))
    manifest = {
        "format": 1, "file": data.name, "sha256": _sha256(data),
        "applied": update, "n_weights": len(state["weights"]),
        "n_optimizer": len(state["optimizer"]), "n_outer": len(outer),
        "n_inner": {str(index): len(v) for index, v in inner.items()}, **meta,
    }
    path = stem.with_suffix(".json")
    _write_atomic(path, lambda f: f.write(json.dumps(manifest, indent=1).encode()))
    for old in list_checkpoints(d)[keep:]:
        for p in (old, old.with_suffix(".npz")):
            p.unlink(missing_ok=True)
    return path


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
    return state, manifest


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
