"""Which runs the p2p engine takes, and what every member of its groups must share."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dask.utils import parse_bytes

from dasktf import config
from dasktf.runtime.p2p.links import GroupSpec

if TYPE_CHECKING:
    from dasktf.wire.packets import CommSpec


def refusal(mode: str, sync_quorum: int | None, comm: CommSpec | None) -> str | None:
    """Why ``engine="p2p"`` cannot run these options, or ``None`` when it can (then
    ``engine="auto"`` picks it)."""
    if mode != "sync":
        return ("engine='p2p' trains in sync steps; an async run applies each "
                "worker's gradient on parameter holders (engine='auto' or 'graph').")
    if sync_quorum is not None:
        return ("engine='p2p' sums every worker's gradient each step; sync_quorum "
                "drops the late ones on a parameter holder (engine='auto' or 'graph').")
    if comm is not None and (comm.placement == "ps" or comm.num_ps > 1):
        return ("engine='p2p' keeps the whole model on every replica; placement='ps' "
                "(num_ps) keeps the optimizer in slices on parameter servers, which "
                "the graph engine runs (engine='auto' or 'graph').")
    if comm is not None and comm.topology != "tree":
        return (f"topology={comm.topology!r} is a reduction of the graph engine's; "
                "engine='p2p' picks its own all-reduce (dasktf.p2p.algorithm: "
                "doubling, direct or ring). Drop topology, or use engine='graph'.")
    return None


def options_refusal(options: Any, fault: Any = None) -> str | None:
    """:func:`refusal` of a trainer's ``options`` that ask for ``engine="p2p"``."""
    if options.engine != "p2p":
        return None
    return refusal(options.mode, options.sync_quorum, options.comm)


def group_spec(gid: str, members: list[str], compression: str) -> GroupSpec:
    """A group's settings, read once here from the client's configuration and sent
    to every member, so that they all choose the same algorithm."""
    threshold = config.get("p2p.bandwidth-threshold")
    return GroupSpec(
        gid, tuple(members), codec=compression,
        algorithm=str(config.get("p2p.algorithm")),
        threshold=int(parse_bytes(threshold) if isinstance(threshold, str) else threshold),
        timeout=config.get_seconds("p2p.timeout"),
    )
