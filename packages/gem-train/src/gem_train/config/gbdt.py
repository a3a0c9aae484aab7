"""The ``[model.gbdt]`` config section: what the GBDT baseline's features are built from, and which library.

Everything has a working default for the built-in sources; a Parquet source names its columns' roles here
when the defaults do not fit::

    [model.gbdt]
    library = "xgboost"       # or "sklearn" (HistGradientBoostingClassifier)
    like_action = 4           # history actions >= 4 count as a "like" (MovieLens ratings); 0: the default
    max_history = 0           # MovieLens: the GBDT reads every earlier event (0), or at most this many
    item_feature = "ad_id"    # the single-id sparse feature that is the candidate item; "": ad_id or by size
    user_feature = "user_id"  # the user's id (tells two users' identical events apart); "": none
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from gem_model import FeatureSpec
from gem_train.config.checks import ConfigError
from gem_train.config.checks import int_in as _int_in

__all__ = ["GbdtConfig", "resolve_item_feature", "resolve_user_feature"]

Library = Literal["xgboost", "sklearn"]


@dataclass
class GbdtConfig:
    """``gem-train baseline --model gbdt`` (see :mod:`gem_train.evaluation.baselines.gbdt`)."""

    library: Library = "xgboost"  # the winner on MovieLens's validation split (gem-train README)
    # The smallest action id of a history event that counts as positive (a "like"); 0: the data source's
    # own (MovieLens: data.movielens.like_threshold), else 1 (every action but action 0, e.g. a view).
    like_action: int = 0
    item_feature: str = ""  # "": ad_id, else the single-id sparse feature with the history's item vocabulary
    user_feature: str = "user_id"  # used when the spec has it; "": none
    # The longest history the GBDT reads where the source can give more than the model's window
    # (MovieLens: data.movielens.max_len is a view of every earlier event); 0: every earlier event. Other
    # sources: their own window.
    max_history: int = 0
    threads: int = 1  # the library's threads (a shared CPU: 1)

    def validate(self, key: str = "model.gbdt") -> None:
        _int_in(f"{key}.like_action", self.like_action, 0)
        _int_in(f"{key}.max_history", self.max_history, 0)
        _int_in(f"{key}.threads", self.threads, 1, 1024)


def resolve_item_feature(cfg: GbdtConfig, spec: FeatureSpec) -> tuple[str, int] | None:
    """(item feature, index of the sequence whose items it shares) or None when there is none.

    ``cfg.item_feature`` names it; empty: ``ad_id`` (the built-in sources' candidate) if its vocabulary size
    is a sequence's ``num_items``, else the one single-id sparse feature whose vocabulary size is.

    Raises:
        ConfigError: the named feature is not a single-id sparse feature of the spec, or its vocabulary is
            no sequence's; or, unnamed, several features match.
    """
    single = {f.name: f for f in spec.sparse if f.max_ids == 1}
    sizes = [s.num_items for s in spec.sequences]
    if cfg.item_feature:
        f = single.get(cfg.item_feature)
        if f is None:
            raise ConfigError(
                f"model.gbdt.item_feature = {cfg.item_feature!r} is not a single-id sparse feature of this "
                f"data (those are {sorted(single)})"
            )
        if f.num_embeddings not in sizes:
            raise ConfigError(
                f"model.gbdt.item_feature = {cfg.item_feature!r} has {f.num_embeddings} ids, but the "
                f"sequences' item vocabularies are {sizes}: the candidate item must share the history's ids"
            )
        return f.name, sizes.index(f.num_embeddings)
    found = [f.name for f in single.values() if f.num_embeddings in sizes]
    if "ad_id" in found:  # the built-in sources' name of the candidate
        found = ["ad_id"]
    if len(found) > 1:
        raise ConfigError(
            f"several single-id sparse features {found} have a sequence's item vocabulary size; name the "
            "candidate item with model.gbdt.item_feature"
        )
    if not found:
        return None
    return found[0], sizes.index(single[found[0]].num_embeddings)


def resolve_user_feature(cfg: GbdtConfig, spec: FeatureSpec) -> str | None:
    """The user-id feature if ``cfg.user_feature`` names a single-id sparse feature of ``spec``."""
    if not cfg.user_feature:
        return None
    single = {f.name for f in spec.sparse if f.max_ids == 1}
    return cfg.user_feature if cfg.user_feature in single else None
