"""Your own training data: Parquet files of one row per example, declared in ``[data.parquet]``.

Modules: :mod:`.format` (the on-disk format, documented), :mod:`.errors`, :mod:`.ids` (raw / hashed /
vocabulary ids), :mod:`.schema` (files and their columns), :mod:`.convert` (Arrow rows -> ``GemBatch`` pieces,
validated, vectorized), :mod:`.reader` (the streaming, sharded, resumable source), :mod:`.inspect`
(``gem-train data inspect``), :mod:`.export` (the built-in datasets written in this format).

The config section is :mod:`gem_train.config.parquet` (the config package sits below the data).
"""
