"""What ``TF_ENABLE_ONEDNN_OPTS=0`` would cost: the MLP's and the cnn's train step
with oneDNN's custom operations on (TensorFlow's default) and off, side by side.

dasktf silences TensorFlow's start-up lines by filtering them (dasktf/cluster/quiet.py),
not by turning oneDNN off; this is the measurement behind that choice. Each setting
runs in its own process (TensorFlow reads the variable at import), alternating
on/off/on/off, and reports the median step time and the loss after a fixed number
of seeded steps (the numerics: oneDNN changes the order of floating-point sums).

    python benchmarks/onednn_opts.py [--rounds 2] [--steps 60]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

CHILD = r"""
import json, os, sys, time
import numpy as np
import keras, tensorflow as tf
from dasktf.models import cnn, mnist_mlp
steps = int(sys.argv[1])
out = {}
for name, build, batch in (("mnist-mlp", mnist_mlp, 256), ("cnn", cnn, 128)):
    keras.utils.set_random_seed(0)
    model = build((28, 28), 10)
    opt = keras.optimizers.Adam(1e-3)
    loss_fn = keras.losses.SparseCategoricalCrossentropy()
    rng = np.random.default_rng(0)
    x = tf.constant(rng.random((batch, 28, 28), dtype=np.float32))
    y = tf.constant(rng.integers(0, 10, batch))

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    for _ in range(5):
        step()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        loss = step()
        loss.numpy()
        times.append(time.perf_counter() - t)
    out[name] = {"step_ms": 1e3 * float(np.median(times)), "loss": float(loss)}
print("RESULT " + json.dumps(out))
"""


def run(setting: str, steps: int) -> dict[str, dict[str, float]]:
    env = {**os.environ, "TF_ENABLE_ONEDNN_OPTS": setting, "TF_CPP_MIN_LOG_LEVEL": "3",
           "TF_NUM_INTRAOP_THREADS": str(os.cpu_count() or 1)}
    done = subprocess.run([sys.executable, "-c", CHILD, str(steps)], env=env,
                          capture_output=True, text=True, check=True)
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    results: dict[str, list[dict[str, dict[str, float]]]] = {"1": [], "0": []}
    started = time.time()
    for _ in range(args.rounds):
        for setting in ("1", "0"):
            results[setting].append(run(setting, args.steps))
    print(f"load average after: {os.getloadavg()[0]:.2f} ({time.time() - started:.0f}s)")
    print("model      oneDNN on ms/step  off ms/step  off/on  loss on      loss off")
    for model in ("mnist-mlp", "cnn"):
        on = sorted(r[model]["step_ms"] for r in results["1"])
        off = sorted(r[model]["step_ms"] for r in results["0"])
        on_ms, off_ms = on[len(on) // 2], off[len(off) // 2]
        print(f"{model:10s} {on_ms:17.2f} {off_ms:12.2f} {off_ms / on_ms:7.2f}  "
              f"{results['1'][0][model]['loss']:.8f}  {results['0'][0][model]['loss']:.8f}")


if __name__ == "__main__":
    main()
