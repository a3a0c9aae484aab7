"""``CollectiveBytes``: count the bytes that collectives really move, by kind, as they are issued.

A ``TorchDispatchMode`` that sees every c10d collective op (the ones FSDP2 calls through
``torch.distributed`` and the functional collectives of expert parallelism), like torch's own
``CommDebugMode``, which counts calls but not bytes. Counted per rank:

- all-gather: bytes of the gathered output (group size x input);
- reduce-scatter: bytes of the input (group size x output);
- all-reduce / all-to-all / broadcast: bytes of the tensors.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["CollectiveBytes"]


def _nbytes(tensors: object) -> int:
    if isinstance(tensors, torch.Tensor):
        return tensors.numel() * tensors.element_size()
    if isinstance(tensors, list | tuple):
        return sum(_nbytes(t) for t in tensors)
    return 0


def _op_table() -> dict:
    c10d, fn = torch.ops.c10d, torch.ops._c10d_functional
    # op -> (kind, which argument holds the counted tensors)
    table = {
        c10d._allgather_base_.default: ("all_gather", 0),
        c10d.allgather_.default: ("all_gather", 0),
        c10d.allgather_into_tensor_coalesced_.default: ("all_gather", 0),
        c10d._reduce_scatter_base_.default: ("reduce_scatter", 1),
        c10d.reduce_scatter_.default: ("reduce_scatter", 1),
        c10d.reduce_scatter_tensor_coalesced_.default: ("reduce_scatter", 1),
        c10d.allreduce_.default: ("all_reduce", 0),
        c10d.allreduce_coalesced_.default: ("all_reduce", 0),
        c10d.alltoall_base_.default: ("all_to_all", 1),
        c10d.broadcast_.default: ("broadcast", 0),
        fn.all_gather_into_tensor.default: ("all_gather", None),  # counted on the output
        fn.reduce_scatter_tensor.default: ("reduce_scatter", 0),
        fn.all_reduce.default: ("all_reduce", 0),
        fn.all_to_all_single.default: ("all_to_all", 0),
    }
    return table


class CollectiveBytes(TorchDispatchMode):
    """Context manager: ``with CollectiveBytes() as cb: step(); cb.bytes["all_gather"]``.

    Attributes:
        bytes: kind -> bytes issued by this rank inside the context.
        calls: kind -> number of collective calls.
    """

    def __init__(self) -> None:
        super().__init__()
        self.bytes: dict[str, int] = defaultdict(int)
        self.calls: dict[str, int] = defaultdict(int)
        self._table = _op_table()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        entry = self._table.get(func)
        if entry is not None:
            kind, arg = entry
            self.bytes[kind] += _nbytes(out if arg is None else args[arg])
            self.calls[kind] += 1
        return out
