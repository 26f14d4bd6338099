"""``dasktf fit``: train a model data-parallel and report test accuracy.

A thin layer over the Python API: it parses options, loads the data set, calls
:class:`dasktf.Trainer` and prints the report.
"""

from __future__ import annotations

import time
from typing import Any

import click

from dasktf.cli.common import (
    CONTEXT,
    BadArgument,
    configure_logging,
    gpus_option,
    parse_gpus,
    run_or_exit,
)
from dasktf.datasets import DATASETS
from dasktf.models import BUILTIN_MODELS


@click.command(context_settings=CONTEXT)
@click.option("--workers", "-w", "n_workers", type=click.IntRange(min=1), default=None,
              help="Workers (replicas) to train on. Default: 2 for the embedded cluster, "
              "all workers of an existing one.")
@click.option("--model", "-m", default="mnist-mlp", show_default=True,
              help=f"A built-in model ({', '.join(BUILTIN_MODELS)}) or an importable "
              "'module:function' returning a Keras model.")
@click.option("--data", "-d", default="digits", show_default=True,
              help=f"A built-in data set ({', '.join(DATASETS)}) or an .npz file with "
              "x_train/y_train (and x_test/y_test) arrays.")
@click.option("--mode", type=click.Choice(["sync", "async"]), default="sync",
              show_default=True,
              help="sync: every step averages the gradients of all workers. async: every "
              "worker loops on its own; a parameter holder applies each gradient as it "
              "arrives and records its staleness.")
@click.option("--engine", type=click.Choice(["auto", "p2p", "graph", "collective"]),
              default="auto", show_default=True,
              help="sync: p2p (a task per worker per epoch, each step's gradients "
              "summed worker to worker over the workers' Dask comms), graph (a Dask "
              "task graph per step) or collective (MultiWorkerMirroredStrategy in a "
              "TensorFlow child per worker; its TensorFlow servers listen "
              "unauthenticated on every interface). auto is p2p where it runs (not "
              "async, --sync-quorum, --ps, --topology), else graph.")
@click.option("--max-staleness", type=int, default=None, metavar="K",
              help="async: bounded staleness; no update is applied more than K updates "
              "after the weights it was computed on (0: sequential SGD).")
@click.option("--staleness-lr", type=click.Choice(["none", "inverse"]), default="none",
              show_default=True,
              help="async: 'inverse' scales each update's learning rate by 1/max(1, staleness).")
@click.option("--sync-quorum", type=int, default=None, metavar="K",
              help="sync: apply each step with the first K of the N gradients and drop "
              "(and count) the late ones.")
@click.option("--slow-worker", "slow_worker", multiple=True, metavar="INDEX:FACTOR",
              help="Slow a worker down for demos: it sleeps (FACTOR-1) x its compute time "
              "each step, e.g. --slow-worker 0:4. Repeatable.")
@click.option("--compression", default="none", show_default=True, metavar="CODEC",
              help="sync: how gradients travel: none, fp16, bf16, int8 or topk:RATIO "
              "(e.g. topk:0.01); lossy codecs keep an error-feedback residual.")
@click.option("--ps", "num_ps", type=click.IntRange(min=1), default=None, metavar="K",
              help="shard the parameters over K parameter servers (sync: placement ps; "
              "async: K parameter holders).")
@click.option("--placement", type=click.Choice(["mirrored", "ps"]), default=None,
              help="sync: every replica applies the mean (mirrored, default) or "
              "parameter servers do (ps).")
@click.option("--topology", type=click.Choice(["tree", "naive", "ring"]), default=None,
              help="sync, mirrored: how gradients are reduced (default tree).")
@click.option("--weights-dtype", type=click.Choice(["float32", "fp16", "bf16"]),
              default="float32", show_default=True,
              help="ps: the dtype weights travel back to the replicas in (master copy "
              "stays float32).")
@click.option("--local-steps", type=click.IntRange(min=1), default=1, show_default=True,
              metavar="H", help="rounds of H local steps per worker, then the workers' "
              "changes are averaged (Local SGD / DiLoCo): one task graph per round.")
@click.option("--outer-optimizer", type=click.Choice(["average", "nesterov"]),
              default="average", show_default=True,
              help="with --local-steps: how the mean change is applied (average: model "
              "averaging; nesterov: DiLoCo, lr 0.7, momentum 0.9).")
@click.option("--outer-lr", "outer_learning_rate",
              type=click.FloatRange(min=0, min_open=True), default=None,
              help="the outer optimizer's learning rate (average: 1, nesterov: 0.7).")
@click.option("--shard-state", type=click.Choice(["optimizer", "gradients"]),
              default=None, help="with --engine p2p: each worker keeps and applies "
              "1/N of the optimizer's state (optimizer: ZeRO-1; gradients: ZeRO-2, "
              "the reduce-scatter in buckets too).")
@click.option("--redundancy", type=click.IntRange(0, 1), default=1, show_default=True,
              help="with --shard-state: copies of each optimizer slice besides its "
              "owner's (1: a lost worker costs nothing; 0: it sends the run back to its "
              "last checkpoint in the epoch, or stops it).")
