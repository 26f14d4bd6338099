"""The one place that picks a run's engine (mode, ``engine=``, ``auto``), and its
checks of the options and the model before any work is done: each engine family
keeps its own rules (``engines/<family>/options.py``), which the run reaches
through here only."""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from dasktf import config
from dasktf.engines.base import Engine, RunHooks
from dasktf.engines.collective import options as collective_options
from dasktf.engines.collective.engine import CollectiveEngine
from dasktf.engines.graph.elastic import ElasticSyncEngine
from dasktf.engines.holder import options as holder_options
from dasktf.engines.holder.engine import AsyncEngine, QuorumEngine
from dasktf.engines.holder.sharded import plan_holders
from dasktf.engines.p2p import options as p2p_options
from dasktf.engines.p2p.engine import P2PEngine
from dasktf.exceptions import EngineHint
from dasktf.runtime.statistics import non_trainable_floats

if TYPE_CHECKING:
    from dasktf.cluster.waits import RunContext
    from dasktf.data.base import PlacedData
    from dasktf.models import CompileRecipe
    from dasktf.wire.packets import CommSpec


# -- each family's rules of the options -----------------------------------------
#: :class:`~dasktf.run.options.TrainOptions` or ``FaultOptions``, not imported:
#: they run the checks below as they are built
Options = Any


def check_mode_options(options: Options, n_workers: int | None = None
                       ) -> dict[int, float]:
    """The async and quorum options of a trainer (against ``n_workers`` when
    known); its ``slow_workers`` as a dict."""
    return holder_options.validate_mode_options(
        options.mode, options.max_staleness, options.staleness_lr, options.sync_quorum,
        options.slow_workers, n_workers)


def refuse_options(options: Options, fault: Options | None = None) -> None:
    """Refuse what a trainer's ``options`` (and a fit call's ``fault`` options) ask
    of an engine family that cannot do it, before anything starts."""
    for family in (holder_options, collective_options, p2p_options):
        why = family.options_refusal(options, fault)
        if why is not None:
            raise ValueError(why)


check_staleness_lr = holder_options.check_staleness_lr
#: why a run cannot be set up again on so many surviving workers (``None``: it can)
setup_refusal = holder_options.setup_refusal


@dataclass(frozen=True)
class EngineInputs:
    """What the factory builds a run's engine from, once its replicas are built
    (:meth:`dasktf.run.run.Run.set_up` gathers it)."""

    options: Options
    fault: Options
    epochs: int
    ctx: RunContext
    #: ``{worker index: factor}``, re-indexed after a loss during the set-up
    slow_workers: dict[int, float]
    placed: PlacedData
    #: the client's model (its variables' shapes)
    model: Any
    #: the replicas' config, the initial weights (futures, ``None``: the model
    #: package's) and the validation shards
    config: Any
    weights: Any
    validation: list[Any]
    plan: EnginePlan


@dataclass(frozen=True)
class EnginePlan:
    """What the engine the factory will pick needs from the model, worked out (and
    refused) by :func:`plan_engine` before any work is done."""

    #: ``placement="ps"``: the model optimizer's layout over the servers' slices
    #: and the trainable variables' positions among the model's weights
    #: (checkpoints, restore points and re-forms merge the slices into it)
    ps_layout: tuple[Any, list[int]] | None = None


def plan_engine(options: Options, model: Any, recipe: CompileRecipe) -> EnginePlan:
    """Check ``model`` (compiled with ``recipe``) against the engine ``options``
    pick, before any work is done.

    Raises
    ------
    ValueError
        ``num_ps`` more than the parameters can be split over; ``placement="ps"``
        with an optimizer whose state is not one slot per variable (no server
        slice can hold it).
    """
    if options.comm.num_ps > 1:  # refuse a num_ps the parameters cannot be split over
        from dasktf.wire.packets import shard_plan

        shard_plan([tuple(v.shape) for v in model.trainable_variables], options.comm.num_ps)
    if getattr(options, "shard_state", None) is not None:
        from dasktf.runtime.p2p.sharding import optimizer_refusal

        why = optimizer_refusal(recipe.optimizer)
        if why is not None:
            raise ValueError(why)
    if recipe.decay_excluded and (options.comm.placement == "ps" or options.comm.num_ps > 1):
        from dasktf.runtime.servers import DECAY_REFUSAL

        raise ValueError(DECAY_REFUSAL)
    ps_layout = None
    if (options.comm.placement == "ps" and options.mode == "sync"
            and options.sync_quorum is None):
        from dasktf.runtime.servers import optimizer_layout

        positions = {id(w): i for i, w in enumerate(model.weights)}
        ps_layout = (
            optimizer_layout(recipe.optimizer, model.trainable_variables),
            [positions[id(v)] for v in model.trainable_variables],
        )
    return EnginePlan(ps_layout=ps_layout)


# -- choosing an engine --------------------------------------------------------
def resolve_engine(engine: str, mode: str = "sync", sync_quorum: int | None = None,
                   comm: CommSpec | None = None) -> str:
    """The engine a run of these options uses: ``"p2p"``, ``"graph"`` or
    ``"collective"`` (async and quorum runs: ``"graph"``, their holders' family).

    ``"auto"`` is the p2p engine wherever it runs (plain sync steps, rounds of local
    steps, any codec: measured faster than the graph engine in every case tried,
    docs/p2p.md), else the graph engine (async, ``sync_quorum``, ``num_ps``, a
    graph topology). The collective engine starts TensorFlow gRPC servers that
    listen, unauthenticated, on every interface (TensorFlow hard-codes
    ``0.0.0.0:<port>``), so it runs only when asked for by name.
    """
    if engine in ("collective", "graph", "p2p"):
        return engine
    return "p2p" if p2p_options.refusal(mode, sync_quorum, comm) is None else "graph"


