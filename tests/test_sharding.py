"""``shard_state="optimizer"`` (ZeRO-1) on the p2p engine: each worker keeps and
applies 1/N of the optimizer, and training stays exact.

On real worker processes: the weights and the optimizer's variables (the slots put
back together at the end) equal single-process Keras ``fit`` and unsharded p2p on
the same global batches, for Adam, SGD with momentum (one layer frozen), AdamW
(with the biases left out of its weight decay too),
a learning-rate schedule, a rate a callback sets, ``clipnorm`` and
``global_clipnorm`` (norms summed across the slices), sample and class weights
and ``ReduceLROnPlateau``,
with a variable split across workers; a second ``fit`` of ``history.model``
continues its optimizer as Keras' does; each replica holds about 1/N of the
unsharded optimizer's bytes; what is not supported yet is refused before the run
starts (or, for a lost worker, when it is lost) with the reason.
"""

from __future__ import annotations

import dask
import keras
import numpy as np
import pytest

import dasktf
from dasktf.cluster.membership import alive_workers
from dasktf.exceptions import ShardingError
from dasktf.run.options import TrainOptions
from dasktf.testing import kill_worker_at_update, own_cluster
from tests.conftest import relative_error

N_WORKERS = 3


def _model(frozen: bool = False, seed: int = 7) -> keras.Model:
    keras.utils.set_random_seed(seed)
    # 64x32 + 32 + 32x10 + 10 = 2,410 parameters: over 3 workers the first kernel
    # is split between ranks 0 and 1 (slices of 803 values)
    layers = [keras.Input((8, 8)), keras.layers.Flatten(),
              keras.layers.Dense(32, activation="sigmoid")]
    if frozen:
        layers.append(keras.layers.Dense(16, activation="tanh", trainable=False))
    layers.append(keras.layers.Dense(10, activation="softmax"))
    return keras.Sequential(layers)


def _halving(epoch: int, lr: float) -> float:
    return 0.02 * 0.5 ** epoch


#: name: (the optimizer, a frozen layer, the callbacks of each fit)
OPTIMIZERS = {
    "adam": (lambda: keras.optimizers.Adam(0.01), False, list),
    "sgd-momentum-frozen": (lambda: keras.optimizers.SGD(0.1, momentum=0.9), True, list),
    "adamw": (lambda: keras.optimizers.AdamW(0.01, weight_decay=0.05), False, list),
    # the biases left out of the decay: a choice Keras keeps out of the config
    "adamw-biases-not-decayed": (lambda: _adamw_without_bias_decay(), False, list),
    # a schedule (counted by the slice's iterations), and a rate a callback sets
    # (the set_learning_rate path) at each epoch's start
    "adam-decay-schedule": (lambda: keras.optimizers.Adam(
        keras.optimizers.schedules.ExponentialDecay(0.01, 3, 0.7)), False, list),
    "adam-lr-callback": (lambda: keras.optimizers.Adam(0.02), False,
                         lambda: [keras.callbacks.LearningRateScheduler(_halving)]),
    # norms summed across the slices: the first kernel's over two workers
    "sgd-clipnorm": (lambda: keras.optimizers.SGD(0.5, momentum=0.5, clipnorm=0.05),
                     False, list),
    "adam-global-clipnorm": (lambda: keras.optimizers.Adam(0.01, global_clipnorm=0.05),
                             False, list),
}


def _adamw_without_bias_decay() -> keras.optimizers.AdamW:
    adamw = keras.optimizers.AdamW(0.05, weight_decay=0.5)
    adamw.exclude_from_weight_decay(var_names=["bias"])
    return adamw


def _twin(model: keras.Model) -> keras.Model:
    twin = keras.models.clone_model(model)
    twin.set_weights(model.get_weights())
    return twin


def _fit(model, x, y, client, optimizer=None, epochs=2, **kwargs):
    return dasktf.fit(model, x, y, client=client, n_workers=N_WORKERS, epochs=epochs,
                      batch_size=48, optimizer=optimizer,
                      loss="sparse_categorical_crossentropy", shuffle=False, seed=0,
                      verbose=0, engine="p2p", **kwargs)


