"""Training data on the workers: one source per input kind behind
:func:`~dasktf.data.sources.make_source` with the step schedules (:mod:`.sources`);
a worker's rows and their stats (:mod:`.shards`); Dask arrays and DataFrames per
partition (:mod:`.partitions`); shards read part by part every epoch, loaders that
yield and ``dataset_fn(ctx)`` (:mod:`.streams`); and the nests of arrays Keras
takes as ``x``, ``y`` and ``sample_weight`` (:mod:`.structure`).
"""
