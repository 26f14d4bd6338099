"""Training data, in the shape of Keras' ``trainers/data_adapters``: one factory
(:mod:`.sources`) picks one adapter per input kind, each a :class:`~.base.Source`;
beneath them shards and their stats, step schedules, validation data, Dask
partitions, streamed shards and the nests of arrays ``x``, ``y`` and
``sample_weight`` are.
"""
