"""``train.compile``: torch.compile applied per block, from outside the model (as torchtitan does)."""

from __future__ import annotations

from torch import nn


def apply_compile(model: nn.Module) -> nn.Module:
    """Compile each block of ``model.layers`` (a ``ModuleDict``), or the whole model if it has none.

    Per-block compilation fuses the norms, gates, casts and residual adds inside a layer while keeping
    graphs small (one compile serves all layers of a shape) and leaving the embedding collections and the
    jagged batch handling eager. ``nn.Module.compile`` works in place, so parameter names and checkpoint
    keys do not change (no ``_orig_mod.`` prefix). Returns ``model``.
    """
    layers = getattr(model, "layers", None)
    if isinstance(layers, nn.ModuleDict) and len(layers) > 0:
        for layer in layers.values():
            layer.compile()
    else:
        model.compile()
    return model
