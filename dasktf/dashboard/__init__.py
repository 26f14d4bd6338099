"""The live training dashboard (Bokeh), fed by the scheduler's MetricsStore.

* :func:`training_doc` builds the page into a Bokeh document (``bokeh serve
  dashboards/training`` uses it);
* :class:`DashboardServer` serves it from a thread of this process
  (``dasktf fit --dashboard``, ``dasktf dashboard``);
* :mod:`dasktf.dashboard.preload` adds it to Dask's own dashboard at ``/dasktf``;
* :func:`write_report` saves a run's plots as one standalone HTML file.

Named data sources (``doc.get_model_by_name(name)``): ``loss``, ``epochs``,
``staleness``, ``staleness_histogram``, ``workers``.
"""

from __future__ import annotations

from dasktf.dashboard.app import (
    TrainingDashboard,
    client_fetcher,
    report_html,
    training_doc,
    write_report,
)
from dasktf.dashboard.server import DashboardServer

__all__ = [
    "DashboardServer",
    "TrainingDashboard",
    "client_fetcher",
    "report_html",
    "training_doc",
    "write_report",
]
