"""A TensorFlow child process started from a Dask worker, and its message loop.

TensorFlow's collective runtime (the one ``MultiWorkerMirroredStrategy`` uses) is
configured once per process from ``TF_CONFIG`` and cannot be reset, so a
long-lived Dask worker cannot host one cluster after another. Each run therefore
starts one child per worker. Dask workers are daemonic processes, which
``multiprocessing`` forbids to have children, so the child is a plain
``subprocess`` running :func:`main` that connects back to its parent
over a loopback socket and proves itself with a one-time token before anything is
unpickled.

Protocol (pickled tuples over a ``multiprocessing.connection.Connection``):
parent -> child: ``("call", target, args)`` then any messages ``target`` reads;
child -> parent: ``("event", records)`` (step records for the metrics stream),
``("reply", value)``, ``("error", traceback text)``.
"""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from dasktf.cluster import quiet
from dasktf.cluster.deadline import Deadline
from dasktf.exceptions import DasktfError

_TOKEN_ENV = "DASKTF_CHILD_TOKEN"
_ADDRESS_ENV = "DASKTF_CHILD_ADDRESS"


class ChildError(DasktfError):
    """The TensorFlow child process of a worker failed, died or timed out."""


class ChildProcess:
    """The parent's handle on one child: start, send, wait for replies, kill."""

    def __init__(self, tf_config: dict[str, Any] | None, name: str,
                 connect_timeout: float = 60.0,
                 extra_env: dict[str, str] | None = None) -> None:
        import json

        self.name = name
        env = dict(os.environ)
        env.pop("TF_CONFIG", None)
        env.update(extra_env or {})
        # The child's own TensorFlow import held to its level from its first line.
        env.update(quiet.spawn_env(env.get(quiet.LEVEL_ENV, "1")))
        if tf_config is not None:
            env["TF_CONFIG"] = json.dumps(tf_config)
        token = secrets.token_hex(16)
        server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        server.settimeout(connect_timeout)
        env[_TOKEN_ENV] = token
        env[_ADDRESS_ENV] = f"127.0.0.1:{server.getsockname()[1]}"
        # stderr to a file: its tail goes into the error when the child dies.
        self.log = tempfile.NamedTemporaryFile(prefix="dasktf-child-", suffix=".log",
                                               delete=False)
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "from dasktf.tf.child import main; main()"],
            env=env, stdin=subprocess.DEVNULL, stdout=self.log, stderr=self.log,
        )
        self.closed = False
        try:
            sock, _ = server.accept()
        except TimeoutError:
            self.kill()
            raise ChildError(
                f"{name}: the TensorFlow child process did not connect back within "
                f"{connect_timeout:g}s.{self.log_tail()}"
            ) from None
        finally:
            server.close()
        sock.settimeout(None)
        self.conn = Connection(sock.detach())
        if self.conn.recv_bytes(64).decode() != token:
            self.kill()
            raise ChildError(f"{name}: a process other than the child connected.")

    def call(self, target: Callable[..., Any], *args: Any) -> None:
        """Start ``target(conn, *args)`` in the child (it answers with replies)."""
        self.conn.send(("call", target, args))

    def send(self, message: Any) -> None:
        self.conn.send(message)

    def wait_reply(self, timeout: float, what: str,
                   on_event: Callable[[Any], None] | None = None,
                   poll: float = 0.2) -> Any:
        """Wait for the next reply, forwarding events; never hangs.

        Raises :class:`ChildError` naming ``what`` when the child dies, fails, is
        killed (``kill()`` from another thread) or does not answer within
        ``timeout`` seconds.
        """
        deadline = Deadline(timeout)
        while True:
            if self.closed:
                raise ChildError(f"{self.name}: {what} was aborted (the run is ending).")
            try:
                ready = self.conn.poll(poll)
            except (OSError, EOFError):
                ready = False
            if ready:
                try:
                    kind, value = self.conn.recv()
                except (OSError, EOFError):
                    kind, value = "died", None
                if kind == "event":
                    if on_event is not None:
                        on_event(value)
                    continue
                if kind == "reply":
                    return value
                if kind == "error":
                    raise ChildError(f"{self.name}: {what} failed in the TensorFlow "
                                     f"child process:\n{value}")
            if self.proc.poll() is not None:
                raise ChildError(
                    f"{self.name}: the TensorFlow child process exited (code "
                    f"{self.proc.returncode}) during {what}.{self.log_tail()}"
                )
            if deadline.passed():
                self.kill()
                raise ChildError(
                    f"{self.name}: {what} did not finish within {timeout:g}s; the child "
                    "was killed. A peer that never joined is the usual cause (check "
                    "that every worker can reach the others' ports)."
                    + self.log_tail()
                )

    def log_tail(self, lines: int = 15) -> str:
        try:
            with open(self.log.name, errors="replace") as f:
                tail = f.read().splitlines()[-lines:]
        except OSError:
            return ""
        return ("\nLast lines of its log:\n" + "\n".join(tail)) if tail else ""

    def kill(self) -> None:
        """Kill the child at once (idempotent, callable from any thread)."""
        self.closed = True
        if self.proc.poll() is None:
            self.proc.kill()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:  # pragma: no cover - kill is not ignorable
                pass
        try:
            os.unlink(self.log.name)
        except OSError:
            pass


def call_and_reply(conn: Connection, fn: Callable[..., Any], *args: Any) -> None:
    """Child-side target of ``run_tf_distributed``: run ``fn(*args)`` and reply."""
    conn.send(("reply", fn(*args)))


def _watch_parent(parent: int) -> None:
    """Exit when the Dask worker that started us is gone (SIGKILL leaves orphans)."""
    while True:
        if os.getppid() != parent:
            os._exit(3)
        time.sleep(0.2)


def main() -> None:
    parent = os.getppid()
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
    host, port = os.environ[_ADDRESS_ENV].rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=30)
    sock.settimeout(None)
    conn = Connection(sock.detach())
    conn.send_bytes(os.environ.pop(_TOKEN_ENV).encode())
    try:
        while True:
            try:
                kind, target, args = conn.recv()
            except EOFError:
                return
            if kind != "call":
                continue
            try:
                target(conn, *args)
            except BaseException:  # noqa: BLE001 - everything goes back to the parent
                import traceback

                conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()