def _assert_same(got: keras.Model, want: keras.Model, what: str, tol: float = 2e-5) -> None:
    for g, w in zip(got.get_weights(), want.get_weights(), strict=True):
        assert relative_error(g, w) < tol, f"{what}: weights"
    mine, theirs = got.optimizer.variables, want.optimizer.variables
    assert [tuple(v.shape) for v in mine] == [tuple(v.shape) for v in theirs], what
    for g, w in zip(mine, theirs, strict=True):
        g, w = np.asarray(g.numpy(), np.float64), np.asarray(w.numpy(), np.float64)
        assert relative_error(g, w) < tol or np.allclose(g, w, atol=1e-7), (
            f"{what}: optimizer variable of shape {g.shape}")


#: ``shard_state="gradients"``'s bucket in the tests: 64 values, so each slice of
#: the 803 goes in 13 rounds (the last one short)
BUCKET = 256
#: and its backward pass staged (dasktf.runtime.staged): the first dense layer's
#: gradient (2,080 values), then the layers after it, each sent before the next
STAGED = {"dasktf.p2p.shard-bucket": BUCKET, "dasktf.p2p.shard-stage": 0}


@pytest.mark.parametrize("shard_state", ["optimizer", "gradients"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_sharded_equals_keras_and_unsharded_p2p(client, small_digits, name, shard_state):
    with dask.config.set(STAGED):
        _sharded_equals_keras_and_unsharded(client, small_digits, name, shard_state)


def _sharded_equals_keras_and_unsharded(client, small_digits, name, shard_state):
    x, y = small_digits  # 250 rows at batch 48: a short last step, uneven shares
    make, frozen, callbacks = OPTIMIZERS[name]
    reference = _model(frozen)
    initial = [w.copy() for w in reference.get_weights()]
    sharded_model, plain_model = _twin(reference), _twin(reference)
    reference.compile(optimizer=make(), loss="sparse_categorical_crossentropy")
    reference.fit(x, y, batch_size=48, epochs=2, shuffle=False, verbose=0,
                  callbacks=callbacks())
    moved = max(relative_error(w, w0) for w, w0 in zip(reference.get_weights(), initial,
                                                       strict=True))
    assert moved > 1e-3, "training must move the weights for the comparison to mean much"

    sharded = _fit(sharded_model, x, y, client, make(), shard_state=shard_state,
                   callbacks=callbacks())
    plain = _fit(plain_model, x, y, client, make(), callbacks=callbacks())
    _assert_same(sharded.model, reference, "sharded vs Keras")
    _assert_same(sharded.model, plain.model, "sharded vs unsharded p2p")
    np.testing.assert_allclose(sharded.history["loss"], plain.history["loss"], rtol=1e-5)
    steps = 2 * -(-len(x) // 48)
    assert sharded.applied_updates == {i: list(range(steps)) for i in range(N_WORKERS)}

    # A second fit continues the optimizer (its gathered slots, cut again), as a
    # second Keras fit does.
    reference.fit(x, y, batch_size=48, epochs=1, shuffle=False, verbose=0,
                  callbacks=callbacks())
    again = _fit(sharded.model, x, y, client, epochs=1, shard_state=shard_state,
                 callbacks=callbacks())
    _assert_same(again.model, reference, "second sharded fit vs Keras")


def _plateau():
    # min_delta=10: no epoch improves on the one before by that much, so the rate
    # halves at the end of every epoch after the first
    return [keras.callbacks.ReduceLROnPlateau(monitor="loss", factor=0.5, patience=0,
                                              min_delta=10.0)]


#: name: (the arguments of both fits, the callbacks of each, epochs)
WEIGHTED = {
    "sample-weight": (lambda y: {"sample_weight": 0.25 + (np.arange(len(y)) % 7) / 3.0},
                      list, 2),
    "class-weight": (lambda y: {"class_weight": {c: 0.5 + c / 4.0 for c in range(10)}},
                     list, 2),
    "reduce-lr-on-plateau": (lambda y: {}, _plateau, 3),
}


@pytest.mark.parametrize("shard_state", ["optimizer", "gradients"])
@pytest.mark.parametrize("name", list(WEIGHTED))
def test_weights_and_plateau_sharded_equal_keras_and_unsharded(client, small_digits, name,
                                                               shard_state):
    """Sample and class weights (the weighted sum over the global batch, summed slice
    by slice) and ReduceLROnPlateau (a rate set on the slice's optimizer at an epoch
    end) train as Keras does, sharded."""
    x, y = small_digits
    arguments, callbacks, epochs = WEIGHTED[name]
    kwargs = arguments(y)
    reference = _model()
    sharded_model, plain_model = _twin(reference), _twin(reference)
    reference.compile(optimizer=keras.optimizers.Adam(0.01),
                      loss="sparse_categorical_crossentropy")
    reference.fit(x, y, batch_size=48, epochs=epochs, shuffle=False, verbose=0,
                  callbacks=callbacks(), **kwargs)
    with dask.config.set(STAGED):
        sharded = _fit(sharded_model, x, y, client, keras.optimizers.Adam(0.01),
                       epochs=epochs, shard_state=shard_state, callbacks=callbacks(),
                       **kwargs)
    plain = _fit(plain_model, x, y, client, keras.optimizers.Adam(0.01), epochs=epochs,
                 callbacks=callbacks(), **kwargs)
    _assert_same(sharded.model, reference, f"{name}: sharded vs Keras")
    _assert_same(sharded.model, plain.model, f"{name}: sharded vs unsharded p2p")
    np.testing.assert_allclose(sharded.history["loss"], plain.history["loss"], rtol=1e-5)
    if name == "reduce-lr-on-plateau":
        rate = float(keras.ops.convert_to_numpy(sharded.model.optimizer.learning_rate))
        assert rate == pytest.approx(0.01 / 4), "halved after epochs 2 and 3"


def _loss_scaled(scale: float, growth: int) -> keras.optimizers.LossScaleOptimizer:
    return keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(0.01),
                                               initial_scale=scale,
                                               dynamic_growth_steps=growth)


def _mixed_model() -> keras.Model:
    keras.utils.set_random_seed(7)
    # 1,040 + 1,088 + 650 parameters: slices of 926 values over 3 workers; the last
    # holds float32 layers only, whose gradients stay finite when the float16
    # layer's overflow: its vote alone would not skip the step
    return keras.Sequential([
        keras.Input((8, 8)), keras.layers.Flatten(),
        keras.layers.Dense(16, activation="sigmoid", dtype="mixed_float16"),
        keras.layers.Dense(64, activation="tanh", dtype="float32"),
        keras.layers.Dense(10, activation="softmax", dtype="float32")])


def _skips(model: keras.Model) -> tuple[int, float]:
    optimizer = model.optimizer
    return (int(optimizer.inner_optimizer.iterations.numpy()),
            float(optimizer.dynamic_scale.numpy()))


@pytest.mark.parametrize("shard_state,staged", [("optimizer", False), ("gradients", False),
                                                ("gradients", True)])
def test_loss_scaling_skips_every_slice_as_unsharded(client, small_digits, shard_state,
                                                     staged):
    """A mixed-precision model (a float16 layer) with a LossScaleOptimizer, sharded:
    a step whose summed gradient is not finite in any slice is skipped on every
    worker and the scale halved, growth doubles it, exactly as unsharded p2p
    (weights, slots, scale, steps applied). Not compared with single-process Keras:
    which steps overflow depends on each worker's float16 backward pass over its
    own rows, not on the global batch (the same holds unsharded). With the backward
    pass staged (run eagerly, in three parts) the float16 layer's gradient is
    rounded apart from the traced one-call pass's: the same steps skipped and the
    same scale, the values equal to float16's rounding, not float32's."""
    x, y = small_digits
    # 2**24: the float16 backward pass overflows for the first steps (skipped, the
    # scale halved each time); growth every 3 finite steps doubles the scale back
    # into an overflow now and then
    with dask.config.set({"dasktf.p2p.shard-bucket": BUCKET,
                          "dasktf.p2p.shard-stage": 0 if staged else False}):
        sharded = _fit(_mixed_model(), x, y, client, _loss_scaled(2.0 ** 24, 3),
                       epochs=3, shard_state=shard_state)
    plain = _fit(_mixed_model(), x, y, client, _loss_scaled(2.0 ** 24, 3), epochs=3)
    steps = 3 * -(-len(x) // 48)
    applied, scale = _skips(plain.model)
    assert 0 < applied < steps - 3, (applied, steps)  # skipped steps, and trained
    assert _skips(sharded.model) == (applied, scale)
    _assert_same(sharded.model, plain.model, "loss scaling: sharded vs unsharded p2p",
                 1e-3 if staged else 2e-5)
    np.testing.assert_allclose(sharded.history["loss"], plain.history["loss"], rtol=1e-5)


def test_mixed_precision_sharded_equals_unsharded(client, small_digits):
    """mixed_precision=True (mixed_bfloat16 on these CPU workers, float32 weights
    and slots) trains sharded as unsharded."""
    x, y = small_digits
    sharded = dasktf.fit("mnist-mlp", x.reshape(len(x), -1), y, client=client,
                         n_workers=N_WORKERS, epochs=1, batch_size=48, optimizer="adam",
                         loss="sparse_categorical_crossentropy", shuffle=False,
                         seed=0, verbose=0, engine="p2p", mixed_precision=True,
                         shard_state="optimizer")
    plain = dasktf.fit("mnist-mlp", x.reshape(len(x), -1), y, client=client,
                       n_workers=N_WORKERS, epochs=1, batch_size=48, optimizer="adam",
                       loss="sparse_categorical_crossentropy", shuffle=False, seed=0,
                       verbose=0, engine="p2p", mixed_precision=True)
    _assert_same(sharded.model, plain.model, "mixed precision: sharded vs unsharded")


def _slot_bytes(dask_worker=None) -> dict[str, int]:
    """The bytes of every live replica's optimizer variables on this worker."""
    from dasktf.runtime.replica import registered_replicas

    return {key[1]: int(sum(np.prod(v.shape) * np.dtype(v.dtype).itemsize
                            for v in r.model.optimizer.variables))
            for key, r in registered_replicas(dask_worker).items()}


class _ReadSlots(keras.callbacks.Callback):
    def __init__(self, client):
        super().__init__()
        self.client, self.seen = client, None

    def on_epoch_end(self, epoch, logs=None):
        self.seen = self.client.run(_slot_bytes)


def test_each_replica_holds_a_third_of_the_optimizer(client, digits):
    x, y = digits.x_train[:600], digits.y_train[:600]
    per_worker = {}
    for shard_state in ("optimizer", None):
        reader = _ReadSlots(client)
        _fit(_model(), x, y, client, keras.optimizers.Adam(0.01), epochs=1,
             shard_state=shard_state, callbacks=[reader],
             **({"redundancy": 0} if shard_state else {}))
        assert reader.seen is not None and len(reader.seen) == N_WORKERS
        assert all(len(runs) == 1 for runs in reader.seen.values()), reader.seen
        per_worker[shard_state] = [b for runs in reader.seen.values()
                                   for b in runs.values()]
    whole = per_worker[None]
    slots = 2 * 2410 * 4  # Adam's two slots of float32 over the trainable parameters
    assert all(b >= slots for b in whole), whole
    for b in per_worker["optimizer"]:  # a third of the slots, plus the two scalars
        assert b <= slots / N_WORKERS + 64, (b, whole)
    assert sum(per_worker["optimizer"]) <= sum(whole) / N_WORKERS + 3 * 64


def _gradient_peaks(dask_worker=None) -> list[tuple[int, int]]:
    from dasktf.runtime.replica import registered_replicas

    return [(r.shard_optimizer.gradient_peak(), r.shard_optimizer.own)
            for r in registered_replicas(dask_worker).values()]


class _ReadPeaks(keras.callbacks.Callback):
    def __init__(self, client):
        super().__init__()
        self.client, self.seen = client, []

    def on_epoch_end(self, epoch, logs=None):
        self.seen = [p for v in self.client.run(_gradient_peaks).values() for p in v]


@pytest.mark.parametrize("stage", [False, 0])
def test_gradients_bucketed_bound_what_a_worker_holds(client, digits, stage):
    """shard_state="gradients": the peers' parts of a worker's slice never wait
    more than two rounds of buckets (2 (N-1) buckets), where "optimizer" sends each
    part whole (a part alone, 803 values, is over that bound); the summed slice is
    1/N of the gradient in both. With the backward pass staged, a worker's own
    gradient is never whole either: the first dense layer's 2,080 values at most,
    of 2,410."""
    x, y = digits.x_train[:600], digits.y_train[:600]
    slice_bytes = 4 * 803
    peaks, own = {}, {}
    for shard_state in ("gradients", "optimizer"):
        reader = _ReadPeaks(client)
        with dask.config.set({"dasktf.p2p.shard-bucket": BUCKET,
                              "dasktf.p2p.shard-stage": stage}):
            _fit(_model(), x, y, client, keras.optimizers.Adam(0.01), epochs=1,
                 shard_state=shard_state, callbacks=[reader])
        assert len(reader.seen) == N_WORKERS, reader.seen
        peaks[shard_state] = [p for p, _ in reader.seen]
        own[shard_state] = [o for _, o in reader.seen]
    # two rounds from each peer, the first with the step's few float64 scalars
    bound = 2 * (N_WORKERS - 1) * BUCKET + (N_WORKERS - 1) * 128 + slice_bytes
    assert all(slice_bytes < p <= bound for p in peaks["gradients"]), peaks
    assert all(p >= slice_bytes + 4 * 802 for p in peaks["optimizer"]), peaks  # a part whole
    assert own["optimizer"] == [4 * 2410] * N_WORKERS
    assert own["gradients"] == [4 * (2410 if stage is False else 2080)] * N_WORKERS


def test_a_residual_functional_model_is_staged_and_equals_keras(client, small_digits):
    """A functional model with a residual block runs its backward pass in stages,
    cut around the block (a worker's own gradient: the first dense layer's 2,080
    values at most, of 3,466), and trains the weights and slots Keras and
    unsharded p2p train."""
    x, y = small_digits
    keras.utils.set_random_seed(7)
    inputs = keras.Input((8, 8))
    hidden = keras.layers.Dense(32, activation="sigmoid")(keras.layers.Flatten()(inputs))
    hidden = keras.layers.Add()([hidden, keras.layers.Dense(32, activation="tanh")(hidden)])
    reference = keras.Model(inputs, keras.layers.Dense(10, activation="softmax")(hidden))
    sharded_model, plain_model = _twin(reference), _twin(reference)
    reference.compile(optimizer=keras.optimizers.Adam(0.01),
                      loss="sparse_categorical_crossentropy")
    reference.fit(x, y, batch_size=48, epochs=2, shuffle=False, verbose=0)
    reader = _ReadPeaks(client)
    with dask.config.set(STAGED):
        sharded = _fit(sharded_model, x, y, client, keras.optimizers.Adam(0.01),
                       shard_state="gradients", callbacks=[reader])
    plain = _fit(plain_model, x, y, client, keras.optimizers.Adam(0.01))
    assert [own for _, own in reader.seen] == [4 * 2080] * N_WORKERS
    _assert_same(sharded.model, reference, "sharded vs Keras")
    _assert_same(sharded.model, plain.model, "sharded vs unsharded p2p")


def test_refusals_before_the_run_starts(client, small_digits):
    model = _model()
    with pytest.raises(ValueError, match="must be None, 'optimizer' or 'gradients'"):
        TrainOptions(model, engine="p2p", shard_state="slots")
    for key, value in (("shard-stage", "lots"), ("shard-bucket", -1), ("shard-bucket", False)):
        with dask.config.set({f"dasktf.p2p.{key}": value}), pytest.raises(
                ValueError, match=f"dasktf.p2p.{key} must be a size in bytes"):
            TrainOptions(model, engine="p2p", shard_state="gradients")
    with pytest.raises(ValueError, match="engine='p2p'"):
        TrainOptions(model, shard_state="optimizer")  # engine="auto"
    with pytest.raises(ValueError, match="p2p engine only"):
        TrainOptions(model, engine="graph", shard_state="optimizer")
    with pytest.raises(ValueError, match="local steps"):
        TrainOptions(model, engine="p2p", shard_state="optimizer", local_steps=4)
    with pytest.raises(ValueError, match="compression='fp16'"):
        TrainOptions(model, engine="p2p", shard_state="optimizer", compression="fp16")
    with pytest.raises(ValueError, match="redundancy must be 0"):
        TrainOptions(model, engine="p2p", shard_state="optimizer", redundancy=2)
    with pytest.raises(ValueError, match="goes with shard_state"):
        TrainOptions(model, engine="p2p", redundancy=0)
    x, y = small_digits
    clipped = keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(clipnorm=1.0))
    with pytest.raises(ValueError, match="clipnorm="):
        _fit(_model(), x, y, client, clipped, shard_state="optimizer")
    optimizer = keras.optimizers.Adam(gradient_accumulation_steps=2)
    with pytest.raises(ValueError, match="gradient_accumulation_steps=") as info:
        _fit(_model(), x, y, client, optimizer, shard_state="optimizer")
    assert "shard_state=None" in str(info.value)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_lost_worker_is_refused_with_the_reason(digits):
    """redundancy=0: its slice of the optimizer had no other copy: the run stops
    with a ShardingError that says so, never goes on with a rebuilt (wrong) slice
    (redundancy=1, the default: tests/test_shard_recovery.py)."""
    x, y = digits.x_train[:600], digits.y_train[:600]
    with own_cluster(N_WORKERS) as (_, client):
        workers = alive_workers(client)
        kill_worker_at_update(client, workers[2], 5, "step")
        with pytest.raises(ShardingError, match="no other copy"):
            _fit(_model(), x, y, client, "adam", epochs=2, shard_state="optimizer",
                 redundancy=0)
