"""The training loop: the run builder (:mod:`.build`), the step and its pipeline (:mod:`.step`), the trainer
(:mod:`.trainer`), and what they use: the model (:mod:`.model`), the plan for gem-parallel (:mod:`.parallel`),
optimizers, gradient clipping, signals, non-finite handling, prefetch, the process group, the run directory,
the metrics log, MFU and ``gem-train bench``.

Kept free of imports: each module is imported where it is used.
"""
