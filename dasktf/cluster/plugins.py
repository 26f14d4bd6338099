"""Plugins registered once per client and scheduler connection, not once per run.

Every run registers what it relies on: scheduler plugins (the membership watcher's,
the liveness detector, the metrics store) and worker plugins (the p2p handlers,
TensorFlow's set-up on a cluster dasktf did not start). Each registration is a
message to the scheduler, and a worker plugin that is not idempotent a message from
it to every worker too: on a short fit, a few percent of what the scheduler handles
(issue 39). The scheduler keeps them (and gives the worker plugins to workers that
join), so a client that registered one over its current connection to the
scheduler does not again; a new connection (a scheduler restarted, a reconnect)
registers again. A plugin someone unregisters behind dasktf's back is not noticed.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Hashable
from typing import Any

_lock = threading.Lock()
#: client -> (its scheduler connection then, the keys registered over it)
_done: weakref.WeakKeyDictionary[Any, tuple[Any, set[Hashable]]] = weakref.WeakKeyDictionary()


def _connection(client: Any) -> Any:
    """The client's batched stream to the scheduler (a new one per connection)."""
    return getattr(client, "scheduler_comm", None)


def register_once(client: Any, key: Hashable, register: Callable[[], Any]) -> None:
    """``register()`` unless ``client`` already did for ``key`` over its current
    connection to the scheduler (``key``: the plugin's name, and what tells its
    settings apart where a new one replaces the old)."""
    comm = _connection(client)
    with _lock:
        entry = _done.get(client)
        if comm is not None and entry is not None and entry[0]() is comm and key in entry[1]:
            return
    register()
    if comm is None:
        return
    with _lock:
        entry = _done.get(client)
        if entry is None or entry[0]() is not comm:
            entry = _done[client] = (weakref.ref(comm), set())
        entry[1].add(key)
