"""``large-h200``: gem-model's ``large`` trunk on one GPU. It loads, its model is the large trunk's width,
and a simple count of its memory fits one 80 GB GPU.

The count (bytes, one GPU, no activation checkpointing):

- states: dense parameters x 16 (fp32 weight, fp32 gradient, AdamW's two fp32 moments), table parameters x 8
  (fp32 weight, dense fp32 gradient) + 4 per table row (row-wise Adagrad); exact, from the model built on
  the meta device;
- activations: ``A x tokens x layers x d_model`` bytes, with ``A`` (bytes per history event, layer and unit of
  width) calibrated on base-h200's measured peak (38.8 GiB, compiled bf16, gem-train BENCHMARKS.md third
  session) less base-h200's states. Both configs keep the same shape ratios (attention width = d_model,
  SwiGLU hidden = 4 d_model, head_dim 128), so what a layer saves per event scales with d_model. ``A`` is
  taken at base-h200's *mean* event count while its peak came from its largest batch, so ``A`` is an
  overestimate; large-h200 is counted at the largest batch of a sample of its own, plus 10%.

The per-event sequence layers dominate both configs (tens of thousands of events against a few hundred
users' tokens), so the example-level activations are inside the calibration. The GPU run measures the peak
(``bench_speed.py`` reports it); this test is the budget it must stay under.
"""

from __future__ import annotations

import dataclasses

import pytest
from torch import nn

import gem_model
from gem_train.config import load_config
from gem_train.data.synthetic import SyntheticAds
from gem_train.loop.model import build_gem_config

GB = 1e9
BASE_H200_PEAK = 38.8 * 2**30  # bytes: measured (H200, compiled bf16, batch 512; BENCHMARKS.md)
GPU_BYTES = 80 * GB
HEADROOM = 0.9  # the allocator's fragmentation, cuBLAS workspaces, the data loader's pinned batches


def _counts(name: str) -> tuple[gem_model.GemConfig, dict[str, int], list[int]]:
    """(model config, parameter counts, history events of 12 training batches) of a shipped config."""
    cfg = load_config(name)
    source = SyntheticAds(cfg.data.synthetic, seed=0)
    gcfg = build_gem_config(cfg.model, source.spec)
    model = gem_model.GemModel(gcfg, device="meta")
    table_ids = {id(p) for p in model.sparse_parameters()}
    tables = [p for p in model.parameters() if id(p) in table_ids]
    counts = {
        "dense": sum(p.numel() for p in model.parameters() if id(p) not in table_ids),
        "tables": sum(p.numel() for p in tables),
        "table_rows": sum(p.shape[0] for p in tables),
        "big_linears": sum(
            1 for m in model.modules() if isinstance(m, nn.Linear) and m.weight.numel() >= 2**20
        ),
    }
    events = [source.get("train", i, cfg.data.batch_size).batch.sequences["history"].total for i in range(12)]
    return gcfg, counts, events


def _states(c: dict[str, int]) -> float:
    return 16.0 * c["dense"] + 8.0 * c["tables"] + 4.0 * c["table_rows"]


@pytest.fixture(scope="module")
def both():
    return _counts("base-h200"), _counts("large-h200")


def test_large_h200_is_the_large_trunk(both):
    _, (gcfg, counts, events) = both
    large = gem_model.get_config("large")
    cfg = load_config("large-h200")
    assert cfg.model.name == "large"
    # The large trunk's widths and depth (only the experts are slimmed: see the config's comment).
    for f in ("d_model", "n_layers", "n_heads", "head_dim", "ffn_hidden", "attention", "embedding_dim"):
        assert getattr(gcfg, f) == getattr(large, f), f
    assert gcfg.d_model == 1024 and gcfg.ffn_hidden == 4096 and gcfg.n_layers == 12
    assert (gcfg.n_experts, gcfg.wukong_hidden) == (4, 1024)
    assert dataclasses.replace(gcfg, n_experts=large.n_experts, wukong_hidden=large.wukong_hidden) == (
        dataclasses.replace(large, features=gcfg.features)
    )
    # Longer histories than base-h200's (max 1,024; lognormal mu 5.5).
    assert cfg.data.synthetic.max_len == 2048 and cfg.data.synthetic.history_lognormal_mu > 5.5
    assert 0.7e9 < counts["dense"] < 0.9e9, counts
    assert min(events) > 20_000, events  # GEMMs of tens of thousands of rows per step


def test_large_h200_memory_fits_one_80gb_gpu(both):
    (bcfg, bcounts, bevents), (lcfg, lcounts, levents) = both
    base_tokens = sum(bevents) / len(bevents)
    per_unit = (BASE_H200_PEAK - _states(bcounts)) / (base_tokens * bcfg.n_layers * bcfg.d_model)
    # Sanity of the calibration: tens of bytes per event, layer and unit of width (a layer saves a few
    # dozen bf16 values per unit of d_model for each event: norms, q/k/v, attention, the SwiGLU hidden).
    assert 20 < per_unit < 200, per_unit
    worst = max(levents) * 1.1
    activations = per_unit * worst * lcfg.n_layers * lcfg.d_model
    total = _states(lcounts) + activations
    print(
        f"large-h200: states {_states(lcounts) / GB:.1f} GB (dense {lcounts['dense'] / 1e6:.0f}M, tables "
        f"{lcounts['tables'] / 1e6:.0f}M), activations {activations / GB:.1f} GB at {worst:.0f} events "
        f"({per_unit:.1f} B per event, layer and unit of d_model), total {total / GB:.1f} GB"
    )
    assert total < HEADROOM * GPU_BYTES, total / GB
    # And it is a production-width load, not a toy: most of the GPU is used.
    assert total > 0.4 * GPU_BYTES, total / GB
