"""dasktf vs plain Keras and MultiWorkerMirroredStrategy, side by side in one run.

A thin wrapper: the benchmark lives in :mod:`dasktf.cli.bench` so that ``dasktf bench``
works from an installed package too. ``python benchmarks/peers.py --help``.
"""

from dasktf.cli.bench import bench

if __name__ == "__main__":  # LocalCluster workers re-import the main module
    bench()
