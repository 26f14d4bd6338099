"""A replica's backward pass a group of layers at a time, the last group first.

One ``GradientTape.gradient`` call returns the whole gradient: with
``shard_state="gradients"`` (ZeRO-2) that own gradient, 4 bytes a parameter, is
the largest gradient buffer a worker holds, sharded or not. A model with cuts
(tensors every path from its input to its output goes through: after each layer of
a ``keras.Sequential``, between a functional model's blocks: :func:`model_blocks`)
can give it in parts instead: the forward pass records
each group on a tape of its own (a gradient call walks back everything its tape
recorded: on one persistent tape, each group's call would walk back to the first
layer), then each group's gradient is one call from its output's gradient
(``output_gradients``) back to its input, so the sharded step sends a group's parts to their owners and drops them
before the next group's are computed
(:func:`~dasktf.runtime.p2p.buckets.bucketed_update`). DeepSpeed frees gradient
buckets from hooks inside the backward pass; Keras on TensorFlow has no such hooks,
and this is the same bound at a layer's grain.

The values are those of the one-call backward pass (the same ops, run in parts,
eagerly), to float32 rounding. A model this cannot cut (no cut, a layer that
adds losses of its own or masks its output, or variables out of layer order)
keeps the one call (:func:`layer_stages` returns ``None``).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from dasktf.data.shards import Shard
    from dasktf.runtime.replica import Replica


@dataclass(frozen=True)
class Block:
    """What runs between two cuts of the model (tensors that every path from its
    input to its output goes through): a chain's one layer, or a functional graph's
    calls from one cut to the next (a residual block, say: a residual sum is never
    cut). Called on the value at the cut before, it gives the value at the next."""

    #: the layers it calls, in the model's order (their variables its gradient's)
    layers: tuple[Any, ...]
    #: a functional graph's calls, each ``(operation, args, kwargs, outputs)``
    #: (:func:`dasktf.compat.functional_calls`); none: ``layers[0]`` alone
    calls: tuple[tuple[Any, ...], ...] = ()
    #: the symbolic tensors at the cut before and at the cut after (functional)
    source: Any = None
    sink: Any = None

    def __call__(self, value: Any) -> Any:
        import keras

        if not self.calls:
            return self.layers[0](value, training=True)
        # as Keras' functional call runs its graph: each call's own arguments, the
        # graph's tensors given their values, and the run's training=
        values = {id(self.source): value}

        def given(x: Any) -> Any:
            return values[id(x)] if isinstance(x, keras.KerasTensor) else x

        for operation, args, kwargs, outputs in self.calls:
            args, kwargs = keras.tree.map_structure(given, (args, kwargs))
            if isinstance(operation, keras.layers.Layer):
                kwargs["training"] = True
            result = operation(*args, **kwargs)
            values.update(zip(map(id, outputs), keras.tree.flatten(result), strict=True))
        return values[id(self.sink)]


@dataclass(frozen=True)
class Stage:
    """Consecutive blocks and the flat range ``[start, stop)`` of their trainable
    variables in the replica's gradient buffer."""

    blocks: tuple[Block, ...]
    start: int
    stop: int
    first: int  # the index of the stage's first trainable variable
    count: int  # how many trainable variables it has


def layer_stages(model: Any, variables: list[Any], min_values: int) -> list[Stage] | None:
    """``model``'s blocks (:func:`model_blocks`) grouped into stages of at least
    ``min_values`` parameters each where blocks allow (a block is never cut), in
    forward order; ``None`` when the model cannot be run in parts here."""
    import keras

    blocks = model_blocks(model)
    if blocks is None or model.losses:
        return None  # (a regularizer's gradient reaches the weights from the loss)
    where = {id(v): i for i, v in enumerate(variables)}
    sizes = [int(np.prod(v.shape)) for v in variables]
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(int)
    stages: list[Stage] = []
    group: list[Block] = []
    order: list[int] = []
    first = 0
    for block in blocks:
        for layer in block.layers:
            if (getattr(layer, "activity_regularizer", None) is not None
                    or getattr(layer, "mask_zero", False)
                    or isinstance(layer, keras.layers.Masking)):
                return None
            order += [where.get(id(v), -1) for v in layer.trainable_variables]
        group.append(block)
        done = len(order)
        if order[first:] != list(range(first, done)):
            return None  # a variable shared, out of order or not a layer's
        if done > first and offsets[done] - offsets[first] >= min_values:
            stages.append(Stage(tuple(group), int(offsets[first]), int(offsets[done]),
                                first, done - first))
            group, first = [], done
    if len(order) != len(variables):
        return None  # a trainable variable outside the layers
    if group:  # the last blocks: a stage of their own if they have variables
        if first < len(order) or not stages:
            stages.append(Stage(tuple(group), int(offsets[first]), int(offsets[-1]),
                                first, len(order) - first))
        else:
            last = stages.pop()
            stages.append(Stage(last.blocks + tuple(group), last.start, last.stop,
                                last.first, last.count))
    return stages


