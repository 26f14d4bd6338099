"""What a replica hands back at an epoch end, whichever engine drove its steps."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from dasktf.runtime.replica import EpochReport
from dasktf.wire.packets import traffic

if TYPE_CHECKING:
    from dasktf.runtime.replica import Replica


def epoch_report(replica: Replica, with_weights: bool,
                 statistics: list[np.ndarray] | None = None, flush: bool = True
                 ) -> EpochReport:
    """The epoch's report of ``replica``, whose last update is applied.

    ``statistics``: the replicas' averaged moving statistics (BatchNormalization's),
    which replace this replica's own first, so validation, the weights reported, the
    checkpoint and the next epoch all use statistics of the whole data and the
    replicas agree again. Then the step records still buffered go out (``flush``;
    else the report takes them, :attr:`EpochReport.records`), and the report takes
    the metric states (reset after), validation on this replica's piece, the
    weights (and the seed streams) if asked, the byte ledger and the rounds' log.
    """
    from distributed import get_worker

    if statistics is not None:
        replica.set_non_trainable(statistics)
    if flush:
        replica.events.flush()
    records = None if flush else replica.events.take() or None
    train = replica.metric_states()
    replica.model.reset_metrics()
    val = replica.evaluate()
    replica.model.reset_metrics()
    seconds, replica.step_seconds = replica.step_seconds, []
    weights = [np.asarray(w) for w in replica.model.get_weights()] if with_weights else None
    ledger = traffic(replica.run_id) if replica.comm is not None else None
    rounds = replica.rounds.take_log() if replica.rounds is not None else None
    return EpochReport(get_worker().address, train, val, weights, seconds, ledger,
                       rounds=rounds, seeds=replica.seed_values() if with_weights else None,
                       records=records)
