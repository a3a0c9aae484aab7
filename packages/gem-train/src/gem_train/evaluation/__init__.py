"""Evaluation: held-out splits scored (:mod:`.evaluate`), metrics (:mod:`.metrics`), model selection on the
validation split (:mod:`.selection`), the final report and plots (:mod:`.report`, :mod:`.plots`) and the
baselines GEM is measured against (:mod:`.baselines`).

Kept free of imports: each module is imported where it is used.
"""
