"""Which runs the p2p engine takes, and what every member of its groups must share."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dask.utils import parse_bytes

from dasktf import config
from dasktf.runtime.p2p.links import GroupSpec
from dasktf.runtime.p2p.redundancy import check_redundancy
from dasktf.runtime.p2p.sharding import check_shard_state

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
    """:func:`refusal` of a trainer's ``options`` that ask for ``engine="p2p"``,
    and :func:`shard_refusal` of any that ask for sharded state."""
    why = shard_refusal(options, fault)
    if why is not None or options.engine != "p2p":
        return why
    return refusal(options.mode, options.sync_quorum, options.comm)


def shard_refusal(options: Any, fault: Any = None) -> str | None:
    """Why ``shard_state`` cannot run with these options (yet), or ``None``."""
    check_shard_state(options.shard_state)
    check_redundancy(options.redundancy)
    if options.shard_state is None:
        if options.redundancy != 1:
            return (f"redundancy={options.redundancy!r} counts the copies of the "
                    "optimizer's slices: it goes with shard_state='optimizer'.")
        return None
    if options.engine != "p2p":
        return (f"shard_state={options.shard_state!r} runs on the p2p engine only (its "
                "reduce-scatter hands each worker its slice); pass engine='p2p'.")
    if options.local is not None:
        return (f"shard_state={options.shard_state!r} with rounds of local steps (local_steps > 1) "
                "is not implemented yet: each worker's inner optimizer steps need its "
                "whole state. Use local_steps=1, or shard_state=None.")
    if options.comm.compression not in (None, "none"):
        return (f"shard_state={options.shard_state!r} sums gradients in float32 only (a codec's "
                f"error feedback is kept per all-reduce chunk); drop "
                f"compression={options.comm.compression!r}, or use shard_state=None.")
    config_bytes("p2p.shard-bucket")  # a bad size said before the cluster is touched
    config_bytes("p2p.shard-stage", off=True)
    return None


def group_spec(gid: str, members: list[str], compression: str) -> GroupSpec:
    """A group's settings, read once here from the client's configuration and sent
    to every member, so that they all choose the same algorithm."""
    return GroupSpec(
        gid, tuple(members), codec=compression,
        algorithm=str(config.get("p2p.algorithm")),
        threshold=config_bytes("p2p.bandwidth-threshold"),
        timeout=config.get_seconds("p2p.timeout"),
        shard_bucket=config_bytes("p2p.shard-bucket"),
        shard_stage=config_bytes("p2p.shard-stage", off=True),
    )


def config_bytes(key: str, off: bool = False) -> Any:
    """The size ``dasktf.<key>`` names, in bytes (an integer, or a string such as
    ``"4MiB"``); with ``off``, ``None`` for ``false``.

    Raises
    ------
    ValueError
        It is not a size, naming the key and the forms it takes.
    """
    value = config.get(key)
    if off and (value is False or value is None):
        return None
    try:
        if isinstance(value, bool):
            raise ValueError(value)
        size = int(parse_bytes(value) if isinstance(value, str) else value)
        if size < 0:
            raise ValueError(value)
    except (TypeError, ValueError):
        forms = "a size in bytes: an integer or a string such as '4MiB'"
        raise ValueError(f"dasktf.{key} must be {forms}" + (", or false (off)" if off else "")
                         + f"; got {value!r}.") from None
    return size
