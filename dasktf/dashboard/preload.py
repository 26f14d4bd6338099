"""Host the training dashboard as a page of Dask's own dashboard.

Start the scheduler with this preload::

    dask scheduler --preload dasktf.dashboard.preload

and open ``http://<scheduler-host>:8787/dasktf`` (next to ``/status``). Dask has no
documented extension API for its dashboard; this uses the known route: the
scheduler imports its preloads before it builds its Bokeh server from
``distributed.dashboard.scheduler.applications`` (a ``{path: doc_function}``
mapping, each called as ``doc_function(scheduler, extra, doc)``), so adding a page
to that mapping at import time serves it. ``dask_setup`` then installs the
:class:`~dasktf.diagnostics.metrics.MetricsStore` on the scheduler from the start, so the page
shows runs before any client registered one. The page reads the store in-process
(the Bokeh server runs on the scheduler's event loop): no extra connection.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from dasktf.dashboard.app import training_doc
from dasktf.diagnostics.metrics import PLUGIN_NAME, Cursor, MetricsStore

if TYPE_CHECKING:
    from bokeh.document import Document
    from distributed import Scheduler

logger = logging.getLogger(__name__)

#: The page's path on Dask's dashboard.
ROUTE = "/dasktf"


def scheduler_doc(scheduler: Scheduler, extra: dict[str, Any], doc: Document) -> None:
    """The Dask-dashboard page: a training dashboard over the scheduler's own store."""
    run = None
    args = getattr(doc.session_context, "request", None)
    if args is not None and "run" in (args.arguments or {}):
        run = args.arguments["run"][0].decode()

    async def fetcher(run: str | None, cursor: Cursor | None) -> dict[str, Any]:
        store = scheduler.plugins.get(PLUGIN_NAME)
        if store is None:
            return {"runs": [], "run": None, "error": "no dasktf run on this scheduler yet"}
        return store.fetch(run, cursor)  # type: ignore[no-any-return,attr-defined]

    training_doc(doc, fetcher, run=run)


def install(applications: dict[str, Any] | None = None) -> None:
    """Add the page to Dask's dashboard route table (idempotent)."""
    if applications is None:
        from distributed.dashboard.scheduler import applications
    applications[ROUTE] = scheduler_doc


def dask_setup(scheduler: Scheduler) -> None:
    """Preload hook: put a MetricsStore on the scheduler from the start."""
    if PLUGIN_NAME not in scheduler.plugins:
        # The scheduler starts its plugins (MetricsStore.start adds the handler)
        # right after its preloads.
        scheduler.add_plugin(MetricsStore(), name=PLUGIN_NAME)
    logger.info("dasktf dashboard page at %s on the scheduler's dashboard", ROUTE)


try:
    install()
except ImportError:  # bokeh missing or too old for Dask's dashboard: nothing to add
    logger.warning("Dask's dashboard is unavailable; no %s page", ROUTE)
