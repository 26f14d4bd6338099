"""Sharded parameter servers for sync training (``placement="ps"``, ``num_ps=K``).

The trainable parameters are split over ``K`` servers by :func:`~dasktf.wire.packets.shard_plan`: every
variable is a piece, a variable larger than a fair share (``P / K``) is first cut
along its first axis, and the pieces go, largest first, to the least-loaded server
(size balanced within one piece). Server ``s`` runs on worker ``s mod N`` beside
that worker's replica and holds the float32 master copy of its slice and its own
optimizer state for it. Per step::

    step_task(w_i) ──► pick(chunk s) ──► ps_apply(s) on worker s mod N ──► weights slice s
      (every worker)     (local)         sum in float32, optimizer step      ──► next step_task
                                                                             (every worker)

so each server receives only its slice of every gradient and sends back only its
slice of the weights, optionally in fp16/bf16 (``weights_dtype``), while its master
copy stays float32. The optimizer on a slice is the model's optimizer applied to one
flat variable, which is exact for element-wise optimizers (SGD, momentum, Adam,
RMSprop, Adagrad, ...); so K servers give the same weights as one.

Every server update carries its global update number and a server applies each at
most once (a recovery may hand a step over again). Checkpoints, restore points and
re-forms read the servers' slices (:func:`ps_state_task`) and merge them into the
mirrored placement's state format, the optimizer variables laid out as the model's
own optimizer holds them (:class:`OptimizerLayout`): a ``num_ps=K`` checkpoint
resumes with any K or with the mirrored placement, and the other way round.
"""

from __future__ import annotations

import copy
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from dasktf import compat
from dasktf.runtime.manager import run_manager
from dasktf.wire.codecs import get_codec
from dasktf.wire.packets import (
    Packet,
    Ranges,
    account,
    gather_ranges,
    scatter_ranges,
    sum_parts,
)

if TYPE_CHECKING:
    from dasktf.runtime.replica import Replica

def server_workers(workers: list[str], num_ps: int) -> list[str]:
    """The worker each server (or async parameter holder) runs on: ``s mod N``,
    beside a replica; two share a worker only when there are fewer workers."""
    return [workers[s % len(workers)] for s in range(num_ps)]


#: The name of a server slice's flat variable: its optimizer's slot variables are
#: named ``ps_shard_<kind>`` (Keras names slots after their variable).
SLICE_NAME = "ps_shard"


#: Why parameter servers' slices refuse ``exclude_from_weight_decay``.
DECAY_REFUSAL = (
    "The optimizer leaves some variables out of its weight decay "
    "(exclude_from_weight_decay), which a parameter server's slice cannot keep: it "
    "holds its part of every variable as one flat variable, decayed alike. Use the "
    "p2p engine (the default) or placement='mirrored', and num_ps=1, for this optimizer.")


