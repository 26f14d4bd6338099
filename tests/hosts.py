"""Worker hosts made of Linux network namespaces, for tests of real network faults.

:class:`HostNetwork` builds N *hosts*: each a network namespace with its own network
stack and one address of 198.18.0.0/24 (the range set aside for network tests), on
a veth pair whose other end sits on a bridge in this namespace (198.18.0.1, where
the test's scheduler listens). Dask workers are started inside with
``ip netns exec``; every packet between two hosts, or a host and the scheduler,
crosses the bridge, so a fault on one host's link is that host's alone:

- :meth:`HostNetwork.vanish` (and :meth:`~HostNetwork.restore`): every packet to
  and from the host dropped, as when it drops off the network: ``blackhole`` routes
  in its namespace (the subnet's two halves, more specific than its own link's
  route) and, for its address, in this one and in every other host's. Nothing
  answers and no RST ever comes.
- :meth:`HostNetwork.link_down` / ``link_up``: its veth pair down (both ends lose
  the carrier).
- :meth:`HostNetwork.shape`: a token bucket of ``rate_mbit`` each way (``tbf``),
  and ``delay_ms`` each way where the kernel has ``netem`` (:func:`netem_available`).
- :func:`freeze` / :func:`thaw`: SIGSTOP / SIGCONT of a process started in a host
  (its connections stay open; nothing answers).

:class:`HostCluster` starts a ``dask scheduler`` on the bridge and a ``dask worker
--no-nanny`` in every host; :class:`FaultAt` is a Keras callback that brings a fault
at a moment of a run.

Everything it makes is named with one prefix (``dtf`` and the pid) and removed by
:meth:`HostNetwork.close` (the fixture's finalizer, also after a failure, and
``atexit``); :func:`remove_stale` removes what an earlier, killed test process
left. Needs root; :func:`unavailable` says why it cannot be used here, for a skip.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import keras

from dasktf.cluster.membership import alive_workers
from dasktf.testing import wait_until

SUBNET = "198.18.0"
BRIDGE_ADDRESS = f"{SUBNET}.1"
#: the subnet in two routes more specific than a host's own link route (a blackhole
#: of the /24 itself would clash with it)
HALVES = (f"{SUBNET}.0/25", f"{SUBNET}.128/25")
#: every name this module makes starts with it (+ the pid), so stale ones are found
PREFIX = "dtf"


def _ip(*args: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    command = ["ip", *args] if ns is None else ["ip", "netns", "exec", ns, "ip", *args]
    return subprocess.run(command, check=check, capture_output=True, text=True, timeout=30)


def _tc(*args: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    command = ["tc", *args] if ns is None else ["ip", "netns", "exec", ns, "tc", *args]
    return subprocess.run(command, check=check, capture_output=True, text=True, timeout=30)


def unavailable() -> str | None:
    """Why namespaces cannot be made here (a skip reason), or ``None``."""
    if sys.platform != "linux":
        return "network namespaces are Linux's"
    if os.geteuid() != 0:
        return "making network namespaces needs root (CI runs as root)"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2 (ip, tc) is not installed"
    probe = f"{PREFIX}probe{os.getpid()}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


def netem_available() -> bool:
    """Whether this kernel has the ``netem`` qdisc (delay); some do not."""
    name = f"{PREFIX}n{os.getpid()}"
    if _ip("link", "add", name, "type", "dummy", check=False).returncode != 0:
        return False
    try:
        return _tc("qdisc", "add", "dev", name, "root", "netem", "delay", "1ms",
                   check=False).returncode == 0
    finally:
        _ip("link", "del", name, check=False)


def remove_stale() -> None:
    """Remove the namespaces and links of test processes of this module that are
    gone (their pid in the name no longer runs)."""
    def dead(name: str) -> bool:
        digits = "".join(c for c in name[len(PREFIX):].split("h")[0].split("b")[0]
                         if c.isdigit())
        return bool(digits) and not os.path.exists(f"/proc/{digits}")

    listed = _ip("netns", "list", check=False).stdout.split()
    for ns in listed:
        if ns.startswith(PREFIX) and dead(ns):
            _ip("netns", "del", ns, check=False)
    for line in _ip("-o", "link", "show", check=False).stdout.splitlines():
        name = line.split(":")[1].strip().split("@")[0] if ":" in line else ""
        if name.startswith(PREFIX) and dead(name):
            _ip("link", "del", name, check=False)


@dataclass
class Host:
    """One worker host: its namespace, address, links and worker process."""

    index: int
    ns: str
    address: str
    #: the veth end on the bridge (this namespace) and the one inside the host
    outer: str
    inner: str


@dataclass
class HostNetwork:
    """N worker hosts on a bridge (see the module). Use as a context manager."""

    n_hosts: int
    tag: str = field(default_factory=lambda: f"{PREFIX}{os.getpid()}")
    hosts: list[Host] = field(default_factory=list)
    processes: list[subprocess.Popen] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.n_hosts > 200:
            raise ValueError("at most 200 hosts in 198.18.0.0/24")
        self.bridge = f"{self.tag}b"
        atexit.register(self.close)

    # -- the network --------------------------------------------------------------
    def __enter__(self) -> HostNetwork:
        remove_stale()
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _build(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{BRIDGE_ADDRESS}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for i in range(self.n_hosts):
            host = Host(i, f"{self.tag}h{i}", f"{SUBNET}.{10 + i}",
                        f"{self.tag}v{i}", f"{self.tag}p{i}")
            self.hosts.append(host)
            _ip("netns", "add", host.ns)
            _ip("link", "add", host.outer, "type", "veth", "peer", "name", host.inner)
            _ip("link", "set", host.inner, "netns", host.ns)
            _ip("link", "set", host.outer, "master", self.bridge)
            _ip("link", "set", host.outer, "up")
            _ip("addr", "add", f"{host.address}/24", "dev", host.inner, ns=host.ns)
            _ip("link", "set", host.inner, "up", ns=host.ns)
            _ip("link", "set", "lo", "up", ns=host.ns)

    def close(self) -> None:
        """Stop every process started here and remove every namespace and link."""
        for proc in self.processes:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGCONT)  # a frozen one must die too
                    proc.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=10)
        self.processes = []
        for host in self.hosts:
            _ip("link", "del", host.outer, check=False)
            _ip("netns", "del", host.ns, check=False)
            _ip("route", "del", "blackhole", f"{host.address}/32", check=False)
        self.hosts = []
        _ip("link", "del", self.bridge, check=False)

    # -- processes ----------------------------------------------------------------
    def spawn(self, command: list[str], host: Host | None = None,
              env: dict[str, str] | None = None) -> subprocess.Popen:
        """Start ``command`` in ``host``'s namespace (this one for ``None``), its
        output to a file under the system's temporary directory."""
        if host is not None:
            command = ["ip", "netns", "exec", host.ns, *command]
        with open(f"/tmp/{self.tag}-{len(self.processes)}.log", "wb") as log:
            proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                    env={**os.environ, **(env or {})},
                                    start_new_session=True)
        self.processes.append(proc)
        return proc

    # -- faults -------------------------------------------------------------------
    def vanish(self, host: Host) -> None:
        """Drop every packet to and from ``host`` (see the module)."""
        for half in HALVES:
            _ip("route", "add", "blackhole", half, ns=host.ns)
        _ip("route", "add", "blackhole", f"{host.address}/32")
        for other in self.hosts:
            if other is not host:
                _ip("route", "add", "blackhole", f"{host.address}/32", ns=other.ns)

    def restore(self, host: Host) -> None:
        """Undo :meth:`vanish`."""
        for half in HALVES:
            _ip("route", "del", "blackhole", half, ns=host.ns, check=False)
        _ip("route", "del", "blackhole", f"{host.address}/32", check=False)
        for other in self.hosts:
            if other is not host:
                _ip("route", "del", "blackhole", f"{host.address}/32", ns=other.ns,
                    check=False)

    @contextlib.contextmanager
    def flap(self, host: Host, seconds: float) -> Iterator[None]:
        """``host`` vanishes for ``seconds``, then comes back (in the block's
        first ``seconds``; the block goes on after)."""
        self.vanish(host)
        try:
            time.sleep(seconds)
        finally:
            self.restore(host)
        yield

    def link_down(self, host: Host) -> None:
        _ip("link", "set", host.outer, "down")

    def link_up(self, host: Host) -> None:
        _ip("link", "set", host.outer, "up")

    def shape(self, rate_mbit: float, delay_ms: float = 0.0) -> None:
        """Every host's link: ``rate_mbit`` each way, and ``delay_ms`` each way where
        the kernel has netem (one way between two hosts: twice ``delay_ms``)."""
        burst = max(64 * 1024, int(rate_mbit * 1e6 / 8 * 0.004))
        for host in self.hosts:
            for dev, ns in ((host.outer, None), (host.inner, host.ns)):
                if delay_ms:
                    _tc("qdisc", "add", "dev", dev, "root", "handle", "1:", "netem",
                        "delay", f"{delay_ms}ms", "limit", "100000", ns=ns)
                    parent = ("parent", "1:1")
                else:
                    parent = ("root",)
                _tc("qdisc", "add", "dev", dev, *parent, "handle", "2:", "tbf",
                    "rate", f"{rate_mbit}mbit", "burst", str(burst),
                    "latency", "500ms", ns=ns)

    def unshape(self) -> None:
        for host in self.hosts:
            _tc("qdisc", "del", "dev", host.outer, "root", check=False)
            _tc("qdisc", "del", "dev", host.inner, "root", ns=host.ns, check=False)