def model_blocks(model: Any) -> list[Block] | None:
    """``model`` cut where one tensor carries everything on to the output, in
    forward order: a ``keras.Sequential`` after each layer; a functional model (one
    input, one output, every operation called once) wherever, in the order Keras
    runs its graph, the value just computed is the only one a later call or the
    output still needs. ``None`` for a graph with no such order or a subclassed
    model, whose ``call`` is its own."""
    import keras

    from dasktf import compat

    if isinstance(model, keras.Sequential):
        return [Block((layer,)) for layer in model.layers]
    calls = compat.functional_calls(model)
    if (calls is None or type(model).call is not compat.functional_class().call
            or len(model.inputs) != 1 or len(model.outputs) != 1):
        return None
    calls = [c for c in calls if not isinstance(c[0], keras.layers.InputLayer)]

    def tensors(args: Any, kwargs: Any) -> list[Any]:
        return [t for t in keras.tree.flatten((args, kwargs))
                if isinstance(t, keras.KerasTensor)]

    uses: dict[int, int] = {id(model.outputs[0]): 1}  # the output is needed at the end
    for _, args, kwargs, _ in calls:
        for t in tensors(args, kwargs):
            uses[id(t)] = uses.get(id(t), 0) + 1
    source = model.inputs[0]
    live = {id(source)}  # values computed that a later call (or the output) needs
    blocks: list[Block] = []
    pending: list[tuple[Any, ...]] = []
    for call in calls:
        _, args, kwargs, outputs = call
        for t in tensors(args, kwargs):
            uses[id(t)] -= 1
            if not uses[id(t)]:
                live.discard(id(t))
        live |= {id(t) for t in outputs if uses.get(id(t))}
        pending.append(call)
        if len(outputs) == 1 and live == {id(outputs[0])}:  # a cut
            layers = tuple(c[0] for c in pending if isinstance(c[0], keras.layers.Layer))
            blocks.append(Block(layers, tuple(pending), source, outputs[0]))
            source, pending = outputs[0], []
    return blocks if not pending and source is model.outputs[0] else None


class StagedBackward:
    """One batch's forward pass, its loss and metrics counted, and its gradient
    given a stage at a time by :meth:`parts` (the mean's, not yet times the
    batch's rows ``count``)."""

    def __init__(self, replica: Replica, stages: list[Stage], batch: Shard) -> None:
        import tensorflow as tf

        from dasktf.runtime.keras_step import batch_args

        self.replica, self.stages = replica, stages
        self.size = int(sum(replica.sizes))
        self.count = len(batch)
        self.loss_sum = 0.0
        #: the most bytes of the gradient a stage gave at once (what it held: its
        #: parts are views of one backward call's output)
        self.largest = 0
        #: per stage: its tape (it records that stage's ops only, so a gradient
        #: call walks that stage back, no further), its input and its output
        self.tapes: list[tuple[Any, Any, Any]] = []
        if not self.count:
            return
        x, y, *w = batch_args(batch)
        with tf.device(replica.device):
            h = x
            for g, stage in enumerate(stages):
                tape = tf.GradientTape()
                with tape:
                    if g:
                        tape.watch(h)
                    out = h
                    for block in stage.blocks:
                        out = block(out)
                    if g == len(stages) - 1:  # the loss on the last stage's tape
                        loss, self.scaled, n = replica.batch_loss(x, y, out,
                                                                  w[0] if w else None)
                self.tapes.append((tape, h, out))
                h = out
            replica.track(x, y, h, w[0] if w else None, loss, n)
            self.loss_sum = float(loss * tf.cast(n, loss.dtype))

    def parts(self) -> Iterator[tuple[int, np.ndarray]]:
        """Each trainable variable's flat gradient, with its start in the whole
        buffer: the last stage's first, a stage computed only once the one after it
        was taken (zeros for a batch without rows, in the same order). The parts
        are views of TensorFlow's output, so a stage's gradient is held once: *not*
        times the rows, as :meth:`Replica.batch_gradient`'s are (a copy each); the
        collective multiplies each bucket it adds by its sender's rows, the same
        float32 product. (Not on the backward pass's first gradient: a float16
        layer's gradient would then overflow where the one-call pass's does not,
        and a loss-scale optimizer skip other steps.)"""
        import tensorflow as tf

        variables = self.replica.variables
        starts = np.concatenate([[0], np.cumsum(self.replica.sizes)]).astype(int)
        if not self.tapes:
            for stage in reversed(self.stages):
                for j in range(stage.first, stage.first + stage.count):
                    zeros = np.zeros(starts[j + 1] - starts[j], np.float32)
                    self.largest = max(self.largest, zeros.nbytes)
                    yield int(starts[j]), zeros
            return
        with tf.device(self.replica.device):
            upstream = None
            for g in range(len(self.stages) - 1, -1, -1):
                stage = self.stages[g]
                mine = variables[stage.first:stage.first + stage.count]
                tape, given, out = self.tapes.pop()  # (its activations freed after)
                sources = mine + ([given] if g else [])
                # the last stage from the loss itself (Keras' cross-entropy of a
                # softmax output may read the logits under it, not the output)
                grads = (tape.gradient(self.scaled, sources) if upstream is None else
                         tape.gradient(out, sources, output_gradients=upstream))
                del tape, given, out
                if g:
                    upstream = grads[-1]
                parts = [np.zeros(int(np.prod(v.shape)), np.float32) if d is None else
                         np.asarray(tf.reshape(tf.cast(d, v.dtype), [-1]))
                         for d, v in zip(grads[:stage.count], mine, strict=True)]
                del grads
                self.largest = max(self.largest, sum(p.nbytes for p in parts))
                for j, part in enumerate(parts):
                    yield int(starts[stage.first + j]), part
                del parts