@click.option("--epochs", "-e", type=click.IntRange(min=1), default=None,
              help="Passes over the data. Default: the data set's own (digits: 5).")
@click.option("--batch-size", "-b", type=click.IntRange(min=1), default=None,
              help="Global batch size, split over the workers. Default: the data set's.")
@click.option("--optimizer", default=None,
              help="A Keras optimizer name (adam, sgd, rmsprop, ...). Default: the data "
              "set's for a built-in model; a module:function model's own compile.")
@click.option("--loss", default=None,
              help="A Keras loss name. Default: the data set's for a built-in model; a "
              "module:function model's own compile.")
@click.option("--lr", "learning_rate", type=click.FloatRange(min=0, min_open=True),
              default=None, help="Learning rate. Default: the data set's.")
@click.option("--seed", type=int, default=0, show_default=True,
              help="Seed of the initial weights and the shuffles.")
@click.option("--scheduler", default=None, metavar="ADDRESS",
              help="Train on an existing Dask cluster (e.g. tcp://10.0.0.5:8786) instead "
              "of starting a local one.")
@click.option("--threads-per-worker", type=click.IntRange(min=1), default=None,
              help="TensorFlow threads per worker. Default: cores // workers.")
@click.option("--no-validation", is_flag=True, help="Skip evaluating the test split each epoch.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar; one line per epoch.")
@click.option("--verbose", "-v", is_flag=True,
              help="Show TensorFlow's INFO lines (client and embedded workers) and "
              "dasktf's INFO logging; by default only warnings and errors. "
              "TF_CPP_MIN_LOG_LEVEL, if set, wins.")
@gpus_option
@click.option("--mixed-precision", is_flag=True,
              help="Keras mixed precision: float16 with loss scaling on GPUs, bfloat16 "
              "on CPUs; gradients are still averaged in float32.")
@click.option("--dashboard", is_flag=True,
              help="Serve the live training dashboard while training and print its URL.")
@click.option("--dashboard-port", type=click.IntRange(0, 65535), default=None,
              help="The dashboard's port (default 5006; 0 picks a free one).")
@click.option("--dashboard-address", default=None, metavar="HOST",
              help="The address the dashboard binds to (default 127.0.0.1).")
@click.option("--report", type=click.Path(dir_okay=False), default=None,
              help="After training, write the dashboard's plots to this standalone "
              "HTML file.")
@click.option("--checkpoint-dir", type=click.Path(file_okay=False), default=None,
              help="Write checkpoints (and the final model.keras) here: at every epoch "
              "end and every --checkpoint-every steps.")
@click.option("--checkpoint-every", type=click.IntRange(min=1), default=None,
              metavar="N_STEPS", help="also checkpoint after every N_STEPS steps of each "
              "epoch (sync) or every N_STEPS updates (async).")
@click.option("--resume", is_flag=True,
              help="Continue from the newest valid checkpoint in --checkpoint-dir up to "
              "--epochs in all.")
@click.option("--on-worker-loss", type=click.Choice(["recover", "raise"]),
              default="recover", show_default=True,
              help="recover: go on with the surviving workers; raise: stop with an error.")
@click.option("--scale-lr", is_flag=True,
              help="When the worker count changes, rescale the global batch and the "
              "learning rate linearly, with a short warm-up.")
def fit(**opts: Any) -> None:
    """Train a model data-parallel and report test accuracy.

    \b
    Examples:
      dasktf fit --workers 3
      dasktf fit --model cnn --data mnist --epochs 2 --batch-size 512
      dasktf fit --scheduler tcp://127.0.0.1:8786 --model mypkg.models:build
      dasktf fit --gpus 0,2 --mixed-precision
    """
    configure_logging(verbose=opts.pop("verbose"))
    run_or_exit(lambda: _fit(**opts))


