"""The metrics stream and the scheduler's MetricsStore: schema, bounds, cost."""

from __future__ import annotations

import statistics
import time

import numpy as np
import pytest

import dasktf
from dasktf.dashboard import TrainingDashboard
from dasktf.diagnostics import metrics
from dasktf.diagnostics.events import TOPIC, pack, unpack
from dasktf.diagnostics.metrics import DecimatedSeries, MetricsStore
from dasktf.runtime.cost import publishing_cost
from dasktf.testing import wait_until


def _records(n: int, workers: int = 3, run: str = "r1", mode: str = "async"):
    rng = np.random.default_rng(0)
    yield {"run": run, "kind": "run_start", "mode": mode, "engine": "graph", "model": "m",
           "workers": [f"tcp://127.0.0.1:{4000 + i}" for i in range(workers)],
           "devices": ["CPU"] * workers, "shard_sizes": [100] * workers,
           "epochs": 1, "steps_per_epoch": n, "total_updates": n, "batch_size": 32}
    for u in range(n):
        yield {"run": run, "kind": "update", "mode": mode, "epoch": 0, "step": u,
               "update": u, "worker": u % workers, "batch_size": 32,
               "loss": 2.0 / (1 + u / 1000), "staleness": int(rng.integers(0, 4)),
               "compute_s": 0.01, "communication_s": 0.002, "waiting_s": 0.001,
               "bytes": 1000, "wall_time": time.time()}


def test_decimated_series_keeps_the_whole_range_in_bounded_rows():
    s = DecimatedSeries(["x", "y"], max_points=100)
    for i in range(10_000):
        s.append({"x": i, "y": 2 * i})
    assert len(s) < 100
    assert s.stride == 128 and s.generation == 7
    xs, ys = s.data["x"], s.data["y"]
    assert xs == sorted(xs) and xs[0] < 64 and xs[-1] > 9_000  # start to end kept
    assert all(y == pytest.approx(2 * x) for x, y in zip(xs, ys, strict=False))  # means of pairs
    part, cursor = s.since(None)
    assert part["reset"] and len(part["data"]["x"]) == len(s)
    for i in range(10_000, 10_000 + 128 * 3):
        s.append({"x": i, "y": 2 * i})
    part, _ = s.since(cursor)
    assert not part["reset"] and len(part["data"]["x"]) == 3


def test_late_rows_are_inserted_in_order_and_readers_reload():
    s = DecimatedSeries(["update", "loss"], max_points=100, order_by="update")
    for u in (1, 3, 4):
        s.append({"update": u, "loss": float(u)})
    rows, cursor = s.since(None)
    s.append({"update": 2, "loss": 2.0})  # another worker's batch, flushed later
    assert s.data["update"] == [1, 2, 3, 4] and s.data["loss"] == [1.0, 2.0, 3.0, 4.0]
    rows, _ = s.since(cursor)
    assert rows["reset"] and rows["data"]["update"] == [1, 2, 3, 4]


def test_store_stays_bounded_and_fast_after_100k_updates():
    store = MetricsStore(max_points=2000)
    batch: list[dict] = []
    start = time.perf_counter()
    for r in _records(100_000):
        batch.append(r)
        if len(batch) == 500:  # what a worker sends per flush at ~1000 steps/s
            store.add_records(batch)
            batch = []
    store.add_records(batch)
    ingest = time.perf_counter() - start
    history = store.runs["r1"]
    assert len(history.loss) <= 2000
    assert all(len(s) <= 2000 for s in history.staleness.values())
    assert sum(history.histogram.values()) == 100_000
    assert sorted(history.histogram) == [0, 1, 2, 3]
    start = time.perf_counter()
    full = store.fetch()
    fetch_seconds = time.perf_counter() - start
    assert full["header"]["updates"] == 100_000 and full["header"]["mode"] == "async"
    assert full["series"]["loss"]["data"]["update"][0] < 100  # the start is still there
    start = time.perf_counter()
    again = store.fetch(cursor=full["cursor"])
    follow_seconds = time.perf_counter() - start
    assert again["series"]["loss"]["data"]["update"] == []
    # Loose sanity bounds (the page polls every second): measured ~1 s / ~10 ms.
    assert ingest < 20 and fetch_seconds < 0.5 and follow_seconds < 0.1
    # The page applies the whole downsampled run at once and stays within bounds.
    dashboard = TrainingDashboard()
    dashboard.apply(full)
    assert len(dashboard.losses.loss.data["loss"]) <= 2000
    assert len(dashboard.staleness.source.data["staleness"]) <= 3 * 2000


