"""The one name of each data split, used by every data source, loader, evaluation and the command line.

- ``"train"``: the training stream (endless, or repeating after one epoch);
- ``"valid"``: the validation split, for model selection (``train.valid_every``); may be empty;
- ``"test"``: the held-out test split, reported and never used for selection.
"""

from __future__ import annotations

from typing import Literal, get_args

__all__ = ["HELD_OUT", "SPLITS", "HeldOutSplit", "Split", "check_split"]

Split = Literal["train", "valid", "test"]
HeldOutSplit = Literal["valid", "test"]
SPLITS: tuple[Split, ...] = get_args(Split)
HELD_OUT: tuple[HeldOutSplit, ...] = get_args(HeldOutSplit)


def check_split(split: str, allowed: tuple[str, ...] = SPLITS) -> None:
    """Raise ValueError naming the allowed splits unless ``split`` is one of them."""
    if split not in allowed:
        raise ValueError(f"split must be one of {', '.join(map(repr, allowed))}, got {split!r}")
