"""What the sync step moves between workers, and how many bytes that is.

Every gradient leaves its worker as a :class:`Packet`: a codec's :class:`Encoded`
form (:mod:`dasktf.wire.codecs`) of the gradient sum, or of one *chunk* of it (a set
of ranges of the flat buffer: ring reduction and sharded parameter servers move
chunks, see :mod:`dasktf.engines.graph.steps` and :mod:`dasktf.runtime.servers`). Reductions decode their
inputs, add them in float32 and re-encode the sum for its way back; a lossy codec
keeps a per-worker, per-chunk error-feedback residual on the replica.

Bytes are counted at the codec: every task that consumes packets adds the bytes of
those made on *another* worker to its worker's ``received`` and to the producing
worker's ``sent`` (a per-process ledger; each worker's end-of-epoch task returns a
copy of it with its report, :func:`traffic`: no extra round trip). So a reduction
that runs where its input was made counts nothing, as no byte moved, and the
figures hold for any topology.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise
from typing import Any

import numpy as np
from dask.sizeof import sizeof

from dasktf.wire.codecs import (
    Encoded,
    decode,
    get_codec,
    validate_weights_dtype,
)
from dasktf.wire.messages import GradientSum

TOPOLOGIES = ("tree", "naive", "ring")
PLACEMENTS = ("mirrored", "ps")
#: Bytes of the few scalars (count, loss) a packet carries besides its buffer.
_HEADER_BYTES = 16

Ranges = list[tuple[int, int]]


@dataclass(frozen=True)
class CommSpec:
    """How a sync run's gradients and weights travel (small and picklable)."""

    compression: str = "none"
    weights_dtype: str | None = None
    topology: str = "tree"
    placement: str = "mirrored"
    num_ps: int = 1
    n_workers: int = 1

    @property
    def n_chunks(self) -> int:
        """Pieces each gradient leaves its worker in (one per reducer)."""
        if self.placement in ("ps", "holder"):  # holder: async, one per holder
            return self.num_ps
        return self.n_workers if self.topology == "ring" and self.n_workers > 1 else 1


@dataclass
class Packet:
    """A gradient sum (``kind="grad"``) or weights (``"weights"``) on the wire.

    ``mean``: the buffer holds ``total / count`` (lossy codecs: keeps fp16 in
    range whatever the batch size); the receiver multiplies back in float32.
    """

    values: Encoded | None
    count: int
    loss_sum: float
    compute_seconds: float = 0.0
    origin: str = ""
    kind: str = "grad"
    mean: bool = False
    #: the global update the sum makes when applied (-1: untracked); replicas apply
    #: each update once (dasktf.engines.graph.elastic's recovery hands sums over again)
    update: int = -1
    #: ``GradientSum.square_sum``: summed as ``loss_sum`` is (every chunk carries it)
    square_sum: float = 0.0

    @property
    def nbytes(self) -> int:
        return (self.values.nbytes if self.values is not None else 0) + _HEADER_BYTES

    def total(self) -> np.ndarray | None:
        """The float32 sum (``mean`` packets scaled back). Without ``mean`` this may
        be the packet's own wire array: callers must not write into it."""
        if self.values is None:
            return None
        out = decode(self.values)
        if self.mean:
            if self.decodes_fresh:
                out *= np.float32(self.count)  # ours alone: scale in place
            else:
                out = out * np.float32(self.count)
        return out

    @property
    def decodes_fresh(self) -> bool:
        """Whether decoding makes a new buffer (every codec but ``none``, whose
        decoding is the wire array itself, shared by every task that reads it)."""
        return self.values is not None and self.values.codec != "none"


@sizeof.register(Packet)
def _sizeof_packet(p: Packet) -> int:
    return p.nbytes + 64


