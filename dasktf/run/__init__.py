"""One fit, independent of the engine: :mod:`.options` (every option, checked once),
:mod:`.run` (place data, build replicas, drive the epochs, merge metrics,
callbacks), :mod:`.compiling` (the optimizer, loss and metrics the replicas compile
with: the call's, else the model's own), :mod:`.engine` (the factory that picks the
engine, and its checks of the model), :mod:`.guard` (checkpoints, resume, worker
loss and growth, through the engine contract only) and :mod:`.checkpoint` (the
files).
"""
