"""The bridge to ``tf.distribute``: ``TF_CONFIG`` for Dask workers, TensorFlow
child processes, and the checks of a user's cluster spec.
"""