def validate_comm_options(
    mode: str,
    compression: Any,
    weights_dtype: Any,
    num_ps: Any,
    placement: Any,
    topology: Any,
    mixed_precision: bool = False,
) -> CommSpec:
    """Check the communication options at the public boundary; return a spec
    (``n_workers`` is filled in once the run's workers are known)."""
    from dasktf import config

    compression = config.get("communication.compression", compression)
    codec = get_codec(compression)
    wdtype = validate_weights_dtype(weights_dtype)
    if num_ps is not None and (
        isinstance(num_ps, bool) or not isinstance(num_ps, (int, np.integer)) or num_ps < 1
    ):
        raise ValueError(f"num_ps must be a positive integer; got {num_ps!r}.")
    if placement is None:
        placement = "ps" if num_ps is not None else "mirrored"
    if placement not in PLACEMENTS:
        raise ValueError(f"placement must be one of {PLACEMENTS}; got {placement!r}.")
    if topology is None:
        # the configured default applies where a topology means something
        topology = (
            config.get("communication.topology")
            if mode == "sync" and placement == "mirrored" else "tree"
        )
    if topology not in TOPOLOGIES:
        raise ValueError(f"topology must be one of {TOPOLOGIES}; got {topology!r}.")
    if mode != "sync":
        if num_ps is not None and mode != "async":
            raise ValueError(
                f"num_ps splits the parameters over servers in mode='sync' or 'async'; "
                f"got mode={mode!r}. Drop num_ps."
            )
        if placement not in ("mirrored", "ps") or topology != "tree" or (
            placement == "ps" and num_ps is None
        ):
            raise ValueError(
                f"placement and topology apply to mode='sync'; got mode={mode!r}. An "
                "async run keeps its parameters on holders: use num_ps=K to split them "
                "over K holders, or train with mode='sync'."
            )
        name = compression if isinstance(compression, str) else codec.name
        # The async holders are the one place weights travel from: they may send
        # them in lower precision whatever the placement (dasktf.engines.holder.sharded: K > 1).
        return CommSpec(name or "none", wdtype, "tree", "holder", int(num_ps or 1))
    if placement == "mirrored" and num_ps is not None and num_ps > 1:
        raise ValueError(
            f"num_ps={num_ps} shards the parameters over servers, but placement="
            "'mirrored' keeps them on every replica; use placement='ps'."
        )
    if placement == "mirrored" and wdtype is not None and mode == "sync":
        raise ValueError(
            f"weights_dtype={wdtype!r} sets how weights travel back to the replicas; "
            "with placement='mirrored' no weights travel (every replica applies the "
            "mean itself). Use placement='ps' (or num_ps=K)."
        )
    if placement == "ps" and topology != "tree":
        raise ValueError(
            f"topology={topology!r} is how mirrored replicas reduce; with placement="
            "'ps' each server reduces its own slice. Drop topology."
        )
    if placement == "ps" and mixed_precision:
        raise ValueError(
            "placement='ps' applies the optimizer on the servers in float32 and has no "
            "loss scaling; drop mixed_precision or use placement='mirrored'."
        )
    name = compression if isinstance(compression, str) else codec.name
    return CommSpec(name or "none", wdtype, topology, placement, int(num_ps or 1))


def allreduce_lower_bound(n_params: int, n_workers: int, bytes_per_value: float = 4) -> float:
    """Bytes each worker must send and receive per step to allreduce ``n_params``
    values: ``2 (N-1)/N x P x bytes_per_value`` (reduce-scatter then all-gather)."""
    if n_workers <= 1:
        return 0.0
    return 2.0 * (n_workers - 1) / n_workers * n_params * bytes_per_value


# -- the worker side -------------------------------------------------------------------
def shard_plan(shapes: list[tuple[int, ...]], num_ps: int) -> list[Ranges]:
    """Flat-buffer ranges of each of ``num_ps`` shards (see the module docstring).

    Raises
    ------
    ValueError
        More servers than the parameters can be cut into.
    """
    sizes = [int(np.prod(s)) if len(s) else 1 for s in shapes]
    total = sum(sizes)
    fair = total / num_ps
    pieces: list[tuple[int, int]] = []  # (start, stop) in the flat buffer
    offset = 0
    for shape, size in zip(shapes, sizes, strict=False):
        rows = shape[0] if len(shape) else 1
        if size > fair and rows > 1:
            row = size // rows
            n = min(rows, int(np.ceil(size / fair)))
            cuts = [round(rows * j / n) for j in range(n + 1)]
            pieces += [(offset + a * row, offset + b * row) for a, b in pairwise(cuts)]
        else:
            pieces.append((offset, offset + size))
        offset += size
    if len([p for p in pieces if p[1] > p[0]]) < num_ps:
        raise ValueError(
            f"num_ps={num_ps}: the model's {len(shapes)} trainable variables "
            f"({total:,} values) cannot be split over that many servers; use fewer."
        )
    loads = [0] * num_ps
    shards: list[Ranges] = [[] for _ in range(num_ps)]
    for start, stop in sorted(pieces, key=lambda p: (p[0] - p[1], p[0])):
        s = int(np.argmin(loads))
        shards[s].append((start, stop))
        loads[s] += stop - start
    return [sorted(r) for r in shards]


