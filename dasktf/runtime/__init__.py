"""Worker-side state the engines share: the replica, its channel and tasks, the
sharded parameter servers, and the cost probes of the metrics path.
"""
