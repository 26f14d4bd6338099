"""Sync training on ``tf.distribute`` ring all-reduce: :mod:`.engine` (client
side) and :mod:`.child` (the TensorFlow child of each worker and its tasks).
"""
