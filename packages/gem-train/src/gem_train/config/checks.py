"""Range checks of config values: each section's ``validate()`` uses these (types are checked at load time
by :mod:`gem_train.config.typed`). Every error is a :class:`ConfigError` naming the dotted key."""

from __future__ import annotations

import math

__all__ = ["ConfigError", "int_in", "real"]


class ConfigError(ValueError):
    """A bad configuration: the message names the dotted key and what is wrong with it."""


def int_in(key: str, value: int, lo: int, hi: int | None = None) -> None:
    if value < lo or (hi is not None and value > hi):
        rng = f"in [{lo}, {hi}]" if hi is not None else (f"> {lo - 1}" if lo == 1 else f">= {lo}")
        raise ConfigError(f"{key} must be {rng}, got {value!r}")


def real(
    key: str,
    value: float,
    lo: float | None = None,
    hi: float | None = None,
    *,
    lo_open: bool = False,
    hi_open: bool = False,
) -> None:
    """``value`` must be finite and within the bounds (open or closed)."""
    if not math.isfinite(value):
        raise ConfigError(f"{key} must be a finite number, got {value!r}")
    below = lo is not None and (value <= lo if lo_open else value < lo)
    above = hi is not None and (value >= hi if hi_open else value > hi)
    if below or above:
        if lo is not None and hi is not None:
            rng = f"in {'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"
        elif lo is not None:
            rng = f"{'>' if lo_open else '>='} {lo:g}"
        else:
            rng = f"{'<' if hi_open else '<='} {hi:g}"
        raise ConfigError(f"{key} must be {rng}, got {value!r}")
