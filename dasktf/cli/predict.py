"""``dasktf predict``: a saved model's predictions on Parquet or CSV data, written
partition by partition where the data is read (:func:`dasktf.predict`)."""

from __future__ import annotations

import os
from typing import Any

import click

from dasktf.cli import common


@click.command(context_settings=common.CONTEXT)
@click.option("--model", "-m", "model_path", required=True,
              type=click.Path(exists=True, dir_okay=False),
              help="A Keras model saved as .keras (model.save('m.keras'), or a dasktf "
              "checkpoint directory's model.keras).")
@click.option("--data", "-d", required=True, metavar="PATH",
              help="Parquet (a file, a directory of files or a glob) or CSV (*.csv): read "
              "by the workers, one partition at a time.")
@click.option("--out", "-o", required=True, type=click.Path(file_okay=False),
              help="A directory to write the predictions to: part.<i>.parquet per input "
              "partition, on the input's index.")
@click.option("--columns", default=None, metavar="A,B,...",
              help="The feature columns (default: the model's input names where they are "
              "all columns, else every column).")
@click.option("--batch-size", "-b", type=click.IntRange(min=1), default=None,
              help="Rows per forward call on a worker (default 1024).")
@click.option("--workers", "-w", "n_workers", type=click.IntRange(min=1), default=None,
              help="Workers of the local cluster to start (default 2).")
@click.option("--scheduler", default=None, metavar="ADDRESS",
              help="Predict on an existing Dask cluster instead of starting one.")
@click.option("--threads-per-worker", type=click.IntRange(min=1), default=None,
              help="TensorFlow threads per worker of the local cluster. Default: cores "
              "// workers.")
@click.option("--overwrite", is_flag=True, help="Write into --out even if it holds files.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
@click.option("--verbose", "-v", is_flag=True,
              help="Show TensorFlow's INFO lines and dasktf's INFO logging.")
@common.gpus_option
def predict(model_path: str, data: str, out: str, columns: str | None,
            batch_size: int | None, n_workers: int | None, scheduler: str | None,
            threads_per_worker: int | None, overwrite: bool, quiet: bool, verbose: bool,
            gpus: str | None) -> None:
    """Predict with a saved model on data too large for this machine's memory.

    \b
    The workers read the data, predict and write the result; this process only
    counts rows. One progress bar counts the partitions written.

    \b
    Examples:
      dasktf predict -m model.keras -d data/ -o predictions/
      dasktf predict -m model.keras -d 'day-*.csv' -o out/ --columns age,city
    """
    common.configure_logging(verbose)
    gpu_arg = common.parse_gpus(gpus)
    if scheduler is not None and (n_workers is not None or gpus is not None):
        raise common.BadArgument("--workers and --gpus start a local cluster; they cannot "
                                 "be combined with --scheduler.")
    if os.path.isdir(out) and os.listdir(out) and not overwrite:
        raise common.BadArgument(f"--out {out} holds files already; pass --overwrite to "
                                 "write into it.")
    wanted = [c.strip() for c in columns.split(",")] if columns else None
    common.run_or_exit(lambda: _predict(model_path, data, out, wanted, batch_size, n_workers,
                                        scheduler, threads_per_worker, gpu_arg, quiet))


def read_frame(data: str, columns: list[str] | None) -> Any:
    """``data`` as a lazy Dask DataFrame (Parquet or CSV), ``columns`` checked."""
    import dask.dataframe as dd

    if data.endswith(".csv") or ".csv" in os.path.basename(data):
        frame = dd.read_csv(data)
    else:
        frame = dd.read_parquet(data)
    if columns is not None:
        missing = [c for c in columns if c not in frame.columns]
        if missing:
            raise ValueError(f"--columns {missing} are not in {data} (its columns: "
                             f"{list(frame.columns)}).")
        frame = frame[columns]
    return frame


def _features(model: Any, frame: Any, columns: list[str] | None) -> Any:
    """The frame as the model takes it: its named inputs' columns, else (one
    input) every column."""
    from dasktf.inference.inputs import model_inputs

    if columns is not None:
        return frame
    specs = model_inputs(model)
    names = [str(kt.name) for kt in (specs.values() if isinstance(specs, dict) else
                                     specs if isinstance(specs, (list, tuple)) else [])]
    if names and all(n in frame.columns for n in names):
        return frame[names]
    return frame


def _predict(model_path: str, data: str, out: str, columns: list[str] | None,
             batch_size: int | None, n_workers: int | None, scheduler: str | None,
             threads: int | None, gpus: Any, quiet: bool) -> None:
    import keras
    from distributed import as_completed

    from dasktf.cluster.local import choose_workers, cluster_client
    from dasktf.inference.predict import predict as dask_predict
    from dasktf.inference.predict import write_parquet

    model = keras.saving.load_model(model_path, compile=False)
    frame = _features(model, read_frame(data, columns), columns)
    with cluster_client(None, scheduler, n_workers, threads, None, gpus) as (client, _):
        choose_workers(client, n_workers)
        predictions = dask_predict(model, frame, batch_size=batch_size, as_frame=True,
                                   client=client)
        futures = write_parquet(predictions, out, client)
        rows = 0
        with _bar(len(futures), quiet) as bar:
            for future in as_completed(futures):
                rows += future.result()
                bar.update(1)
    click.echo(f"Wrote {rows} predictions in {len(futures)} partition(s) to {out}")


def _bar(total: int, quiet: bool) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, unit="partition", desc="predict", disable=quiet,
                file=click.get_text_stream("stderr"))
