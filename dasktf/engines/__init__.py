"""The engines a run drives, all behind one contract (:mod:`.base`), one family per
subpackage; families never import each other.

* :mod:`.graph`: sync training as a Dask task graph per step (topologies,
  sharded servers, elastic recovery).
* :mod:`.holder`: async and quorum training around a parameter-holder actor.
* :mod:`.collective`: sync training on ``tf.distribute`` ring all-reduce.
"""
