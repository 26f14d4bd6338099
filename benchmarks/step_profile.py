"""Where a graph-engine step's worker time goes: the cnn at local batch B.

Timed interleaved in one process with a worker's thread count (env ``T``, default
1): the replica's gradient function alone and with its NumPy hand-off, the apply
of a summed gradient, the reduction's NumPy sum and pickling the 4.8 MB buffer,
against a plain fused ``tf.function`` train step of the same model (what a single
process runs). Usage: ``T=1 python benchmarks/step_profile.py [B=256] [REPS=10]``.
"""

from __future__ import annotations

import os
import pickle
import sys
import time

THREADS = int(os.environ.get("T", "1"))
os.environ["TF_NUM_INTRAOP_THREADS"] = str(THREADS)
os.environ["TF_NUM_INTEROP_THREADS"] = "1"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
MNIST = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "mnist.npz")


def main(batch: int, reps: int) -> None:
    import keras
    import numpy as np

    from dasktf.cli.bench import fused_train_step
    from dasktf.data.shards import Shard
    from dasktf.datasets import load_dataset, load_mnist_npz
    from dasktf.models import CompileRecipe, model_spec
    from dasktf.runtime.replica import Replica, ReplicaConfig
    from dasktf.transport import ModelPackage
    from dasktf.wire.messages import sum_gradients

    d = load_mnist_npz(MNIST) if os.path.exists(MNIST) else load_dataset("digits")
    x, y = d.x_train[: batch * reps], d.y_train[: batch * reps]
    spec = model_spec("cnn", x.shape[1:], 10)
    keras.utils.set_random_seed(0)
    package = ModelPackage.pack(spec.build())
    recipe = CompileRecipe(keras.optimizers.serialize(keras.optimizers.SGD()),
                           "sparse_categorical_crossentropy")
    cfg = ReplicaConfig(package.ref(), recipe, 0, publish_metrics=False)
    rep = Replica(cfg, 0, Shard(x, y), np.full(reps, batch), None, None, False)
    g = rep.gradient(0, 0)
    rep.apply(g)
    batches = [(b.x, b.y) for b in (rep.batch(0, i) for i in range(reps))]

    model = spec.build()
    fused = fused_train_step(model, keras.optimizers.SGD())

    fused(*batches[0])
    parts = [rep.gradient(0, i) for i in range(2)]
    variants = {
        "gradient fn (TensorFlow only)": lambda i: rep._gradient_fn(*batches[i]),
        "gradient + slice + .numpy()": lambda i: rep.gradient(0, i),
        "apply a summed gradient": lambda i: rep.apply(g),
        "sum of 2 buffers (NumPy)": lambda i: sum_gradients(*parts),
        "pickle the 4.8 MB buffer": lambda i: pickle.dumps(g, protocol=5),
        "fused tf.function step (reference)": lambda i: fused(*batches[i]).numpy(),
    }
    times: dict[str, list[float]] = {k: [] for k in variants}
    for i in range(reps):
        for name, fn in variants.items():
            start = time.perf_counter()
            fn(i)
            times[name].append(time.perf_counter() - start)
    print(f"cnn, local batch {batch}, {THREADS} TF thread(s), median (min) of {reps} "
          f"interleaved runs, ms; load average {os.getloadavg()[0]:.2f}")
    for name, ts in times.items():
        print(f"  {name:<36} {1000 * np.median(ts):8.1f}  ({1000 * min(ts):.1f})")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 256,
         int(sys.argv[2]) if len(sys.argv) > 2 else 10)
