"""Tensor parallelism's pieces: sharding (``sharding``) and the collectives (``group``); the rank processes are
started by ``hylo.launch``."""
