"""PyTorch paths of gem_kernels: the per-sequence reference oracles and the vectorized CPU paths."""
