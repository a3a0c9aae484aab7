"""The identity of a run's data: what every checkpoint records about the data it was trained on, and how two
such records differ (a resume refuses other data unless told, :mod:`gem_train.loop.resume_check`).

Every dataset has ``data_identity() -> dict``, JSON-able and stable (the same data gives the same dict)::

    {"source": "parquet" | "movielens-100k" | "synthetic",
     "settings": {...},   # the config values that make the data (recorded for the reader)
     "content": {...}}    # what the files hold, which no config value says (compared on resume)

- Parquet (:mod:`gem_train.data.parquet.identity`): every split's files by resolved path, with their sizes,
  row counts and the sha256 of their footers, the vocabulary files' sha256, the columns read and their types.
- MovieLens-100K: the sha256s of its three files (checked against the known ones when they are fetched) and of
  the events and attributes parsed from them, and the rows of each split.
- Synthetic: the data is a pure function of the generator's settings and the seed, so those are its identity
  (``content`` is empty: the config comparison covers them).

``settings`` need no comparison of their own: they are config values, which the resume compares key by key.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

__all__ = ["DataDifference", "data_identity", "identity_differences", "identity_digest", "show"]


@dataclass(frozen=True)
class DataDifference:
    """What differs between the data of a checkpoint and this run's.

    ``key``: the config key the data belongs to (what ``--allow-change`` names, e.g. ``data.parquet.train``);
    ``detail``: what differs, in words; ``locators``: config keys whose allowed change moves this data (a new
    ``data.parquet.root`` means other files): such a change accepts the difference too.
    """

    key: str
    detail: str
    locators: tuple[str, ...]


def data_identity(source: Any) -> dict[str, Any]:
    """``source.data_identity()``, or an empty record for a source that has none (a test double)."""
    make = getattr(source, "data_identity", None)
    if make is None:
        return {"source": type(source).__name__, "settings": {}, "content": {}}
    return make()


def identity_digest(identity: dict[str, Any]) -> str:
    """sha256 of the identity's canonical JSON: equal digests, equal identities."""
    text = json.dumps(identity, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def show(value: Any, limit: int = 100) -> str:
    """A config or identity value in a message: JSON (TOML-like), cut at ``limit`` characters."""
    text = json.dumps(value, sort_keys=True) if not isinstance(value, float) else repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def identity_differences(old: dict[str, Any], new: dict[str, Any]) -> list[DataDifference]:
    """The differences in content between a checkpoint's data identity ``old`` and this run's ``new``."""
    teacher = _teacher_differences(old, new)  # a [distill] student's teacher (gem_train.transfer)
    src_old, src_new = old.get("source"), new.get("source")
    if src_old != src_new:
        return [DataDifference("data.source", f"the data source {show(src_old)} -> {show(src_new)}", ())]
    if src_new == "parquet":
        from gem_train.data.parquet.identity import parquet_differences

        return teacher + parquet_differences(old, new)
    section = {"movielens-100k": "data.movielens", "synthetic": "data.synthetic"}.get(str(src_new), "data")
    a, b = old.get("content") or {}, new.get("content") or {}
    out = teacher
    for k in sorted(set(a) | set(b)):
        if a.get(k) != b.get(k):
            detail = f"{k} {show(a.get(k), 60)} -> {show(b.get(k), 60)}"
            out.append(DataDifference(section, detail, ("data.source", section)))
    return out


def _teacher_differences(old: dict[str, Any], new: dict[str, Any]) -> list[DataDifference]:
    """A distilled student's teacher data (``"teacher"``: the config key and the sha256 of the predictions'
    or the teacher checkpoint's manifest, :meth:`gem_train.transfer.source.DistillSource.data_identity`)."""
    a, b = old.get("teacher"), new.get("teacher")
    if a == b:
        return []
    key = str((b or a or {}).get("key", "distill.teacher"))
    detail = f"the teacher's data {show(a, 60)} -> {show(b, 60)}"
    return [DataDifference(key, detail, ("distill",))]
