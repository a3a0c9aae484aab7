"""``convert``: swap a model's ``nn.Linear`` layers for :class:`MXFP8Linear` under a precision policy."""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterable

from torch import nn

from gem_precision.linear import MXFP8Linear
from gem_precision.recipe import Recipe

SkipFn = Callable[[str, nn.Module], bool]

# Name components that mark prediction heads and losses, which GEM keeps in higher precision: CTR/CVR
# outputs are "highly sensitive to numerical change".
HEAD_NAME_PARTS = ("head", "heads", "loss", "logit", "logits", "classifier", "task", "tower_out", "output")


def default_skip(name: str, module: nn.Module) -> bool:
    """The default policy: keep prediction heads and losses (by name component) in higher precision."""
    parts = name.lower().replace("-", "_").split(".")
    return any(p in HEAD_NAME_PARTS or p.endswith(("_head", "_loss", "_logits")) for p in parts)


def _as_predicate(skip: SkipFn | Iterable[str] | None) -> SkipFn:
    if skip is None:
        return default_skip
    if callable(skip):
        return skip
    if isinstance(skip, str):
        raise TypeError("skip must be a predicate or an iterable of module names, not a single string")
    patterns = tuple(skip)

    def by_name(name: str, module: nn.Module) -> bool:
        # A listed name skips that module and everything under it; glob patterns are allowed.
        return any(name == p or name.startswith(p + ".") or fnmatch.fnmatchcase(name, p) for p in patterns)

    return by_name


def _find_blocks(model: nn.Module, blocks: str | None) -> tuple[str, list[str]]:
    """(path, child names) of the ModuleList/ModuleDict of blocks (the largest one if not named)."""
    if blocks is not None:
        container = model.get_submodule(blocks)
        if not isinstance(container, nn.ModuleList | nn.ModuleDict | nn.Sequential):
            raise TypeError(f"blocks={blocks!r} names a {type(container).__name__}, not a module container")
        return blocks, [n for n, _ in container.named_children()]
    best: tuple[str, list[str]] = ("", [])
    for path, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList | nn.ModuleDict):
            names = [n for n, _ in mod.named_children()]
            if len(names) > len(best[1]):
                best = (path, names)
    if not best[1]:
        raise ValueError("keep_last_blocks needs a ModuleList/ModuleDict of blocks; name it with blocks=")
    return best


def convert(
    model: nn.Module,
    recipe: Recipe | None = None,
    *,
    skip: SkipFn | Iterable[str] | None = None,
    min_features: int = 128,
    keep_last_blocks: int = 0,
    blocks: str | None = None,
) -> nn.Module:
    """Replace, in place, every ``nn.Linear`` of ``model`` that the policy does not keep with an
    :class:`MXFP8Linear` that shares its parameters (optimizer state stays valid).

    Args:
        model: any module.
        recipe: the :class:`Recipe` of converted layers (default ``Recipe()``: MXFP8 forward and dgrad).
        skip: module names (fully qualified; a name covers its submodules; glob patterns allowed) or a
            predicate ``(name, module) -> bool`` of layers to keep; default :func:`default_skip` (heads
            and losses by name).
        min_features: layers with ``in_features`` or ``out_features`` below this stay unconverted (small
            GEMMs gain nothing and lose precision). 0 disables the rule.
        keep_last_blocks: keep the last N blocks unconverted (later layers are the most sensitive).
        blocks: path of the ModuleList/ModuleDict of blocks; default: the largest one in the model.

    A layer whose every GEMM the recipe's auto fallback (``fp8_min_speedup > 0``) runs in bf16 at any token
    count (:meth:`Recipe.for_layer`) also stays an ``nn.Linear``: its graph is then exactly a bf16 run's.

    Returns:
        ``model`` itself. Converted layers are ``MXFP8Linear``; the rest are untouched.
    """
    recipe = recipe or Recipe()
    skip_fn = _as_predicate(skip)
    kept_prefixes: list[str] = []
    if keep_last_blocks > 0:
        path, names = _find_blocks(model, blocks)
        kept_prefixes = [f"{path}.{n}" if path else n for n in names[-keep_last_blocks:]]

    bf16 = ("bf16",) * 3
    auto = recipe.fp8_min_speedup > 0 and recipe.gemms != bf16

    def keep(name: str, mod: nn.Linear) -> bool:
        if min(mod.in_features, mod.out_features) < min_features:
            return True
        if auto and recipe.for_layer(mod.in_features, mod.out_features).gemms == bf16:
            return True
        if any(name == p or name.startswith(p + ".") for p in kept_prefixes):
            return True
        return skip_fn(name, mod)

    # Collect first: replacing while iterating named_modules would visit the new modules.
    targets = [
        (name, mod)
        for name, mod in model.named_modules()
        if type(mod) is nn.Linear and name and not keep(name, mod)
    ]
    if isinstance(model, nn.Linear) and type(model) is nn.Linear and not keep("", model):
        return MXFP8Linear.from_linear(model, recipe)
    for name, mod in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, MXFP8Linear.from_linear(mod, recipe))
    return model
