"""Serving the dashboard: a Bokeh server in a background thread of this process.

``dasktf fit --dashboard`` and ``dasktf dashboard`` run the page next to their
client; the preload (:mod:`dasktf.dashboard.preload`) serves it from Dask's own
dashboard instead. BokehJS always comes from this server (``/static``), never from a
CDN, so the page works without internet.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
from functools import partial
from typing import TYPE_CHECKING, Any

from dasktf import config
from dasktf.dashboard.app import Fetcher, client_fetcher, training_doc
from dasktf.diagnostics.metrics import ensure_store

if TYPE_CHECKING:
    from distributed import Client

logger = logging.getLogger(__name__)


class DashboardServer:
    """A Bokeh server for the training dashboard, in a daemon thread.

    Parameters
    ----------
    client
        Where to read the metrics: this client's scheduler (its ``MetricsStore``).
    run
        The run to show; ``None`` follows the newest.
    address, port
        Where to listen (defaults ``dasktf.dashboard.address`` / ``.port``; port 0
        picks a free one). Loopback unless you mean to expose it.

    Examples
    --------
    >>> with DashboardServer(client) as server:  # doctest: +SKIP
    ...     print(server.url)
    ...     dasktf.fit(..., client=client)
    """

    def __init__(
        self,
        client: Client | None = None,
        run: str | None = None,
        address: str | None = None,
        port: int | None = None,
        fetcher: Fetcher | None = None,
    ) -> None:
        if fetcher is None:
            if client is None:
                raise ValueError("DashboardServer needs a client (or a fetcher).")
            fetcher = client_fetcher(client)
            # Record from now on even if no run has registered the store yet.
            ensure_store(client)
        self.fetcher = fetcher
        self.run = run
        self.address = str(config.get("dashboard.address", address))
        port = int(config.get("dashboard.port", port))
        if not 0 <= port < 65536:
            raise ValueError(f"dashboard port must be in 0..65535; got {port}.")
        self.port = port or _free_port(self.address)
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._loop: Any = None
        self._server: Any = None

    @property
    def url(self) -> str:
        host = f"[{self.address}]" if ":" in self.address else self.address
        return f"http://{host}:{self.port}/"

    def start(self, timeout: float = 30) -> DashboardServer:
        """Start serving; raises ``OSError`` naming the address if it cannot bind."""
        self._thread = threading.Thread(target=self._serve, name="dasktf-dashboard",
                                        daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError(f"the dashboard server did not start within {timeout}s")
        if self._error is not None:
            raise OSError(
                f"cannot serve the dashboard on {self.address}:{self.port} "
                f"({self._error}); pick another --dashboard-port or address"
            ) from self._error
        logger.info("dasktf dashboard at %s", self.url)
        return self

    def _serve(self) -> None:
        from bokeh.application import Application
        from bokeh.application.handlers.function import FunctionHandler
        from bokeh.server.server import Server
        from bokeh.settings import settings
        from tornado.ioloop import IOLoop

        asyncio.set_event_loop(asyncio.new_event_loop())
        try:
            if settings.resources(default="server") not in ("server", "server-dev", "inline"):
                # BOKEH_RESOURCES=cdn would break the page offline: serve it ourselves.
                settings.resources.set_value("server")
            loop = IOLoop.current()
            app = Application(FunctionHandler(
                partial(training_doc, fetcher=self.fetcher, run=self.run)
            ))
            origins = [f"{self.address}:{self.port}"]
            if self.address in ("127.0.0.1", "::1"):
                origins.append(f"localhost:{self.port}")
            self._server = Server(
                {"/": app}, io_loop=loop, address=self.address, port=self.port,
                allow_websocket_origin=origins,
            )
            self._server.start()
            self._loop = loop
        except BaseException as exc:  # noqa: BLE001 - reported by start()
            self._error = exc
            self._ready.set()
            return
        self._ready.set()
        loop.start()

    def stop(self) -> None:
        """Stop the server and its thread (idempotent)."""
        if self._loop is None or self._server is None:
            return
        server, loop = self._server, self._loop
        self._server = self._loop = None

        def _stop() -> None:
            server.stop()
            loop.stop()

        loop.add_callback(_stop)
        if self._thread is not None:
            self._thread.join(timeout=10)

    def __enter__(self) -> DashboardServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def _free_port(address: str) -> int:
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((address, 0))
        return int(s.getsockname()[1])