def test_store_forgets_the_oldest_runs():
    store = MetricsStore(max_runs=2)
    for run in ("a", "b", "c"):
        store.add_records(list(_records(5, run=run)))
    assert list(store.runs) == ["b", "c"]
    assert store.fetch()["run"] == "c"
    assert "unknown run 'a'" in store.fetch("a")["error"]


def test_async_records_fill_the_staleness_panel():
    """Synthetic async records (the schema the async engine publishes)."""
    store = MetricsStore()
    store.add_records(list(_records(300)))
    dashboard = TrainingDashboard()
    dashboard.apply(store.fetch())
    st = dashboard.staleness
    assert set(st.source.data["staleness"]) == {0, 1, 2, 3}
    assert set(st.source.data["worker"]) == {"0", "1", "2"}
    assert sum(st.histogram.data["count"]) == 300
    assert "async mode" in st.note.text
    assert "mode</b> <span class='mode'>async" in dashboard.header.root.text
    assert "engine</b> <span class='engine'>graph" in dashboard.header.root.text
    assert dashboard.workers.source.data["state"] == ["running"] * 3


def test_async_updates_flushed_out_of_order_keep_every_loss_in_order():
    start, *updates = _records(12)
    late = [r for r in updates if r["worker"] == 1]  # worker 1 flushes last
    store = MetricsStore()
    store.add_records([start] + [r for r in updates if r["worker"] != 1])
    store.add_records(late)
    loss = store.fetch()["series"]["loss"]["data"]
    assert loss["update"] == list(range(12))
    assert loss["loss"] == sorted(loss["loss"], reverse=True)  # each row kept its own loss



def test_an_event_packs_its_records_as_tables_and_unpacks_them_whole():
    """Field sets changing mid-stream, one value repeated or not, values equal but of
    another type (1 and 1.0 and True), None, NaN, nested values: unpack gives the
    records back, in order, with their types."""
    nan = float("nan")
    records = [
        {"run": "r", "kind": "step", "worker": 1, "loss": None, "x": 1, "nested": [1, 2]},
        {"run": "r", "kind": "step", "worker": 1, "loss": 2.5, "x": 1.0, "nested": [1, 2]},
        {"run": "r", "kind": "step", "worker": 1, "loss": nan, "x": True, "nested": [1, 2]},
        {"run": "r", "kind": "inner", "worker": 1, "local_loss": 0.5},
        {"run": "r", "kind": "step", "worker": 1, "loss": 1.0, "x": 1, "nested": [1, 2]},
        {"run": "r", "kind": "epoch", "epoch": 0, "logs": {"loss": 1.0}},
        {"run": "r", "kind": "epoch", "epoch": 1, "logs": {"loss": 0.5}},
    ]
    msg = pack(records)
    assert [t["n"] for t in msg["tables"]] == [3, 1, 1, 2]
    first = msg["tables"][0]
    assert first["same"] == {"run": "r", "kind": "step", "worker": 1, "nested": [1, 2]}
    assert set(first["columns"]) == {"loss", "x"}
    back = unpack(("t", msg))
    assert len(back) == len(records)
    for got, want in zip(back, records, strict=True):
        assert got.keys() == want.keys()
        for field, value in want.items():
            if value != value:  # NaN
                assert got[field] != got[field]
            else:
                assert got[field] == value and type(got[field]) is type(value), field
    assert unpack(("t", {"records": records[:2]})) == records[:2]  # the plain form too


def _stream(rng, runs):
    """Records of sync, async and local-step runs, in the flushes their workers
    would send (uneven sizes, workers in turn, async flushes out of order)."""
    flushes = []
    for run, mode in runs:
        workers, steps = 3, 150
        flushes.append([{"run": run, "kind": "run_start", "mode": mode, "workers": [
            f"w{i}" for i in range(workers)], "steps_per_epoch": 50, "epochs": 3,
            "local_steps": 4 if mode == "local" else 1, "total_updates": steps}])
        for w in range(workers):
            buffered = []
            for u in range(steps):
                r = {"run": run, "kind": "update" if mode == "async" else "step",
                     "mode": "async" if mode == "async" else "sync", "epoch": u // 50,
                     "step": u % 50, "update": u, "worker": w,
                     "batch_size": int(rng.choice([32, 32, 31])),
                     "loss": None if u == 0 or (mode == "sync" and w and u % 7 == 0)
                     else float(rng.random()),
                     "loss_step": u if mode == "async" else u - 1,
                     "staleness": int(rng.integers(0, 5)) if mode == "async" else 0,
                     "compute_s": float(rng.random()), "communication_s": 0.001,
                     "waiting_s": float(rng.random()), "bytes": int(rng.integers(1, 9)),
                     "wall_time": 1.0 + u}
                if mode == "local" and u % 4 == 3:
                    r["drift"] = float(rng.random())
                if mode == "local":
                    buffered.append({"run": run, "kind": "inner", "worker": w,
                                     "epoch": u // 50, "step": u % 50, "batch_size": 32,
                                     "local_loss": float(rng.random())})
                buffered.append(r)
                if len(buffered) >= rng.integers(1, 40):
                    flushes.append(buffered)
                    buffered = []
            flushes.append(buffered)
        flushes.append([{"run": run, "kind": "epoch", "epoch": 0, "update": 49,
                         "logs": {"loss": 1.0, "accuracy": 0.5}}])
        flushes.append([{"run": run, "kind": "run_end", "status": "finished"}])
    order = rng.permutation(len(flushes))  # async workers flush independently
    return [flushes[i] for i in order if flushes[i]]


