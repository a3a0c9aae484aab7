"""8-bit FSDP all-gather: each rank quantizes its own weight shard, the all-gather carries FP8 bytes.

The weights of large linear layers are wrapped (before ``fully_shard``) in :class:`QuantizedAllGatherWeight`,
a tensor subclass that FSDP2 recognises by its extension points:

- ``fsdp_pre_all_gather``: the rank's shard (fp32 master rows ``[R/s, K]``) is quantized to E4M3 and
  handed to the all-gather as ``uint8`` rows (gloo has no float8 type; NCCL moves bytes either way), each
  followed by its scale bytes: gem-precision's packed rows (``gem_precision.packed``, the PyTorch reference
  off CUDA). "fp8": one fp32 scale per row (the bytes of ``quantize_rowwise``). "mxfp8": one E8M0 scale per
  32 elements along K (the bytes of ``to_mx``). FSDP2 shards dim 0 (rows), so row scales and K-blocks never
  cross a shard boundary: no rank needs another's data to quantize, and the gathered payload is exactly the
  quantization of the whole weight. The wrapped shards of one FSDP unit share an :class:`AllGatherRound`
  (set by :func:`group_quantized_all_gather` after ``fully_shard``): the unit's first call of a round
  quantizes all of them in one Triton launch, the others take their rows. One launch per round, not per
  weight: the per-launch host cost was the whole of a weight's quantization time at a GEM trunk's shapes.
- ``fsdp_post_all_gather``: the gathered bytes are dequantized into the unsharded weight in FSDP's
  ``param_dtype`` (``dequantize_packed``: one launch, straight into FSDP's buffer when it reuses one).
  Backward sees that weight as it is (the straight-through estimator of torchao's float8 all-gather);
  gradients reduce-scatter in ``reduce_dtype`` into the fp32 master as usual.

Bytes per element gathered: 1 + 4/K ("fp8") or 1 + 1/32 ("mxfp8"), against 2 for bf16.

Limits (checked on every rank before any collective, see :func:`check_quantized_all_gather`): 2-D
``nn.Linear`` weights of at least ``min_numel`` elements; their rows must split evenly over the shard group
(FSDP2 pads uneven shards, and its extension API then admits only all-gather inputs of exactly the padded
shard's shape, leaving no room for the scales); "mxfp8" also needs K divisible by 32, so every block is
whole. Other parameters keep FSDP's own all-gather.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from gem_precision import MXTensor
from gem_precision.packed import dequantize_packed, quantize_packed, quantize_packed_many

__all__ = [
    "MX_BLOCK",
    "QUANTIZED_FORMATS",
    "AllGatherRound",
    "QuantizedAllGatherWeight",
    "check_quantized_all_gather",
    "enable_quantized_all_gather",
    "group_quantized_all_gather",
    "quantized_all_gather_targets",
]

QUANTIZED_FORMATS = ("fp8", "mxfp8")
MX_BLOCK = 32
_E4M3 = torch.float8_e4m3fn

# FSDP2 builds the sharded and padded local tensor with these ops; they must return the subclass so the
# shard FSDP all-gathers from still carries the extension points (the ops torchao preserves, too).
_PRESERVE = {
    torch.ops.aten.empty_like.default,
    torch.ops.aten.new_zeros.default,
    torch.ops.aten.slice.Tensor,
    torch.ops.aten.copy_.default,
    torch.ops.aten.view.default,
    torch.ops.aten.as_strided.default,
    torch.ops.aten._to_copy.default,
    torch.ops.aten._pin_memory.default,
    torch.ops.aten.split.Tensor,
    torch.ops.aten.clone.default,
}


class QuantizedAllGatherWeight(torch.Tensor):
    """A weight (or a shard of it) whose FSDP2 all-gather moves 8-bit payloads.

    Wraps a plain tensor ``_tensor`` (the fp32 master data); every op but FSDP's sharding ops sees the
    plain tensor, so optimizers and ``state_dict`` work as for the bare parameter.

    Args:
        tensor: the weight ``[N, K]`` (or its local shard).
        fmt: "fp8" (row-wise scales) or "mxfp8" (32-element blocks along K).
        round_: the :class:`AllGatherRound` of the shard's FSDP unit (kept by the tensors FSDP derives from
            this one); without one, each shard is quantized in its own launch.
    """

    _tensor: torch.Tensor
    _fmt: str
    _round: AllGatherRound | None

    @staticmethod
    def __new__(
        cls, tensor: torch.Tensor, fmt: str, round_: AllGatherRound | None = None
    ) -> QuantizedAllGatherWeight:
        return torch.Tensor._make_wrapper_subclass(
            cls, tensor.size(), strides=tensor.stride(), storage_offset=tensor.storage_offset(),
            dtype=tensor.dtype, layout=tensor.layout, device=tensor.device,
            requires_grad=tensor.requires_grad,
        )  # fmt: skip

    def __init__(self, tensor: torch.Tensor, fmt: str, round_: AllGatherRound | None = None) -> None:
        if fmt not in QUANTIZED_FORMATS:
            raise ValueError(f"QuantizedAllGatherWeight: fmt must be one of {QUANTIZED_FORMATS}, got {fmt!r}")
        self._tensor = tensor
        self._fmt = fmt
        self._round = round_

    # Tensor.__repr__ also takes a keyword tensor_contents, which this wrapper's repr has no use for.
    def __repr__(self) -> str:  # type: ignore[override]
        return f"QuantizedAllGatherWeight(fmt={self._fmt}, tensor={self._tensor})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[override]
        # (torch's stub for Tensor.__torch_dispatch__ leaves out ``func``: it types the disabled default.)
        first = next(a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, cls))
        fmt, round_ = first._fmt, first._round
        if func is torch.ops.aten.detach.default:
            return cls(args[0]._tensor.detach(), fmt, round_)
        args, kwargs = pytree.tree_map_only(cls, lambda t: t._tensor, (args, kwargs or {}))
        out = func(*args, **kwargs)
        if func not in _PRESERVE:
            return out
        return pytree.tree_map_only(torch.Tensor, lambda t: cls(t, fmt, round_), out)

    def __tensor_flatten__(self):
        return ["_tensor"], self._fmt

    @staticmethod
    def __tensor_unflatten__(inner_tensors, fmt, outer_size, outer_stride):
        return QuantizedAllGatherWeight(inner_tensors["_tensor"], fmt)

    # -- FSDP2 extension points ---------------------------------------------------------------------------

    def fsdp_pre_all_gather(
        self, mesh: Any, outer_size: Any, outer_stride: Any, module: nn.Module, mp_policy: Any
    ) -> tuple[tuple[torch.Tensor, ...], None]:
        """Quantize this rank's shard ``[r, K]`` into one ``uint8 [r, K + s]`` all-gather input: each row's
        K E4M3 bytes followed by its ``s`` scale bytes (fp32 row scale: ``s = 4``; E8M0 block scales:
        ``s = K / 32``), gem-precision's packed rows (one Triton launch on CUDA). One input keeps rows and
        their scales together, whatever FSDP2's path (its one-rank path copies a single input). With a round,
        the unit's shards are quantized together (:class:`AllGatherRound`)."""
        if self._round is not None:
            return (self._round.quantize(self),), None
        return (quantize_packed(self._tensor, self._fmt),), None

    def fsdp_post_all_gather(
        self,
        all_gather_outputs: tuple[torch.Tensor, ...],
        metadata: Any,
        param_dtype: torch.dtype,
        *,
        out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None:
        """Dequantize the gathered rows ``uint8 [N, K + s]`` into the unsharded weight ``[N, K]`` of
        ``param_dtype`` (written into ``out`` when FSDP reuses its buffer: one launch on CUDA)."""
        (packed,) = all_gather_outputs
        k = self.shape[1]
        if out is not None:
            # FSDP re-gathers into the buffer backward saved from forward: the same values, so the
            # version counter must not move (as FSDP2's own copy-out does).
            with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(out):
                dequantize_packed(packed, k, self._fmt, out=out)
            return None
        weight = dequantize_packed(packed, k, self._fmt, param_dtype)
        return weight, (weight,)


class AllGatherRound:
    """The wrapped shards of one FSDP unit, quantized together: one launch per all-gather round.

    FSDP2 calls ``fsdp_pre_all_gather`` for every parameter of a unit in one loop before it copies their
    inputs into one all-gather buffer; nothing writes the shards in between. So the unit's first call of a
    round quantizes every member (:func:`gem_precision.packed.quantize_packed_many`) and keeps the others'
    rows until they are asked for. A shard asked for twice starts a new round, whose members are the shards
    the last round served (so a shard FSDP re-creates, e.g. after loading a state dict, takes its place).
    Kept rows are handed out only to the same shard at the same version counter (an in-place write in between
    would bump it), and are dropped when the next round starts.

    Attributes:
        fmt: "fp8" or "mxfp8".
        batches: quantize launches (calls of ``quantize_packed_many``) so far: one per round once the
            members are known.
    """

    def __init__(self, fmt: str) -> None:
        self.fmt = fmt
        self.batches = 0
        self._members: list[weakref.ref[QuantizedAllGatherWeight]] = []
        self._served: list[weakref.ref[QuantizedAllGatherWeight]] = []
        self._kept: dict[int, tuple[weakref.ref[QuantizedAllGatherWeight], int, torch.Tensor]] = {}

    def add(self, shard: QuantizedAllGatherWeight) -> None:
        """Make ``shard`` a member (it joins this round's batch)."""
        self._members.append(weakref.ref(shard))

    def quantize(self, shard: QuantizedAllGatherWeight) -> torch.Tensor:
        """``quantize_packed(shard._tensor, fmt)``: from this round's batch, or a new batch of ``shard`` and
        every member not yet served this round."""
        if any(ref() is shard for ref in self._served):
            self._members, self._served, self._kept = self._served, [], {}
        self._served.append(weakref.ref(shard))
        kept = self._kept.pop(id(shard), None)
        if kept is not None and kept[0]() is shard and kept[1] == shard._tensor._version:
            return kept[2]
        served = {id(ref()) for ref in self._served}
        # A member left on another device (the meta one FSDP replaced) is not this round's.
        device = shard._tensor.device
        others = [
            m
            for ref in self._members
            if (m := ref()) is not None and id(m) not in served and m._tensor.device == device
        ]
        packed = quantize_packed_many([shard._tensor, *(m._tensor for m in others)], self.fmt)
        self.batches += 1
        for m, rows in zip(others, packed[1:]):
            self._kept[id(m)] = (weakref.ref(m), m._tensor._version, rows)
        return packed[0]


def _unit_parameters(unit: nn.Module) -> list[nn.Parameter]:
    """The parameters FSDP unit ``unit`` manages: its own and its submodules', not those of nested units."""
    params = list(unit.parameters(recurse=False))
    for child in unit.children():
        if not isinstance(child, FSDPModule):
            params += _unit_parameters(child)
    return params


def group_quantized_all_gather(model: nn.Module) -> list[AllGatherRound]:
    """Give the wrapped shards of each FSDP unit of ``model`` one :class:`AllGatherRound` (call after
    ``fully_shard``); returns the rounds (a unit with no wrapped weight has none)."""
    rounds = []
    for unit in model.modules():
        if not isinstance(unit, FSDPModule):
            continue
        # The DTensor's own local tensor: the object FSDP2 calls the extension points on (``to_local()``
        # returns a new alias of it).
        locals_ = [p._local_tensor if isinstance(p, DTensor) else p for p in _unit_parameters(unit)]
        shards = [t for t in locals_ if isinstance(t, QuantizedAllGatherWeight)]
        for fmt in dict.fromkeys(t._fmt for t in shards):
            round_ = AllGatherRound(fmt)
            for shard in shards:
                if shard._fmt == fmt:
                    shard._round = round_
                    round_.add(shard)
            rounds.append(round_)
    return rounds


def dequantize_gathered(
    data: torch.Tensor, scale: torch.Tensor, fmt: str, dtype: torch.dtype
) -> torch.Tensor:
    """The weight ``[N, K]`` of ``dtype`` from E4M3 bytes ``data [N, K]`` uint8 and ``scale`` (fp32
    ``[N, 1]`` for "fp8", uint8 E8M0 ``[N, K/32]`` for "mxfp8"): what :meth:`QuantizedAllGatherWeight.
    fsdp_post_all_gather` gives for those rows (a test oracle, from the unpacked quantizer outputs)."""
    values = data.view(_E4M3)
    if fmt == "fp8":
        return (values.to(torch.float32) * scale).to(dtype)
    return MXTensor(values, scale, MX_BLOCK, 1, torch.float32).dequantize(dtype)


def quantized_all_gather_targets(
    model: nn.Module, min_numel: int, ignored: set[nn.Parameter] | None = None
) -> list[tuple[str, nn.Linear]]:
    """``(name, linear)`` of the linear layers whose weight gets the 8-bit all-gather: 2-D weights of at
    least ``min_numel`` elements, outside ``ignored``."""
    ignored = ignored or set()
    return [
        (name, m)
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear)
        and m.weight.dim() == 2
        and m.weight.numel() >= min_numel
        and m.weight not in ignored
    ]


