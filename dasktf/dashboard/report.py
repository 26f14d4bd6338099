"""A standalone HTML report of a run: the dashboard's plots, BokehJS inlined."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from dasktf.dashboard.app import TITLE, TrainingDashboard
from dasktf.diagnostics.metrics import fetch

if TYPE_CHECKING:
    from distributed import Client


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
