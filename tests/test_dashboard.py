"""The live dashboard in a real browser (Debian's chromium driven by Playwright).

Every test trains for real on the session's LocalCluster. Set
``DASKTF_DOCS_SCREENSHOT=1`` to also refresh ``docs/dashboard.png``.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import threading
import traceback
from collections.abc import Iterator
from typing import Any

import dask
import keras
import pytest
from click.testing import CliRunner
from distributed import Client

import dasktf
import dasktf.cli
from dasktf.dashboard import DashboardServer, write_report
from dasktf.diagnostics import metrics
from dasktf.diagnostics.events import TOPIC, unpack
from dasktf.testing import wait_until

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
DOCS = os.path.join(os.path.dirname(__file__), "..", "docs")

pytestmark = pytest.mark.skipif(
    not os.path.exists(CHROMIUM),
    reason="needs Debian's chromium (apt-get install chromium; .ci/run installs it)",
)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--headless", "--no-sandbox"])
        yield b
        b.close()


class Training:
    """A real fit running in a thread, so the test can watch it."""

    def __init__(self, client: Client, data: Any, **kw: Any) -> None:
        self.history: Any = None
        self.error: BaseException | None = None
        x, y = data.x_train, data.y_train
        kw = {"n_workers": 3, "epochs": 6, "batch_size": 32, "seed": 0, "verbose": 0,
              "metrics": ["accuracy"], "validation_data": (data.x_test, data.y_test),
              "optimizer": "adam", **kw}
        self._thread = threading.Thread(
            target=self._fit, args=(client, x, y, kw), daemon=True
        )
        self._thread.start()

    def _fit(self, client: Client, x: Any, y: Any, kw: dict[str, Any]) -> None:
        try:
            self.history = dasktf.fit("mnist-mlp", x, y, client=client, **kw)
        except BaseException as exc:  # noqa: BLE001 - re-raised by join()
            self.error = exc

    def join(self, timeout: float = 120) -> Any:
        self._thread.join(timeout)
        if self._thread.is_alive():  # say where it is: a hang must be diagnosable
            frame = sys._current_frames().get(self._thread.ident or -1)
            where = "".join(traceback.format_stack(frame)) if frame else "(no frame)"
            raise AssertionError(f"the training run did not finish in time; at\n{where}")
        if self.error is not None:
            raise self.error
        return self.history


class _HoldAfterFirstEpoch(keras.callbacks.Callback):
    """Holds the run (on the client) at the end of its first epoch until released,
    at most 120 s: bounded, a forgotten release only slows the test down."""

    def __init__(self) -> None:
        super().__init__()
        self._go = threading.Event()
        self.held = False

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        if epoch == 0:
            self.held = True
            self._go.wait(120)

    def release(self) -> None:
        self._go.set()


def _source(page: Any, name: str) -> dict[str, list[Any]]:
    return page.evaluate(
        "(name) => { const s = Bokeh.documents[0].get_model_by_name(name);"
        " const d = s.data instanceof Map ? Object.fromEntries(s.data) : s.data;"
        " const out = {}; for (const k of Object.keys(d)) out[k] = Array.from(d[k]);"
        " return out; }",
        name,
    )


def _open(browser: Any, url: str) -> Any:
    page = browser.new_page(viewport={"width": 1400, "height": 1250})
    page.goto(url, timeout=30_000)
    page.wait_for_function(
        "() => window.Bokeh && Bokeh.documents.length > 0 && "
        "Bokeh.documents[0].get_model_by_name('loss') !== null", timeout=30_000,
    )
    return page


def _store_updates(client: Client, run: str | None = None) -> int:
    snap = metrics.fetch(client, run)
    return int(snap["header"]["updates"]) if snap.get("run") else 0


def test_live_dashboard_shows_loss_staleness_and_every_worker(client, digits, browser,
                                                              tmp_path):
    with DashboardServer(client, port=0) as server:
        assert server.url.startswith("http://127.0.0.1:")
        known = _known_runs(client)  # earlier tests' runs: the page follows the newest
        # The run waits after its first epoch until the page has been seen live: a
        # fast engine would otherwise finish before the test looks (6 epochs in 7 s).
        gate = _HoldAfterFirstEpoch()
        training = Training(client, digits, callbacks=[gate])
        page = _open(browser, server.url)
        run = wait_until(lambda: _updates_of_new_run(client, known, 0), 60, "the run to start")
        wait_until(lambda: run in page.inner_text(".dasktf-header")
              and len(_source(page, "loss")["loss"]) >= 5, 60, "the first loss points")
        header = page.inner_text(".dasktf-header")
        before = len(_source(page, "loss")["loss"])
        assert "status running" in header.replace("\n", " "), header
        gate.release()
        wait_until(lambda: len(_source(page, "loss")["loss"]) > before, 60,
                   "new loss points on the open page")
        history = training.join()
        assert gate.held, "the run never reached the end of its first epoch"

        # The page follows to the end of the run.
        wait_until(lambda: "finished" in page.inner_text(".dasktf-header"), 20, "the run's end")
        header = page.inner_text(".dasktf-header").replace("\n", " ")
        assert re.search(r"mode\s+sync", header) and "mnist-mlp" in header, header
        assert re.search(r"engine\s+p2p", header), header  # auto: the p2p engine
        assert "epoch 6 / 6" in header and "workers 3 (CPU)" in header, header
        loss = _source(page, "loss")
        assert loss["update"] == sorted(loss["update"]) and loss["update"][0] == 0
        epochs = _source(page, "epochs")
        assert epochs["val_accuracy"] == pytest.approx(history.history["val_accuracy"])

        # Staleness panel: the sync run's zeros, and the page says why.
        note = page.inner_text(".bk-Div >> text=staleness is 0")
        assert note.startswith("sync mode")
        staleness = _source(page, "staleness")
        assert staleness["staleness"] and set(staleness["staleness"]) == {0}
        assert set(staleness["worker"]) == {"0", "1", "2"}
        assert _source(page, "staleness_histogram")["staleness"] == [0]

        # The worker table lists every worker, in the data and on screen.
        workers = _source(page, "workers")
        assert workers["address"] == history.workers
        assert workers["state"] == ["finished"] * 3
        assert all(s > 0 for s in workers["steps"])
        wait_until(lambda: "finished" in page.inner_text(".slick-viewport"), 10, "the table")
        table_text = page.inner_text(".slick-viewport")
        for address in history.workers:
            assert address in table_text, table_text
        assert table_text.count("finished") == 3, table_text

        # BokehJS came from this server, not a CDN.
        scripts = page.evaluate("() => Array.from(document.scripts).map(s => s.src)")
        assert not [s for s in scripts if s and not s.startswith(server.url)], scripts

        page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)
        if os.environ.get("DASKTF_DOCS_SCREENSHOT"):
            page.screenshot(path=os.path.join(DOCS, "dashboard.png"), full_page=True)
        page.close()

    # The same plots as a standalone file: BokehJS inline, no server, no network.
    path = write_report(tmp_path / "run.html", client, history.run_id)
    text = open(path, encoding="utf-8").read()
    assert "cdn.bokeh.org" not in text and history.run_id in text
    page = browser.new_page()
    page.route("**/*", lambda route: route.abort()
               if not route.request.url.startswith("file:") else route.continue_())
    page.goto(f"file://{path}")
    page.wait_for_function("() => window.Bokeh && Bokeh.documents.length > 0",
                           timeout=30_000)
    assert len(_source(page, "loss")["loss"]) == len(loss["loss"])
    assert _source(page, "workers")["address"] == history.workers
    assert re.search(r"engine\s+p2p", page.inner_text(".dasktf-header"))
    page.close()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _known_runs(client: Client) -> set[str]:
    return {r["run"] for r in metrics.fetch(client)["runs"]}


def _updates_of_new_run(client: Client, known: set[str], at_least: int) -> str | None:
    snap = metrics.fetch(client)
    if snap.get("run") in known or snap.get("run") is None:
        return None
    return snap["run"] if snap["header"]["updates"] >= at_least else None


class _Lines:
    """Lines a subprocess prints, read in a thread (a silent process never blocks)."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.lines: list[str] = []
        self._thread = threading.Thread(target=self._read, args=(proc,), daemon=True)
        self._thread.start()

    def _read(self, proc: subprocess.Popen) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            self.lines.append(line)

    def starting(self, prefix: str) -> str | None:
        return next((x for x in self.lines if x.startswith(prefix)), None)


