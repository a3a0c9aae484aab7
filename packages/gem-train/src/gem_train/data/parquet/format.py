"""The on-disk format gem-train trains on: Parquet files of one row per example (an impression).

Files and splits
    Train, validation and test are separate lists of paths or globs (``data.parquet.train``, ``valid``,
    ``test``; relative to ``data.parquet.root``), matched files read in sorted order, row group by row group.
    Every file of a split must hold the declared columns (other columns are ignored and never read); a
    column may differ in integer or float width between files (it is cast to the first file's type).
    ``valid = []`` cuts the validation split off the training files instead: their latest
    ``valid_fraction`` (default 0.1) of rows by request time (:mod:`.time_split`); ``valid_fraction = 0``
    with no valid files means no validation split.

Columns, by kind (names are free: the config maps each feature to its columns)
    dense       float32/float64 columns, one per feature (``dense.columns = [...]``), or one
                ``fixed_size_list<float, n>`` column (``dense.column``, ``dense.n_dense = n``). A null or
                NaN/inf value is a bad row, or is replaced by ``dense_fill`` with ``dense_nan = "fill"``.
    sparse      one column per pooled feature: ``int64`` (one id per row; null = no id) or
                ``list<int64>`` (multi-hot, at most ``max_ids`` ids; a null list = no id).
    sequences   per behaviour sequence, ``list<int64>`` columns of equal length within each row, oldest
                event first: item ids (``items``, required), action-type ids (``actions``; absent: 0) and
                Unix-second timestamps (``timestamps``; >= 0 and non-decreasing; absent: 0). Histories longer
                than ``max_len`` keep their most recent ``max_len`` events. (Per-event float values are not
                part of gem-model's batch yet and cannot be declared.)
    request     ``request_time`` (optional int64 seconds, >= every event of the row; absent: the row's
                latest event timestamp, 0 without events).
    labels      one column per task (``[data.parquet.labels] task = "column"``), bool or integer/float 0/1,
                nullable: a null label masks that task for that row (e.g. a conversion label only where there
                was a click). The task order of the table is the model's.

Ids
    Every id feature (a sparse feature, or a sequence's item ids) declares how raw values become table rows
    (``ids``): ``"raw"`` - already in ``[0, num_embeddings)`` (anything else is a bad row); ``"hash"`` -
    ``splitmix64(id) mod num_embeddings`` (:mod:`.ids`; stable across machines and versions, collisions
    counted by ``gem-train data inspect``); ``"vocab"`` - the line number of the id in ``vocab_file`` (one
    int64 per line; an unknown id is a bad row). Action ids are always raw, in ``[0, num_actions)``.

Bad input
    A missing or mistyped column, an unreadable or empty file, or a glob matching nothing stops the run
    before training (naming the file). A bad row (unequal event lists, an id out of range or unknown, a
    negative or decreasing timestamp, a null inside an event list, more than ``max_ids`` ids, NaN in a dense
    feature, a label not 0/1, an event after the request time) stops it with ``on_bad_row = "error"``
    (naming file, row group and row) or, with ``"skip"``, is left out of its batch and counted.

The loader (:mod:`.reader`) and the checks (:mod:`.convert`) implement exactly this; :mod:`.export` writes
the built-in datasets in it.
"""

from __future__ import annotations

__all__: list[str] = []
