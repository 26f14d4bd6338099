"""What keeps the scheduler's and the client's work per step small (issue 17):
a window of sync steps reaches the scheduler as one graph, and the client hears one
replica's loss rather than every worker's records. The scale figures themselves are
benchmarks (benchmarks/scale.py, docs/SCALING.md); these tests stay at 3 workers.
"""

from __future__ import annotations

import dask
import keras
import numpy as np
import pytest
from distributed.diagnostics.plugin import SchedulerPlugin

import dasktf
from dasktf.cluster.membership import alive_workers
from dasktf.diagnostics.events import LOSS_TOPIC, TOPIC, MetricsBuffer, unpack

STEPS = 12  # 3 workers x 8 rows x 12 steps


class GraphCounter(SchedulerPlugin):
    """Counts the update-graph messages that carry a run's step tasks."""

    name = "dasktf-test-graph-counter"

    def __init__(self) -> None:
        self.graphs: list[int] = []
        self.segments: list[int] = []

    def update_graph(self, scheduler, *, tasks=(), **kwargs) -> None:
        steps = [k for k in tasks if isinstance(k, str) and k.startswith("dasktf-step-")]
        if steps:
            self.graphs.append(len(steps))
        segments = [k for k in tasks
                    if isinstance(k, str) and k.startswith("dasktf-segment-")]
        if segments:
            self.segments.append(len(segments))


def _graphs(dask_scheduler=None) -> list[int]:
    plugin = dask_scheduler.plugins[GraphCounter.name]
    out, plugin.graphs = list(plugin.graphs), []
    return out


def _segments(dask_scheduler=None) -> list[int]:
    plugin = dask_scheduler.plugins[GraphCounter.name]
    out, plugin.segments = list(plugin.segments), []
    return out


def _fit(client, data, window: int) -> tuple[list[np.ndarray], list[int]]:
    x, y = data
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(10, activation="softmax")])
    client.run_on_scheduler(_graphs)  # forget earlier runs' graphs
    with dask.config.set({"dasktf.submit-window": window, "dasktf.submit-ahead": 6}):
        history = dasktf.fit(model, x, y, client=client, n_workers=3, epochs=1,
                             batch_size=24, optimizer="sgd", shuffle=False, verbose=0,
                             loss="sparse_categorical_crossentropy", engine="graph")
    return history.model.get_weights(), client.run_on_scheduler(_graphs)


def test_a_window_of_steps_reaches_the_scheduler_as_one_graph(client, digits):
    data = digits.x_train[: 24 * STEPS].reshape(-1, 64), digits.y_train[: 24 * STEPS]
    client.register_plugin(GraphCounter())
    per_step, one_each = _fit(client, data, window=1)
    windowed, three_each = _fit(client, data, window=3)
    # window 1: the first 6 steps at once (submit-ahead), then one step per graph
    assert one_each == [18] + [3] * (STEPS - 6)
    # window 3: 6 at once, then 3 steps (9 tasks) per graph as 3 retire
    assert three_each == [18, 9, 9]
    # the graph's shape changes nothing that trains
    for a, b in zip(per_step, windowed, strict=True):
        np.testing.assert_array_equal(a, b)


def _p2p_fit(client, digits, **kw):
    x, y = digits.x_train[:480].reshape(-1, 64), digits.y_train[:480]
    client.register_plugin(GraphCounter())
    client.run_on_scheduler(_segments)  # forget earlier runs'
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(10, activation="softmax")])
    history = dasktf.fit(model, x, y, client=client, n_workers=3, epochs=3, batch_size=48,
                         optimizer="sgd", verbose=0, engine="p2p",
                         loss="sparse_categorical_crossentropy", **kw)
    assert history.engine == "p2p"
    return history, client.run_on_scheduler(_segments)


def test_a_p2p_fit_costs_the_scheduler_one_task_per_worker_not_one_per_epoch(
        client, digits):
    """A p2p fit of 3 epochs reaches the scheduler as one graph of N segment tasks
    (segments span epochs: dasktf.runtime.p2p.span), not N a graph each epoch; and
    per-epoch segments (``dasktf.p2p.span-epochs: false``) train the same model."""
    spanned, graphs = _p2p_fit(client, digits, validation_split=0.25)
    assert graphs == [3]  # one graph of 3 tasks for the whole fit
    with dask.config.set({"dasktf.p2p.span-epochs": False}):
        per_epoch, graphs = _p2p_fit(client, digits, validation_split=0.25)
    assert graphs == [3, 3, 3]  # a graph of 3 an epoch (one update-graph message)
    for key in ("loss", "val_loss"):
        assert spanned.history[key] == per_epoch.history[key]
    for a, b in zip(spanned.model.get_weights(), per_epoch.model.get_weights(),
                    strict=True):
        np.testing.assert_array_equal(a, b)


