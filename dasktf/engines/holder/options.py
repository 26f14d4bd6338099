"""The async and quorum options, checked before anything starts (the family's
rules, reached through the factory, :mod:`dasktf.run.engine`), and where the
holders go.
"""

from __future__ import annotations

from typing import Any

from dasktf.engines.base import check_integer

#: Accepted values of ``staleness_lr``.
STALENESS_LR = (None, "inverse")


# -- argument validation (the public boundary calls these) ---------------------------
def validate_mode_options(
    mode: str,
    max_staleness: Any,
    staleness_lr: Any,
    sync_quorum: Any,
    slow_workers: Any,
    n_workers: int | None = None,
) -> dict[int, float]:
    """Check the async/quorum/straggler options; return ``slow_workers`` as a dict.

    ``n_workers`` (when known) bounds ``sync_quorum`` and the slowed indices.
    """
    if max_staleness is not None:
        check_integer("max_staleness", max_staleness, 0)
        if mode != "async":
            raise ValueError(
                f"max_staleness bounds the staleness of mode='async'; got mode={mode!r}."
            )
    if staleness_lr not in STALENESS_LR:
        raise ValueError(f"staleness_lr must be None or 'inverse'; got {staleness_lr!r}.")
    if staleness_lr is not None and mode != "async":
        raise ValueError(f"staleness_lr applies to mode='async'; got mode={mode!r}.")
    if sync_quorum is not None:
        check_integer("sync_quorum", sync_quorum, 1, expected="an integer >= 1")
        if mode != "sync":
            raise ValueError(
                f"sync_quorum makes sync steps use the first k of N gradients; it needs "
                f"mode='sync', got mode={mode!r}."
            )
        if n_workers is not None and sync_quorum > n_workers:
            raise ValueError(
                f"sync_quorum={sync_quorum} exceeds the {n_workers} worker(s) of the run; "
                f"a step can wait for at most all of them (use 1..{n_workers})."
            )
    slow: dict[int, float] = {}
    if slow_workers:
        if not isinstance(slow_workers, dict):
            raise TypeError(
                "slow_workers must be a dict {worker index: slow-down factor}, e.g. "
                f"{{0: 4}}; got {type(slow_workers).__name__}."
            )
        for index, factor in slow_workers.items():
            check_integer("a slow_workers index", index, 0)
            if n_workers is not None and index >= n_workers:
                raise ValueError(
                    f"slow_workers index {index} is out of range for {n_workers} "
                    f"worker(s); use 0..{n_workers - 1}."
                )
            if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor >= 1:
                raise ValueError(
                    f"slow_workers[{index}] must be a factor >= 1 (4 makes that worker "
                    f"take 4x its compute time); got {factor!r}."
                )
            slow[int(index)] = float(factor)
    return slow


def check_staleness_lr(staleness_lr: str | None, optimizer_config: dict[str, Any] | None
                       ) -> None:
    """Refuse ``staleness_lr`` with an optimizer whose learning rate is a schedule."""
    if staleness_lr is not None and optimizer_config is not None and isinstance(
        optimizer_config.get("config", {}).get("learning_rate"), dict
    ):
        raise ValueError(
            "staleness_lr='inverse' scales a fixed learning rate; this optimizer "
            "has a LearningRateSchedule. Use a float learning rate, or drop "
            "staleness_lr."
        )


def options_refusal(options: Any, fault: Any = None) -> str | None:
    """Why a trainer's ``options`` (with a fit call's ``fault`` options) ask the
    holders' family (or the servers that split the optimizer like it) for what it
    cannot do, or ``None``."""
    if options.local is not None and options.sync_quorum is not None:
        return ("local_steps (and an outer optimizer) cannot combine with sync_quorum: "
                "a quorum drops the late workers' gradients of a step, while a round's "
                "change is a worker's whole round of steps. Use mode='async' with "
                "local_steps for rounds that never wait for a slow worker.")
    if options.local is not None and (options.comm.num_ps > 1
                                      or options.comm.placement == "ps"):
        return ("local_steps does not combine with num_ps > 1: the parameter servers "
                "(or async holders) would each hold a slice of the outer optimizer, "
                "which dasktf does not build. Rounds already cut the traffic H-fold, "
                "which is what sharding the servers is for; drop num_ps.")
    if fault is not None and fault.scale_lr and (options.mode != "sync"
                                                 or options.sync_quorum is not None):
        # An async update (or a quorum step's share) is one worker's batch, whose
        # size a change of the worker count does not touch: there is no global
        # batch for the linear scaling rule to follow.
        return ("scale_lr follows the global batch of sync steps when the worker count "
                "changes; an async or sync_quorum update is one worker's batch, which "
                "does not change with the worker count. Use mode='sync' without "
                "sync_quorum, or leave scale_lr off (the learning rate stays as given).")
    return None


def setup_refusal(options: Any, fault: Any, survivors: int) -> str | None:
    """Why a run of this family cannot be set up again on ``survivors`` workers
    after a loss during its set-up, or ``None``."""
    if options.sync_quorum is not None and options.sync_quorum > survivors:
        return (f"sync_quorum={options.sync_quorum} needs that many workers and "
                f"{survivors} are left. Restart the worker(s) or lower sync_quorum")
    if options.mode == "async" and fault.resume:
        return ("an async run resumes only on as many workers as wrote its "
                "checkpoint. Restart the worker(s) and resume again")
    return None


def choose_holder(workers: list[str], slow_workers: dict[int, float]) -> int:
    """The holder's worker index: the first worker that is not slowed down (the
    applies run in the holder's own thread, but a slowed process would still blur
    what a straggler costs)."""
    for i in range(len(workers)):
        if slow_workers.get(i, 1.0) <= 1.0:
            return i
    return 0
