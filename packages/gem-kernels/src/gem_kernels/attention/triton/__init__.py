"""Triton kernels of jagged attention and their launchers, imported lazily by :mod:`..ops` (only when a
kernel runs), one job per module:

- kernels: :mod:`.fwd` (forward), :mod:`.bwd` (dQ, then dK/dV), :mod:`.onetile` (one program per sequence
  for short keys or few queries, whole or split), :mod:`.persistent` (persistent grid, TMA loads); their
  shared ``@triton.jit`` helpers: :mod:`.common` (layout, band, program prologues) and :mod:`.tile_math`
  (the per-tile math); :mod:`.schedule` (the persistent kernels' jagged tile schedule, in torch ops).
- launchers: :mod:`.launch` (the entry points), :mod:`.split` (split backward), :mod:`.persistent_launch`,
  :mod:`.tiles` (fixed or autotuned blocks), :mod:`.autotuners` (every kernel's autotuner).
"""
