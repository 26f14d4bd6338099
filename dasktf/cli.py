"""The ``dasktf`` command line: ``dasktf fit`` and friends.

A thin layer over the Python API: it parses options, loads the data set, calls
:class:`dasktf.Trainer`, prints the report, and maps failures to exit codes:
0 success, 2 bad arguments (an unknown model, data set or option value), 1 a
training failure (a lost worker, an unreachable scheduler, a failing replica),
always with a one-line reason on stderr.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

import click

from dasktf.datasets import DATASETS
from dasktf.models import BUILTIN_MODELS

CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


class _BadArgument(click.UsageError):
    """Exit code 2 with click's usual 'Error: ...' line."""


def parse_gpus(text: str | None) -> Any:
    """``--gpus`` as the API's ``gpus=``; a malformed value exits with code 2."""
    from dasktf.devices import parse_gpus as parse

    try:
        return parse(text)
    except ValueError as exc:
        raise _BadArgument(str(exc)) from exc


_gpus_option = click.option(
    "--gpus", default=None, metavar="all|none|N|0,2,3",
    help="GPUs to start one worker each on: all, none, a count N, or indices (a single "
    "index as '3,'). Default: every visible GPU, else CPU workers. With --scheduler, "
    "the workers advertising a GPU resource.",
)


@click.group(context_settings=CONTEXT)
@click.version_option(package_name="dasktf")
def main() -> None:
    """Data-parallel TensorFlow/Keras training on a Dask cluster."""


@main.command(context_settings=CONTEXT)
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
@click.option("--engine", type=click.Choice(["auto", "graph", "collective"]),
              default="auto", show_default=True,
              help="sync: graph (a Dask task graph per step) or collective "
              "(MultiWorkerMirroredStrategy ring all-reduce in a TensorFlow child per "
              "worker; its TensorFlow servers listen unauthenticated on every "
              "interface). auto is graph, with a hint where collective measured faster.")
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
@click.option("--epochs", "-e", type=click.IntRange(min=1), default=None,
              help="Passes over the data. Default: the data set's own (digits: 5).")
@click.option("--batch-size", "-b", type=click.IntRange(min=1), default=None,
              help="Global batch size, split over the workers. Default: the data set's.")
@click.option("--optimizer", default=None,
              help="A Keras optimizer name (adam, sgd, rmsprop, ...). Default: the data set's.")
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
@_gpus_option
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
    _configure_logging()
    _run_or_exit(lambda: _fit(**opts))


