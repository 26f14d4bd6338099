"""The one way a loop that polls keeps its time limit (no dasktf imports: every
room may use it)."""

from __future__ import annotations

import time
from collections.abc import Callable


class Deadline:
    """The time limit of one wait, so a polling loop asks instead of keeping a clock."""

    def __init__(self, seconds: float) -> None:
        self.seconds = float(seconds)
        self._end = time.monotonic() + self.seconds

    def passed(self) -> bool:
        return time.monotonic() > self._end

    def left(self) -> float:
        return max(0.0, self._end - time.monotonic())


def poll_until(ready: Callable[[], bool], seconds: float, interval: float) -> bool:
    """Ask ``ready()`` every ``interval`` seconds; ``True`` once it says so,
    ``False`` when ``seconds`` passed first."""
    deadline = Deadline(seconds)
    while not ready():
        if deadline.passed():
            return False
        time.sleep(interval)
    return True
