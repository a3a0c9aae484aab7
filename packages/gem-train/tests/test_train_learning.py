"""Training learns: 80 steps of the tiny GEM model on the synthetic data beat every constant predictor."""

from __future__ import annotations

import numpy as np
import torch

from gem_train.config import load_config
from gem_train.data.synthetic import SyntheticAds, ground_truth_ne
from gem_train.evaluation.metrics import normalized_entropy
from gem_train.loop.trainer import Trainer

# 80 steps of 128 (10,240 impressions) with learning rates raised for so short a run (the shipped 600-step
# config uses lr 2e-3, sparse_lr 0.05); 4,096 test impressions. About 25-35 s on one thread here.
RUN = (
    "train.steps=80",
    "data.batch_size=128",
    "optim.lr=6e-3",
    "optim.sparse_lr=0.5",
    "optim.warmup_steps=10",
    "data.synthetic.eval_examples=4096",
    "checkpoint.every=0",
    "train.log_every=40",
    "train.progress_bar=false",
)

# Test CTR NE after these 80 steps, measured with seeds 0-3: 0.938, 0.962, 0.973, 0.915 (seed 0 is the one
# run here). The bound is the worst of them plus 0.012 of margin for other platforms' arithmetic: 0.985.
# No constant predictor can get below 1.0 (NE of a constant is >= 1, with equality at the test's own base
# rate; checked below on the same labels), so passing needs a model that ranks and calibrates better than
# the base rate. The same run with learning rates of 1e-9 (no training) scores NE 1.079, AUC 0.49.
CTR_NE_BOUND = 0.985


def test_80_steps_of_tiny_beat_every_constant_predictor(tmp_path):
    torch.set_num_threads(1)
    cfg = load_config("tiny-cpu", [*RUN, f"run.out_dir={tmp_path}", "run.seed=0"])
    result = Trainer(cfg).fit()
    assert result.status == "completed" and result.step == 80 and result.final_eval is not None
    ctr = result.final_eval.tasks["ctr"]

    # The same test labels the trainer scored, and the best constant predictor on them.
    ds = SyntheticAds(cfg.data.synthetic, seed=cfg.run.seed)
    bs = cfg.data.eval_batch_size
    parts = [ds.get("test", i, bs) for i in range(ds.held_out_batches("test", bs))]
    y = np.concatenate([p.batch.labels.numpy()[:, 0] for p in parts])
    assert len(y) == 4096 and 0 < y.mean() < 1
    best_constant = normalized_entropy(np.full(len(y), y.mean()), y)
    assert best_constant >= 1.0 - 1e-9

    assert ctr.ne < CTR_NE_BOUND, f"test CTR NE {ctr.ne:.4f} after 80 steps (bound {CTR_NE_BOUND})"
    # Nor can a model beat the hidden model's own probabilities (the Bayes floor) beyond sampling noise on
    # 4,096 labels: an NE below floor - 0.03 would mean the labels leak into the inputs.
    floor = ground_truth_ne(
        [p.true_probs for p in parts],
        [p.batch.labels.numpy() for p in parts],
        [p.batch.label_mask.numpy() for p in parts],
        ds.spec.tasks,
    )["ctr"]
    assert ctr.ne > floor - 0.03, (ctr.ne, floor)
    assert ctr.auc > 0.6  # measured 0.62-0.70 over the same seeds; a constant has AUC 0.5
    assert np.isfinite(result.losses).all() and np.mean(result.losses[-10:]) < np.mean(result.losses[:10])
