"""Shared pieces of the sparse tests: the toy model's tables with a fixed readout, ragged batches, unsharded
references (row-wise Adagrad in plain PyTorch)."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from gem_parallel.testing.toy_model import ToyEmbeddings

DIM = 8
# Features (key, rows), tables t_<key>: t_a is over half the tables' bytes (row-wise on 2 ranks), t_s over a
# quarter (row-wise on 4).
BAG_FEATURES = (("a", 45), ("b", 7))
SEQ_FEATURES = (("s", 29), ("t", 5))
BAG_TABLES = tuple((f"t_{k}", r) for k, r in BAG_FEATURES)
SEQ_TABLES = tuple((f"t_{k}", r) for k, r in SEQ_FEATURES)
BAG_KEYS = tuple(k for k, _ in BAG_FEATURES)
SEQ_KEYS = tuple(k for k, _ in SEQ_FEATURES)


class ToyModel(nn.Module):
    """The toy model's tables (``gem_parallel.testing.toy_model.ToyEmbeddings``) plus a fixed readout:
    loss = sum(tanh(pooled) * u) + sum_k sum(tanh(seq_k) * v_k)."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.embeddings = ToyEmbeddings(BAG_FEATURES, SEQ_FEATURES, DIM)
        for p in self.embeddings.parameters():
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        self.register_buffer("u", torch.randn(len(BAG_KEYS) * DIM, generator=g))
        self.register_buffer("v", torch.randn(len(SEQ_KEYS), DIM, generator=g))

    def loss(self, bags: KeyedJaggedTensor, seqs: KeyedJaggedTensor) -> Tensor:
        pooled, per_key = self.embeddings(bags, seqs)
        out = (torch.tanh(pooled.flatten(1)) * self.u).sum()
        for i, k in enumerate(SEQ_KEYS):
            out = out + (torch.tanh(per_key[k]) * self.v[i]).sum()
        return out


def _kjt(
    keys: tuple[str, ...], rows: list[int], batch: int, g: torch.Generator, max_len: int
) -> KeyedJaggedTensor:
    lengths = torch.randint(0, max_len + 1, (len(keys), batch), generator=g)
    lengths[0, 0] = 0  # an empty bag / sequence every batch
    lengths[-1, -1] = 1
    values = torch.cat(
        [torch.randint(0, r, (int(lengths[i].sum()),), generator=g) for i, r in enumerate(rows)]
    )
    return KeyedJaggedTensor(keys=list(keys), values=values, lengths=lengths.reshape(-1))


def rank_batch(
    step: int, rank: int, batch: int = 3, seed: int = 0
) -> tuple[KeyedJaggedTensor, KeyedJaggedTensor]:
    """The (bags, sequences) KJTs of ``rank`` at ``step``: ragged lengths 0..3 and 0..4, fresh each call."""
    g = torch.Generator().manual_seed(1000 * seed + 97 * step + rank)
    return (
        _kjt(BAG_KEYS, [r for _, r in BAG_TABLES], batch, g, 3),
        _kjt(SEQ_KEYS, [r for _, r in SEQ_TABLES], batch, g, 4),
    )


def concat(kjts: list[KeyedJaggedTensor]) -> KeyedJaggedTensor:
    """The KJTs of several ranks as one batch (per key, the ranks' samples in rank order)."""
    keys = kjts[0].keys()
    values, lengths = [], []
    for k in keys:
        for kjt in kjts:
            values.append(kjt[k].values())
            lengths.append(kjt[k].lengths())
    return KeyedJaggedTensor(keys=keys, values=torch.cat(values), lengths=torch.cat(lengths))


def table_weights(model: nn.Module) -> dict[str, Tensor]:
    """Unsharded tables by name (plain module)."""
    e = model.embeddings
    out = {n: e.bags.embedding_bags[n].weight.detach().clone() for n, _ in BAG_TABLES}
    out.update({n: e.sequences.embeddings[n].weight.detach().clone() for n, _ in SEQ_TABLES})
    return out


def _whole(entries: dict[str, object], shapes: dict[str, tuple[int, ...]], group) -> dict[str, Tensor]:
    """Whole tensors from this rank's shards (``local_pieces``), summed over the sharding ``group`` (each
    element lives on exactly one rank of it). Collective: every rank of the group, the same names."""
    import torch.distributed as dist

    from gem_parallel.sparse.shard import local_pieces

    out = {}
    for name in sorted(shapes):
        full = torch.zeros(shapes[name])
        entry = entries.get(name)
        for offsets, piece in local_pieces(entry) if entry is not None else []:  # type: ignore[arg-type]
            full[tuple(slice(o, o + n) for o, n in zip(offsets, piece.shape))] += piece
        dist.all_reduce(full, group=group)
        out[name] = full
    return out


