"""Worker-side state the engines share: the replica, its channel and tasks, the
Keras side of its step (keras_step: input signatures, loss and metric variables),
the sharded parameter servers, and the cost probes of the metrics path.
"""
