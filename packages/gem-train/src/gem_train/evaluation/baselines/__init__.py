"""The baselines GEM is measured against: the plain MLP (:mod:`.mlp`, trained by the same loop) and
gradient-boosted trees on causal features (:mod:`.gbdt`)."""
