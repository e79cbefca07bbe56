"""Backends: how the attention and linear-attention layers read and write their caches for each forward mode."""