def freeze(proc: subprocess.Popen) -> None:
    os.kill(proc.pid, signal.SIGSTOP)


def thaw(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(proc.pid, signal.SIGCONT)


class HostCluster:
    """A scheduler on the bridge and one worker per host (replaced when lost)."""

    def __init__(self, net: HostNetwork, tmp: str, security_args: list[str]) -> None:
        self.net, self.security_args = net, security_args
        self.procs: dict[int, subprocess.Popen] = {}
        file = os.path.join(tmp, "scheduler.json")
        self.scheduler = net.spawn(
            [sys.executable, "-m", "distributed.cli.dask_scheduler", "--host",
             BRIDGE_ADDRESS, "--port", "0", "--no-dashboard", "--scheduler-file", file,
             *security_args], env=_ENV)
        wait_until(lambda: os.path.exists(file) and os.path.getsize(file) > 0, 60,
                   "the scheduler's file")
        time.sleep(0.2)  # written, then flushed
        with open(file) as f:
            self.address = json.load(f)["address"]

    def ensure_workers(self, client) -> None:
        """A worker on every host whose worker is not running, or not in the
        cluster any more (removed while frozen: woken up, it shuts down)."""
        listed = " ".join(self.workers(client))
        for host in self.net.hosts:
            proc = self.procs.get(host.index)
            alive = proc is not None and proc.poll() is None
            if alive and f"//{host.address}:" not in listed:
                thaw(proc)
                proc.kill()
                proc.wait(timeout=30)
                alive = False
            if not alive:
                self.procs[host.index] = self.net.spawn(
                    [sys.executable, "-m", "distributed.cli.dask_worker", self.address,
                     "--host", host.address, "--nthreads", "1", "--no-nanny",
                     "--no-dashboard", "--preload", "dasktf.cluster.quiet",
                     *self.security_args], host=host, env=_ENV)

    def workers(self, client) -> list[str]:
        return alive_workers(client)

    def worker_of(self, client, host: Host) -> str:
        return next(w for w in self.workers(client) if f"//{host.address}:" in w)

    def close(self) -> None:
        for proc in [self.scheduler, *self.procs.values()]:
            thaw(proc)
            proc.kill()
            proc.wait(timeout=30)


_ENV = {"TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONUNBUFFERED": "1"}


class FaultAt(keras.callbacks.Callback):
    """Runs ``fault()`` ``delay`` seconds into epoch ``epoch`` (in a thread, so a
    fault that takes time does not hold the run's loop); ``at`` is its time, and
    :meth:`check` raises what the fault raised."""

    def __init__(self, fault, epoch: int, delay: float = 0.3,
                 then=None) -> None:
        super().__init__()
        self.fault, self.epoch, self.delay, self.then = fault, epoch, delay, then
        self.at: float | None = None
        self.error: BaseException | None = None
        self.done = threading.Event()
        self.thread: threading.Thread | None = None

    def on_epoch_begin(self, epoch, logs=None):
        if epoch == self.epoch and self.thread is None:
            def run() -> None:
                try:
                    time.sleep(self.delay)
                    self.at = time.time()
                    self.fault()
                    if self.then is not None:
                        self.then()
                except BaseException as exc:  # noqa: BLE001 - check() raises it in the test
                    self.error = exc
                finally:
                    self.done.set()

            self.thread = threading.Thread(target=run, daemon=True)
            self.thread.start()

    def check(self) -> None:
        """The fault happened, and did what it does without an error."""
        assert self.done.wait(timeout=30), "the fault never ran"
        if self.error is not None:
            raise self.error
