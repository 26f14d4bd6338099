"""A real bandwidth limit on loopback for one benchmark's own Dask workers (issue 8).

On one machine every "network" transfer is a memory copy over ``lo``, so no
reduction topology can win by moving fewer bytes. :class:`LinkShaper` puts a Linux
``tc`` HTB qdisc on ``lo`` that gives **each worker its own uplink** of
``rate_mbit``: the workers listen on known ports (``LocalCluster(...,
worker_port="61100:61115")``), and every packet whose *source* port is worker *i*'s
listening port (the data that worker serves: Dask workers pull, so a gradient or a
sum leaves its worker from its listening port) goes through HTB class *i*, limited
to ``rate_mbit``. Everything else on ``lo`` (other processes' traffic, the
scheduler, requests to the workers) is not classified and passes at full speed
(HTB's direct queue).

What it models: N nodes with a full-duplex link each, limited on the way out. The
way in is not limited (a packet cannot be told apart by its receiver on ``lo``:
the pulling side uses an ephemeral port), which flatters all-to-one reductions (a
reducer receives N-1 gradients at N-1 times the link rate).

Safety, since others share ``lo``: the ports default to a range above the
kernel's ephemeral range (``/proc/sys/net/ipv4/ip_local_port_range``: 32768-60999),
so no other process's connection matches a filter; the shaper refuses to start
unless ``lo`` has its default root qdisc, marks its own qdisc with handle
``d7f:``, removes only that, in ``__exit__``, at exit (``atexit``) and on SIGTERM,
and checks that ``tc qdisc show dev lo`` reads as before. Needs root.
"""

from __future__ import annotations

import atexit
import re
import signal
import subprocess
from collections.abc import Sequence

TC = "/usr/sbin/tc"
#: The root qdisc handle that marks a qdisc as ours (hex).
HANDLE = "d7f"
#: Worker ports: above the ephemeral range, so only our workers listen there.
DEFAULT_PORTS = "61100:61115"
#: Root qdiscs ``lo`` may have when nobody shapes it.
DEFAULT_ROOTS = ("noqueue", "pfifo_fast", "fq_codel", "fq", "mq")


def parse_ports(spec: str) -> list[int]:
    """``"61100:61115"`` (inclusive) or ``"61100"`` -> a list of ports."""
    first, _, last = spec.partition(":")
    lo, hi = int(first), int(last or first)
    if not 0 < lo <= hi < 65536:
        raise ValueError(f"bad port range {spec!r}; use FIRST:LAST, e.g. {DEFAULT_PORTS}.")
    return list(range(lo, hi + 1))


def burst_bytes(rate_mbit: float) -> int:
    """HTB bucket: 2 ms at the rate, at least two 64 KiB (GSO) loopback packets."""
    return max(2 * 65536, int(rate_mbit * 1e6 / 8 * 0.002))


def shaping_commands(
    ports: Sequence[int], rate_mbit: float, dev: str = "lo", tc: str = TC,
    match: str = "sport",
) -> list[list[str]]:
    """The ``tc`` command lines that give each port's outgoing traffic (source port)
    its own HTB class of ``rate_mbit`` on ``dev``; unmatched traffic is not shaped.
    ``match="dport"``: each port's *incoming* traffic instead (a worker's downlink:
    what peers push to its listening port, as ``dasktf.runtime.p2p`` does).
    ``match="both"``: each port gets both, an uplink class ``1+i`` and a downlink
    class ``1+N+i``, so a transfer is limited at the end its ports tell apart: what
    a worker serves (Dask pulls) at the server's uplink, what is pushed to a worker
    at its downlink. A packet matches one of them at most: one end of every
    connection is an ephemeral port.

    A pure function (tested without root): class and filter ``1+i`` for
    ``ports[i]``.
    """
    if rate_mbit <= 0:
        raise ValueError(f"rate_mbit must be positive; got {rate_mbit!r}.")
    if match not in ("sport", "dport", "both"):
        raise ValueError(f"match must be 'sport', 'dport' or 'both'; got {match!r}.")
    if not ports or len(ports) > 2000:
        raise ValueError(f"need 1 to 2000 ports; got {len(ports)}.")
    rate = f"{rate_mbit:g}mbit"
    burst = str(burst_bytes(rate_mbit))
    # default 0: unclassified packets go through HTB's direct queue, unshaped.
    # r2q keeps each class's quantum (rate / r2q bytes) near 2 packets.
    r2q = str(max(1, int(rate_mbit * 1e6 / 8 / 131072)))
    cmds = [[tc, "qdisc", "add", "dev", dev, "root", "handle", f"{HANDLE}:", "htb",
             "default", "0", "r2q", r2q]]
    directions = ["sport", "dport"] if match == "both" else [match]
    for d, direction in enumerate(directions):
        for i, port in enumerate(ports, start=1 + d * len(ports)):
            cls = f"{HANDLE}:{i:x}"
            cmds.append([tc, "class", "add", "dev", dev, "parent", f"{HANDLE}:",
                         "classid", cls, "htb", "rate", rate, "ceil", rate, "burst",
                         burst, "cburst", burst])
            cmds.append([tc, "filter", "add", "dev", dev, "parent", f"{HANDLE}:",
                         "protocol", "ip", "prio", "1", "u32", "match", "ip", direction,
                         str(int(port)), "0xffff", "flowid", cls])
    return cmds


