"""Your own training data: Parquet files of one row per example, declared in ``[data.parquet]``.

Modules: :mod:`.format` (the on-disk format, documented), :mod:`.config` (the config section),
:mod:`.errors`, :mod:`.ids` (raw / hashed / vocabulary ids), :mod:`.schema` (files and their columns),
:mod:`.convert` (Arrow rows -> ``GemBatch`` pieces, validated, vectorized), :mod:`.reader` (the streaming,
sharded, resumable source), :mod:`.inspect` (``gem-train data inspect``), :mod:`.export` (the built-in
datasets written in this format).

Kept free of imports here: :mod:`gem_train.config` imports :mod:`.config` to declare the section.
"""