def test_the_client_hears_one_replica_s_loss_not_every_worker_s_records(client, digits):
    x, y = digits.x_train[:720].reshape(-1, 64), digits.y_train[:720]
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(10, activation="softmax")])
    with dask.config.set({"dasktf.metrics-interval": "50ms"}):
        history = dasktf.fit(model, x, y, client=client, n_workers=3, epochs=2,
                             batch_size=24, optimizer="sgd", verbose=0,
                             loss="sparse_categorical_crossentropy")
    run = history.run_id
    steps = [r for e in client.get_events(TOPIC) for r in unpack(e)
             if r.get("run") == run and r.get("kind") == "step"]
    first_flushes = [e for e in client.get_events(TOPIC)
                     if any(r.get("run") == run and r.get("worker") == 0 for r in unpack(e))]
    loss_events = [e for e in client.get_events(LOSS_TOPIC)
                   if any(r.get("run") == run for r in unpack(e))]
    losses = [r for e in loss_events for r in unpack(e)]
    # the dashboard's topic still has every worker's step records...
    assert {r["worker"] for r in steps} == {0, 1, 2}
    # ...the client's has the newest global loss of replica 0's batches only: one
    # record a flush, and no more messages than replica 0 flushed
    assert 0 < len(losses) == len(loss_events) <= len(first_flushes)
    first = {r["loss_step"]: r["loss"] for r in steps if r["worker"] == 0 and "loss" in r}
    assert all(first[r["loss_step"]] == r["loss"] for r in losses)


def test_many_workers_send_the_scheduler_fewer_metric_messages_each():
    with dask.config.set({"dasktf.metrics-interval": "0.5s", "dasktf.metrics-rate": 16}):
        assert MetricsBuffer(n_workers=3).interval == 0.5
        # 64 workers: every 4 s each, 16 messages a second in all
        assert MetricsBuffer(n_workers=64).interval == 4.0
        # replica 0's records carry the global loss: they keep the interval
        assert MetricsBuffer(n_workers=64, reports_loss=True).interval == 0.5
    with dask.config.set({"dasktf.metrics-rate": 0}), \
            pytest.raises(ValueError, match="metrics-rate must be a positive"):
        MetricsBuffer(n_workers=3)


def test_by_default_a_run_s_workers_send_their_records_4_times_a_second_in_all():
    """``dasktf.metrics-rate`` 4 (16 before issue 39): at 8 workers each sends every
    2 s, not every 0.5 s (the step records were a short 8-worker fit's largest count
    of messages to the scheduler after Dask's heartbeats); 2 workers keep
    ``metrics-interval``, and so does the replica whose records carry the loss."""
    assert MetricsBuffer(n_workers=2).interval == 0.5
    assert MetricsBuffer(n_workers=8).interval == 2.0
    assert MetricsBuffer(n_workers=8, reports_loss=True).interval == 0.5


def _count_identity(dask_scheduler=None) -> None:
    """Wrap the scheduler's ``identity`` handler with a counter (once)."""
    handler = dask_scheduler.handlers["identity"]
    if getattr(handler, "dasktf_counted", None) is None:
        calls = [0]

        def counted(*args, **kwargs):
            calls[0] += 1
            return handler(*args, **kwargs)

        counted.dasktf_counted = calls
        dask_scheduler.handlers["identity"] = counted


def _identity_calls(dask_scheduler=None) -> int:
    return dask_scheduler.handlers["identity"].dasktf_counted[0]


