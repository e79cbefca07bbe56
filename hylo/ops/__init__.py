"""Kernels. Each module holds the plain PyTorch reference of its op family (the specification, and the CPU path)
and, on CUDA, the fast version beside it; public names dispatch between the two."""
