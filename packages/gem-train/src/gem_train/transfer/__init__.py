"""GEM as a foundation model: batch inference to Parquet and knowledge transfer into small vertical models.

Modules: :mod:`~gem_train.transfer.rows` (which rows a split has and their keys), :mod:`~.prediction_files`
(atomic Parquet shards and the manifest), :mod:`~.representation` (the tensor the heads read),
:mod:`~.predict` (``gem-train predict``), :mod:`~.teacher` (teacher predictions: stored and joined by key,
or live), :mod:`~.batch` (``DistillBatch``), :mod:`~.source` (the student's data: teacher labels and
stored representations joined in), :mod:`~.student` (auxiliary heads and student adapters beside the serving
model), :mod:`~.losses` (the distillation loss), :mod:`~.errors`.
"""