def chunk_ranges(spec: CommSpec, sizes: list[int], shapes: list[tuple[int, ...]]) -> list[Ranges]:
    """The flat-buffer ranges of each chunk a gradient is split into."""
    total = int(sum(sizes))
    if spec.placement == "ps" or (spec.placement == "holder" and spec.num_ps > 1):

        return shard_plan(shapes, spec.num_ps)
    n = spec.n_chunks
    edges = [round(total * c / n) for c in range(n + 1)]
    return [[(edges[c], edges[c + 1])] for c in range(n)]


def gather_ranges(flat: np.ndarray, ranges: Ranges) -> np.ndarray:
    if len(ranges) == 1:
        a, b = ranges[0]
        return flat[a:b]
    return np.concatenate([flat[a:b] for a, b in ranges])


def scatter_ranges(out: np.ndarray, ranges: Ranges, values: np.ndarray) -> None:
    i = 0
    for a, b in ranges:
        out[a:b] = values[i : i + b - a]
        i += b - a


@dataclass
class Slices:
    """Async with ``num_ps=K > 1`` (:mod:`dasktf.engines.holder.sharded`): a gradient or the
    weights as K slices, one per holder, each as it travels (codec applied)."""

    parts: list[Any]
    ranges: list[Ranges]
    size: int

    @property
    def nbytes(self) -> int:
        return sum(wire_nbytes(p) for p in self.parts)

    def assemble(self) -> np.ndarray:
        """The full flat float32 buffer (weights)."""
        out = np.empty(self.size, np.float32)
        for ranges, part in zip(self.ranges, self.parts, strict=True):
            scatter_ranges(out, ranges, decode_weights(part))
        return out


def as_gradient_sum(grad: Any) -> GradientSum:
    """Async holder: a pushed gradient back in float32 (a GradientSum as is)."""
    if isinstance(grad, GradientSum):
        return grad
    return GradientSum(grad.total(), grad.count, grad.loss_sum, grad.compute_seconds,
                       square_sum=grad.square_sum)


def encode_weights(flat: np.ndarray, weights_dtype: str | None) -> Any:
    """Weights on their way to a replica: float32 as is, else fp16/bf16."""
    return flat if weights_dtype is None else get_codec(weights_dtype).encode(flat)


def wire_nbytes(obj: Any) -> int:
    """Bytes of a gradient or weights buffer as it travels (``None``: nothing)."""
    if obj is None:
        return 0
    if isinstance(obj, GradientSum):
        return (obj.total.nbytes if obj.total is not None else 0) + _HEADER_BYTES
    return int(obj.nbytes)


def holder_nbytes(push: Any, weights: Any) -> list[int]:
    """Async: the bytes of one update's push and pulled weights, per holder."""
    parts = [p.parts if isinstance(p, Slices) else [p] for p in (push, weights)]
    if len(parts[0]) < len(parts[1]):  # no push (the run had stopped)
        parts[0] = [None] * len(parts[1])
    if len(parts[1]) < len(parts[0]):  # no weights (the worker had that version)
        parts[1] = [None] * len(parts[0])
    return [wire_nbytes(a) + wire_nbytes(b) for a, b in zip(*parts, strict=True)]


def decode_weights(flat: Any) -> np.ndarray:
    if isinstance(flat, Slices):
        return flat.assemble()
    return decode(flat) if isinstance(flat, Encoded) else flat


def pick(packets: list[Packet], index: int) -> Packet:
    """One chunk of a step's packets (runs where they were made: moves nothing)."""
    return packets[index]


def reduce_packets(run_id: str, compression: str, *parts: Packet) -> Packet:
    """The sync reduction: decode, add in float32, encode the sum for its way back."""
    from distributed import get_worker

    account(run_id, parts)
    summed = sum_packets(parts)
    total, count = summed.total, summed.count
    codec = get_codec(compression)
    values = None
    if total is not None and count:
        values = codec.encode_sum(total / np.float32(count) if codec.lossy else total)
    return Packet(values, count, summed.loss_sum, summed.compute_seconds,
                  get_worker().address, mean=codec.lossy, update=summed.update,
                  square_sum=summed.square_sum)


def sum_packets(parts: tuple[Packet, ...] | list[Packet]) -> GradientSum:
    """Decode gradient packets and add them in float32, in the order given: a
    reduction task and a direct exchange (:mod:`dasktf.engines.graph.steps`) add the same
    gradients in the same (worker) order, so their sums are bitwise the same."""
    total, count, loss_sum = sum_parts(parts)
    return GradientSum(total, count, loss_sum, max(p.compute_seconds for p in parts),
                       max(p.update for p in parts), sum(p.square_sum for p in parts))


