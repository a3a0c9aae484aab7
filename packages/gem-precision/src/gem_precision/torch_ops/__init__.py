"""PyTorch paths of gem_precision: the references (oracles of the Triton kernels) and the CPU paths."""
