"""The errors dasktf raises, so that callers can tell a failed run from a bad call.

Bad arguments raise the built-in ``ValueError`` / ``TypeError``; everything that goes
wrong once training has started derives from :class:`DasktfError`. What a run
says without failing is a warning of one of the categories at the end.
"""

from __future__ import annotations


class DasktfError(RuntimeError):
    """Base class of the errors raised while a run is under way."""


class SchedulerUnreachableError(DasktfError, OSError):
    """No Dask scheduler answered at the given address within the timeout."""


class WorkerLostError(DasktfError):
    """A worker that held a replica left the cluster during a run.

    ``workers`` are the lost workers' addresses; ``phase`` says when: one of the
    set-up's phases (``"connecting"``, ``"registering plugins"``, ``"placing data"``,
    ``"building replicas"``, ``"starting the engine"``), ``"the first step"``, or
    ``None`` once training was under way.
    """

    def __init__(self, message: str, workers: list[str] | None = None,
                 phase: str | None = None) -> None:
        super().__init__(message)
        self.workers = list(workers or [])
        self.phase = phase


class PeerLostError(WorkerLostError):
    """A peer of a worker-to-worker collective (:mod:`dasktf.runtime.p2p`) was lost:
    its connection closed, or it stopped answering, during update ``step``."""

    def __init__(self, message: str, address: str, step: int) -> None:
        super().__init__(message, [address])
        self.address = address
        self.step = step

    def __reduce__(self) -> tuple[type, tuple[str, str, int]]:
        # raised on a worker, read on the client: keep the address and step
        return type(self), (str(self), self.address, self.step)


class PeerTimeoutError(PeerLostError, TimeoutError):
    """A peer of a worker-to-worker collective sent nothing within
    ``dasktf.p2p.timeout`` (alive as far as its connection shows, but stuck)."""


class CollectiveAbortedError(DasktfError):
    """A worker-to-worker collective was stopped on purpose (the run decided to end),
    releasing a worker that waited in it."""


class AllWorkersLostError(WorkerLostError):
    """The last worker of a run was lost; raised after a checkpoint was saved (if a
    ``checkpoint_dir`` was given) whose path the message names."""


class ReplicaError(DasktfError):
    """Building a replica, or a step on one, failed on its worker."""


class ShardingError(DasktfError):
    """A run with sharded optimizer state (``shard_state="optimizer"``) lost a slice
    of the optimizer: a lost worker with ``redundancy=0`` (its slice had no other
    copy), or both copies of a slice lost at once with ``redundancy=1``."""


class StepTimeoutError(DasktfError, TimeoutError):
    """A step did not finish within ``dasktf.step-timeout``."""


class SecurityWarning(UserWarning):
    """dasktf started a network service that listens beyond loopback or without
    authentication (the collective engine's TensorFlow servers)."""


class EngineHint(UserWarning):
    """Another engine would likely have run this job faster; nothing was switched."""


class WorkerEnvironmentWarning(UserWarning):
    """A worker's process was started with settings that slow training (glibc's
    malloc thresholds); nothing was changed."""
