"""A replica's backward pass a group of layers at a time, the last group first.

One ``GradientTape.gradient`` call returns the whole gradient: with
``shard_state="gradients"`` (ZeRO-2) that own gradient, 4 bytes a parameter, is
the largest gradient buffer a worker holds, sharded or not. A chain of layers
(a ``keras.Sequential``, or a functional model whose graph is a chain:
:func:`chain_layers`) can give it in parts instead: the forward pass records
each group on a tape of its own (a gradient call walks back everything its tape
recorded: on one persistent tape, each group's call would walk back to the first
layer), then each group's gradient is one call from its output's gradient
(``output_gradients``) back to its input, so the sharded step sends a group's parts to their owners and drops them
before the next group's are computed
(:func:`~dasktf.runtime.p2p.buckets.bucketed_update`). DeepSpeed frees gradient
buckets from hooks inside the backward pass; Keras on TensorFlow has no such hooks,
and this is the same bound at a layer's grain.

The values are those of the one-call backward pass (the same ops, run in parts,
eagerly), to float32 rounding. A model this cannot cut (not a chain, a layer that
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
class Stage:
    """Consecutive layers and the flat range ``[start, stop)`` of their trainable
    variables in the replica's gradient buffer."""

    layers: tuple[Any, ...]
    start: int
    stop: int
    first: int  # the index of the stage's first trainable variable
    count: int  # how many trainable variables it has


def layer_stages(model: Any, variables: list[Any], min_values: int) -> list[Stage] | None:
    """``model``'s layers cut into stages of at least ``min_values`` parameters
    each where layers allow (one layer is never cut), in forward order; ``None``
    when the model is not a chain this module can run in parts."""
    import keras

    chain = chain_layers(model)
    if chain is None or model.losses:
        return None  # (a regularizer's gradient reaches the weights from the loss)
    where = {id(v): i for i, v in enumerate(variables)}
    sizes = [int(np.prod(v.shape)) for v in variables]
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(int)
    stages: list[Stage] = []
    layers: list[Any] = []
    order: list[int] = []
    first = 0
    for layer in chain:
        if (getattr(layer, "activity_regularizer", None) is not None
                or getattr(layer, "mask_zero", False)
                or isinstance(layer, keras.layers.Masking)):
            return None
        layers.append(layer)
        order += [where.get(id(v), -1) for v in layer.trainable_variables]
        done = len(order)
        if order[first:] != list(range(first, done)):
            return None  # a variable shared, out of order or not a layer's
        if done > first and offsets[done] - offsets[first] >= min_values:
            stages.append(Stage(tuple(layers), int(offsets[first]), int(offsets[done]),
                                first, done - first))
            layers, first = [], done
    if len(order) != len(variables):
        return None  # a trainable variable outside the layers
    if layers:  # the last layers: a stage of their own if they have variables
        if first < len(order) or not stages:
            stages.append(Stage(tuple(layers), int(offsets[first]), int(offsets[-1]),
                                first, len(order) - first))
        else:
            last = stages.pop()
            stages.append(Stage(last.layers + tuple(layers), last.start, last.stop,
                                last.first, last.count))
    return stages


def chain_layers(model: Any) -> list[Any] | None:
    """``model``'s layers in forward order when each takes the output of the one
    before and nothing else: a ``keras.Sequential``'s, or a functional model's
    whose graph is such a chain (one input, one output, every layer called once,
    with no argument but that tensor; a call's ``training=``, which the model's own
    ``training`` overrides in Keras' functional call, and a ``None`` are no
    arguments). ``None`` for any other graph (a branch, a residual sum, a shared
    layer, an op of ``keras.ops``, a call's argument of its own) or a subclassed
    model, whose ``call`` is its own."""
    import keras

    from dasktf import compat

    if isinstance(model, keras.Sequential):
        return list(model.layers)
    calls = compat.functional_calls(model)
    if (calls is None or type(model).call is not compat.functional_class().call
            or len(model.inputs) != 1 or len(model.outputs) != 1):
        return None
    tensor, chain = model.inputs[0], []
    for layer, args, kwargs, outputs in calls:
        if isinstance(layer, keras.layers.InputLayer):
            continue
        if (not isinstance(layer, keras.layers.Layer) or len(args) != 1
                or args[0] is not tensor or len(outputs) != 1
                or any(kwargs[k] is not None for k in set(kwargs) - {"training"})):
            return None
        tensor = outputs[0]
        chain.append(layer)
    return chain if tensor is model.outputs[0] else None


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
                    for layer in stage.layers:
                        out = layer(out, training=True)
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
