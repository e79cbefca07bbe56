"""Models and their weights: the Qwen3-Next target, its MTP head, checkpoint loading, the embedded default."""
