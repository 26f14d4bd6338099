"""Training data on the workers: one source per input kind behind
:func:`~dasktf.data.sources.make_source`, shards, schedules and their checks
(:mod:`.sources`), and the nests of arrays Keras takes as ``x``, ``y`` and
``sample_weight`` (:mod:`.structure`).
"""
