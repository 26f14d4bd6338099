"""A replica's end of the wire: how its gradient leaves as packets and how the
reduced sum (or the servers' weights) comes back (:mod:`dasktf.wire.packets`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from dasktf.wire.codecs import (
    ErrorFeedback,
    decode,
    get_codec,
)
from dasktf.wire.messages import GradientSum
from dasktf.wire.packets import (
    CommSpec,
    Packet,
    Ranges,
    Slices,
    account,
    chunk_ranges,
    gather_ranges,
    scatter_ranges,
    sum_packets,
)

if TYPE_CHECKING:
    from dasktf.runtime.replica import Replica


@dataclass
class Channel:
    """A replica's end of the wire: codec, chunks, error-feedback residuals."""

    spec: CommSpec
    chunks: list[Ranges]
    size: int
    feedback: list[ErrorFeedback] = field(default_factory=list)
    #: codec bytes of the last step: sent (made here) and received (made elsewhere)
    last_bytes: int = 0

    @classmethod
    def for_replica(cls, replica: Replica) -> Channel:
        spec: CommSpec = replica.comm
        chunks = chunk_ranges(spec, replica.sizes, replica.shapes)
        codec = get_codec(spec.compression)
        return cls(spec, chunks, int(sum(replica.sizes)),
                   [ErrorFeedback(codec) for _ in chunks])

    def send(self, out: GradientSum, origin: str) -> Packet | list[Packet]:
        """Encode this step's gradient (chunk by chunk, with error feedback)."""
        packets = []
        lossy = self.feedback[0].codec.lossy
        for ranges, feedback in zip(self.chunks, self.feedback, strict=False):
            values = None
            if out.total is not None and out.count:
                part = gather_ranges(out.total, ranges)
                values = feedback.encode(part / np.float32(out.count) if lossy else part)
            packets.append(
                Packet(values, out.count, out.loss_sum, out.compute_seconds, origin,
                       mean=lossy, update=out.update, square_sum=out.square_sum)
            )
        return packets[0] if self.spec.n_chunks == 1 else packets


def channel(replica: Replica) -> Channel | None:
    """``replica``'s channel (made on first use), or ``None`` without a comm spec."""
    if replica.comm is None:
        return None
    if replica.channel is None:
        replica.channel = Channel.for_replica(replica)
    return replica.channel  # type: ignore[no-any-return]


def receive(
    replica: Replica, previous: Any, run_id: str
) -> tuple[GradientSum | None, GradientSum | None]:
    """Decode what the last step's reduction sent: ``(to_apply, seen)``.

    ``to_apply`` is the float32 gradient sum the replica applies (``None`` under
    ``placement="ps"``: the weights were set here from the servers' slices);
    ``seen`` carries the step's count and loss for the step record.
    """
    ch = channel(replica)
    if ch is not None:
        ch.last_bytes = 0
    if ch is None or previous is None or isinstance(previous, GradientSum):
        return previous, previous
    packets = previous if isinstance(previous, list) else [previous]
    if len(ch.chunks) > 1 and len(packets) != len(ch.chunks):  # (1 chunk: an exchange)
        raise RuntimeError(
            f"received {len(packets)} chunk(s) for a replica cut into {len(ch.chunks)}; "
            "this is a dasktf bug (engine and replicas disagree on the ring)."
        )
    ch.last_bytes = account(run_id, packets)
    first = packets[0]
    if first.kind == "weights":
        flat = np.empty(ch.size, np.float32)
        for ranges, p in zip(ch.chunks, packets, strict=False):
            assert p.values is not None
            scatter_ranges(flat, ranges, decode(p.values))
        replica.take_weights(flat, first.update)
        return None, GradientSum(None, first.count, first.loss_sum)
    if len(packets) == 1:
        total = first.total()
    elif ch.spec.n_chunks == 1:
        # the unreduced gradients of a direct exchange (dasktf.engines.graph.steps): summed
        # here, as the reduction task would have summed them
        summed = sum_packets(packets)
        return summed, summed
    elif first.values is None:
        total = None
    else:
        total = np.empty(ch.size, np.float32)
        for ranges, p in zip(ch.chunks, packets, strict=False):
            scatter_ranges(total, ranges, p.total())  # type: ignore[arg-type]
    summed = GradientSum(total, first.count, first.loss_sum, update=first.update,
                         square_sum=first.square_sum)
    return summed, summed


def send(replica: Replica, out: GradientSum) -> Any:
    """This step's gradient as it leaves the worker (unchanged without a channel)."""
    ch = channel(replica)
    if ch is None:
        return out
    from distributed import get_worker

    origin = get_worker().address
    sent = ch.send(out, origin)
    packets = sent if isinstance(sent, list) else [sent]
    ch.last_bytes += sum(p.nbytes for p in packets)
    return sent


def encode_push(replica: Replica, grad: GradientSum) -> Any:
    """Async: the gradient as it leaves for the holder (codec, error feedback);
    :class:`Slices` with one slice per holder when there are several."""
    ch = channel(replica)
    sliced = ch is not None and ch.spec.placement == "holder" and ch.spec.n_chunks > 1
    if ch is None or (ch.spec.compression == "none" and not sliced):
        return grad
    if not sliced:
        return ch.send(grad, "")
    if ch.spec.compression == "none":
        total = grad.total
        parts: list[Any] = [
            GradientSum(None if total is None else gather_ranges(total, r).copy(),
                        grad.count, grad.loss_sum, grad.compute_seconds,
                        square_sum=grad.square_sum)
            for r in ch.chunks
        ]
    else:
        parts = ch.send(grad, "")  # type: ignore[assignment]
    return Slices(parts, ch.chunks, ch.size)
