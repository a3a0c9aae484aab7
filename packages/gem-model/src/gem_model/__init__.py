"""gem_model: an open GEM-style recommendation foundation model (InterFormer / Kunlun / Wukong style).

Model code is free of parallelism and precision: gem-parallel and gem-precision apply them from outside.
"""

# First: imports torchrec and fbgemm, with a clear error on a mismatched stack (see _stack.py).
import gem_model._stack  # noqa: F401
from gem_model.attention import ContextCrossAttention, PoolingAttention, SequenceSelfAttention
from gem_model.batch import GemBatch, JaggedSequence
from gem_model.config import ATTENTION_KINDS, CONFIG_NAMES, AttentionKind, GemConfig, get_config
from gem_model.embeddings import GemEmbeddings
from gem_model.features import FeatureSpec, SequenceFeature, SparseFeature
from gem_model.flops import attention_pairs, flops, flops_by_block, model_summary, parameter_counts
from gem_model.interaction import NonSequenceSummary, SequenceSummary, WukongEnsemble, WukongLayer
from gem_model.model import GemLayer, GemModel, multitask_loss
from gem_model.synthetic import random_batch, random_lengths

__version__ = "0.1.0"

__all__ = [
    "ATTENTION_KINDS",
    "CONFIG_NAMES",
    "AttentionKind",
    "ContextCrossAttention",
    "FeatureSpec",
    "GemBatch",
    "GemConfig",
    "GemEmbeddings",
    "GemLayer",
    "GemModel",
    "JaggedSequence",
    "NonSequenceSummary",
    "PoolingAttention",
    "SequenceFeature",
    "SequenceSelfAttention",
    "SequenceSummary",
    "SparseFeature",
    "WukongEnsemble",
    "WukongLayer",
    "attention_pairs",
    "flops",
    "flops_by_block",
    "get_config",
    "model_summary",
    "multitask_loss",
    "parameter_counts",
    "random_batch",
    "random_lengths",
]