def _fit(
    n_workers: int | None, model: str, data: str, mode: str, epochs: int | None,
    batch_size: int | None, optimizer: str | None, learning_rate: float | None,
    loss: str | None,
    seed: int, scheduler: str | None, threads_per_worker: int | None,
    no_validation: bool, quiet: bool, gpus: str | None = None,
    mixed_precision: bool = False, max_staleness: int | None = None,
    staleness_lr: str = "none", sync_quorum: int | None = None,
    slow_worker: tuple[str, ...] = (),
    dashboard: bool = False,
    dashboard_port: int | None = None, dashboard_address: str | None = None,
    report: str | None = None,
    engine: str = "auto",
    checkpoint_dir: str | None = None, checkpoint_every: int | None = None,
    resume: bool = False, on_worker_loss: str = "recover", scale_lr: bool = False,
    compression: str = "none", num_ps: int | None = None, placement: str | None = None,
    topology: str | None = None, weights_dtype: str = "float32",
    local_steps: int = 1, outer_optimizer: str = "average",
    outer_learning_rate: float | None = None, shard_state: str | None = None,
    redundancy: int = 1,
) -> None:
    import dasktf
    from dasktf.run.engine import resolve_engine
    from dasktf.run.options import TrainOptions

    try:
        dataset = dasktf.load_dataset(data, seed=seed)
    except ValueError as exc:
        raise BadArgument(str(exc)) from exc
    d = dataset.defaults
    classification = dataset.task == "classification"
    builtin = model in BUILTIN_MODELS
    epochs = epochs or d.get("epochs", 1)
    batch_size = batch_size or d.get("batch_size", 128)
    # Every option checked here, the way the API checks them: before the cluster
    # starts, a bad value fails in seconds.
    options = TrainOptions(
        model,
        # None: the embedded cluster starts one worker per GPU, or 2 CPU workers.
        n_workers=n_workers,
        mode=mode,
        # A module:function model keeps what its factory compiled unless told.
        optimizer=optimizer or (d.get("optimizer", "adam") if builtin else None),
        learning_rate=learning_rate or (d.get("learning_rate") if builtin else None),
        loss=loss,
        metrics=["accuracy"] if classification and builtin else None,
        seed=seed,
        threads_per_worker=threads_per_worker,
        gpus=parse_gpus(gpus),
        mixed_precision=mixed_precision,
        max_staleness=max_staleness,
        staleness_lr=None if staleness_lr == "none" else staleness_lr,
        sync_quorum=sync_quorum,
        slow_workers=parse_slow_workers(slow_worker),
        engine=engine,
        compression=compression, weights_dtype=weights_dtype, num_ps=num_ps,
        placement=placement, topology=topology, local_steps=local_steps,
        outer_optimizer=outer_optimizer, outer_learning_rate=outer_learning_rate,
        shard_state=shard_state, redundancy=redundancy,
    )
    start = time.perf_counter()
    trainer = dasktf.Trainer.from_options(options, scheduler=scheduler)
    from dasktf.cli.dashboard import serve_dashboard, write_run_report

    with trainer, serve_dashboard(
        trainer.client if dashboard else None, dashboard_address, dashboard_port
    ):
        click.echo(
            f"dasktf fit: model {model}, data {dataset.name} "
            f"({len(dataset.x_train):,} train / {len(dataset.x_test):,} test), mode {mode}, "
            f"engine {resolve_engine(engine, mode, sync_quorum, options.comm)}, "
            f"global batch {batch_size}, {epochs} epoch(s)"
            + (f", rounds of {local_steps} local steps ({outer_optimizer})"
               if options.local is not None else "")
        )
        history = trainer.fit(
            dataset.x_train,
            dataset.y_train,
            epochs=epochs,
            batch_size=batch_size,
            validation_data=None if no_validation else (dataset.x_test, dataset.y_test),
            verbose=2 if quiet else 1,
            checkpoint_dir=checkpoint_dir,
            checkpoint_every=checkpoint_every,
            resume=resume,
            on_worker_loss=on_worker_loss,
            scale_lr=scale_lr,
        )
        click.echo(f"workers: {', '.join(history.workers)}")
        if history.updates is not None:
            click.echo(_per_worker_summary(history))
        result = trainer.evaluate(dataset.x_test, dataset.y_test)
        if report:
            write_run_report(trainer.client, history.run_id, report)
    wall = time.perf_counter() - start
    train_seconds = sum(history.history["epoch_seconds"])
    examples = len(dataset.x_train) * len(history.history["loss"])
    summary = [f"test loss {result['loss']:.4f}"]
    if "accuracy" in result:
        summary.append(f"test accuracy {result['accuracy']:.4f}")
    summary += [f"wall time {wall:.1f}s", f"{examples / train_seconds:,.0f} examples/s"]
    if "bytes_per_step" in history.history:
        bound = "push+pull" if trainer.mode == "async" else "allreduce"
        summary.append(f"{history.history['bytes_per_step'][-1] / 1e6:.3f} MB/step/worker "
                       f"({history.history['bytes_bound_ratio'][-1]:.2f}x the {bound} "
                       "bound)")
    click.echo("done: " + "  ".join(summary))


def parse_slow_workers(values: tuple[str, ...]) -> dict[int, float]:
    """``--slow-worker 0:4`` (repeatable) as the API's ``slow_workers={0: 4.0}``."""
    slow: dict[int, float] = {}
    for text in values:
        index, sep, factor = text.partition(":")
        try:
            if not sep:
                raise ValueError
            slow[int(index)] = float(factor)
        except ValueError:
            raise BadArgument(
                f"--slow-worker {text!r}: expected INDEX:FACTOR, e.g. 0:4 (worker 0 "
                "takes 4x its compute time)."
            ) from None
    return slow


def _per_worker_summary(history: Any) -> str:
    """One line per worker: its updates, their staleness, and dropped gradients."""
    frame = history.updates
    lines = ["worker  updates  staleness mean/max  dropped"]
    for i in range(len(history.workers)):
        mine = frame[frame["worker"] == i]["staleness"]
        mean = f"{mine.mean():.2f}" if len(mine) else "-"
        lines.append(
            f"{i:>6}  {len(mine):>7}  {mean:>9}/{mine.max() if len(mine) else '-':<8} "
            f"{history.dropped.get(i, 0):>7}"
        )
    return "\n".join(lines)
