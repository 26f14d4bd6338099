"""Train from a Parquet directory read as a Dask DataFrame, where its partitions live.

The example writes the digits data set as a directory of Parquet files (one per
partition, 64 pixel columns and a ``label`` column), then does what a Dask user
does: ``dd.read_parquet`` on a cluster, ``persist`` so each partition sits on one
worker, hold the last partition out for validation, and
``dasktf.fit(model, train, "label")``. Each worker's shard is made from the
partitions it already holds; the client receives row counts, the validation
partition, metrics and the trained weights, never the training partitions.
``--stream`` reads the files part by part on the workers every epoch instead
(``stream=True``: for data larger than the workers' memory).

Run: ``python examples/parquet_frame.py --workers 2``.
"""

from __future__ import annotations

import argparse
import pathlib
import tempfile

import dask.dataframe as dd
import keras
import pandas as pd
from distributed import Client, LocalCluster

import dasktf
from dasktf.cluster.membership import alive_workers


def write_parquet(directory: pathlib.Path, partitions: int) -> int:
    """The digits training set as ``partitions`` Parquet files; returns the rows."""
    digits = dasktf.load_dataset("digits")
    flat = digits.x_train.reshape(len(digits.x_train), -1)
    frame = pd.DataFrame(flat, columns=[f"pixel{i}" for i in range(flat.shape[1])])
    frame["label"] = digits.y_train.astype("int64")
    dd.from_pandas(frame, npartitions=partitions).to_parquet(directory, write_index=False)
    return len(frame)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--stream", action="store_true",
                        help="read the Parquet files part by part every epoch")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        path = pathlib.Path(tmp) / "digits.parquet"
        rows = write_parquet(path, partitions=4 * args.workers)
        with LocalCluster(n_workers=args.workers, threads_per_worker=1,
                          host="127.0.0.1", dashboard_address=None) as cluster, \
                Client(cluster) as client:
            df = dd.read_parquet(path)
            if not args.stream:
                df = df.persist()  # the partitions now live on the workers
            train, val = df.partitions[:-1], df.partitions[-1:]
            print(f"{rows} rows in {df.npartitions} partitions on "
                  f"{len(alive_workers(client))} workers "
                  f"({'streamed' if args.stream else 'resident'})")

            model = keras.Sequential([
                keras.Input((64,)),
                keras.layers.Dense(64, activation="relu"),
                keras.layers.Dense(10, activation="softmax"),
            ])
            model.compile(optimizer=keras.optimizers.Adam(1e-2),
                          loss="sparse_categorical_crossentropy", metrics=["accuracy"])
            history = dasktf.fit(model, train, "label", client=client, epochs=args.epochs,
                                 batch_size=64, stream=args.stream, verbose=0, seed=0,
                                 validation_data=(val.drop(columns="label"), val["label"]))
            print(f"train accuracy {history.history['accuracy'][-1]:.4f}  "
                  f"validation accuracy {history.history['val_accuracy'][-1]:.4f}")


if __name__ == "__main__":
    main()