def test_a_waiting_client_checks_its_workers_without_the_schedulers_identity(client,
                                                                            digits):
    """The liveness check a waiting client runs every poll asks the scheduler which
    of the run's workers it lists (a small query), not for its identity (every
    worker described, O(cluster)): a p2p epoch of many polls costs no identity call,
    and a worker gone is still named."""
    from dasktf.cluster.membership import listed_workers

    workers = alive_workers(client)
    assert listed_workers(client, [*workers, "tcp://127.0.0.1:9"]) == set(workers)
    client.run_on_scheduler(_count_identity)
    before = client.run_on_scheduler(_identity_calls)
    x, y = digits.x_train, digits.y_train
    with dask.config.set({"dasktf.poll-interval": "20ms"}):  # many polls
        history = dasktf.fit("mnist-mlp", x, y, client=client, n_workers=3, epochs=2,
                             batch_size=16, seed=0, verbose=0, engine="p2p")
    assert len(history.history["loss"]) == 2
    # the set-up's and the epoch ends' (9 here); one a poll would be hundreds (326
    # before the liveness check asked for the listed workers only)
    assert client.run_on_scheduler(_identity_calls) - before <= 15


class SetUpGraphs(SchedulerPlugin):
    """Which update-graph message first carried each task of a run (a later one
    names it too where it is a dependency), and where each pinned task may run
    (its workers, whether it may go elsewhere)."""

    name = "dasktf-test-set-up-graphs"

    def __init__(self) -> None:
        self.graphs = 0
        self.sent_in: dict[str, int] = {}
        self.where: dict[str, tuple[list[str], bool]] = {}

    def update_graph(self, scheduler, *, tasks=(), **kwargs) -> None:
        self.graphs += 1
        for k in tasks:
            self.sent_in.setdefault(k, self.graphs)
            ts = scheduler.tasks.get(k)
            if ts is not None and ts.worker_restrictions and k not in self.where:
                self.where[k] = (sorted(ts.worker_restrictions), bool(ts.loose_restrictions))


def _set_up_graphs(dask_scheduler=None):
    plugin = dask_scheduler.plugins[SetUpGraphs.name]
    out = plugin.sent_in, plugin.where
    plugin.graphs, plugin.sent_in, plugin.where = 0, {}, {}
    return out


def _load(index, n):
    x, y = np.random.default_rng(index).normal(size=(64, 8)), np.arange(64) % 4
    return x.astype("float32"), y


def test_a_fit_s_set_up_sends_each_per_worker_phase_as_one_graph(client):
    """The set-up's tasks, one per worker each (the shards a loader builds and their
    stats), reach the scheduler as one update-graph message each, not N (the
    scheduler's fixed cost per message was most of a short fit's:
    benchmarks/scale.py --whole-fit), every one of them still pinned to its own
    worker, never moved; the replicas are built with no task at all (over the
    client's connections to the workers: dasktf.cluster.calls), each on its worker;
    and the end reads the updates each replica applied from the spanning segment's
    results, with no task of its own."""
    from distributed.utils import key_split

    client.register_plugin(SetUpGraphs())
    client.run_on_scheduler(_set_up_graphs)  # forget earlier runs'
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4, activation="softmax")])
    history = dasktf.fit(model, _load, client=client, n_workers=3, epochs=2, batch_size=24,
                         optimizer="sgd", verbose=0, engine="p2p",
                         loss="sparse_categorical_crossentropy")
    assert len(history.history["loss"]) == 2
    steps = 3 * 64 // 24
    assert history.applied_updates == {i: list(range(2 * steps)) for i in range(3)}
    sent_in, where = client.run_on_scheduler(_set_up_graphs)
    graphs: dict[str, list[int]] = {}
    for key, graph in sent_in.items():
        graphs.setdefault(key_split(key), []).append(graph)
    # one graph for the shards and their stats, one for the segments: each of 3
    # tasks; none to build the replicas, none to read the applied updates
    assert graphs["load_shard"] == graphs["stats_of"] == [graphs["load_shard"][0]] * 3
    assert graphs["dasktf-segment"] == [graphs["dasktf-segment"][0]] * 3, graphs
    assert not {"dasktf-replica", "create_replica_task", "applied_log_task"} & set(graphs)
    assert [r["worker"] for r in history.replica_info] == history.workers
    workers = alive_workers(client)
    for prefix in ("load_shard", "stats_of"):
        placed = [v for k, v in where.items() if key_split(k) == prefix]
        assert sorted(w for (w,), loose in placed if not loose) == workers, (prefix, placed)