def sum_parts(parts: tuple[Packet, ...] | list[Packet]) -> tuple[np.ndarray | None, int, float]:
    total = None
    for p in parts:
        t = p.total()
        if t is None:
            continue
        if total is None:
            # a decoded buffer is ours to add into; the wire array is not
            total = t if p.decodes_fresh else np.array(t, np.float32, copy=True)
        else:
            total += t
    return total, sum(p.count for p in parts), sum(p.loss_sum for p in parts)


# -- the byte ledger -------------------------------------------------------------------
_TRAFFIC: dict[str, dict[str, Any]] = {}


def account(run_id: str, packets: Any) -> int:
    """Count packets made on another worker as received here and sent there."""
    from distributed import get_worker

    here = get_worker().address
    ledger = _TRAFFIC.setdefault(run_id, {"received": 0, "sent": {}})
    moved = 0
    for p in packets:
        if isinstance(p, Packet) and p.origin and p.origin != here:
            ledger["received"] += p.nbytes
            ledger["sent"][p.origin] = ledger["sent"].get(p.origin, 0) + p.nbytes
            moved += p.nbytes
    return moved


def record_traffic(run_id: str, here: str, sent: int, received: int) -> None:
    """Count bytes a worker-to-worker collective (:mod:`dasktf.runtime.p2p`) moved:
    ``sent`` by this worker, ``here``, and ``received`` by it (each member counts
    its own, so nothing is counted twice)."""
    ledger = _TRAFFIC.setdefault(run_id, {"received": 0, "sent": {}})
    ledger["received"] += int(received)
    ledger["sent"][here] = ledger["sent"].get(here, 0) + int(sent)


def traffic(run_id: str) -> dict[str, Any]:
    """This process's ledger of ``run_id``: a copy, as it rides on the epoch report."""
    ledger = _TRAFFIC.get(run_id, {"received": 0, "sent": {}})
    return {"received": int(ledger["received"]), "sent": dict(ledger["sent"])}


def release_run(run_id: str) -> None:
    """Drop this process's byte ledger of ``run_id`` (called by
    :func:`dasktf.runtime.tasks.release_replicas`, with the server slices: no extra
    broadcast, which would wait on a dead worker)."""
    _TRAFFIC.pop(run_id, None)


def merge_traffic(
    ledgers: dict[str, dict[str, Any]], workers: list[str]
) -> dict[str, tuple[int, int]]:
    """``{worker: (bytes sent, bytes received)}`` since the run started, from the
    workers' ledgers (``{worker: traffic(run_id)}``)."""
    received = {w: int(ledgers.get(w, {}).get("received", 0)) for w in workers}
    sent = dict.fromkeys(workers, 0)
    for ledger in ledgers.values():
        for origin, n in ledger["sent"].items():
            sent[origin] = sent.get(origin, 0) + int(n)
    return {w: (sent.get(w, 0), received.get(w, 0)) for w in workers}


class TrafficLog:
    """A run's bytes per epoch, from the ledgers its workers' epoch reports carry
    (:func:`traffic`; no round trip of its own), and the figures the history logs."""

    def __init__(self) -> None:
        self._before: dict[str, tuple[int, int]] = {}
        #: ``{worker: (bytes sent, bytes received)}`` over the last epoch
        self.epoch: dict[str, tuple[int, int]] = {}

    def update(self, ledgers: dict[str, dict[str, Any]], workers: list[str]) -> None:
        """Take the epoch's ledgers (``{worker: traffic(run_id)}``)."""
        now = merge_traffic(ledgers, workers)
        zero = (0, 0)
        self.epoch = {w: (s - self._before.get(w, zero)[0], r - self._before.get(w, zero)[1])
                      for w, (s, r) in now.items()}
        self._before = now

    def logs(self, n_params: int, n_workers: int, updates: int, examples: int
             ) -> dict[str, float]:
        """Per worker and update: bytes sent + received (mean over workers), sent
        alone, and the busiest direction of the busiest worker over the allreduce
        lower bound ``2 (N-1)/N x P x 4`` (each direction; ring: about 1); the
        bytes all workers sent per example trained (``examples`` in the epoch)."""
        steps = max(1, updates)
        moved = list(self.epoch.values()) or [(0, 0)]
        bound = allreduce_lower_bound(n_params, n_workers)
        busiest = max(max(s, r) for s, r in moved) / steps
        logs = {
            "bytes_per_step": float(sum(s + r for s, r in moved) / len(moved) / steps),
            "bytes_sent_per_step": float(sum(s for s, _ in moved) / len(moved) / steps),
            "bytes_lower_bound": bound,
            "bytes_bound_ratio": busiest / bound if bound else 0.0,
        }
        if examples:
            logs["bytes_per_example"] = float(sum(s for s, _ in moved) / examples)
        return logs