#: Where the hint's figures come from: ``dasktf bench --models mnist-mlp --workers 3
#: --epochs 3`` on 2-core machines, 2026-11-24 (MEASUREMENTS.md, and this stop's run).
_MEASURED_SPEEDUP = ("ran 1.35-1.6x faster than the graph engine in `dasktf bench` "
                     "(mnist-mlp, 3 CPU workers: 13.1k against 9.7k and 20.7k against "
                     "13.2k examples/s)")
_hinted = False


def collective_hint(engine: str, mode: str, sync_quorum: int | None,
                    slow_workers: dict[int, float] | None, n_params: int,
                    n_workers: int, total_steps: int, gpu: bool,
                    fault_options: bool = False, resolved: str = "graph") -> str | None:
    """The hint for an ``engine="auto"`` run the collective engine would have run
    faster, or ``None``; only where auto chose the graph engine (``resolved``): the
    p2p engine has no scheduler in its steps either.

    Measured here (2 cores, benchmarks/peers.py): the graph engine costs ~7 ms of
    scheduler hops per step, the collective engine ~10-15 s more to start (a
    TensorFlow child per worker) and next to nothing per step. So it wins for
    plain sync runs on 2+ CPU workers of a small model (under
    ``dasktf.collective.hint-max-params`` parameters, where the hop is a large
    share of the step) with enough steps (``hint-min-steps``) to pay back its
    start-up, unless checkpoints, resume or ``scale_lr`` were asked for
    (``fault_options``: only the graph engine recovers inside the run).
    """
    plain_sync = mode == "sync" and sync_quorum is None and not slow_workers
    if (engine == "auto" and resolved == "graph" and plain_sync and not gpu
            and not fault_options
            and n_workers >= 2
            and n_params < int(config.get("collective.hint-max-params"))
            and total_steps >= int(config.get("collective.hint-min-steps"))):
        return (
            f"This run's step is hop-bound (a {n_params:,}-parameter model, "
            f"{n_workers} CPU workers, {total_steps:,} steps): engine='collective' "
            f"(dasktf fit --engine collective) {_MEASURED_SPEEDUP}. It is not picked "
            "by itself because its TensorFlow servers accept unauthenticated "
            "connections on every interface; see the README's Security section."
        )
    return None


def warn_collective_hint(hint: str | None) -> None:
    """Say :func:`collective_hint`'s hint once per process."""
    global _hinted
    if hint is not None and not _hinted:
        _hinted = True
        warnings.warn(hint, EngineHint, stacklevel=2)


def make_engine(inputs: EngineInputs, hooks: RunHooks) -> Engine:
    """The engine of one run: async or quorum around a parameter holder; sync on
    the engine :func:`resolve_engine` picks: the collective engine when asked for
    by name, the p2p engine where it runs, else the fault-tolerant task-graph engine
    (with :func:`collective_hint`'s hint where the collective engine would have
    been faster). ``hooks``: what the run's guard gives it."""
    t, epochs = inputs.options, inputs.epochs
    cfg, weights, val = inputs.config, inputs.weights, inputs.validation
    placed, workers = inputs.placed, inputs.ctx.workers
    if t.mode == "sync" and t.sync_quorum is None:
        chosen = resolve_engine(t.engine, t.mode, t.sync_quorum, t.comm)
        if chosen == "collective":
            return CollectiveEngine(inputs.ctx, cfg, placed.shards, placed.schedule,
                                    weights, val, hooks,
                                    keep_state=inputs.fault.checkpoint_dir is not None)
        options = inputs.fault
        shapes = [tuple(v.shape) for v in inputs.model.trainable_variables]
        spec = dataclasses.replace(t.comm, n_workers=len(workers))
        average_stats = bool(non_trainable_floats(inputs.model))
        if chosen == "p2p":
            return P2PEngine(inputs.ctx, spec, shapes, placed.schedule, hooks,
                             batch_size=int(placed.schedule.sum(axis=1).max()),
                             average_stats=average_stats, local=t.local,
                             shard_state=t.shard_state, redundancy=t.redundancy)
        warn_collective_hint(collective_hint(
            t.engine, t.mode, t.sync_quorum, inputs.slow_workers,
            sum(int(np.prod(s)) for s in shapes), len(workers),
            epochs * inputs.ctx.steps_per_epoch, bool(inputs.ctx.resources),
            bool(options.checkpoint_dir or options.resume or options.scale_lr)))
        return ElasticSyncEngine(inputs.ctx, spec, shapes, placed.schedule, hooks,
                                 average_stats=average_stats,
                                 ps_layout=inputs.plan.ps_layout, local=t.local)
    holder = holder_options.choose_holder(workers, inputs.slow_workers)
    args = (inputs.ctx, workers[holder], cfg, weights, placed.shards[holder], val,
            placed.schedule)
    if t.mode == "async":
        # num_ps=K: K holders, one slice each (K=1: the one holder above)
        holders, plan = plan_holders(
            workers, inputs.slow_workers,
            [tuple(v.shape) for v in inputs.model.trainable_variables], t.comm.num_ps,
        )
        return AsyncEngine(*args, max_staleness=t.max_staleness,
                           staleness_lr=t.staleness_lr, epochs=epochs, holders=holders,
                           plan=plan, hooks=hooks, local=t.local)
    return QuorumEngine(*args, quorum=t.sync_quorum, epochs=epochs, hooks=hooks)
