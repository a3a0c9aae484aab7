"""The torch and TorchRec warnings a gem-train run would print that say nothing about the run, filtered.

Each is raised by library code we do not own about library code we do not own, or (FSDP2's view warning for
the embeddings unit) was checked and costs more to silence at its cause than it is worth; the ones whose cause
was ours are fixed there instead (FSDP2's "returned a view tensor" for the whole model: the task heads return
tensors of their own, gem-model; "Slicing a flattened dim from root mesh": gem-parallel keeps its flattened
mesh; the deprecated c10d names in gem-parallel; torchrun's ``OMP_NUM_THREADS`` banner: ``gem-train launch``
sets the variable as torchrun would). gem-train's docs/reliability.md, "Known warnings", lists them. Only
exact messages are filtered, so a new warning still shows.
"""

from __future__ import annotations

import logging
import warnings

__all__ = ["FILTERED_WARNINGS", "filter_known_warnings"]

# (category, message regex, why it is not ours to fix)
FILTERED_WARNINGS: tuple[tuple[type[Warning], str, str], ...] = (
    (
        UserWarning,
        r"torch\.distributed is disabled, unavailable or uninitialized",
        "DCP on one process says it assumes one process: that is the intent",
    ),
    (
        FutureWarning,
        r"`torch\.distributed\.(reduce_scatter_tensor|all_gather_into_tensor)` is deprecated",
        "TorchRec's sharded-embedding collectives (torchrec.distributed.comm_ops) call torch's older names",
    ),
    (
        FutureWarning,
        r"Please use DTensor instead and we are deprecating ShardedTensor",
        "TorchRec's sharded tables are ShardedTensors; DCP warns each time it plans to save or load one",
    ),
    (
        UserWarning,
        r"FSDP2-wrapped module \(FSDPGemEmbeddings\) returned a view tensor",
        "with FSDP owning the tables, the embeddings' outputs are views of the lookups' (a copy would cost a "
        "pass over every history event's embedding); nothing writes into them, and the gradients equal one "
        "process's (gem-train tests/test_train_fsdp_outputs.py)",
    ),
)

# torch logs this (once per process) from torch.fx's ProxyableClassMeta, which TorchRec's KeyedJaggedTensor
# uses: torch's own class calls its own deprecated is_fx_tracing() each time a KeyedJaggedTensor is built.
_FX_LOGGER = "torch.fx._symbolic_trace"
_FX_MESSAGE = "is_fx_tracing will return true for both fx.symbolic_trace and torch.export"


class _DropMessage(logging.Filter):
    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)


def filter_known_warnings() -> None:
    """Install the filters in this process (its DataLoader workers inherit them); idempotent."""
    for category, message, _why in FILTERED_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)
    fx = logging.getLogger(_FX_LOGGER)
    if not any(isinstance(f, _DropMessage) for f in fx.filters):
        fx.addFilter(_DropMessage(_FX_MESSAGE))
