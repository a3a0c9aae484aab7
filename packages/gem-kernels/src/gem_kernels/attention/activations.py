"""Pointwise GDPA activations in PyTorch: values, derivatives, and the ids the Triton kernels use.

Every activation maps 0 to 0, so a masked (query, key) pair contributes exactly nothing; the kernels
still mask explicitly, so this is not relied upon for correctness.
"""

from __future__ import annotations

import math

import torch

# Id 0 is the softmax family; the kernels branch on this id as a constexpr.
ACTIVATION_IDS: dict[str, int] = {
    "softmax": 0,
    "silu": 1,
    "gelu": 2,  # tanh approximation
    "relu": 3,
    "relu2": 4,  # relu(x) ** 2
    "identity": 5,
}
ALIASES = {"relu_square": "relu2", "gelu_tanh": "gelu", "linear": "identity"}
GDPA_ACTIVATIONS = tuple(n for n in ACTIVATION_IDS if n != "softmax")

_GELU_C = math.sqrt(2.0 / math.pi)
_GELU_A = 0.044715


def canonical_activation(name: str) -> str:
    """The canonical GDPA activation name for ``name`` (aliases resolved); raises on unknown names."""
    if not isinstance(name, str):
        raise TypeError(f"activation must be a str, got {type(name).__name__}")
    name = ALIASES.get(name, name)
    if name not in GDPA_ACTIVATIONS:
        raise ValueError(f"activation must be one of {list(GDPA_ACTIVATIONS) + list(ALIASES)}, got {name!r}")
    return name


def act_value(name: str, x: torch.Tensor) -> torch.Tensor:
    """act(x), elementwise."""
    if name == "silu":
        return x * torch.sigmoid(x)
    if name == "gelu":
        return x * torch.sigmoid(2.0 * _GELU_C * (x + _GELU_A * x**3))
    if name == "relu":
        return torch.relu(x)
    if name == "relu2":
        return torch.relu(x) ** 2
    if name == "identity":
        return x
    raise ValueError(f"unknown activation {name!r}")


def act_grad(name: str, x: torch.Tensor) -> torch.Tensor:
    """d act(x) / dx, elementwise."""
    if name == "silu":
        sg = torch.sigmoid(x)
        return sg * (1.0 + x * (1.0 - sg))
    if name == "gelu":
        # gelu_tanh(x) = x * sigmoid(2u), u = c (x + a x^3)
        sg = torch.sigmoid(2.0 * _GELU_C * (x + _GELU_A * x**3))
        du = _GELU_C * (1.0 + 3.0 * _GELU_A * x * x)
        return sg + x * sg * (1.0 - sg) * 2.0 * du
    if name == "relu":
        return (x > 0).to(x.dtype)
    if name == "relu2":
        return 2.0 * torch.relu(x)
    if name == "identity":
        return torch.ones_like(x)
    raise ValueError(f"unknown activation {name!r}")
