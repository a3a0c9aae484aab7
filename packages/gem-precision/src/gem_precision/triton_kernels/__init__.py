"""Triton kernels of gem_precision (imported lazily by the public faces, only when a kernel runs)."""
