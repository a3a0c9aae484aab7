"""The baselines GEM is measured against: the plain MLP (:mod:`.mlp`, a model trained by the same loop) and
gradient-boosted trees on a practitioner's causal features (:mod:`.gbdt`, the command; its `[model.gbdt]`
section is :mod:`gem_train.config.gbdt`).

The GBDT's machinery:

- :mod:`.training_log`: what the training split holds, flattened (candidate rows, the distinct history events,
  the candidate item's attributes);
- :mod:`.item_stats`: the candidate item's statistics from the training split only, with the encodings that
  keep a training row's own label out of its features;
- :mod:`.gbdt_features`: the GBDT's causal features of a batch (history, item, static);
- :mod:`.gbdt_matrix`: the feature matrices of the three splits from a batch source;
- :mod:`.gbdt_fit`: XGBoost or scikit-learn fitted with the number of trees chosen on the validation split.
"""
