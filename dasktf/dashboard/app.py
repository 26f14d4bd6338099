"""The training dashboard document: components laid out, fed by polling the store.

:class:`TrainingDashboard` owns the components and the cursor into the scheduler's
:class:`~dasktf.diagnostics.metrics.MetricsStore`. :func:`training_doc` adds it to a Bokeh
document with a periodic callback that fetches what is new every
``dasktf.dashboard.refresh``. Where the snapshots come from is a *fetcher*, an async
``(run, cursor) -> snapshot`` callable: :func:`client_fetcher` asks a scheduler
through a ``distributed.Client`` (``dasktf fit --dashboard``, ``dasktf dashboard``,
``bokeh serve dashboards/training``); the scheduler preload reads its own store.
:func:`write_report` saves the page as one standalone HTML file, BokehJS inlined.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from bokeh.layouts import column
from bokeh.models import Div

from dasktf import config
from dasktf.dashboard.components import (
    LossCurves,
    RoundsPanel,
    RunHeader,
    StalenessPanel,
    WorkerPanel,
)
from dasktf.diagnostics.metrics import Cursor, ensure_store, fetch, fetch_async

if TYPE_CHECKING:
    from bokeh.document import Document
    from bokeh.models import LayoutDOM
    from distributed import Client

logger = logging.getLogger(__name__)

Fetcher = Callable[[str | None, Cursor | None], Awaitable[dict[str, Any]]]

TITLE = "dasktf training"


class TrainingDashboard:
    """The whole page for one run: header, loss, staleness, workers.

    Parameters
    ----------
    run
        The run id to show; ``None`` follows the newest run on the scheduler (and
        switches to a newer one when it starts).
    """

    def __init__(self, run: str | None = None) -> None:
        self.run = run
        self.cursor: Cursor | None = None
        self.header = RunHeader()
        self.losses = LossCurves()
        self.staleness = StalenessPanel()
        self.rounds = RoundsPanel()
        self.workers = WorkerPanel()
        self.root: LayoutDOM = column(
            self.header.root,
            self.losses.root,
            Div(text="<h3 style='margin:4px 0'>Staleness</h3>"),
            self.staleness.root,
            self.rounds.root,
            Div(text="<h3 style='margin:4px 0'>Workers</h3>"),
            self.workers.root,
            sizing_mode="stretch_width",
            name="dasktf_dashboard",
        )
        self.updates = 0

    def apply(self, snapshot: dict[str, Any]) -> None:
        """Show one snapshot from :meth:`MetricsStore.fetch`."""
        # A newer run (when following the newest) comes with every series reset:
        # the store ignores a cursor of another run.
        self.header.update(snapshot)
        if snapshot.get("run") is None:
            return
        self.losses.update(snapshot)
        self.staleness.update(snapshot)
        self.rounds.update(snapshot)
        self.workers.update(snapshot)
        self.cursor = snapshot.get("cursor")
        self.updates += 1

    async def refresh(self, fetcher: Fetcher) -> None:
        """Fetch what is new and show it (one fetch at a time)."""
        try:
            snapshot = await fetcher(self.run, self.cursor)
        except Exception as exc:
            logger.debug("dashboard fetch failed", exc_info=True)
            self.header.root.text = (
                f"<b>dasktf</b>: cannot reach the scheduler ({type(exc).__name__}: {exc})"
            )
            return
        self.apply(snapshot)


def client_fetcher(client: Client) -> Fetcher:
    """A fetcher that asks ``client``'s scheduler, from any event loop.

    The Bokeh server runs its own IOLoop (often in another thread than the
    client's), so the request is run on the client's loop and awaited here.
    """

    async def fetcher(run: str | None, cursor: Cursor | None) -> dict[str, Any]:
        timeout = config.get_seconds("connect-timeout")
        future = asyncio.run_coroutine_threadsafe(
            fetch_async(client, run, cursor), client.loop.asyncio_loop
        )
        return await asyncio.wait_for(asyncio.wrap_future(future), timeout)

    return fetcher


def training_doc(
    doc: Document,
    fetcher: Fetcher,
    run: str | None = None,
    refresh: float | str | None = None,
) -> TrainingDashboard:
    """Add a live training dashboard to ``doc`` (a Bokeh server session).

    Examples
    --------
    >>> from functools import partial
    >>> from bokeh.server.server import Server
    >>> app = partial(training_doc, fetcher=client_fetcher(client))  # doctest: +SKIP
    >>> Server({"/": app}, port=5006).start()  # doctest: +SKIP
    """
    dashboard = TrainingDashboard(run)
    doc.title = TITLE
    doc.add_root(dashboard.root)
    busy = False

    async def poll() -> None:
        nonlocal busy
        if busy:  # a slow scheduler: skip a beat rather than pile up requests
            return
        busy = True
        try:
            await dashboard.refresh(fetcher)
        finally:
            busy = False

    period_ms = int(1000 * config.get_seconds("dashboard.refresh", refresh))
    doc.add_next_tick_callback(poll)
    doc.add_periodic_callback(poll, max(100, period_ms))
    return dashboard


_SHARED: dict[str, Client] = {}


def shared_client(address: str) -> Client:
    """One client per scheduler address for this process (Bokeh directory apps run
    their ``main.py`` once per session; they must not open a connection each)."""
    from dasktf.cluster.local import connect

    client = _SHARED.get(address)
    if client is None or client.status not in ("running", "connecting"):
        # Called from Bokeh's event loop: connect from another thread, where a
        # blocking Client may start its own loop.
        with ThreadPoolExecutor(1) as pool:
            client = _SHARED[address] = pool.submit(connect, address).result()
            pool.submit(ensure_store, client).result()
    return client


def report_html(snapshot: dict[str, Any]) -> str:
    """The HTML of a self-contained page showing ``snapshot`` (one full fetch)."""
    from bokeh.embed import file_html
    from bokeh.resources import INLINE

    if snapshot.get("run") is None:
        raise ValueError(f"nothing to report: {snapshot.get('error', 'no run')}")
    dashboard = TrainingDashboard(snapshot["run"])
    dashboard.apply(snapshot)
    title = f"{TITLE}: run {snapshot['run']}"
    return file_html(dashboard.root, INLINE, title)


def write_report(
    path: str | os.PathLike[str],
    client: Client | None = None,
    run: str | None = None,
    snapshot: dict[str, Any] | None = None,
) -> str:
    """Write the report of ``run`` (default: the newest) to ``path``; return the path.

    Give either a ``client`` (its scheduler's MetricsStore is read) or a
    ``snapshot`` from :func:`dasktf.diagnostics.metrics.fetch`. The file needs no server and no
    internet: BokehJS is inlined.
    """
    if snapshot is None:
        if client is None:
            raise ValueError("write_report needs a client or a snapshot.")
        snapshot = fetch(client, run)
    text = report_html(snapshot)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return os.fspath(path)
