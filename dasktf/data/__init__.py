"""Training data on the workers: one source per input kind behind
:func:`~dasktf.data.sources.make_source`, shards, schedules and their checks.
"""
