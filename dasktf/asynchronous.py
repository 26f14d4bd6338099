"""Moved to :mod:`dasktf.engines.holder`; this documented path keeps working."""

from dasktf.engines.holder.engine import AsyncEngine
from dasktf.engines.holder.records import UpdateRecord, updates_frame

__all__ = ["AsyncEngine", "UpdateRecord", "updates_frame"]