def cleanup_command(dev: str = "lo", tc: str = TC) -> list[str]:
    return [tc, "qdisc", "del", "dev", dev, "root"]


def root_qdisc(show_output: str) -> tuple[str, str] | None:
    """``(kind, handle)`` of the root qdisc in ``tc qdisc show`` output."""
    for line in show_output.splitlines():
        m = re.match(r"qdisc (\S+) (\S+) root", line.strip())
        if m:
            return m.group(1), m.group(2).rstrip(":")
    return None


def class_bytes(show_output: str) -> dict[str, int]:
    """``{classid: bytes sent}`` from ``tc -s class show`` output."""
    out: dict[str, int] = {}
    current = None
    for line in show_output.splitlines():
        m = re.match(r"class htb (\S+) ", line.strip())
        if m:
            current = m.group(1)
            continue
        m = re.match(r"Sent (\d+) bytes", line.strip())
        if m and current is not None:
            out[current] = int(m.group(1))
            current = None
    return out


class LinkShaper:
    """Context manager: each of ``ports`` gets an uplink of ``rate_mbit`` on ``dev``
    while inside (see the module docstring)."""

    def __init__(self, rate_mbit: float, ports: Sequence[int], dev: str = "lo",
                 tc: str = TC, match: str = "sport") -> None:
        self.rate_mbit = rate_mbit
        self.match = match
        self.ports = list(ports)
        self.dev = dev
        self.tc = tc
        self._before: str | None = None
        self._active = False
        self._old_sigterm = None

    def _run(self, cmd: list[str], check: bool = True) -> str:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
        if check and r.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}): {r.stderr.strip()}")
        return r.stdout

    def show(self) -> str:
        return self._run([self.tc, "qdisc", "show", "dev", self.dev])

    def __enter__(self) -> LinkShaper:
        before = self.show()
        root = root_qdisc(before)
        if root is None or root[0] not in DEFAULT_ROOTS:
            raise RuntimeError(
                f"{self.dev} already has a root qdisc ({before.strip()!r}); not touching "
                f"it. If it is a left-over of this benchmark (handle {HANDLE}:), remove it "
                f"with: {' '.join(cleanup_command(self.dev, self.tc))}"
            )
        self._before = before
        atexit.register(self.remove)
        if self._old_sigterm is None:
            self._old_sigterm = signal.signal(signal.SIGTERM, _raise_system_exit)
        self._active = True
        try:
            for cmd in shaping_commands(self.ports, self.rate_mbit, self.dev, self.tc,
                                        self.match):
                self._run(cmd)
        except BaseException:
            self.remove()
            raise
        return self

    def class_bytes(self) -> dict[str, int]:
        return class_bytes(self._run([self.tc, "-s", "class", "show", "dev", self.dev]))

    def remove(self) -> None:
        """Delete our qdisc (only if the root is still ours); idempotent."""
        if not self._active:
            return
        root = root_qdisc(self.show())
        if root is not None and root == ("htb", HANDLE):
            self._run(cleanup_command(self.dev, self.tc))
        self._active = False
        after = self.show()
        if self._before is not None and after != self._before:
            raise RuntimeError(
                f"{self.dev} qdisc did not return to its state: before "
                f"{self._before.strip()!r}, after {after.strip()!r}"
            )

    def __exit__(self, *exc: object) -> None:
        try:
            self.remove()
        finally:
            atexit.unregister(self.remove)
            if self._old_sigterm is not None:
                signal.signal(signal.SIGTERM, self._old_sigterm)
                self._old_sigterm = None


def _raise_system_exit(signum: int, frame: object) -> None:
    # SIGTERM (e.g. from `timeout`) unwinds through the finally blocks that remove
    # the qdisc, instead of killing the process with the limit in place.
    raise SystemExit(128 + signum)
