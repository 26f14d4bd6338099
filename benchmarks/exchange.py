"""Two-worker sync step: the direct exchange against a reduction task, interleaved.

Both run in one cluster, alternately, so the machine's load changes hit both alike:
the default run (two workers, codec ``none``: each step sums the two gradients
itself, one scheduler hop a step) and ``topology="naive"`` (one reduction task
pinned to the first worker: two hops a step, what every two-worker run did before
the exchange). Figures are the second epoch of each fit (the first traces).

Usage: ``python benchmarks/exchange.py [--reps 4] [--mnist PATH]``.
"""

from __future__ import annotations

import argparse
import os

import numpy as np

#: (model, global batch, timed steps): hop-bound and compute-bound
CASES = [("mnist-mlp", 128, 40), ("cnn", 512, 8)]
SHAPES = {"exchange": {}, "reduction task": {"topology": "naive"}}


def step_ms(client, model: str, x, y, batch: int, steps: int, **kw) -> float:
    import dasktf

    n = batch * steps
    history = dasktf.fit(model, x[:n], y[:n], client=client, n_workers=2, epochs=2,
                         batch_size=batch, seed=0, verbose=0, shuffle=False, **kw)
    return 1000 * history.history["epoch_seconds"][1] / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=4)
    parser.add_argument("--mnist", default=os.path.join(
        os.path.dirname(__file__), "..", "..", "shared", "data", "mnist.npz"))
    args = parser.parse_args()

    from distributed import Client
    from sync_overhead import (
        load_data,  # the sibling script: benchmarks/ is on sys.path
    )

    import dasktf

    x, y = load_data(args.mnist)
    loads = []
    with dasktf.make_local_cluster(2) as cluster, Client(cluster) as client:
        client.wait_for_workers(2)
        times: dict[tuple[str, str], list[float]] = {}
        for model, batch, steps in CASES:
            step_ms(client, model, x, y, batch, 2)  # warm the workers' imports
            for _ in range(args.reps):
                for name, kw in SHAPES.items():
                    loads.append(os.getloadavg()[0])
                    ms = step_ms(client, model, x, y, batch, steps, **kw)
                    times.setdefault((model, name), []).append(ms)
    print(f"2 workers, {args.reps} interleaved runs each, load average "
          f"{min(loads):.1f}-{max(loads):.1f}; median (min-max) ms a step, examples/s")
    for model, batch, _ in CASES:
        base = np.median(times[(model, "reduction task")])
        for name in SHAPES:
            t = times[(model, name)]
            med = float(np.median(t))
            print(f"{model:<10} {batch:>5} {name:<15} {med:7.1f} ({min(t):.1f}-{max(t):.1f})"
                  f" {batch / med * 1000:>9,.0f}/s  {med / base:5.2f}x")


if __name__ == "__main__":
    main()