def check_quantized_all_gather(
    targets: list[tuple[str, nn.Linear]], fmt: str, shard_sizes: dict[str, int]
) -> None:
    """Raises ``ValueError`` naming the first weight that cannot take the ``fmt`` all-gather.

    Args:
        targets: from :func:`quantized_all_gather_targets`.
        fmt: "fp8" or "mxfp8".
        shard_sizes: FSDP shard-group size per target name (experts shard over fewer ranks).
    """
    if fmt not in QUANTIZED_FORMATS:
        raise ValueError(f"all_gather must be one of {QUANTIZED_FORMATS} here, got {fmt!r}")
    for name, linear in targets:
        n, k = linear.weight.shape
        shards = shard_sizes[name]
        if n % shards:
            raise ValueError(
                f"all_gather={fmt!r}: {name}.weight [{n}, {k}] has {n} rows, which do not split evenly over "
                f"the {shards} ranks of its FSDP shard group (an unevenly sharded weight cannot carry its "
                "scales through FSDP2's all-gather); raise all_gather_min_numel above "
                f"{linear.weight.numel()} to keep it in FSDP's own all-gather"
            )
        if fmt == "mxfp8" and k % MX_BLOCK:
            raise ValueError(
                f"all_gather='mxfp8': {name}.weight [{n}, {k}] cannot be cut into whole {MX_BLOCK}-element "
                f"MX blocks along K={k}; raise all_gather_min_numel above {linear.weight.numel()} "
                "or use 'fp8'"
            )


def enable_quantized_all_gather(targets: list[tuple[str, nn.Linear]], fmt: str) -> None:
    """Wrap each target's weight in :class:`QuantizedAllGatherWeight` (in place; call before ``fully_shard``
    and after :func:`check_quantized_all_gather`)."""
    for _, linear in targets:
        w = linear.weight
        linear.weight = nn.Parameter(QuantizedAllGatherWeight(w.data, fmt), requires_grad=w.requires_grad)
