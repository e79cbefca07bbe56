"""Tensor parallelism: sharding (``sharding``), the collectives (``group``) and the rank processes (``launcher``)."""
