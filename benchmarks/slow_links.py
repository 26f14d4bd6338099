"""Rounds where links are slow (issue 39): time to 0.95 test accuracy, H=1 against
rounds of local steps, on links of 100 Mbit/s with 50 ms one way between workers.

Three worker hosts made of network namespaces (``tests/hosts.py``: a ``dask worker
--no-nanny`` in each, the scheduler on the bridge; root), the MNIST MLP, global batch
256, Adam 1e-3, seed 0, the p2p engine. Every host's link is a token bucket of
``--rate-mbit`` each way (``tbf``: :meth:`HostNetwork.shape`).

The delay: this kernel has no ``netem`` qdisc (nor BPF tooling to stamp departure
times for ``fq``), so no qdisc here can hold a packet back for 50 ms. Where
:func:`tests.hosts.netem_available` says yes, netem delays each host's link by half
of ``--delay-ms`` each way. Where it says no, the delay is made in dasktf's own
transport, in the workers only, by this benchmark: a collective message that reaches
a worker's mailbox (:class:`dasktf.runtime.p2p.mailbox.Mailbox`, either transport)
is handed to the training thread no sooner than ``--delay-ms`` after it arrived.
Messages in flight together are delayed together (each has its own clock), and a
chain of hops pays the delay at each hop, as on a link; what is not delayed: the
scheduler's messages, the data's scatter and TCP's own handshakes and
acknowledgements (the bytes still cross the shaped links). A message is stamped when
its bytes are taken off the socket, which with the direct transport can be after
they arrived (while the training thread computed): the delay then counts from later
than on a real link, which can only make H=1 (a collective every step) slower.

H=1 on such links is slow (hundreds of examples/s), so it is not run to 0.95: its
rate is measured over a bounded window (``--window-rows`` rows, 2 epochs, the second
epoch's rate) on the shaped links, and its time to 0.95 is the epochs its accuracy
curve on plain links needs (``--plain-from``, a ``compressed_allreduce.py
--part per-example`` JSON, or run here with ``--plain-epochs``) times the 60,000 rows
over that rate. The same window is also measured on plain links and on the rate
alone (without the delay), to show what each costs H=1. Each rounds configuration (``--rounds``, ``H:CODEC`` with the
Nesterov outer step) is trained on the shaped links for ``--epochs`` epochs on the
60,000 rows, and its time to 0.95 is the training time (epoch seconds: the set-up
and the data's scatter are left out, for both) until its test accuracy first
reached 0.95.

Usage: ``sudo python benchmarks/slow_links.py [--plain-from per-example.json]
[--rounds 64:int8,64:topk:0.01] [--json out.json]``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from distributed import Client

import dasktf
from tests.hosts import HostCluster, HostNetwork, netem_available, unavailable

TARGET = 0.95
ROWS = 60_000


def delay_messages(seconds: float) -> None:
    """(On a worker) hand each collective message to the training thread no sooner
    than ``seconds`` after it reached this worker's mailbox; ``0``: as before."""
    from dasktf.runtime.p2p.mailbox import Mailbox

    put, take = Mailbox.__dict__.get("_undelayed", (Mailbox.put, Mailbox.take))
    Mailbox._undelayed = (put, take)
    if not seconds:
        Mailbox.put, Mailbox.take = put, take
        return

    def delayed_put(self, key, source, payload, wake=True):
        # (stamped before it is filed: the training thread may take it at once)
        self.__dict__.setdefault("_arrived", {})[(key, source)] = time.monotonic()
        return put(self, key, source, payload, wake)

    def delayed_take(self, key, source, timeout, peer, progress=None):
        payload = take(self, key, source, timeout, peer, progress)
        arrived = self.__dict__.get("_arrived", {}).pop((key, source), None)
        if arrived is not None:
            time.sleep(max(0.0, arrived + seconds - time.monotonic()))
        return payload

    Mailbox.put, Mailbox.take = delayed_put, delayed_take


def _import_tensorflow() -> None:
    import tensorflow  # noqa: F401


def fit(client: Client, data: dict[str, Any], rows: int, epochs: int, h: int,
        codec: str) -> dict[str, Any]:
    options = {} if h == 1 else {"local_steps": h, "outer_optimizer": "nesterov"}
    began = time.perf_counter()
    history = dasktf.fit(
        "mnist-mlp", data["x"][:rows], data["y"][:rows], client=client, n_workers=3,
        epochs=epochs, batch_size=256, optimizer="adam", learning_rate=1e-3,
        metrics=["accuracy"], validation_data=(data["x_val"], data["y_val"]), seed=0,
        verbose=0, engine="p2p", compression=None if codec == "none" else codec,
        **options)
    h_ = history.history
    return {"local_steps": h, "codec": codec, "rows": rows, "epochs": epochs,
            "val_accuracy": [float(a) for a in h_["val_accuracy"]],
            "epoch_seconds": [float(t) for t in h_["epoch_seconds"]],
            "bytes_per_step": sum(h_["bytes_per_step"]) / len(h_["bytes_per_step"]),
            "wall_s": time.perf_counter() - began, "load": os.getloadavg()[0]}


