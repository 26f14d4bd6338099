"""One fit, independent of the engine: :mod:`.run` (place data, build replicas,
drive the epochs, merge metrics, callbacks), :mod:`.engine` (the factory that
picks the engine), :mod:`.guard` (checkpoints, resume, worker loss and growth)
and :mod:`.checkpoint` (the files).
"""