def _count_handlers(dask_scheduler=None) -> None:
    """Wrap every RPC and stream handler of the scheduler with a call counter by op
    (once; as benchmarks/handler_cpu.py does for their CPU)."""
    import functools
    import inspect
    from collections import Counter

    s = dask_scheduler
    if hasattr(s, "dasktf_test_calls"):
        return
    calls = s.dasktf_test_calls = Counter()

    def wrap(op, fn):
        if inspect.iscoroutinefunction(fn):
            @functools.wraps(fn)
            async def counted_async(*args, **kwargs):
                calls[op] += 1
                return await fn(*args, **kwargs)
            return counted_async

        @functools.wraps(fn)
        def counted(*args, **kwargs):
            calls[op] += 1
            return fn(*args, **kwargs)
        return counted

    for table in (s.stream_handlers, s.handlers):
        for op, fn in list(table.items()):
            if op != "run_function":  # the test's own reads
                table[op] = wrap(op, fn)


def _handler_calls(dask_scheduler=None) -> dict[str, int]:
    out = dict(dask_scheduler.dasktf_test_calls)
    dask_scheduler.dasktf_test_calls.clear()
    return out


def test_a_waiting_client_hears_of_its_workers_from_the_watcher_not_a_poll(client,
                                                                          digits):
    """A p2p fit's waits (the set-up's, the epochs', the end's) read the membership
    watcher's events every poll and ask the scheduler which workers it lists at
    most every ``dasktf.membership-backstop``: with a poll every 20 ms, a handful of
    ``ncores`` questions a fit, not one a poll (issue 39: ~11 of a short 8-worker
    fit's ~210 messages to the scheduler); and the shards and the validation pieces
    reach the workers with one ``update_data`` message each, where a scatter per
    worker was two messages per worker (``ncores_running``, ``update_data``); the
    model's package and the results travel between the client and the workers,
    not through the scheduler; and the plugins and the losses' subscription are
    registered by the client's first fit only."""
    client.run_on_scheduler(_count_handlers)
    x, y = digits.x_train[:960], digits.y_train[:960]
    val = digits.x_train[960:1200], digits.y_train[960:1200]
    client.run_on_scheduler(_handler_calls)  # forget earlier calls
    # many polls; the backstop's question once (a loaded machine's fit of several
    # times 10 s would ask a few times more)
    with dask.config.set({"dasktf.poll-interval": "20ms",
                          "dasktf.membership-backstop": "1h"}):
        history = dasktf.fit("mnist-mlp", x, y, client=client, n_workers=3, epochs=3,
                             batch_size=48, seed=0, verbose=0, engine="p2p",
                             validation_data=val)
    calls = client.run_on_scheduler(_handler_calls)
    assert len(history.history["val_loss"]) == 3
    # the end of each set-up phase (5) and end phase (4), which ask always (a worker
    # dropped in one is named with it: dasktf.run.setup), and the end's release; one
    # a poll would be hundreds (the fit takes seconds at 20 ms a poll: 630 before)
    assert calls.get("ncores", 0) <= 10, calls
    # the shards, the validation pieces, the model's package (sent by the client to
    # a worker, which the others copy: never through the scheduler's ``scatter``),
    # and the copies of the package (told, not made by the scheduler's
    # ``replicate``: dasktf.cluster.broadcast)
    assert calls.get("update_data", 0) == 4, calls
    assert calls.get("scatter", 0) == 0, calls
    assert calls.get("replicate", 0) == 0, calls
    assert calls.get("ncores_running", 0) == 1, calls  # the package's scatter
    assert calls.get("register_worker_plugin", 0) >= 1, calls  # TensorFlow's, p2p's
    assert calls.get("register_scheduler_plugin", 0) >= 1, calls
    # the losses' and the membership's topics: subscribed once by this client (if
    # this is its first fit), never unsubscribed by a run
    assert calls.get("subscribe-topic", 0) <= 2, calls
    assert calls.get("unsubscribe-topic", 0) == 0, calls

    # a second fit on this client registers no plugin again: the scheduler keeps
    # them (dasktf.cluster.plugins; every fit registered 2 worker plugins, one of
    # them sent to every worker again, and 3 scheduler plugins)
    again = dasktf.fit("mnist-mlp", x, y, client=client, n_workers=3, epochs=1,
                       batch_size=48, seed=0, verbose=0, engine="p2p")
    calls = client.run_on_scheduler(_handler_calls)
    assert len(again.history["loss"]) == 1
    for op in ("register_worker_plugin", "register_scheduler_plugin", "subscribe-topic",
               "unsubscribe-topic"):
        assert calls.get(op, 0) == 0, (op, calls)
