"""Checkpoints of asynchronous runs: what the engine hands the run to save, and
what it checks before it resumes.

In an async run the training state is the parameter holder's (master weights,
optimizer variables, version) plus *which batches were applied*: workers run ahead
of each other and several gradients are in flight, so "epoch e, step s" does not
describe the progress. A checkpoint is a consistent cut taken by the holder between
two applies (:meth:`~dasktf.engines.holder.actor.ParameterHolder.snapshot`): its state
and the ``(pass, step)`` items applied for every shard
(:meth:`AsyncEngine.checkpoint <dasktf.engines.holder.engine.AsyncEngine.checkpoint>`).
The files are the run's (:mod:`dasktf.run.checkpoint`: atomic, SHA-256, fallback to
the previous); the progress goes in the manifest (``"async"``). The shuffle order
needs no state: every permutation is drawn from ``(seed, pass, shard)`` and the
manifest holds the seed.

On resume the holder loads the state and counts the applied items against each
shard's budget; each shard's cursor computes its unapplied items first (the gaps
left by gradients in flight at the cut), then goes on from its furthest pass
(:meth:`~dasktf.engines.holder.state.AsyncState.restored`). So every batch of the
requested epochs is applied exactly once over the two runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dasktf.engines.base import Saved


def cut_state(snapshot: dict[str, Any]) -> dict[str, Any]:
    """A holder snapshot as a checkpoint's state: weights, optimizer, ``applied``."""
    return {"weights": snapshot["weights"], "optimizer": snapshot["optimizer"],
            "applied": snapshot["version"] - 1}


def resumable(saved: Saved, n_shards: int) -> tuple[int, dict[int, list[tuple[int, int]]]]:
    """The version and the applied batches per shard of an async run's checkpoint.

    Raises
    ------
    ValueError
        A checkpoint of another mode, or of a run on other shards or batches.
    """
    manifest, path = saved.manifest, saved.path
    if manifest.get("mode") != "async" or "async" not in manifest:
        raise ValueError(
            f"{path} is a checkpoint of a mode={manifest.get('mode', 'sync')!r} run; an "
            "async run resumes only from an async run's checkpoints (use another "
            "checkpoint_dir or the same mode)."
        )
    if manifest["n_shards"] != n_shards or manifest["batch_size"] != saved.batch_size:
        raise ValueError(
            f"{path} was written by a run on {manifest['n_shards']} worker(s) with "
            f"batch_size={manifest['batch_size']}; this run has {n_shards} and "
            f"{saved.batch_size}. Resume with the same n_workers and batch_size."
        )
    progress = manifest["async"]
    done = {int(k): [(int(p), int(s)) for p, s in v] for k, v in progress["done"].items()}
    return int(progress["version"]), done
