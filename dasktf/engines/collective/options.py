"""Which runs the collective engine takes: plain sync steps, checkpointed at epoch
ends (the family's rules, reached through the factory, :mod:`dasktf.run.engine`)."""

from __future__ import annotations

from typing import Any


def options_refusal(options: Any, fault: Any = None) -> str | None:
    """Why ``engine="collective"`` cannot run a trainer's ``options`` (with a fit
    call's ``fault`` options), or ``None``."""
    if options.engine != "collective":
        return None
    if options.mode != "sync" or options.sync_quorum is not None or options.slow_workers:
        return ("engine='collective' runs plain sync training (every step all-reduces "
                "all workers' gradients); it has no async, sync_quorum or slow_workers. "
                "Use engine='graph' for those.")
    if options.local is not None:
        return ("engine='collective' all-reduces a gradient every step inside "
                "TensorFlow; rounds of local steps run on the p2p and task-graph "
                "engines (engine='auto', 'p2p' or 'graph'), which average once per round.")
    asked = [name for name in ("checkpoint_every", "scale_lr")
             if fault is not None and getattr(fault, name)]
    if asked:
        return (f"engine='collective' does not support {', '.join(asked)}: it "
                "checkpoints at every epoch end (checkpoint_dir, resume=True) and a lost "
                "worker ends the run with WorkerLostError. Use engine='graph' for step "
                "checkpoints and in-run recovery.")
    return None
