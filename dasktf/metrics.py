"""Moved to :mod:`dasktf.diagnostics.metrics`; this documented path keeps working."""

from dasktf.diagnostics.metrics import MetricsStore, ensure_store, fetch, fetch_async

__all__ = ["MetricsStore", "ensure_store", "fetch", "fetch_async"]