@pytest.mark.slow
def test_dashboard_started_late_shows_the_earlier_points(client, digits, browser):
    known = _known_runs(client)
    # An async run with a straggler: the page must show real, non-zero staleness.
    # (3 epochs: ~540 updates, far more than the page needs; the suite's time is shared)
    training = Training(client, digits, batch_size=24, mode="async", slow_workers={0: 3.0},
                        epochs=3)
    run = wait_until(lambda: _updates_of_new_run(client, known, 40), 90, "40 updates")
    # Each record reaches the scheduler once, in its worker's next flush: wait until
    # the straggler's first ones are in (the fast workers' updates can reach 40
    # within one flush interval), so none can arrive after the truncation below.
    wait_until(lambda: {1, 2, 3} <= set(
        metrics.fetch(client, run)["series"]["loss"]["data"]["update"]), 30,
        "the first three updates in the store")
    # Empty the scheduler's event log: the page must rebuild the run from the store.
    client.run_on_scheduler(lambda dask_scheduler: dask_scheduler._broker.truncate(TOPIC))
    # (the run goes on publishing, but the first updates are gone from the log)
    left = [r.get("update") for e in client.get_events(TOPIC) for r in unpack(e)]
    assert not {1, 2, 3} & set(left), left
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "dasktf.cli", "dashboard", "--scheduler",
         client.scheduler.address, "--port", str(port)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    out = _Lines(proc)
    try:
        line = wait_until(lambda: out.starting("dashboard: "), 60, "the dashboard's URL")
        assert f"http://127.0.0.1:{port}/" in line and run in line, line
        page = _open(browser, f"http://127.0.0.1:{port}/")
        wait_until(lambda: len(_source(page, "loss")["update"]) >= 30, 30, "the earlier points")
        # async numbers updates from 1 (update n makes weights version n)
        assert _source(page, "loss")["update"][:3] == [1, 2, 3]
        header = page.inner_text(".dasktf-header")
        assert run in header and re.search(r"mode\s+async", header), header
        wait_until(lambda: max(_source(page, "staleness")["staleness"], default=0) > 0, 30,
              "non-zero staleness")
        assert sum(_source(page, "staleness_histogram")["count"]) > 0
        page.close()
    finally:
        proc.terminate()
        proc.wait(timeout=20)
    training.join()