def _shapes() -> dict[str, tuple[int, ...]]:
    return {n: (r, DIM) for n, r in BAG_TABLES + SEQ_TABLES}


def sharded_table_weights(model: nn.Module, group) -> dict[str, Tensor]:
    """Every table as one whole tensor from a sharded model (collective over the sharding group)."""
    sd = model.embeddings.state_dict()
    return _whole({k.split(".")[-2]: v for k, v in sd.items()}, _shapes(), group)


def sharded_state(model: nn.Module, group) -> dict[str, Tensor]:
    """Row-wise Adagrad accumulators of a sharded model, whole, per table name (collective over the group)."""
    from gem_parallel.sparse import sparse_sharding

    sd = sparse_sharding(model).fused_optimizer.state_dict()["state"]
    mine = {kk.split(".")[0]: st for s in sd.values() for kk, st in s.items()}
    return _whole(mine, {n: (r,) for n, (r, _) in _shapes().items()}, group)


class RowWiseAdagrad:
    """Exact row-wise Adagrad on whole tables with dense gradients, the reference of fbgemm's fused
    ``EXACT_ROWWISE_ADAGRAD``: for a table ``W [rows, dim]`` with gradient ``G``, ``s_r += mean_j G_rj^2`` and
    ``W_r -= lr * G_r / (sqrt(s_r) + eps)``. A row no batch looked up has a zero gradient and stays
    bit-identical. ``state[p]["sum"]`` is the fp32 accumulator ``[rows]``."""

    def __init__(self, params, lr: float, eps: float) -> None:
        self.params, self.lr, self.eps = list(params), lr, eps
        self.state = {p: {"sum": torch.zeros(p.shape[0], dtype=torch.float32)} for p in self.params}

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        for p in self.params:
            if p.grad is None:
                continue
            g = p.grad.float()
            acc = self.state[p]["sum"]
            acc.add_(g.square().mean(dim=1))
            p.sub_((self.lr * g / (acc.sqrt() + self.eps)[:, None]).to(p.dtype))


def reference_run(
    world: int, replicas: int, sync_every: int, steps: int, lr: float, eps: float
) -> dict[str, object]:
    """The unsharded run the sharded one must equal, with the dense-gradient :class:`RowWiseAdagrad`.

    Replica ``r`` is the sharding group of ranks ``[r, R + r, ...]``: its tables take, each step, the mean
    loss of those ranks' batches (TorchRec divides the gradient by the group size, as DDP averages), and
    every ``sync_every`` steps the replicas' weights and accumulators are averaged. ``replicas=1`` is 1D.

    Returns ``losses[step][rank]`` (before that step's update), ``tables[r]`` / ``state[r]`` (per table
    name) after the last step, ``touched[r]`` (rows each replica's batches looked up) and the initial tables.
    """
    models = [ToyModel() for _ in range(replicas)]
    opts = [RowWiseAdagrad(m.embeddings.parameters(), lr=lr, eps=eps) for m in models]
    names = {id(p): n.split(".")[-2] for n, p in models[0].embeddings.named_parameters()}
    initial = table_weights(models[0])
    losses: list[list[float]] = []
    touched: list[dict[str, set[int]]] = [{n: set() for n in initial} for _ in range(replicas)]
    for step in range(steps):
        row = [0.0] * world
        for r, (m, opt) in enumerate(zip(models, opts)):
            opt.zero_grad()
            total = torch.zeros(())
            for rank in range(r, world, replicas):
                bags, seqs = rank_batch(step, rank)
                for kjt, tables in ((bags, BAG_TABLES), (seqs, SEQ_TABLES)):
                    for k, (n, _) in zip(kjt.keys(), tables):
                        touched[r][n].update(kjt[k].values().tolist())
                loss = m.loss(bags, seqs)
                row[rank] = float(loss)
                total = total + loss
            (total / (world // replicas)).backward()
            opt.step()
        losses.append(row)
        if replicas > 1 and (step + 1) % sync_every == 0:
            with torch.no_grad():
                for ps in zip(*(m.embeddings.parameters() for m in models)):
                    mean = torch.stack([p for p in ps]).mean(0)
                    accs = [opt.state[p]["sum"] for opt, p in zip(opts, ps)]
                    acc_mean = torch.stack(accs).mean(0)
                    for p, a in zip(ps, accs):
                        p.copy_(mean)
                        a.copy_(acc_mean)
    state = [
        {
            names[id(p0)]: opt.state[p]["sum"].clone()
            for p0, p in zip(models[0].embeddings.parameters(), m.embeddings.parameters())
        }
        for m, opt in zip(models, opts)
    ]
    tables = [table_weights(m) for m in models]
    return {"losses": losses, "tables": tables, "state": state, "touched": touched, "initial": initial}
