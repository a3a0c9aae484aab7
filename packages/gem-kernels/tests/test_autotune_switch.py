"""GEM_KERNELS_AUTOTUNE=0 (``triton_attention.AUTOTUNE``): each attention kernel keeps one candidate per
shape class (the first listed that fits), so a cold warm-up compiles one tile per kernel and bucket."""

from __future__ import annotations

import pytest

ta = pytest.importorskip("gem_kernels.attention.triton_attention")


def _key(c):
    return (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages)


@pytest.mark.parametrize("kernel", ["fwd", "dq", "dkdv"])
@pytest.mark.parametrize(
    ("bq", "bkv", "cls"), [(1024, 1024, "general"), (1024, 16, "short_kv"), (16, 1024, "few_q")]
)
def test_pruner_keeps_one_candidate_without_autotuning(monkeypatch, kernel, bq, bkv, cls):
    prune = ta._pruner(kernel)
    configs = ta._configs(kernel)
    args = {"bucket_q": bq, "bucket_kv": bkv}
    fits = [c for c in ta._CANDIDATES[kernel][cls] if c[1] <= max(bkv, 16)]
    monkeypatch.setattr(ta, "AUTOTUNE", True)
    assert sorted(_key(c) for c in prune(configs, args)) == sorted(fits)
    monkeypatch.setattr(ta, "AUTOTUNE", False)
    kept = prune(configs, args)
    assert [_key(c) for c in kept] == fits[:1]