def test_rounds_panel_shows_inner_losses_round_ends_drift_and_bytes(client, digits,
                                                                   browser, tmp_path):
    """A sync run in rounds of 4 local steps: the page plots every worker's inner
    steps, a round end every 4 steps, each round's drift (as the history has it)
    and the bytes per example, and says what staleness means in rounds."""
    with DashboardServer(client, port=0) as server:
        history = Training(client, digits, epochs=2, local_steps=4).join()
        page = _open(browser, server.url)  # it follows the newest run: this one
        wait_until(lambda: "finished" in page.inner_text(".dasktf-header"), 30, "the run's end")
        steps = -(-len(digits.x_train) // 32)
        wait_until(lambda: len(_source(page, "inner_loss")["step"]) == 3 * 2 * steps, 20,
              "every inner step")
        inner = _source(page, "inner_loss")
        assert set(inner["worker"]) == {"0", "1", "2"}
        assert all(loss > 0 for loss in inner["loss"])
        rounds = _source(page, "rounds")
        # the p2p engine's records carry their own round's drift, the epoch's last
        # included (the graph engine's, the round before's: not the last one)
        per_epoch = -(-steps // 4)
        assert rounds["round"] == list(range(2 * per_epoch)), rounds["round"]
        # a round ends every 4 steps of its epoch, the last one at the epoch's end
        assert rounds["step"] == [(r // per_epoch) * steps + min((r % per_epoch + 1) * 4,
                                                                 steps)
                                  for r in rounds["round"]]
        drift = {r["update"]: r["drift"] for r in history.rounds}
        assert rounds["drift"] == pytest.approx([drift[r] for r in rounds["round"]])
        assert min(rounds["drift"]) > 0 and min(rounds["bytes_per_example"]) > 0
        note = page.inner_text(".bk-Div >> text=staleness is 0")
        assert "rounds of 4 local steps" in note, note
        rounds_note = page.inner_text(".bk-Div >> text=Drift = the workers' spread")
        assert rounds_note.startswith("Rounds of 4 local steps"), rounds_note
        assert page.is_visible(".bk-Div >> text=Drift = the workers' spread")
        page.screenshot(path=str(tmp_path / "rounds.png"), full_page=True)
        page.close()


def test_dashboard_command_reports_a_bad_run_and_scheduler(client):
    with dask.config.set({"dasktf.connect-timeout": "2s"}):
        result = CliRunner().invoke(dasktf.cli.main, ["dashboard", "--scheduler",
                                                      "tcp://127.0.0.1:1"])
    assert result.exit_code == 1 and "tcp://127.0.0.1:1" in result.output
    # whether or not an earlier test left a store and runs there: one run it knows
    metrics.ensure_store(client)
    client.log_event(TOPIC, {"records": [{"run": "known", "kind": "start"}]})
    wait_until(lambda: metrics.fetch(client)["runs"], 10, "the published run")
    result = CliRunner().invoke(dasktf.cli.main, ["dashboard", "--scheduler",
                                                  client.scheduler.address, "--run", "nope"])
    assert result.exit_code == 2 and "unknown run 'nope'" in result.output, result.output


@pytest.mark.slow
def test_fit_serves_the_dashboard_and_writes_the_report(tmp_path):
    report = tmp_path / "run.html"
    proc = subprocess.run(
        [sys.executable, "-m", "dasktf.cli", "fit", "--workers", "2", "--epochs", "1",
         "--quiet", "--dashboard", "--dashboard-port", "0", "--report", str(report)],
        capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(r"^dashboard: http://127\.0\.0\.1:\d+/$", proc.stdout, re.M), proc.stdout
    assert f"report: {report}" in proc.stdout
    text = report.read_text(encoding="utf-8")
    assert "cdn.bokeh.org" not in text and '"name":"loss"' in text.replace(" ", "")


@pytest.mark.slow
def test_dask_dashboard_hosts_the_page_via_the_preload(digits, browser):
    from distributed import LocalCluster

    import dasktf.dashboard.preload as preload

    with LocalCluster(n_workers=1, threads_per_worker=1, host="127.0.0.1",
                      dashboard_address="127.0.0.1:0",
                      scheduler_kwargs={"preload": ["dasktf.dashboard.preload"]}) as cluster, \
            Client(cluster) as c:
        dasktf.fit("mnist-mlp", digits.x_train[:300], digits.y_train[:300], client=c,
                   epochs=1, batch_size=50, verbose=0)
        url = cluster.dashboard_link.replace("/status", preload.ROUTE)
        page = _open(browser, url)
        wait_until(lambda: len(_source(page, "loss")["loss"]) >= 4, 20, "the run's loss")
        assert "finished" in page.inner_text(".dasktf-header")
        page.close()
