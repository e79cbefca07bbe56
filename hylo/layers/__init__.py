"""The model's building blocks. Each layer owns its parameters and knows how to load them from a checkpoint;
the cache-touching work is delegated to the backend handed in with the batch."""
