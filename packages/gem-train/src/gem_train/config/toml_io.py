"""TOML in and out: :func:`load_config` (a file or a shipped config, plus overrides, checked) and
:func:`dumps_toml` (``tomllib`` only reads; enough for our nested tables of scalars and arrays)."""

from __future__ import annotations

import importlib.resources
import tomllib
from pathlib import Path
from typing import Any

from gem_train.config.checks import ConfigError
from gem_train.config.overrides import apply_overrides
from gem_train.config.schema import TrainConfig
from gem_train.config.typed import config_from_dict
from gem_train.configs import SHIPPED_CONFIGS

__all__ = ["SHIPPED_CONFIGS", "dumps_toml", "load_config"]


def _read_shipped(name: str) -> str:
    res = importlib.resources.files("gem_train").joinpath("configs", f"{name}.toml")
    return res.read_text(encoding="utf-8")


def load_config(source: str | Path | None = None, overrides: list[str] | None = None) -> TrainConfig:
    """Load a run config.

    Args:
        source: a path to a TOML file, or the name of a shipped config (``SHIPPED_CONFIGS``); ``None`` is
            ``"tiny-cpu"``.
        overrides: dotted ``key=value`` strings applied on top (``train.steps=20``).

    Raises:
        ConfigError: unreadable TOML, an unknown key, a wrong type or an out-of-range value (naming the key).
    """
    source = "tiny-cpu" if source is None else source
    path = Path(source)
    if path.suffix == ".toml" or path.exists():
        if path.is_dir():
            raise ConfigError(
                f"config {str(path)!r} is a directory; pass a TOML file or a shipped config name"
            )
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist")
        text, origin = path.read_text(encoding="utf-8"), str(path)
    elif str(source) in SHIPPED_CONFIGS:
        text, origin = _read_shipped(str(source)), f"shipped config {source!r}"
    else:
        raise ConfigError(
            f"no config file {str(source)!r}, and it is not a shipped config ({', '.join(SHIPPED_CONFIGS)})"
        )
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{origin}: invalid TOML: {e}") from e
    raw = apply_overrides(raw, list(overrides or []))
    cfg = config_from_dict(TrainConfig, raw)
    cfg.validate()
    return cfg


def _toml_scalar(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if v != v or v in (float("inf"), float("-inf")):
            return {"nan": "nan", "inf": "inf", "-inf": "-inf"}[repr(v)]
        return repr(v)
    if isinstance(v, str):
        escaped = v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
        return f'"{escaped}"'
    if isinstance(v, list | tuple):
        return "[" + ", ".join(_toml_scalar(x) for x in v) + "]"
    raise TypeError(f"cannot write {type(v).__name__} to TOML")


def dumps_toml(data: dict[str, Any]) -> str:
    """Nested dicts of scalars/arrays -> TOML text (tables after scalars, so it re-reads identically)."""
    lines: list[str] = []

    def emit(table: dict[str, Any], prefix: str) -> None:
        scalars = {k: v for k, v in table.items() if not isinstance(v, dict)}
        tables = {k: v for k, v in table.items() if isinstance(v, dict)}
        if prefix and (scalars or not tables):
            lines.append(f"[{prefix}]")
        for k, v in scalars.items():
            lines.append(f"{_toml_key(k)} = {_toml_scalar(v)}")
        if scalars:
            lines.append("")
        for k, v in tables.items():
            emit(v, f"{prefix}.{_toml_key(k)}" if prefix else _toml_key(k))

    emit(data, "")
    return "\n".join(lines).rstrip() + "\n"


def _toml_key(k: str) -> str:
    return k if k.replace("_", "").replace("-", "").isalnum() else _toml_scalar(k)
