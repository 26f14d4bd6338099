"""Checkpoints and resume for asynchronous runs.

In an async run the training state is the parameter holder's (master weights,
optimizer variables, version) plus *which batches were applied*: workers run ahead
of each other and several gradients are in flight, so "epoch e, step s" does not
describe the progress. A checkpoint is a consistent cut taken by the holder between
two applies (:meth:`~dasktf.engines.holder.actor.ParameterHolder.snapshot`): its state and
the ``(pass, step)`` items applied for every shard. The files are the sync ones
(:mod:`dasktf.run.checkpoint`: atomic, SHA-256, fallback to the previous); the progress
goes in the manifest. The shuffle order needs no state: every permutation is drawn
from ``(seed, pass, shard)`` and the manifest holds the seed.

On resume the holder loads the state and counts the applied items against each
shard's budget; each shard's cursor computes its unapplied items first (the gaps
left by gradients in flight at the cut), then goes on from its furthest pass. So
every batch of the requested epochs is applied exactly once over the two runs.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

from dasktf.callbacks import adopt_learning_rate
from dasktf.engines.holder.checkpoint import HolderCut, load_cut
from dasktf.run import checkpoint as ckpt
from dasktf.runtime.replica import non_trainable_values

if TYPE_CHECKING:
    from dasktf.engines.holder.engine import AsyncEngine
    from dasktf.run.guard import RunGuard


def save_async_checkpoint(guard: RunGuard, engine: AsyncEngine, epoch: int) -> Path:
    """Write the holder's consistent cut into the run's checkpoint directory."""
    run = guard.run
    cut = HolderCut(engine)
    meta = {
        "next_epoch": epoch, "epochs": guard.epochs, "seed": run.trainer.options.seed,
        "batch_size": run.batch_size, "workers": list(run.ctx.workers),
        "n_shards": len(run.placed.shards), "mode": "async", "run": run.run_id,
        "model": run.spec_description, "wall_time": time.time(),
        "async": cut.progress,
    }
    path = ckpt.save_checkpoint(guard.options.checkpoint_dir, cut.state, meta)  # type: ignore[arg-type]
    guard.last_checkpoint = path
    cut.keep(str(path))
    return path


def resume_async(guard: RunGuard, engine: AsyncEngine) -> tuple[int, int]:
    """Load the newest valid checkpoint into the holder and the cursors; return the
    epoch to go on with (and step 0: the cursors carry the position)."""
    found = ckpt.load_latest(guard.options.checkpoint_dir)  # type: ignore[arg-type]
    if found is None:
        guard.announce(f"no checkpoint in {guard.options.checkpoint_dir}; starting afresh")
        return 0, 0
    state, manifest, path = found
    run = guard.run
    n = len(run.placed.shards)
    if manifest.get("mode") != "async" or "async" not in manifest:
        raise ValueError(
            f"{path} is a checkpoint of a mode={manifest.get('mode', 'sync')!r} run; an "
            "async run resumes only from an async run's checkpoints (use another "
            "checkpoint_dir or the same mode)."
        )
    if manifest["n_shards"] != n or manifest["batch_size"] != run.batch_size:
        raise ValueError(
            f"{path} was written by a run on {manifest['n_shards']} worker(s) with "
            f"batch_size={manifest['batch_size']}; this run has {n} and "
            f"{run.batch_size}. Resume with the same n_workers and batch_size."
        )
    progress = manifest["async"]
    guard.last_checkpoint = path
    run.model.set_weights(state["weights"])
    adopt_learning_rate(run.model, state["optimizer"])
    epoch = load_cut(engine, state, progress, non_trainable_values(run.model))
    done = sum(len(v) for v in progress["done"].values())
    guard.announce(f"resumed from {path} at epoch {epoch + 1} (async, update "
                   f"{progress['version'] + 1}, {done} batches already applied)")
    return min(epoch, guard.epochs), 0
