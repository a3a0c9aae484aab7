"""Dotted ``key=value`` overrides of the command line, applied to the raw TOML dict before type checks."""

from __future__ import annotations

import copy
import tomllib
from typing import Any

from gem_train.config.checks import ConfigError

__all__ = ["apply_overrides", "parse_override"]


def parse_override(text: str) -> tuple[str, Any]:
    """Parse ``key=value``: the value is read as a TOML literal (``3``, ``1e-3``, ``true``, ``"x"``,
    ``[1, 2]``); anything that is not a TOML literal is taken as a bare string (``lognormal``)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} is not of the form key=value")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {text!r}: empty key")
    raw = raw.strip()
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return key, value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Return a copy of the raw config dict with dotted ``key=value`` overrides set (before type checks)."""
    out = copy.deepcopy(data)
    for text in overrides:
        key, value = parse_override(text)
        parts = key.split(".")
        node = out
        for i, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {text!r}: '{'.'.join(parts[: i + 1])}' is not a table")
            node = child
        node[parts[-1]] = value
    return out
