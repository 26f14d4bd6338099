"""What a run listens on: loopback only, unless the user names an engine that cannot.

Every listening socket of the run's process tree (the client, the embedded cluster's
scheduler, nannies and workers, and any TensorFlow child) is read with psutil while
the run trains, so a service that binds every interface for a moment is seen too.
"""

from __future__ import annotations

import ipaddress
import os
import re
import socket
import subprocess
import sys
import threading
import warnings

import dask
import psutil
import pytest

import dasktf
from dasktf.exceptions import EngineHint, SecurityWarning
from dasktf.run.engine import collective_hint


def _listening(root: psutil.Process) -> set[tuple[str, int, str]]:
    """``(address, port, process name)`` of every listening socket of ``root``'s tree."""
    found = set()
    for proc in [root, *root.children(recursive=True)]:
        try:
            name = " ".join(proc.cmdline()[:3])
            for conn in proc.net_connections(kind="inet"):
                # TCP servers are LISTEN; a bound UDP socket has no status but serves.
                serving = conn.status == psutil.CONN_LISTEN or (
                    conn.type == socket.SOCK_DGRAM and conn.laddr and not conn.raddr)
                if serving:
                    found.add((conn.laddr.ip, conn.laddr.port, name))
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue  # a process that ended between the listing and the read
    return found


class SocketWatch:
    """Samples the listening sockets of a process tree until stopped (bounded)."""

    def __init__(self, pid: int, interval: float = 0.25, limit: float = 600) -> None:
        self.root = psutil.Process(pid)
        self.seen: set[tuple[str, int, str]] = set()
        self._stop = threading.Event()
        self._interval, self._limit = interval, limit
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        deadline = self._limit / self._interval
        while not self._stop.is_set() and deadline > 0:
            try:
                self.seen |= _listening(self.root)
            except psutil.NoSuchProcess:
                return
            deadline -= 1
            self._stop.wait(self._interval)

    def __enter__(self) -> SocketWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def beyond_loopback(self) -> set[tuple[str, int, str]]:
        return {s for s in self.seen if not ipaddress.ip_address(s[0]).is_loopback}


# The old engine="auto" rule picked the collective engine for a sync run of a small
# model on 2+ CPU workers and at least dasktf.collective.hint-min-steps steps (then
# auto-min-steps, default 1,000; the hint still reads it). Lowered to 100, 3 epochs
# of the 1,438 digits at batch 32 (135 steps) are such a run, in a third of the time.
LONG_RUN_EPOCHS = 3
MIN_STEPS = 100


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_default_cli_run_listens_on_loopback_only():
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2",
           "DASK_DASKTF__COLLECTIVE__HINT_MIN_STEPS": str(MIN_STEPS)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "dasktf.cli", "fit", "--workers", "2", "--epochs",
         str(LONG_RUN_EPOCHS), "--quiet"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )
    with SocketWatch(proc.pid) as watch:
        out, err = proc.communicate(timeout=280)
    assert proc.returncode == 0, err[-3000:]
    assert "mode sync, engine p2p" in out, out
    # The run is one the old rule gave to the collective engine; the p2p engine runs
    # it now (no scheduler per step either), and the collective hint is not said.
    assert "engine='collective'" not in err, err[-3000:]
    assert len({port for _, port, _ in watch.seen}) >= 4, watch.seen  # it did look
    assert not watch.beyond_loopback(), sorted(watch.seen)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_default_python_fit_listens_on_loopback_only(digits):
    with SocketWatch(os.getpid()) as watch, warnings.catch_warnings(record=True) as caught, \
            dask.config.set({"dasktf.collective.hint-min-steps": MIN_STEPS}):
        warnings.simplefilter("always")
        history = dasktf.fit("mnist-mlp", digits.x_train, digits.y_train, n_workers=2,
                             epochs=LONG_RUN_EPOCHS, batch_size=32, seed=0, verbose=0)
        # a run the old rule gave to the collective engine, which the graph engine
        # would hint at (the hint is said once per process, so it is asked for here)
        n_params = history.model.count_params()
        steps = LONG_RUN_EPOCHS * -(-len(digits.x_train) // 32)
        assert collective_hint("auto", "sync", None, None, n_params, 2, steps, False)
        assert not collective_hint("auto", "sync", None, None, n_params, 2, steps, False,
                                   resolved="p2p")
    assert history.engine == "p2p" and history.params["engine"] == "p2p"
    assert history.params["mode"] == "sync"
    assert not [w for w in caught if issubclass(w.category, SecurityWarning)]
    assert not watch.beyond_loopback(), sorted(watch.seen)
    assert len({port for _, port, _ in watch.seen}) >= 4, watch.seen  # it did look


@pytest.mark.timeout(300)
def test_the_collective_engine_warns_naming_the_ports_it_opens(client, small_digits):
    x, y = small_digits
    with SocketWatch(os.getpid()) as watch, pytest.warns(SecurityWarning) as caught:
        history = dasktf.fit("mnist-mlp", x, y, client=client, n_workers=2,
                             engine="collective", epochs=1, batch_size=50, verbose=0)
    assert history.engine == "collective" and history.params["engine"] == "collective"
    [warning] = [w for w in caught if issubclass(w.category, SecurityWarning)]
    text = str(warning.message)
    assert "every interface" in text and "unauthenticated" in text, text
    named = {int(p) for p in re.findall(r"127\.0\.0\.1:(\d+)", text)}
    assert len(named) == 2, text
    # The watch sees what the warning names: TensorFlow's servers on every interface
    # (which is also what shows that the loopback tests above can fail).
    exposed = {port for _, port, _ in watch.beyond_loopback()}
    assert named <= exposed, (named, sorted(watch.seen))


def test_auto_hints_collective_only_where_it_runs_the_graph_engine():
    args = dict(mode="sync", sync_quorum=None, slow_workers=None, n_params=80_000,
                n_workers=2, total_steps=5_000, gpu=False)
    assert collective_hint("auto", **args, resolved="p2p") is None  # no hops there
    hint = collective_hint("auto", **args)
    assert hint is not None and "engine='collective'" in hint and "80,000" in hint
    for change in ({"n_params": 1_200_000}, {"total_steps": 50}, {"mode": "async"},
                   {"n_workers": 1}, {"gpu": True}, {"fault_options": True}):
        assert collective_hint("auto", **{**args, **change}) is None, change
    assert collective_hint("graph", **args) is None  # named: the user chose
    assert issubclass(EngineHint, UserWarning) and issubclass(SecurityWarning, UserWarning)


@pytest.mark.timeout(240)
def test_tls_passes_through_to_the_embedded_cluster(small_digits):
    from distributed.security import Security

    x, y = small_digits
    trainer = dasktf.Trainer("mnist-mlp", n_workers=2, security=Security.temporary(),
                             seed=0)
    with trainer:
        assert trainer.client.scheduler.address.startswith("tls://127.0.0.1:")
        history = trainer.fit(x, y, epochs=1, batch_size=50, verbose=0)
    assert history.workers and all(w.startswith("tls://127.0.0.1:") for w in history.workers)
    assert history.history["loss"][0] > 0