def test_the_store_takes_packed_tables_as_it_takes_the_records_one_by_one():
    """Every series (decimated past max_points), the staleness histogram, the
    per-worker sums and rates and the header: the same from the tables (one
    replica's steps taken as columns) as from the records, for sync, async and
    local-step runs."""
    rng = np.random.default_rng(3)
    flushes = _stream(rng, [("sync", "sync"), ("async", "async"), ("local", "local")])
    by_record, by_table = MetricsStore(max_points=64), MetricsStore(max_points=64)
    for i, flush in enumerate(flushes):
        by_record.add_records(flush, now=100.0 + i)
        by_table.add_message(pack(flush), now=100.0 + i)
    for run in ("sync", "async", "local"):
        want, got = by_record.runs[run], by_table.runs[run]
        assert got.snapshot(None, 500.0, 2.0) == want.snapshot(None, 500.0, 2.0)
        assert (got.records, got.max_update, got.histogram, got._bytes, got._rows) == (
            want.records, want.max_update, want.histogram, want._bytes, want._rows)
        assert got.staleness[0].stride > 1  # decimated on the way
        for w, stats in want.workers.items():
            assert got.workers[w].__getstate__() == stats.__getstate__(), (run, w)


@pytest.mark.parametrize("engine", ["p2p", "graph"])
def test_sync_run_publishes_the_full_schema(client, small_digits, engine):
    x, y = small_digits
    history = dasktf.fit("mnist-mlp", x, y, client=client, n_workers=2, epochs=2,
                         batch_size=50, seed=0, verbose=0, metrics=["accuracy"],
                         engine=engine)
    # the workers' last batch of records may still be on its way
    wait_until(lambda: metrics.fetch(client, history.run_id)["header"]["updates"] == 10,
               10, "the run's 10 updates in the store", interval=0.2)
    snap = metrics.fetch(client, history.run_id)
    h = snap["header"]
    assert (h["mode"], h["status"], h["n_workers"], h["updates"]) == ("sync", "finished", 2, 10)
    assert h["total_updates"] == 10 and h["epochs"] == 2
    w = snap["workers"]
    assert list(w["address"]) == history.workers
    assert list(w["steps"]) == [10, 10] and list(w["shard_size"]) == [125, 125]
    assert all(v > 0 for v in w["compute_ms"]) and all(v > 0 for v in w["mb_moved"])
    assert list(snap["histogram"]["staleness"]) == [0]
    loss = snap["series"]["loss"]["data"]
    # graph: the global loss of every step but the last of each epoch rides on step
    # records (a step's record carries the step before's); p2p: every step's own
    assert list(loss["update"]) == ([0, 1, 2, 3, 5, 6, 7, 8] if engine == "graph"
                                    else list(range(10)))
    epochs = snap["series"]["epochs"]["data"]
    assert list(epochs["loss"]) == pytest.approx(history.history["loss"])
    assert list(epochs["accuracy"]) == pytest.approx(history.history["accuracy"])


