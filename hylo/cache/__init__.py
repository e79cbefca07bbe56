"""The caches: request slots, the KV pool of the attention layers and the state pool of the linear layers.

``memory.py`` is the one place that allocates cache memory; everything else borrows views of these tensors.
"""