class PSShard:
    """One server's slice: the float32 master copy and its optimizer state."""

    def __init__(self, replica: Replica, ranges: Ranges, generation: int = 0) -> None:
        import keras
        import tensorflow as tf

        # The replica on this worker holds the same initial weights as every other
        # (async: the holder's own replica, built from the run's initial weights).
        initial = gather_ranges(replica.flat_weights(), ranges).copy()
        self.variable = keras.Variable(initial, dtype="float32", name=SLICE_NAME)
        opt = replica.model.optimizer
        if compat.weight_decay_excluded(opt, replica.variables):
            raise ValueError(DECAY_REFUSAL)
        self.optimizer = opt.__class__.from_config(opt.get_config())
        self.optimizer.build([self.variable])
        if int(opt.iterations.numpy()) and not hasattr(opt, "inner_optimizer"):
            # a trained model's optimizer goes on: this slice of its state
            layout = optimizer_layout(keras.optimizers.serialize(opt), replica.variables)
            slots = set(layout.slots())
            flat = layout.to_flat([np.asarray(v.numpy()) for v in opt.variables])
            self.load(initial, [gather_ranges(v, ranges) if j in slots else v
                                for j, v in enumerate(flat)])
        self._apply_fn = tf.function(
            self._apply,
            input_signature=[tf.TensorSpec((initial.size,), tf.float32),
                             tf.TensorSpec((), tf.float32)],
        )
        #: Sync runs: the last global update applied (each at most once), the packet
        #: it produced (handed out again if a recovery asks for that update again),
        #: the run's generation (a rewind's loads supersede older steps' tasks) and
        #: ``{update: snapshot}`` kept for a checkpoint of exactly that update.
        self.applied = replica.applied
        self.last: Packet | None = None
        self.generation = generation
        self.kept: dict[int, dict[str, Any]] = {}
        self.lock = threading.Lock()
        #: a ``scale_lr`` warm-up under way, as on the replicas (sync runs)
        self.lr_ramp: tuple[int, int, float, float] | None = None

    def _apply(self, total: Any, count: Any) -> None:
        self.optimizer.apply_gradients([(total / count, self.variable)])

    def apply(self, total: np.ndarray, count: int, lr_scale: float = 1.0) -> np.ndarray:
        """One optimizer step on the slice; ``lr_scale`` scales the learning rate of
        this step only (async ``staleness_lr``)."""
        if lr_scale != 1.0:
            base = float(self.optimizer.learning_rate.numpy())
            self.optimizer.learning_rate = base * lr_scale
            try:
                self._apply_fn(total, np.float32(count))
            finally:
                self.optimizer.learning_rate = base
        else:
            self._apply_fn(total, np.float32(count))
        return np.asarray(self.variable.numpy(), np.float32)

    def state(self) -> list[np.ndarray]:
        """The optimizer's variables (a checkpoint's part of this slice)."""
        return [np.asarray(v.numpy()) for v in self.optimizer.variables]

    def load(self, values: np.ndarray, optimizer: list[np.ndarray]) -> np.ndarray:
        self.variable.assign(values)
        for v, value in zip(self.optimizer.variables, optimizer, strict=True):
            v.assign(value)
        return np.asarray(self.variable.numpy(), np.float32)

    def snapshot(self) -> dict[str, Any]:
        """This slice's part of a training state: a consistent cut."""
        return {"applied": self.applied,
                "values": np.asarray(self.variable.numpy(), np.float32).copy(),
                "optimizer": self.state()}


def _server(run_id: str, shard: int, ranges: Ranges, generation: int) -> PSShard:
    """This worker's slice ``shard``; built from the local replica on first use.
    A slice a rewind or re-form took away or reloaded is not rebuilt for an older
    generation's task (cancelled, yet still running)."""
    from dasktf.runtime.replica import get_replica

    shards = run_manager().shards
    state = shards.get((run_id, shard))
    if state is None:
        if generation:
            raise RuntimeError(
                f"server slice {shard} of run {run_id} is not on this worker for "
                f"generation {generation}; this is a dasktf bug."
            )
        state = shards[(run_id, shard)] = PSShard(get_replica(run_id), ranges)
    return state


def ps_apply_task(
    run_id: str, shard: int, ranges: Ranges, weights_dtype: str | None, *parts: Packet,
    update: int = -1, keep: bool = False, generation: int = 0,
) -> Packet | None:
    """Server ``shard``: sum its slice of every worker's gradient, step the
    optimizer on it, return the slice of the new weights for the replicas.

    ``update``: the global update this step makes; a server applies it once and
    hands the same weights out again if asked twice. ``keep``: keep the slice's
    state after it for a checkpoint of exactly that update. A task of an older
    ``generation`` than the slice (a step a recovery cancelled) does nothing."""
    from distributed import get_worker

    address = get_worker().address
    account(run_id, parts)
    state = _server(run_id, shard, ranges, generation)
    with state.lock:
        if generation < state.generation or 0 <= update < state.applied:
            return None  # superseded (a recovery cancelled it): nobody gathers it
        if update >= 0 and update == state.applied and state.last is not None:
            return state.last  # asked again: the same weights, applied once
        if state.lr_ramp is not None and update >= 0:
            from dasktf.runtime.replica import ramped_learning_rate

            state.optimizer.learning_rate, done = ramped_learning_rate(state.lr_ramp, update)
            state.lr_ramp = None if done else state.lr_ramp
        total, count, loss_sum = sum_parts(parts)
        if total is not None and count:
            weights = state.apply(total, count)
        else:
            weights = np.asarray(state.variable.numpy(), np.float32)
        if update >= 0:
            state.applied = update
        if keep:
            state.kept[update] = state.snapshot()  # until read, as replicas keep
        state.last = Packet(get_codec(weights_dtype).encode(weights), count, loss_sum,
                            max(p.compute_seconds for p in parts), address,
                            kind="weights", update=update)
        return state.last


