"""Row-chunked CPU inference (:mod:`gem_model.rowwise`): when it chunks, that a chunked chain gives each row
what the whole-tensor call gives, and that the whole model's inference forward with tiny chunks (chunk edges
inside sequences, a last partial chunk) equals the unchunked one.

Tolerance: each row goes through the same kernels with the same reduction length either way, so the values
agree to float32 rounding; a GEMM library may block a short chunk differently from the whole tensor, which
moves an output by a few ulps: atol 1e-6 on O(1) logits, rtol 1e-5 on activations."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

import gem_model as gm
import gem_model.rowwise as rowwise_module
from gem_model import GemModel
from gem_model.rowwise import chunks_rows, rowwise


@pytest.fixture
def chunk_of(monkeypatch):
    """Set :data:`gem_model.rowwise.ROW_CHUNK` for one test."""

    def set_chunk(rows: int) -> None:
        monkeypatch.setattr(rowwise_module, "ROW_CHUNK", rows)

    return set_chunk


def test_chunks_only_large_cpu_tensors_without_autograd(chunk_of):
    chunk_of(8)
    big, small = torch.zeros(9, 3), torch.zeros(8, 3)
    with torch.no_grad():
        assert chunks_rows(big) and not chunks_rows(small)
    with torch.inference_mode():
        assert chunks_rows(big)
    assert not chunks_rows(big)  # autograd on: the graph stays whole
    if torch.cuda.is_available():
        with torch.no_grad():
            assert not chunks_rows(big.cuda())


@pytest.mark.parametrize("rows", (1, 7, 8, 9, 23))
def test_rowwise_matches_the_whole_call(chunk_of, rows):
    """Two inputs, two outputs of other widths and dtypes, row counts around the chunk (8)."""
    chunk_of(8)
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 5, generator=g)
    y = torch.randn(rows, 3, 2, generator=g)
    w = torch.randn(6, 5, generator=g)

    def chain(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = F.silu(F.linear(a, w))
        return h * b.sum((1, 2), keepdim=True).squeeze(-1), (b * 2).to(torch.float64)

    whole = chain(x, y)
    calls = []

    def counted(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append(a.shape[0])
        return chain(a, b)

    with torch.no_grad():
        got = rowwise(counted, x, y)
    assert calls == ([8] * (rows // 8) + ([rows % 8] if rows % 8 else []) if rows > 8 else [rows])
    for a, b in zip(got, whole, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_rowwise_refuses_inputs_of_different_rows():
    with pytest.raises(ValueError, match="rows"):
        rowwise(lambda a, b: (a,), torch.zeros(4, 2), torch.zeros(5, 2))


def _inference_logits(model: GemModel, batch: gm.GemBatch) -> dict[str, torch.Tensor]:
    with torch.inference_mode():
        return {k: v.clone() for k, v in model(batch).items()}


@pytest.mark.parametrize("kinds", (("full", "window"), ("block", "full")))
def test_model_inference_with_tiny_chunks_equals_unchunked(chunk_of, monkeypatch, kinds):
    """Chunks of 13 rows cut every history mid-sequence: the self-attention, cross-attention and PMA
    projections and the FFN block are chunked; attention itself never is. Ragged lengths with empty
    histories; both the rotary path and the block kernel (which rotates inside)."""
    config = dataclasses.replace(gm.get_config("tiny"), attention=kinds)
    torch.manual_seed(0)
    model = GemModel(config).eval()
    batch = gm.random_batch(config.features, 9, seed=3, empty_fraction=0.2)
    assert batch.sequences[config.features.sequences[0].name].item_ids.numel() > 3 * 13
    chunk_of(1 << 30)
    whole = _inference_logits(model, batch)
    chunk_of(13)
    decisions: list[bool] = []
    decide = rowwise_module.chunks_rows
    monkeypatch.setattr(rowwise_module, "chunks_rows", lambda x: decisions.append(decide(x)) or decisions[-1])
    chunked = _inference_logits(model, batch)
    # per layer: the self-attention, cross-attention and PMA projections and the FFN block; the final PMA
    assert decisions == [True] * (4 * config.n_layers + 1)
    for task in whole:
        torch.testing.assert_close(chunked[task], whole[task], rtol=1e-5, atol=1e-6)
    with torch.no_grad():  # autograd off but not inference mode: chunked too, the same values
        for task, logits in model(batch).items():
            torch.testing.assert_close(logits, whole[task], rtol=1e-5, atol=1e-6)