def test_publishing_costs_under_2_percent_of_the_sync_step(client, digits):
    """The sync benchmark (``benchmarks/sync_overhead.py --metrics``) measures the
    cost side by side; here, loosely: the CPU one step's records cost (on a worker,
    batches really sent, plus the store folding them in) stays under 2% of a real
    sync step of the smallest model (0.5% measured on the p2p engine's 2.9 ms step:
    the bound keeps a 4x margin for a loaded machine), and workers batch their
    records by time: no message per record (a round trip per step would double
    this step)."""
    x, y = digits.x_train[:640], digits.y_train[:640]
    steps, epochs = len(x) // 32, 3
    kw = dict(client=client, n_workers=2, batch_size=32, seed=0, verbose=0)
    dasktf.fit("mnist-mlp", x[:64], y[:64], epochs=1, **kw)  # warm the workers up
    start = time.monotonic()
    history = dasktf.fit("mnist-mlp", x, y, epochs=epochs, **kw)
    wall = time.monotonic() - start
    step_seconds = statistics.median(history.history["epoch_seconds"][1:]) / steps

    cost = publishing_cost(client, n_workers=2, n=5_000)
    assert cost < 0.02 * step_seconds, (cost, step_seconds)

    time.sleep(1)  # the last flushes
    per_worker: dict[int, int] = {}
    records = 0
    for event in client.get_events(TOPIC):
        steps_here = [r for r in unpack(event)
                      if r.get("run") == history.run_id and r.get("kind") == "step"]
        if steps_here:
            per_worker[steps_here[0]["worker"]] = per_worker.get(steps_here[0]["worker"], 0) + 1
            records += len(steps_here)
    assert records == 2 * steps * epochs
    interval = dasktf.config.get_seconds("metrics-interval")
    assert max(per_worker.values()) <= wall / interval + epochs + 2, (per_worker, wall)


def test_worker_states_running_slow_and_lost():
    store = MetricsStore(slow_factor=2.0)
    records = list(_records(300))
    for r in records[1:]:
        if r["worker"] == 2:
            r["compute_s"] = 0.05  # 5x the others' 0.01
    store.add_records(records)
    store.remove_worker(None, "tcp://127.0.0.1:4001", stimulus_id="test")
    rows = store.fetch()["workers"]
    assert list(rows["state"]) == ["running", "lost", "slow"]
    store.add_records([{"run": "r1", "kind": "run_end", "status": "finished"}])
    assert list(store.fetch()["workers"]["state"]) == ["finished", "lost", "finished"]


def test_runs_of_one_client_share_one_subscription_a_topic(client):
    """Each run hears its own run's loss records, and each run's membership
    watcher every change, through the client's one subscription to each topic:
    two runs of one client (fits in threads) no longer take each other's handler,
    and the one that ends first no longer unsubscribes the other."""
    from dasktf.cluster import membership
    from dasktf.diagnostics.events import LOSS_TOPIC, listen_for_losses

    heard: dict[str, list[float]] = {"a": [], "b": []}
    stop_a = listen_for_losses(client, "run-a", lambda r: heard["a"].append(r["loss"]))
    stop_b = listen_for_losses(client, "run-b", lambda r: heard["b"].append(r["loss"]))

    def loss(run: str, value: float) -> None:
        client.log_event(LOSS_TOPIC, {"records": [{"run": run, "loss": value}]})

    # the subscription travels on the client's stream, the events by RPC: a probe
    # run's loss until one is heard
    probe: list[float] = []
    stop_probe = listen_for_losses(client, "probe", probe.append)
    wait_until(lambda: loss("probe", 0.0) or probe, 10, "the subscription")
    stop_probe()

    loss("run-a", 1.0)
    loss("run-b", 2.0)
    loss("run-c", 3.0)  # another client's run: nobody here listens
    wait_until(lambda: heard["a"] and heard["b"], 10, "both runs' losses")
    stop_a()  # run a ends; run b goes on hearing
    loss("run-a", 4.0)
    loss("run-b", 5.0)
    wait_until(lambda: len(heard["b"]) == 2, 10, "run b's second loss")
    stop_b()
    assert heard == {"a": [1.0], "b": [2.0, 5.0]}

    first, second = membership.MembershipWatcher(client), membership.MembershipWatcher(client)

    def change(worker: str) -> None:
        client.log_event(membership.TOPIC, {"action": "removed", "worker": worker,
                                            "time": time.time()})

    wait_until(lambda: change("probe") or second.removed(["probe"]), 10, "the subscription")
    change("tcp://198.18.0.9:1")
    wait_until(lambda: first.removed(["tcp://198.18.0.9:1"]), 10, "the first watcher")
    wait_until(lambda: second.removed(["tcp://198.18.0.9:1"]), 10, "the second watcher")
    first.close()  # its run ends; the other's watcher goes on hearing
    change("tcp://198.18.0.9:2")
    wait_until(lambda: second.removed(["tcp://198.18.0.9:2"]), 10, "the second watcher")
    assert not first.removed(["tcp://198.18.0.9:2"])
    second.close()
