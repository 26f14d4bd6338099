"""Writing a prediction partition by partition, on the workers.

``dasktf predict`` reads data larger than the client's memory: each partition's
prediction is written by the worker that computed it, as ``part.<i>.parquet``
(one output file per input partition, with the input's index), and only a row
count comes back to the client.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from distributed import Client, Future


def write_part(frame: Any, path: str) -> int:
    """Write one partition's predictions to ``path``; its row count."""
    frame.to_parquet(path, index=True)
    return len(frame)


def write_parquet(frame: Any, directory: str, client: Client) -> list[Future]:
    """One task per partition of ``frame`` writing ``directory/part.<i>.parquet``;
    the futures of their row counts, in partition order."""
    import dask

    os.makedirs(directory, exist_ok=True)
    width = len(str(max(frame.npartitions - 1, 0)))
    tasks = [dask.delayed(write_part, pure=True)(part, os.path.join(
        directory, f"part.{i:0{width}d}.parquet"))
        # As declared: an optimized read may fuse small files into fewer partitions.
        for i, part in enumerate(frame.to_delayed(optimize_graph=False))]
    return client.compute(tasks)  # type: ignore[no-any-return]
