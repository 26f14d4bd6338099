"""A table of numeric columns of bounded length: the store's series
(:mod:`dasktf.diagnostics.metrics`)."""

from __future__ import annotations

import bisect
from typing import Any


class DecimatedSeries:
    """A table of numeric columns that never holds more than ``max_points`` rows.

    Rows are appended one at a time. When the table is full, each pair of
    neighbouring rows is replaced by its mean and ``stride`` doubles: from then on a
    row is the mean of ``stride`` appended records. ``generation`` counts these
    rewrites, so a reader holding ``(generation, length)`` knows whether it may take
    just the new rows or must reload the series.
    """

    def __init__(
        self, columns: list[str], max_points: int, order_by: str | None = None
    ) -> None:
        self.columns = list(columns)
        # Async workers flush their records independently, so rows can arrive out of
        # order; a late row is inserted in place (and readers reload the series).
        self.order_by = order_by
        self.max_points = max(2, int(max_points) // 2 * 2)
        self.data: dict[str, list[float | None]] = {c: [] for c in self.columns}
        self.stride = 1
        self.generation = 0
        self._pending: list[dict[str, Any]] = []

    def __len__(self) -> int:
        return len(self.data[self.columns[0]])

    def append(self, row: dict[str, Any]) -> None:
        """Add one record (missing columns are ``None``)."""
        if self.stride == 1:
            key = self.order_by
            column = self.data[key] if key else None
            if column and row.get(key) is not None and column[-1] is not None \
                    and row[key] < column[-1]:
                at = bisect.bisect_right(column, row[key])
                for c in self.columns:
                    self.data[c].insert(at, row.get(c))
                self.generation += 1
            else:
                self._push(row)
        else:
            self._pending.append(row)
            if len(self._pending) >= self.stride:
                self._push(_mean_row(self._pending, self.columns))
                self._pending = []
        if len(self) >= self.max_points:
            self._compact()

    def extend(self, columns: dict[str, list[Any]], n: int) -> None:
        """Add ``n`` records given as columns, as ``n`` :meth:`append` calls would."""
        if self.stride == 1 and self.order_by is None and len(self) + n < self.max_points:
            for c in self.columns:  # no compaction on the way: the columns whole
                self.data[c].extend(columns.get(c) or [None] * n)
            return
        names = list(columns)
        for values in zip(*columns.values(), strict=True):
            self.append(dict(zip(names, values, strict=True)))

    def _push(self, row: dict[str, Any]) -> None:
        for c in self.columns:
            self.data[c].append(row.get(c))

    def _compact(self) -> None:
        n = len(self)
        for c in self.columns:
            old = self.data[c]
            self.data[c] = [_mean2(old[i], old[i + 1]) for i in range(0, n - 1, 2)] + (
                [old[-1]] if n % 2 else []
            )
        self.stride *= 2
        self.generation += 1

    def since(self, cursor: list[int] | None) -> tuple[dict[str, Any], list[int]]:
        """Rows after ``cursor`` (``[generation, length]``) and the new cursor.

        The result has ``reset: True`` and every row when the reader's cursor is
        from an older generation (or absent).
        """
        n = len(self)
        if cursor is None or cursor[0] != self.generation or cursor[1] > n:
            start, reset = 0, True
        else:
            start, reset = int(cursor[1]), False
        rows = {c: self.data[c][start:] for c in self.columns}
        return {"reset": reset, "data": rows, "stride": self.stride}, [self.generation, n]


def _mean2(a: float | None, b: float | None) -> float | None:
    if a is None:
        return b
    if b is None:
        return a
    return (a + b) / 2


def _mean_row(rows: list[dict[str, Any]], columns: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for c in columns:
        values = [r[c] for r in rows if r.get(c) is not None]
        out[c] = sum(values) / len(values) if values else None
    return out