def epochs_to(curve: list[float], target: float) -> int | None:
    return next((i + 1 for i, a in enumerate(curve) if a >= target), None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate-mbit", type=float, default=100.0)
    parser.add_argument("--delay-ms", type=float, default=50.0,
                        help="one way between two workers")
    parser.add_argument("--window-rows", type=int, default=7_680)
    parser.add_argument("--plain-from", default=None,
                        help="a per-example JSON with H=1's curve on plain links")
    parser.add_argument("--plain-epochs", type=int, default=8)
    parser.add_argument("--rounds", default="64:int8,64:topk:0.01")
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--rows", type=int, default=ROWS, help="(fewer: a quick check)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    reason = unavailable()
    if reason:
        sys.exit(f"cannot build hosts here: {reason}")
    from benchmarks.compressed_allreduce import parse_rounds
    from dasktf.cli.bench import load_data

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    data = load_data("mnist", ROWS, 10_000)
    netem = netem_available()
    load_before = os.getloadavg()
    print(f"{os.cpu_count()} cores, load average before {load_before}; links "
          f"{args.rate_mbit:g} Mbit/s each way, {args.delay_ms:g} ms one way "
          f"({'netem' if netem else 'in the workers mailboxes: no netem here'})",
          flush=True)
    plain = None
    if args.plain_from:
        with open(args.plain_from) as f:
            plain = next(r for r in json.load(f)["per_example"]
                         if r["model"] == "mnist-mlp" and r["local_steps"] == 1
                         and r["codec"] == "none")
    out: dict[str, Any] = {"args": vars(args), "netem": netem, "load_before": load_before}
    with HostNetwork(3) as net, tempfile.TemporaryDirectory() as tmp:
        cluster = HostCluster(net, tmp, [])
        try:
            with Client(cluster.address, timeout=30) as client:
                cluster.ensure_workers(client)
                client.wait_for_workers(3, timeout=120)
                client.run(_import_tensorflow)
                if plain is None:
                    plain = fit(client, data, args.rows, args.plain_epochs, 1, "none")
                    print(f"  plain links, H=1: {plain['val_accuracy']}", flush=True)
                # (H=1's rate on plain links and on the rate alone: what the delay adds)
                before = [fit(client, data, args.window_rows, 2, 1, "none")]
                net.shape(rate_mbit=args.rate_mbit,
                          delay_ms=args.delay_ms / 2 if netem else 0)
                try:
                    if not netem:
                        before.append(fit(client, data, args.window_rows, 2, 1, "none"))
                        client.run(delay_messages, args.delay_ms / 1000)
                    window = fit(client, data, args.window_rows, 2, 1, "none")
                    print(f"  shaped, H=1 window: {window['epoch_seconds']} s an epoch "
                          f"(load {window['load']:.1f})", flush=True)
                    rounds = []
                    for h, codec in parse_rounds(args.rounds):
                        rounds.append(fit(client, data, args.rows, args.epochs, h, codec))
                        print(f"  shaped, H={h} {codec}: {rounds[-1]['val_accuracy']}, "
                              f"{rounds[-1]['epoch_seconds']} (load "
                              f"{rounds[-1]['load']:.1f})", flush=True)
                finally:
                    net.unshape()
                    client.run(delay_messages, 0.0)
        finally:
            cluster.close()
    out.update(plain=plain, window=window, window_plain=before[0],
               window_rate_only=before[1] if len(before) > 1 else None, rounds=rounds, load_after=os.getloadavg())
    report(out)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
        print(f"wrote {args.json}")


def report(out: dict[str, Any]) -> None:
    """H=1 (extrapolated) and each rounds configuration, side by side."""
    plain, window = out["plain"], out["window"]
    h1_rate = window["rows"] / window["epoch_seconds"][-1]
    h1_epochs = epochs_to(plain["val_accuracy"], TARGET)
    rows = out["rounds"][0]["rows"] if out["rounds"] else ROWS
    h1_time = None if h1_epochs is None else h1_epochs * rows / h1_rate
    for name in ("window_plain", "window_rate_only"):
        w = out[name]
        if w is not None:
            print(f"H=1 over {w['rows']:,} rows, {name[7:].replace('_', ' ')} links: "
                  f"{w['rows'] / w['epoch_seconds'][-1]:,.0f} examples/s")
    print(f"\n| run (shaped links) | examples/s | epochs to {TARGET} | time to {TARGET} (s) "
          f"| faster than H=1 | test accuracy per epoch |")
    print("|---|---|---|---|---|---|")
    print(f"| H=1, no codec (rate over {window['rows']:,} rows; epochs from plain links) "
          f"| {h1_rate:,.0f} | {h1_epochs} | "
          f"{'-' if h1_time is None else f'{h1_time:,.0f}'} (extrapolated) | | "
          + " ".join(f"{a:.4f}" for a in plain["val_accuracy"]) + " (plain links) |")
    for r in out["rounds"]:
        n = epochs_to(r["val_accuracy"], TARGET)
        t = None if n is None else sum(r["epoch_seconds"][:n])
        rate = r["rows"] * len(r["epoch_seconds"]) / sum(r["epoch_seconds"])
        ratio = "-" if t is None or h1_time is None else f"{h1_time / t:.1f}x"
        r["time_to_target_s"] = t
        print(f"| H={r['local_steps']} nesterov, {r['codec']} | {rate:,.0f} | {n} | "
              f"{'-' if t is None else f'{t:,.1f}'} | {ratio} | "
              + " ".join(f"{a:.4f}" for a in r["val_accuracy"]) + " |")
    out["h1_rate"], out["h1_epochs_to_target"], out["h1_time_to_target_s"] = (
        h1_rate, h1_epochs, h1_time)
    print(f"load average before {out['load_before']}, after {out['load_after']}")


if __name__ == "__main__":
    main()
