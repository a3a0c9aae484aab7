"""The baselines' own machinery (the GEM and MLP models are in gem-model / :mod:`gem_train.baseline`).

- :mod:`~gem_train.baselines.gbdt_config`: the ``[model.gbdt]`` config section;
- :mod:`~gem_train.baselines.training_log`: what the training split holds, flattened (candidate rows, the
  distinct history events, the candidate item's attributes);
- :mod:`~gem_train.baselines.item_stats`: the candidate item's statistics from the training split only, with
  the encodings that keep a training row's own label out of its features;
- :mod:`~gem_train.baselines.gbdt_features`: the GBDT's causal features of a batch (history, item, static);
- :mod:`~gem_train.baselines.gbdt_matrix`: the feature matrices of the three splits from a batch source;
- :mod:`~gem_train.baselines.gbdt_fit`: XGBoost or scikit-learn fitted with the number of trees chosen on
  the validation split.
"""