def _fit(
    n_workers: int | None, model: str, data: str, mode: str, epochs: int | None,
    batch_size: int | None, optimizer: str | None, learning_rate: float | None,
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
) -> None:
    import dasktf
    from dasktf.asynchronous import validate_mode_options
    from dasktf.collective import resolve_engine
    from dasktf.comm import validate_comm_options

    comm = dict(compression=compression, weights_dtype=weights_dtype, num_ps=num_ps,
                placement=placement, topology=topology)
    validate_comm_options(mode, mixed_precision=mixed_precision, **comm)

    slow_workers = parse_slow_workers(slow_worker)
    # Before the data set and the cluster: a bad option fails in seconds.
    validate_mode_options(
        mode, max_staleness, None if staleness_lr == "none" else staleness_lr,
        sync_quorum, slow_workers, n_workers,
    )
    try:
        dataset = dasktf.load_dataset(data, seed=seed)
    except ValueError as exc:
        raise _BadArgument(str(exc)) from exc
    d = dataset.defaults
    classification = dataset.task == "classification"
    epochs = epochs or d.get("epochs", 1)
    batch_size = batch_size or d.get("batch_size", 128)
    start = time.perf_counter()
    trainer = dasktf.Trainer(
        model,
        scheduler=scheduler,
        # None: the embedded cluster starts one worker per GPU, or 2 CPU workers.
        n_workers=n_workers,
        mode=mode,
        optimizer=optimizer or d.get("optimizer", "adam"),
        learning_rate=learning_rate or d.get("learning_rate"),
        metrics=["accuracy"] if classification else None,
        seed=seed,
        threads_per_worker=threads_per_worker,
        gpus=parse_gpus(gpus),
        mixed_precision=mixed_precision,
        max_staleness=max_staleness,
        staleness_lr=None if staleness_lr == "none" else staleness_lr,
        sync_quorum=sync_quorum,
        slow_workers=slow_workers,
        engine=engine,
        **comm,
    )
    from dasktf.dashboard.cli import serve_dashboard, write_run_report

    with trainer, serve_dashboard(
        trainer.client if dashboard else None, dashboard_address, dashboard_port
    ):
        click.echo(
            f"dasktf fit: model {model}, data {dataset.name} "
            f"({len(dataset.x_train):,} train / {len(dataset.x_test):,} test), mode {mode}, "
            f"engine {resolve_engine(engine)}, global batch {batch_size}, {epochs} epoch(s)"
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


@main.command(context_settings=CONTEXT)
@click.option("--workers", "-w", "n_workers", type=click.IntRange(min=1), default=None,
              help="Start a local cluster of this many workers (default: one per GPU, "
              "else 2).")
@click.option("--scheduler", default=None, metavar="ADDRESS",
              help="Inspect an existing Dask cluster instead of starting one.")
@_gpus_option
@click.option("--no-tensorflow", is_flag=True,
              help="Do not import TensorFlow on the workers (faster; no TF device list).")
def info(n_workers: int | None, scheduler: str | None, gpus: str | None,
         no_tensorflow: bool) -> None:
    """List the cluster's workers and the devices each one sees.

    \b
    Columns: address, name, pid, threads, memory limit, GPU name and memory (from
    nvidia-smi, restricted to the worker's CUDA_VISIBLE_DEVICES), the
    CUDA_VISIBLE_DEVICES it was started with, and TensorFlow's physical devices.

    \b
    Examples:
      dasktf info --workers 2
      dasktf info --scheduler tcp://10.0.0.5:8786
    """
    _configure_logging()
    _run_or_exit(lambda: _info(n_workers, scheduler, parse_gpus(gpus), not no_tensorflow))


def _info(n_workers: int | None, scheduler: str | None, gpus: Any, with_tf: bool) -> None:
    from dasktf.cluster import choose_workers, cluster_client
    from dasktf.devices import cluster_info, format_worker_table, split_gpu_workers

    if scheduler is not None and (n_workers is not None or gpus is not None):
        raise _BadArgument("--workers and --gpus start a local cluster; "
                           "they cannot be combined with --scheduler.")
    with cluster_client(None, scheduler, n_workers, None, None, gpus) as (client, _):
        choose_workers(client, n_workers)  # a starting cluster: wait for its workers
        rows = cluster_info(client, with_tensorflow=with_tf)
        where = scheduler or f"local cluster at {client.scheduler.address}"
        click.echo(f"{len(rows)} worker(s), {where}")
        click.echo(format_worker_table(rows))
        workers = {r.address: {"resources": {"GPU": r.gpu_resource}} for r in rows}
        with_gpu, without = split_gpu_workers(workers)
        if with_gpu and without:
            click.echo(f"workers without a GPU resource (left out of GPU runs): "
                       f"{', '.join(without)}")


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
            raise _BadArgument(
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


@main.command(context_settings=CONTEXT)
@click.option("--scheduler", required=True, metavar="ADDRESS",
              help="The Dask scheduler of the cluster the run trains on.")
@click.option("--run", "run", default=None, metavar="RUN_ID",
              help="The run to show (default: the newest; the page follows new runs).")
@click.option("--port", type=click.IntRange(0, 65535), default=None,
              help="The dashboard's port (default 5006; 0 picks a free one).")
@click.option("--address", default=None, metavar="HOST",
              help="The address the dashboard binds to (default 127.0.0.1).")
@click.option("--report", type=click.Path(dir_okay=False), default=None,
              help="Write the run's plots to this standalone HTML file and exit.")
def dashboard(scheduler: str, run: str | None, port: int | None, address: str | None,
              report: str | None) -> None:
    """Serve the live training dashboard of a run on an existing cluster.

    It shows the whole run so far (the scheduler keeps a downsampled history),
    then follows it. Stop it with Ctrl-C.

    \b
    Examples:
      dasktf dashboard --scheduler tcp://127.0.0.1:8786
      dasktf dashboard --scheduler tcp://10.0.0.5:8786 --run 3f2a9c01de --port 5007
      dasktf dashboard --scheduler tcp://10.0.0.5:8786 --report run.html
    """
    from dasktf.dashboard.cli import attach

    _configure_logging()
    _run_or_exit(lambda: attach(scheduler, run, address, port, report))


def _run_or_exit(fn: Any) -> None:
    """Run ``fn``; map errors to exit codes with a one-line reason."""
    from dasktf.exceptions import DasktfError

    try:
        fn()
    except click.ClickException:
        raise
    except (ValueError, TypeError) as exc:
        raise _BadArgument(_first_line(exc)) from exc
    except (DasktfError, FileNotFoundError, OSError, TimeoutError) as exc:
        click.echo(f"Error: {_first_line(exc)}", err=True)
        _echo_detail(exc)
        sys.exit(1)
    except KeyboardInterrupt:
        click.echo("Interrupted.", err=True)
        sys.exit(130)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0]


def _echo_detail(exc: BaseException) -> None:
    """A worker's traceback, if any, after the one-line reason."""
    lines = str(exc).strip().splitlines()
    if len(lines) > 1:
        click.echo("\n".join(lines[1:]), err=True)


def _configure_logging() -> None:
    import os

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    # distributed configures its loggers (INFO) when first imported; with the lazy
    # public API that can happen after this function, so import it first.
    import distributed  # noqa: F401

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    for noisy in ("distributed", "tensorflow", "absl"):
        logging.getLogger(noisy).setLevel(logging.ERROR)


from dasktf.tfcli import COMMANDS as _TF_COMMANDS  # noqa: E402 - after main exists

for _command in _TF_COMMANDS:
    main.add_command(_command)


if __name__ == "__main__":  # pragma: no cover
    main()
