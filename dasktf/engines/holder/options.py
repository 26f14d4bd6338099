"""The async and quorum options, checked before anything starts, and where the
holders go.
"""

from __future__ import annotations

from typing import Any

import numpy as np

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
    def _int(name: str, value: Any, low: int) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}; got {value!r}.")

    if max_staleness is not None:
        _int("max_staleness", max_staleness, 0)
        if mode != "async":
            raise ValueError(
                f"max_staleness bounds the staleness of mode='async'; got mode={mode!r}."
            )
    if staleness_lr not in STALENESS_LR:
        raise ValueError(f"staleness_lr must be None or 'inverse'; got {staleness_lr!r}.")
    if staleness_lr is not None and mode != "async":
        raise ValueError(f"staleness_lr applies to mode='async'; got mode={mode!r}.")
    if sync_quorum is not None:
        _int("sync_quorum", sync_quorum, 1)
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
            _int("a slow_workers index", index, 0)
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


def spread_holders(order: list[str], num_ps: int) -> list[str]:
    """Holder ``s`` on ``order[s]``; round the list again (two holders on one worker)
    only when it has fewer workers than holders."""
    return [order[s % len(order)] for s in range(num_ps)]


def choose_holder(workers: list[str], slow_workers: dict[int, float]) -> int:
    """The holder's worker index: the first worker that is not slowed down (the
    applies run in the holder's own thread, but a slowed process would still blur
    what a straggler costs)."""
    for i in range(len(workers)):
        if slow_workers.get(i, 1.0) <= 1.0:
            return i
    return 0