def ps_state_task(
    run_id: str, shard: int, ranges: Ranges, generation: int, update: int | None = None,
    after: Any = None,
) -> dict[str, Any]:
    """Slice ``shard``'s state: kept right after ``update`` if asked and kept, else
    as it is now (``after``: the task that kept it, a dependency never read)."""
    from dasktf.runtime.replica import take_kept

    state = _server(run_id, shard, ranges, generation)
    with state.lock:
        kept = take_kept(state.kept, update)
        return kept if kept is not None else state.snapshot()


def ps_load_task(
    run_id: str, slices: dict[int, tuple[Ranges, np.ndarray, list[np.ndarray]]],
    applied: int, generation: int,
) -> int:
    """Make this worker the server of exactly ``slices`` (``{shard: (ranges,
    values, optimizer variables)}``), at update ``applied``: a rewind, a re-form
    or a resume. The run's other slices here are dropped."""
    from dasktf.runtime.replica import get_replica

    shards = run_manager().shards
    for key in [k for k in shards if k[0] == run_id]:
        with shards[key].lock:  # after an apply in progress
            del shards[key]
    replica = get_replica(run_id)
    for shard, (ranges, values, optimizer) in slices.items():
        state = PSShard(replica, ranges, generation)
        state.load(values, optimizer)
        state.applied = applied
        shards[(run_id, shard)] = state
    return len(slices)


# -- the servers' state in the mirrored placement's format --------------------------
@dataclass(frozen=True)
class OptimizerLayout:
    """Where each of the model optimizer's variables is in a server slice's.

    A slice's optimizer (one flat variable) has the same scalars (iterations,
    learning rate, Nadam's product, ...) and one flat slot per kind (momentum,
    velocity, ...); the model's optimizer has one slot per kind and trainable
    variable, in an order of its own (Adam interleaves kinds per variable, RMSprop
    does not). ``entries[i]`` is ``("scalar", j)`` (the slice optimizer's j-th
    variable) or ``("slot", j, v)`` (the part of the slice optimizer's j-th
    variable that is trainable variable v).
    """

    entries: tuple[tuple[Any, ...], ...]
    n_slice: int
    sizes: tuple[int, ...]
    shapes: tuple[tuple[int, ...], ...]

    def slots(self) -> list[int]:
        """The slice optimizer's variables that are flat slots."""
        return sorted({e[1] for e in self.entries if e[0] == "slot"})

    def to_flat(self, optimizer: list[np.ndarray]) -> list[np.ndarray]:
        """The model optimizer's variables as a slice optimizer spanning every
        parameter would hold them."""
        out: list[Any] = [None] * self.n_slice
        offsets = np.concatenate([[0], np.cumsum(self.sizes)]).astype(int)
        for j in self.slots():
            out[j] = np.empty(int(offsets[-1]), np.float32)
        for entry, value in zip(self.entries, optimizer, strict=True):
            if entry[0] == "scalar":
                out[entry[1]] = np.asarray(value)
            else:
                _, j, v = entry
                out[j][offsets[v]:offsets[v + 1]] = np.asarray(value).ravel()
        return out

    def from_flat(self, flat: list[np.ndarray]) -> list[np.ndarray]:
        """The inverse of :meth:`to_flat`."""
        offsets = np.concatenate([[0], np.cumsum(self.sizes)]).astype(int)
        out = []
        for entry in self.entries:
            if entry[0] == "scalar":
                out.append(np.asarray(flat[entry[1]]))
            else:
                _, j, v = entry
                out.append(np.asarray(flat[j][offsets[v]:offsets[v + 1]])
                           .reshape(self.shapes[v]).copy())
        return out


