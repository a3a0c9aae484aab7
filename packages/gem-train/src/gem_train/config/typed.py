"""dict <-> dataclass with type checks: a TOML table becomes a config section, or a :class:`ConfigError`
naming the dotted key of an unknown key or a value of the wrong type."""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Literal

from gem_train.config.checks import ConfigError

__all__ = ["check_value", "config_from_dict", "config_to_dict"]


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (types.UnionType, typing.Union):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if dataclasses.is_dataclass(tp):
        return "table"
    if origin is dict or tp is dict:
        return "table"
    return getattr(tp, "__name__", str(tp))


def check_value(value: Any, tp: Any, key: str) -> Any:
    """Return ``value`` converted to ``tp`` (int -> float only), or raise ConfigError naming ``key``."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin is Literal:
        if value not in typing.get_args(tp):
            raise ConfigError(f"{key}: expected one of {_type_name(tp)}, got {value!r}")
        return value
    if origin in (types.UnionType, typing.Union):
        for arg in typing.get_args(tp):
            try:
                return check_value(value, arg, key)
            except ConfigError:
                continue
        raise ConfigError(f"{key}: expected {_type_name(tp)}, got {type(value).__name__} {value!r}")
    if tp is type(None):
        if value is not None:
            raise ConfigError(f"{key}: expected None, got {value!r}")
        return value
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a table, got {type(value).__name__} {value!r}")
        return config_from_dict(tp, value, prefix=key)
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a table, got {type(value).__name__} {value!r}")
        return dict(value)
    if origin in (list, tuple) or tp in (list, tuple):
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{key}: expected an array, got {type(value).__name__} {value!r}")
        args = typing.get_args(tp)
        item_tp = args[0] if args else Any
        items = [check_value(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if (origin is tuple or tp is tuple) else items
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected bool, got {type(value).__name__} {value!r}")
        return value
    if tp is int:
        # bool is an int subclass in Python; `steps = true` is a mistake, not 1.
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected int, got {type(value).__name__} {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{key}: expected float, got {type(value).__name__} {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected str, got {type(value).__name__} {value!r}")
        return value
    raise ConfigError(f"{key}: unsupported config type {tp!r}")


_T = typing.TypeVar("_T")


def config_from_dict(cls: type[_T], data: dict[str, Any], prefix: str = "") -> _T:
    """Build dataclass ``cls`` from a (TOML) dict, checking every key and type.

    Missing keys take the dataclass default. Raises :class:`ConfigError` naming the dotted key of an unknown
    key or a value of the wrong type.
    """
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        dotted = f"{prefix}.{key}" if prefix else key
        if key not in names:
            raise ConfigError(f"unknown config key '{dotted}' (known keys here: {', '.join(names)})")
        kwargs[key] = check_value(value, hints[key], dotted)
    return cls(**kwargs)


def config_to_dict(cfg: Any) -> dict[str, Any]:
    """The dataclass as nested plain dicts (tuples become lists), ready for TOML/JSON."""

    def conv(v: Any) -> Any:
        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            return {f.name: conv(getattr(v, f.name)) for f in dataclasses.fields(v)}
        if isinstance(v, dict):
            return {k: conv(x) for k, x in v.items()}
        if isinstance(v, list | tuple):
            return [conv(x) for x in v]
        return v

    return conv(cfg)
