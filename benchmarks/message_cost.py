"""What one p2p message costs the two training threads that send and read it.

Two processes, each with the direct transport's :class:`~dasktf.runtime.p2p.direct.Links`
on loopback TCP connections (one each way, as two workers' are) and a
:class:`~dasktf.runtime.p2p.mailbox.Mailbox`, send each other a message in turn,
as a collective's rounds do: the wall time of a round trip, and the CPU each
thread spent per message it sent and read (``time.thread_time``). No Dask and no
TensorFlow: the transport alone, so a change to it shows. The same on a Unix
socket pair beside it: what a same-host transport would save.

``--compare PATH`` runs the same in another checkout of dasktf (a ``git worktree``
of the commit before a change) alternately with this one, repetition by
repetition, so the machine's load hits both alike, and prints the ratios.

Usage: ``python benchmarks/message_cost.py [--messages 3000] [--reps 5]
[--compare /path/to/other/checkout]``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

#: payload sizes: a ready round's empty message, a scalar round, an MLP slice, a
#: cnn slice
SIZES = [("4 B", 1), ("4 KiB", 1024), ("104 KB", 26_000), ("1 MB", 250_000)]
#: the sockets: loopback TCP (the workers' own), a Unix socket pair
FAMILIES = ("tcp", "unix")


def _pair(family: str) -> tuple[socket.socket, socket.socket]:
    """A connected pair (the sender's end, the reader's end)."""
    if family == "unix":
        return socket.socketpair()
    with socket.create_server(("127.0.0.1", 0)) as server:
        out = socket.create_connection(server.getsockname())
        into, _ = server.accept()
    for s in (out, into):
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return out, into


def _member(rank: int, out_fd: int, in_fd: int, messages: int, size: int) -> dict:
    """One side: ``messages`` round trips (rank 0 sends first); its figures."""
    import numpy as np

    from dasktf.runtime.p2p.direct import Channel, Links
    from dasktf.runtime.p2p.mailbox import Key, Mailbox

    out = socket.socket(fileno=out_fd)
    into = socket.socket(fileno=in_fd)
    into.setblocking(False)
    mailbox = Mailbox()
    links = Links(connect=lambda dest: Channel(out),
                  deliver=lambda source, key, payload: mailbox.put(key, source, payload,
                                                                   wake=False),
                  lost=lambda source, error: mailbox.fail(error))
    links.arrived(1 - rank, Channel(into))
    payload = (np.ones(size, np.float32),)
    peer = 1 - rank

    def turn(step: int) -> None:
        if rank == 0:
            links.send(peer, Key(step, "rd", 0, 0), payload)
            mailbox.take(Key(step, "rd", 1, 0), peer, 60, "peer", links.progress)
        else:
            mailbox.take(Key(step, "rd", 0, 0), peer, 60, "peer", links.progress)
            links.send(peer, Key(step, "rd", 1, 0), payload)
        links.flush(60, str, step)

    for step in range(200):  # warm the connection and the code paths
        turn(step)
    cpu, wall = time.thread_time(), time.perf_counter()
    for step in range(200, 200 + messages):
        turn(step)
    cpu, wall = time.thread_time() - cpu, time.perf_counter() - wall
    links.close()
    # each turn: one message sent and one read by this thread: a message's two ends
    return {"round_trip_us": 1e6 * wall / messages, "cpu_per_message_us": 1e6 * cpu / messages}


def measure(messages: int, size: int, family: str = "tcp") -> dict:
    """Both sides in processes of their own; rank 0's wall, both ends' CPU."""
    a_out, b_in = _pair(family)
    b_out, a_in = _pair(family)
    ctx = __import__("multiprocessing").get_context("fork")
    with ctx.Pool(2) as pool:
        results = [pool.apply_async(_member, (rank, out.fileno(), into.fileno(), messages,
                                              size))
                   for rank, out, into in ((0, a_out, a_in), (1, b_out, b_in))]
        got = [r.get(timeout=600) for r in results]
    for s in (a_out, b_in, b_out, a_in):
        s.close()
    return {"round_trip_us": got[0]["round_trip_us"],
            "cpu_per_message_us": statistics.mean(g["cpu_per_message_us"] for g in got)}


def _run(tree: str, messages: int) -> dict:
    """:func:`measure` at every size, in a fresh interpreter importing ``tree``'s dasktf."""
    env = dict(os.environ, PYTHONPATH=tree)
    code = (f"import json, sys; sys.path.insert(0, {os.path.dirname(__file__)!r}); "
            "from message_cost import measure, SIZES, FAMILIES; "
            f"print(json.dumps({{f + ' ' + n: measure({messages}, s, f) "
            "for n, s in SIZES for f in FAMILIES}))")
    out = subprocess.run([sys.executable, "-c", code], env=env, check=True,
                         capture_output=True, text=True, cwd=tree).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=3000)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--compare", default=None,
                        help="another checkout of dasktf, run alternately with this one")
    args = parser.parse_args()
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    trees = {"this": here} | ({"compare": os.path.abspath(args.compare)}
                              if args.compare else {})
    runs: dict[str, list[dict]] = {name: [] for name in trees}
    for _ in range(args.reps):
        for name, tree in trees.items():
            runs[name].append(_run(tree, args.messages))
    print(f"load average: {os.getloadavg()[0]:.2f}; {args.messages} round trips, "
          f"median of {args.reps}")
    print(f"{'socket':>6} {'size':>7} {'tree':>8} {'round trip us':>14} "
          f"{'CPU/message us':>15}")
    for label, _ in SIZES:
        for family in FAMILIES:
            key, medians = f"{family} {label}", {}
            for name in trees:
                rt = statistics.median(r[key]["round_trip_us"] for r in runs[name])
                cpu = statistics.median(r[key]["cpu_per_message_us"] for r in runs[name])
                medians[name] = (rt, cpu)
                print(f"{family:>6} {label:>7} {name:>8} {rt:14.1f} {cpu:15.1f}")
            if "compare" in medians:
                (rt, cpu), (rt0, cpu0) = medians["this"], medians["compare"]
                print(f"{family:>6} {label:>7} {'ratio':>8} {rt / rt0:14.3f} "
                      f"{cpu / cpu0:15.3f}")


if __name__ == "__main__":
    main()