def optimizer_layout(optimizer_config: Any, variables: list[Any]) -> OptimizerLayout:
    """Match a fresh model optimizer's variables (built on ``variables``) to a slice
    optimizer's by Keras' slot names (``<variable path>_<kind>``).

    Raises
    ------
    ValueError
        An optimizer whose state is not one slot per kind and variable (it cannot
        live on parameter servers' slices).
    """
    import keras

    # Keras' deserializer changes the config it is given: copies
    full = keras.optimizers.deserialize(copy.deepcopy(optimizer_config))
    full.build(variables)
    probe = keras.optimizers.deserialize(copy.deepcopy(optimizer_config))
    probe.build([keras.Variable(np.zeros(2, np.float32), name=SLICE_NAME)])
    prefix = SLICE_NAME + "_"
    kinds = {v.name[len(prefix):]: j for j, v in enumerate(probe.variables)
             if v.name.startswith(prefix) and tuple(v.shape) == (2,)}
    scalars = [j for j in range(len(probe.variables)) if j not in kinds.values()]
    by_name = {v.name: i for i, v in enumerate(full.variables)}
    entries: list[Any] = [None] * len(full.variables)
    for kind, j in kinds.items():
        for v, var in enumerate(variables):
            i = by_name.get(f"{var.path.replace('/', '_')}_{kind}")
            if i is None or tuple(full.variables[i].shape) != tuple(var.shape):
                raise ValueError(
                    f"{type(full).__name__}'s state is not one {kind!r} slot per "
                    "variable; parameter servers (placement='ps') cannot hold it."
                )
            entries[i] = ("slot", j, v)
    rest = [i for i, e in enumerate(entries) if e is None]
    if len(rest) != len(scalars) or any(full.variables[i].shape != () for i in rest):
        raise ValueError(
            f"{type(full).__name__}'s variables do not map onto a flat slice's; "
            "parameter servers (placement='ps') cannot hold its state."
        )
    for i, j in zip(rest, scalars, strict=False):
        entries[i] = ("scalar", j)
    return OptimizerLayout(tuple(entries), len(probe.variables),
                           tuple(int(np.prod(v.shape)) for v in variables),
                           tuple(tuple(v.shape) for v in variables))


def merge_server_states(
    replica_state: dict[str, Any], slices: list[dict[str, Any]], plan: list[Ranges],
    layout: OptimizerLayout, trainable: list[int],
) -> dict[str, Any]:
    """One training state from a replica's (counters, non-trainable weights) and
    the servers' slices (float32 master weights, optimizer state), in the mirrored
    placement's format. ``trainable``: the trainable variables' positions among
    the model's weights."""
    applied = {s["applied"] for s in slices}
    if applied != {replica_state["applied"]}:
        raise RuntimeError(
            f"the servers hold updates {sorted(applied)} but the replica "
            f"{replica_state['applied']}; this is a dasktf bug."
        )
    total = sum(layout.sizes)
    master = np.empty(total, np.float32)
    flat_opt: list[Any] = [None] * layout.n_slice
    for j in layout.slots():
        flat_opt[j] = np.empty(total, np.float32)
    for ranges, part in zip(plan, slices, strict=True):
        scatter_ranges(master, ranges, part["values"])
        for j, value in enumerate(part["optimizer"]):
            if j in layout.slots():
                scatter_ranges(flat_opt[j], ranges, np.asarray(value))
            elif flat_opt[j] is None:
                flat_opt[j] = np.asarray(value)  # scalars: the same on every server
    weights = list(replica_state["weights"])
    offsets = np.concatenate([[0], np.cumsum(layout.sizes)]).astype(int)
    for v, position in enumerate(trainable):
        weights[position] = master[offsets[v]:offsets[v + 1]].reshape(layout.shapes[v])
    return {**replica_state, "weights": weights, "optimizer": layout.from_flat(flat_opt)}


def split_server_states(
    state: dict[str, Any], plan: list[Ranges], layout: OptimizerLayout,
    trainable: list[int],
) -> list[tuple[Ranges, np.ndarray, list[np.ndarray]]]:
    """Each server's ``(ranges, values, optimizer variables)`` of a training state
    (the inverse of :func:`merge_server_states`)."""
    master = np.concatenate([np.asarray(state["weights"][p], np.float32).ravel()
                             for p in trainable])
    flat_opt = layout.to_flat(state["optimizer"])
    slots = set(layout.slots())
    return [
        (ranges, gather_ranges(master, ranges).copy(),
         [gather_ranges(v, ranges).copy() if j in slots else np.asarray(v)
          for j, v in enumerate(flat_opt)])
        for ranges in plan
    ]


def set_shards_learning_rate(run_id: str, lr: float) -> None:
    """The servers' optimizers on this worker follow a learning rate the run set."""
    for key, state in run_manager().shards.items():
        if key[0] == run_id:
            state.lr_ramp = None
            state.optimizer.learning_rate = lr


def ramp_shards_learning_rate(run_id: str, factor: float, steps: int) -> None:
    """The servers on this worker warm up to ``factor`` times their learning rate
    over the next ``steps`` updates (``scale_lr``), as the replicas do."""
    for key, state in run_manager().shards.items():
        if key[0] == run_id:
            with state.lock:
                old = float(state.optimizer.learning_rate.numpy())
                state.lr_ramp = (state.applied + 1, max(1, int(steps)), old, old * factor)

