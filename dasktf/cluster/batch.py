"""Many tasks, one message: tasks pinned to the run's workers sent to the scheduler
as one graph.

``Client.submit`` sends one ``update-graph`` message per task, and the scheduler's
fixed cost per message (handing its deserialisation to a thread, building the
task states, logging the event) was the largest single item of its CPU per sync
step (``benchmarks/scale.py``, docs/SCALING.md), and of a short fit's set-up (a
replica, a shard and its stats per worker). A :class:`TaskBatch` collects tasks
with their restrictions and sends them with one ``Client.get(..., sync=False)`` of
a ``HighLevelGraph`` whose layers carry the restrictions as annotations: keys,
arguments and placement are exactly those ``submit`` would have made (each task is
the ``Task`` ``submit`` builds: :func:`dasktf.compat.graph_task`; a task without a
``key`` gets ``submit``'s ``pure=False`` one; pinned tasks never move, as with
``allow_other_workers=False``).

Only the tasks the caller will read get a future (:meth:`TaskBatch.want`): every
future is a ``key-in-memory`` report to the client and a ``client-releases-keys``
message back, per task, which made the client's and the scheduler's work per step
grow with the workers for tasks whose results only other tasks read.

It sits below everything that submits (the run's set-up, the data adapters, the
engines and the worker-side helpers they share) and imports none of them.
"""

from __future__ import annotations

import functools
import operator
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dasktf import compat

if TYPE_CHECKING:
    from collections.abc import Callable

    from distributed import Client, Future


@dataclass(frozen=True)
class Pending:
    """A task of the batch not sent yet: its key stands in for its future (as an
    argument of a later task, of this batch or a later one, it is a dependency)."""

    key: str


class TaskBatch:
    """Tasks collected for one ``update-graph`` message."""

    def __init__(self, client: Client) -> None:
        self.client = client
        #: (pinned, resources) -> {key: task}; a layer's annotations are per group
        self._groups: dict[tuple[bool, tuple[tuple[str, float], ...]], dict[str, Any]] = {}
        self._where: dict[str, list[str]] = {}
        self._keys: list[str] = []
        self._wanted: list[str] = []
        #: the futures the queued tasks' arguments hold: alive until the graph is
        #: sent (a task refers to a future by key only, and a future the caller let go
        #: of meanwhile would be released: its task cancelled, "lost dependencies")
        self._held: list[Future] = []

    def want(self, obj: Any) -> None:
        """The client will read these tasks (a :class:`Pending`, or a list of them):
        they get futures at :meth:`flush`."""
        if isinstance(obj, Pending):
            self._wanted.append(obj.key)
        elif isinstance(obj, list):
            for o in obj:
                self.want(o)

    def add(
        self,
        func: Callable[..., Any],
        *args: Any,
        key: str | None = None,
        workers: list[str] | None = None,
        resources: dict[str, float] | None = None,
        **kwargs: Any,
    ) -> Pending:
        """Queue ``func(*args, **kwargs)`` as task ``key`` (``submit``'s
        ``pure=False`` key when ``None``), pinned to ``workers`` (never moved) when
        given; returns what later tasks pass to depend on it. Arguments may hold
        futures and :class:`Pending` tasks, in lists too: dependencies."""
        from dask.utils import funcname
        from distributed import futures_of

        if key is None:
            key = f"{funcname(func)}-{uuid.uuid4()}"
        self._held.extend(futures_of([args, kwargs]))
        task = compat.graph_task(key, func, tuple(_ref(a) for a in args),
                                 {k: _ref(v) for k, v in kwargs.items()})
        group = (workers is not None, tuple(sorted((resources or {}).items())))
        self._groups.setdefault(group, {})[key] = task
        if workers is not None:
            self._where[key] = list(workers)
        self._keys.append(key)
        return Pending(key)

    def flush(self) -> dict[str, Future]:
        """Send the queued tasks as one graph; ``{key: future}`` for the wanted
        ones (the others run as the wanted ones need them)."""
        if not self._keys:
            return {}
        from dask.highlevelgraph import HighLevelGraph, MaterializedLayer

        layers: dict[str, Any] = {}
        where = functools.partial(operator.getitem, self._where)
        for i, ((pinned, resources), tasks) in enumerate(self._groups.items()):
            annotations: dict[str, Any] = {}
            if pinned:
                annotations["workers"] = where
            if resources:
                annotations["resources"] = dict(resources)
            layers[f"dasktf-batch-{i}"] = MaterializedLayer(tasks, annotations=annotations)
        graph = HighLevelGraph(layers, {name: set() for name in layers})
        wanted = list(dict.fromkeys(self._wanted))
        futures = self.client.get(graph, wanted, sync=False)
        out = dict(zip(wanted, futures, strict=True))
        self._groups, self._where, self._keys, self._wanted = {}, {}, [], []
        self._held = []  # the scheduler holds them for their dependents now
        return out

    def send(self, tasks: list[Pending]) -> list[Future]:
        """Want ``tasks``, :meth:`flush`, and return their futures in their order:
        one task per worker sent as one message, read back as ``submit``'s list."""
        self.want(tasks)
        futures = self.flush()
        return [futures[t.key] for t in tasks]


def resolve(obj: Any, futures: dict[str, Future]) -> Any:
    """``obj`` with every :class:`Pending` of a flushed batch replaced by its
    future (lists of them too); anything else as it is."""
    if isinstance(obj, Pending):
        return futures.get(obj.key, obj)
    if isinstance(obj, list):
        return [resolve(o, futures) for o in obj]
    return obj


def _ref(arg: Any) -> Any:
    """``arg`` with its :class:`Pending` tasks (in lists too) made references to
    their keys (dependencies, as futures are)."""
    if isinstance(arg, Pending):
        return compat.task_ref(arg.key)
    if isinstance(arg, list):
        return [_ref(a) for a in arg]
    return arg
