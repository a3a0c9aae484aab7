"""Triton kernels of gem_kernels and their launchers (imported lazily by the public faces, only when a
kernel runs). Named ``triton_kernels`` so it does not shadow the ``triton`` package."""
