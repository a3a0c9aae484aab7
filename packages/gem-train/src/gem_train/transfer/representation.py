"""The model's representation of an example: the tensor its task heads read, captured by a forward hook.

- **GEM** (``gem_model.GemModel``): ``z = [X_sum || S_sum]`` flattened, ``[B, (n_sum_tokens +
  n_pma_tokens + n_recent) * d_model]`` (192 floats for ``tiny``, 1024 for ``small``): the final
  non-sequence summary tokens (what the interaction stack made of the dense and sparse features) next to
  the final sequence summary (the history pooled by PMA, plus the most recent events, after every layer's
  cross-attention to the candidate's context). Every task head reads exactly this, so it is the last
  task-shared tensor: what the trunk knows about the impression, before any task's MLP. It is the input of
  each head (``model.heads[task]``), captured by a pre-hook on the first head; gem-model is unchanged.
- **MLP baseline**: the last hidden layer's activations (the input of the output layer ``model.mlp[-1]``),
  ``[B, hidden[-1]]``; with ``hidden = []`` the concatenated input features.

Used by ``gem-train predict --embeddings`` (the stored representation, LoopFM's feature) and by the
student's auxiliary heads (:mod:`gem_train.transfer.student`), which read the student's own representation.
"""

from __future__ import annotations

from typing import Any, cast

from torch import Tensor, nn

from gem_model import GemModel

__all__ = ["RepresentationCapture", "representation_module"]


def representation_module(model: nn.Module) -> tuple[nn.Module, int, str]:
    """``(module, width, what)``: the module whose first input is the representation, its width and a
    short description of the tensor."""
    if isinstance(model, GemModel):
        first = next(iter(model.heads.values()))
        norm = cast(nn.LayerNorm, first.norm)
        c = model.config
        what = (
            f"GEM heads' input [X_sum || S_sum]: ({c.n_sum_tokens} + {c.n_pma_tokens} + {c.n_recent}) "
            f"tokens x d_model {c.d_model}"
        )
        return first, int(norm.normalized_shape[0]), what
    mlp = getattr(model, "mlp", None)
    if isinstance(mlp, nn.Sequential) and isinstance(mlp[-1], nn.Linear):
        out = mlp[-1]
        return out, int(out.in_features), "MLP baseline's last hidden layer (the output layer's input)"
    raise TypeError(f"no known representation for a {type(model).__name__}")


class RepresentationCapture:
    """Keeps the representation of the latest forward while ``enabled`` (a pre-hook on the module of
    :func:`representation_module`; registered once, cheap when disabled).

    ``value`` is the ``[B, D]`` tensor of the last forward (as the model computed it: part of the autograd
    graph in training, so heads on it train the trunk too).
    """

    def __init__(self, model: nn.Module) -> None:
        self.module, self.width, self.what = representation_module(model)
        self.enabled = False
        self.value: Tensor | None = None
        self._handle = self.module.register_forward_pre_hook(self._hook)

    def _hook(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        if self.enabled:
            self.value = args[0]

    def take(self) -> Tensor:
        """The captured ``[B, D]`` representation (then forgotten)."""
        value, self.value = self.value, None
        if value is None:
            raise RuntimeError("no representation was captured: the model's heads did not run")
        return value.flatten(1)

    def remove(self) -> None:
        self._handle.remove()
