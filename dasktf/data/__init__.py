"""Training data on the workers, in the shape of Keras' ``trainers/data_adapters``:
one factory (:func:`~dasktf.data.sources.make_source`, every probe of what ``x``
is) picks one adapter per input kind (:mod:`.arrays`, :mod:`.dask_collections`,
:mod:`.loaders`, :mod:`.dataset_fn`; :mod:`.keras_inputs` reads a ``tf.data``
dataset or a ``PyDataset`` on the client), each a :class:`~.base.Source`. Beneath
them: a worker's rows and their stats (:mod:`.shards`), the step schedules
(:mod:`.schedules`), validation data (:mod:`.validation`), Dask collections per
partition (:mod:`.partitions`), shards read part by part (:mod:`.streams`) and the
nests of arrays Keras takes as ``x``, ``y`` and ``sample_weight`` (:mod:`.structure`).
"""
