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

Topic subscriptions likewise (:func:`subscribe_shared`): one per client and
connection, whose events go to every handler dasktf registered for the topic.
"""

from __future__ import annotations

import itertools
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


class _Fanout:
    """The handler of a client's one subscription to a topic: every event to
    each handler registered for it."""

    def __init__(self) -> None:
        self.handlers: dict[int, Callable[[Any], None]] = {}

    def __call__(self, event: Any) -> None:
        for handler in list(self.handlers.values()):
            handler(event)


_fanouts: weakref.WeakKeyDictionary[Any, dict[str, _Fanout]] = weakref.WeakKeyDictionary()
_tokens = itertools.count()


def subscribe_shared(client: Any, topic: str, handler: Callable[[Any], None]
                     ) -> Callable[[], None]:
    """Call ``handler(event)`` for each event of ``topic`` that reaches ``client``;
    returns what stops it. ``Client.subscribe_topic`` keeps one handler a topic:
    when each run subscribed and unsubscribed itself, two runs of one client (fits
    in threads) took each other's handler and the first to end unsubscribed both;
    and the two messages were a short fit's (issue 39). So the client subscribes
    once per connection to the scheduler (again after a reconnect) and stays
    subscribed, its events going to every handler registered now."""
    with _lock:
        fanout = _fanouts.setdefault(client, {}).setdefault(topic, _Fanout())
        token = next(_tokens)
        fanout.handlers[token] = handler
    register_once(client, ("topic", topic), lambda: client.subscribe_topic(topic, fanout))
    return lambda: fanout.handlers.pop(token, None)  # type: ignore[func-returns-value]
