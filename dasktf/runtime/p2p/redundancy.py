"""Redundant slices of a sharded optimizer: nothing lost with a lost worker (issue 38).

With ``shard_state="optimizer"`` rank r alone holds slice r of the optimizer
(:mod:`dasktf.runtime.p2p.sharding`); a lost worker would take its slice with it.
With ``redundancy=1`` (the default) rank r also keeps a copy of slice r - 1 (mod
N), its *backup*, and applies to it the very update its owner applies:

* the owner relays its summed slice (the reduce-scatter's output, the same bits)
  to the next rank, which applies it to its copy with the same optimizer, the same
  clipping factors and the same learning rate, so both copies hold the same values,
  the new weights of the slice included: so the all-gather does not send the
  owner's new slice to that rank, and the relay costs no byte more than an
  unsharded step (1/N of the gradient's bytes each, one for the other). The owner
  sending its updated slots instead would cost a slot's bytes per slot (Adam: 2/N
  of the gradient's) on top, every member sending its part to both holders
  (N-1)/N;
* before anyone applies update u, every member tells every other that it holds
  what it needs to apply u (its summed slice and the relayed one: a *ready*
  round of empty messages), and keeps that as its *pending* update. A member
  applies u (claims it) only once every member is ready; so if one survivor of a
  loss applied u, every survivor held its pending u, and the recovery completes it
  there (:meth:`RedundantShard.complete`): every slice then has a copy at the same
  update, whichever worker was lost, during the reduce-scatter or the all-gather.

The recovery (:func:`recovered_state` over every survivor's
:func:`slices_task`) puts the whole optimizer and the trainable weights together
from one copy of each slice (the owner's, or the backup's where the owner was
lost); :func:`reshard_task` loads them into every survivor, which builds the whole
optimizer again, and the next step cuts it over the N - 1 survivors. A checkpoint's
state (the slices gathered), a resume and a re-form load the same way, and so does
the rewind of a run with ``redundancy=0`` (a lost slice had no copy): the survivors
go back to the run's newest checkpoint in the epoch (``rewind``; see
:mod:`dasktf.engines.p2p.engine`).

Per worker this holds (1 + redundancy)/N of the unsharded optimizer's slots.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from dasktf import compat
from dasktf.exceptions import ShardingError
from dasktf.runtime.p2p.sharding import ShardOptimizer, assemble_optimizer

if TYPE_CHECKING:
    from dasktf.runtime.replica import Replica

#: The values of ``redundancy``: copies of each slice besides its owner's.
REDUNDANCIES = (0, 1)


def check_redundancy(value: Any) -> None:
    """Refuse a ``redundancy`` this version cannot keep, saying why."""
    if value is None or (isinstance(value, int) and not isinstance(value, bool)
                         and value in REDUNDANCIES):
        return
    raise ValueError(
        f"redundancy must be 0 (each optimizer slice on one worker: a lost worker "
        f"sends the run back to its last checkpoint, or stops it) or 1 (each slice "
        f"on a second worker too: a lost worker costs nothing); got {value!r}.")


@dataclass
class Pending:
    """What a member needs to apply ``update`` to its slice and its backup."""

    update: int
    chunk: np.ndarray
    relayed: np.ndarray
    count: int
    #: the clipping factors, once the members' norms were summed
    scales: np.ndarray | None = None


class RedundantShard(ShardOptimizer):
    """Rank ``rank`` of ``n``'s slice of the optimizer and a copy of rank ``rank - 1``'s
    (:attr:`backup`), updated alike (see the module)."""

    def __init__(self, replica: Replica, rank: int, n: int) -> None:
        import tensorflow as tf

        from dasktf.runtime.keras_step import SignatureFunction

        # built first: the whole optimizer is still the model's
        self.backup = ShardOptimizer(replica, (rank - 1) % n, n, take_over=False)
        super().__init__(replica, rank, n)
        # Both slices' updates in one TensorFlow call: on a small model a call's
        # fixed cost is most of an apply (benchmarks/shard_redundancy.py).
        lo, hi = self.edges[rank], self.edges[rank + 1]
        b_lo, b_hi = self.backup.edges[self.backup.rank], self.backup.edges[self.backup.rank + 1]
        self._apply_both = SignatureFunction(self._apply_both_body, [
            tf.TensorSpec((hi - lo,), tf.float32), tf.TensorSpec((b_hi - b_lo,), tf.float32),
            tf.TensorSpec((), tf.float32), tf.TensorSpec((len(self.parts),), tf.float32)])
        self.pending: Pending | None = None
        #: the update applied here and the weights not taken yet: the slices'
        #: values are their pieces', not the model's
        self.torn = False
        #: held while an update is claimed and applied, and while a recovery reads
        self.lock = threading.Lock()

    def step(self, replica: Replica, update: int, chunk: np.ndarray, count: int,
             exchange: Callable[[np.ndarray], np.ndarray],
             relay: Callable[[np.ndarray], np.ndarray]
             ) -> tuple[np.ndarray, np.ndarray] | None:
        """The slice's new values and its backup's (which the all-gather then
        does not bring: its owner does not send them here), ``None`` if not
        applied here."""
        if not count:  # the same on every member: none applies
            return None
        pending = Pending(update, chunk, relay(chunk), count)
        with self.lock:  # kept before this member says it is ready
            self.pending = pending
        exchanged = False

        def counted(vector: np.ndarray) -> np.ndarray:
            nonlocal exchanged
            exchanged = True
            return exchange(vector)
        # Sent after the relay came: the clipping norms' (or the loss scale's
        # vote's) exchange is the ready round, else an empty one is.
        pending.scales = self.scales(chunk, count, counted)
        if not exchanged:
            exchange(np.zeros(0))  # ready: every member can apply ``update``
        with self.lock:
            if not replica.claim_update(update):
                return None
            return self._apply_pending(pending)

    def _apply_pending(self, p: Pending) -> tuple[np.ndarray, np.ndarray]:
        """Apply ``p`` to the backup and to the slice (under :attr:`lock`); the
        slice's new values and the backup's."""
        assert p.scales is not None
        new, copied = self._apply_both(p.chunk, p.relayed, np.float32(p.count), p.scales)
        self.pending, self.torn = None, True
        return np.asarray(new), np.asarray(copied)

    def _apply_both_body(self, chunk: Any, relayed: Any, count: Any, scales: Any) -> Any:
        """The backup's update and the slice's (a TF body): their new values."""
        import keras

        # The slice's learning rate is the one a callback or a warm-up sets: the
        # backup takes it here, in the call (set eagerly, it cost r1's step 7% of
        # its CPU: benchmarks/RESULTS.md)
        rate, mirror = self.optimizer.learning_rate, self.backup.optimizer.learning_rate
        if isinstance(rate, keras.Variable) and isinstance(mirror, keras.Variable):
            mirror.assign(rate)
        copied = self.backup._apply_body(relayed, count, scales)
        return self._apply_body(chunk, count, scales), copied

    def taken(self) -> None:
        self.torn = False

    def complete(self, replica: Replica, target: int) -> None:
        """A recovery's: apply the pending ``target`` here if this member was
        ready for it and did not apply it (fenced: counted here)."""
        with self.lock:
            p = self.pending
            if (replica.applied >= target or p is None or p.update != target
                    or p.scales is None):
                return
            self._apply_pending(p)
            with replica.apply_lock:
                replica.applied_log.append(target)
                replica.applied = target

    def copies(self) -> list[dict[str, Any]]:
        """Each slice held here: its rank, its values and its optimizer variables."""
        out = []
        for shard in (self, self.backup):
            values = (np.concatenate([np.asarray(p.numpy()) for p in shard.pieces])
                      if self.torn else shard.own_values())
            out.append({"slice": shard.rank, "values": values,
                        "optimizer": [np.asarray(v.numpy()) for v in shard.optimizer.variables]})
        return out

    def slot_bytes(self) -> int:
        return super().slot_bytes() + self.backup.slot_bytes()


def redundant_shard(replica: Replica, rank: int, n: int) -> ShardOptimizer:
    """Rank ``rank`` of ``n``'s slice with a copy of its neighbour's; alone in its
    group, the whole optimizer has no other worker to be copied to."""
    return RedundantShard(replica, rank, n) if n > 1 else ShardOptimizer(replica, rank, n)


# -- the worker side of a recovery or a load ---------------------------------------------
def slices_task(run_id: str, target: int) -> dict[str, Any]:
    """This survivor's copies of the optimizer's slices at update ``target`` (its
    pending one completed first); its whole state if it holds no slices."""
    from dasktf.runtime.replica import get_replica

    replica = get_replica(run_id)
    shard = replica.shard_optimizer
    if isinstance(shard, RedundantShard):
        shard.complete(replica, target)
        with shard.lock, replica.apply_lock:
            return {"applied": replica.applied, "n": shard.n, "layout": shard.layout,
                    "copies": shard.copies(), "whole": None}
    if shard is not None:  # redundancy 0: this slice alone
        with replica.apply_lock:
            return {"applied": replica.applied, "n": shard.n, "layout": shard.layout,
                    "copies": [{"slice": shard.rank, "values": shard.own_values(),
                                "optimizer": [np.asarray(v.numpy())
                                              for v in shard.optimizer.variables]}],
                    "whole": None}
    return {"applied": replica.applied, "whole": replica.training_state()}


def reshard_task(run_id: str, state: dict[str, Any], flat: np.ndarray | None = None,
                 unfence: bool = True, rewind: bool = False) -> int:
    """Load ``state`` (its ``optimizer`` whole) into the replica, its slices (if
    any) dropped for the whole optimizer again: the next step cuts it over the
    group it runs in. ``state["weights"]`` ``None``: the model's own are kept, the
    trainable ones then set from ``flat``. ``rewind``: an older state than the
    replica's (a restore point: see
    :func:`~dasktf.runtime.reconcile.set_state_task`). Returns the update it holds."""
    import tensorflow as tf

    from dasktf.runtime.reconcile import learning_rate_of, set_state_task
    from dasktf.runtime.replica import get_replica

    replica = get_replica(run_id)
    with replica.apply_lock:
        shard = replica.shard_optimizer
        if shard is not None:
            whole = type(shard.optimizer).from_config(shard.config)
            compat.exclude_from_weight_decay(whole, replica.variables, compat.weight_decay_excluded(
                shard.optimizer, shard.pieces))
            with tf.device(replica.device):
                whole.build(replica.variables)
            rate = learning_rate_of(replica.model.optimizer)  # the slice's, live
            if rate is not None:  # (the config's is the one the slices were cut at)
                whole.learning_rate = rate
            replica.model.optimizer = whole
            replica.shard_optimizer = None
        if state.get("weights") is None:
            state = {**state, "weights": replica.model.get_weights()}
    if rewind:
        from dasktf.runtime.p2p.links import link

        link(run_id).gate.drop_results()
    applied = set_state_task(run_id, state, unfence, rewind)
    if flat is not None:
        with replica.apply_lock:
            at = np.cumsum([0, *replica.sizes])
            for j, v in enumerate(replica.variables):
                v.assign(np.asarray(flat[at[j]:at[j + 1]]).reshape(replica.shapes[j]))
    return applied


# -- the client side -------------------------------------------------------------------
def recovered_state(reads: list[dict[str, Any]], target: int,
                    shapes: list[tuple[int, ...]]) -> tuple[dict[str, Any], np.ndarray | None]:
    """The state at update ``target`` from the survivors' :func:`slices_task`: one
    copy of each slice; and the trainable weights, flat (``None``: the state's own
    weights are whole). Raises :class:`ShardingError` when a slice has no copy left
    at ``target``."""
    for read in reads:
        if read["whole"] is not None and read["applied"] == target:
            return read["whole"], None
    found: dict[int, dict[str, Any]] = {}
    for read in reads:
        if read["whole"] is None and read["applied"] == target:
            for copy in read["copies"]:
                found.setdefault(copy["slice"], {**copy, "layout": read["layout"]})
    n = max((int(r["n"]) for r in reads if r["whole"] is None), default=0)
    missing = [s for s in range(n) if s not in found]
    if missing or not found:
        raise ShardingError(
            f"slice(s) {missing} of the optimizer have no copy left on the surviving "
            f"workers at update {target} (with redundancy=1 each slice lives on two "
            "neighbouring workers: both were lost), and the run kept no checkpoint "
            "in this epoch to go back to. Keep checkpoints (checkpoint_dir=; "
            "checkpoint_every= for points inside epochs): the run then goes back to "
            "the last one by itself; or resume from an earlier one (resume=True).")
    states = [{"rank": s, "layout": found[s]["layout"], "optimizer": found[s]["optimizer"]}
              for s in range(n)]
    flat = np.concatenate([np.asarray(found[s]["values"], np.float32) for s in range(n)])
    return {"weights": None, "optimizer": assemble_optimizer(states, shapes),
            "applied": target}, flat
