"""The wire: what moves between processes, in NumPy only.

Codecs (:mod:`.codecs`, half casts in :mod:`.halfcast`), the messages a step
sends (:mod:`.messages`) and the packets, chunk ranges and byte ledger of
:mod:`.packets`. Nothing here imports a replica, an engine or TensorFlow.
"""
