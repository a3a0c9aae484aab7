"""Smoke tests of one installed gem package, run inside the fresh environment tools/check_install.py made.

Usage: ``python tools/install_smoke.py PACKAGE`` (e.g. ``gem-kernels``). Each check uses only the package's
public API and what it declares, and fails loudly (AssertionError, non-zero exit) on a wrong result.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import Tensor


def _naive_attention(q: Tensor, k: Tensor, v: Tensor, offsets: Tensor, causal: bool) -> Tensor:
    """Per-sequence softmax attention in plain PyTorch: the oracle of the gem-kernels check."""
    import torch

    out = []
    for b in range(len(offsets) - 1):
        s, e = int(offsets[b]), int(offsets[b + 1])
        qs, ks, vs = q[s:e].transpose(0, 1), k[s:e].transpose(0, 1), v[s:e].transpose(0, 1)  # [H, L, D]
        scores = qs @ ks.transpose(1, 2) * q.shape[-1] ** -0.5
        if causal:
            scores = scores.masked_fill(torch.ones(e - s, e - s, dtype=torch.bool).triu(1), float("-inf"))
        out.append((scores.softmax(-1) @ vs).transpose(0, 1))
    return torch.cat(out)


def gem_kernels() -> None:
    import torch

    import gem_kernels

    torch.manual_seed(0)
    offsets = torch.tensor([0, 3, 3, 8, 9])  # ragged, with an empty and a length-1 sequence
    q, k, v = (torch.randn(9, 2, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    out = gem_kernels.jagged_flash_attention(q, k, v, offsets, max_q_len=5, causal=True)
    want = _naive_attention(q, k, v, offsets, causal=True)
    # fp64 on both sides: agreement to rounding (1e-12 is ~1e4 ulps of headroom for the softmax sums).
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    ref = torch.autograd.grad(want, (q, k, v), grad)
    for g, r in zip(got, ref, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-10)
    assert float(got[0].abs().sum()) > 0
    print("gem-kernels: jagged_flash_attention forward/backward match a per-sequence softmax in fp64")


def gem_precision() -> None:
    import torch

    from gem_precision import to_mx

    torch.manual_seed(0)
    x = torch.randn(4, 96) * torch.logspace(-3, 3, 96)  # blocks of very different magnitudes
    x[0, :32] = 0.0  # an all-zero block
    mx = to_mx(x)  # E4M3 elements, one E8M0 scale per 32 along the last dim
    assert mx.data.dtype == torch.float8_e4m3fn and mx.scale.shape == (4, 3)
    back = mx.dequantize()
    assert back.dtype == x.dtype and bool((back[0, :32] == 0).all())
    # E4M3 keeps 3 mantissa bits: a normal element is off by at most half a step, 2**-4 of itself.
    normal = back.abs() >= mx.dequantize(torch.float32).abs().amax() * 2.0**-20
    err = (back - x).abs()[normal] / x.abs()[normal]
    assert float(err.max()) <= 2.0**-4, float(err.max())
    again = to_mx(back)  # the dequantized values are representable: quantizing them is exact
    assert torch.equal(again.scale, mx.scale)
    assert torch.equal(again.data.view(torch.uint8), mx.data.view(torch.uint8))
    print(f"gem-precision: to_mx round trip within 2**-4 (max {float(err.max()):.4f}), re-quantization exact")


def gem_parallel() -> None:
    import torch
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor

    import gem_parallel
    import gem_parallel._stack  # what gem-parallel's TorchRec code imports first

    dims = gem_parallel.ParallelDims(world_size=1)
    assert dims.world_size == 1
    # fbgemm's CPU kernels are loaded: a TorchRec bag collection runs and sums the right rows.
    ebc = EmbeddingBagCollection(
        tables=[EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=10, feature_names=["f"])]
    )
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=["f"], values=torch.tensor([1, 2, 3]), lengths=torch.tensor([2, 0, 1])
    )
    pooled = ebc(kjt)["f"]
    weight = ebc.embedding_bags["t"].weight
    torch.testing.assert_close(pooled[0], weight[1] + weight[2])
    assert bool((pooled[1] == 0).all())
    print("gem-parallel: ParallelDims and a TorchRec EmbeddingBagCollection on fbgemm's CPU kernels")


def gem_model() -> None:
    import torch

    import gem_model as gm

    config = gm.get_config("tiny")
    torch.manual_seed(0)
    model = gm.GemModel(config)
    batch = gm.random_batch(config.features, 4, seed=0)
    logits = model(batch)
    assert set(logits) == set(config.features.tasks)
    assert all(v.shape == (4,) and bool(torch.isfinite(v).all()) for v in logits.values())
    loss = gm.multitask_loss(logits, batch)[0]
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(g is not None and bool(torch.isfinite(g).all()) for g in grads)
    assert sum(float(g.abs().sum()) for g in grads if g is not None) > 0
    print(f"gem-model: tiny GemModel forward/backward, loss {float(loss):.4f}, {len(grads)} gradients")


def gem_train() -> None:
    exe = Path(sys.executable).with_name("gem-train")
    out = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=120, check=True).stdout
    assert "train" in out and "eval" in out, out
    with tempfile.TemporaryDirectory() as tmp:
        args = [
            f"run.out_dir={tmp}",
            "train.steps=5",
            "train.progress_bar=false",
            "data.synthetic.eval_examples=512",
            "data.synthetic.valid_examples=512",
        ]
        proc = subprocess.run([exe, "train", *args], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert list(Path(tmp).glob("*/metrics.jsonl")), list(Path(tmp).iterdir())
    print("gem-train: --help and a 5-step train on the synthetic data")


CHECKS = {
    f.__name__.replace("_", "-"): f for f in (gem_kernels, gem_precision, gem_parallel, gem_model, gem_train)
}


def main(pkg: str) -> None:
    module = __import__(pkg.replace("-", "_"))
    # The package under test is the installed wheel, not a source tree that happens to be on the path.
    assert module.__file__.startswith(sys.prefix), f"{pkg} imported from {module.__file__}, not {sys.prefix}"
    CHECKS[pkg]()


if __name__ == "__main__":
    main(sys.argv[1])
