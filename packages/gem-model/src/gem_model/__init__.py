"""gem_model: an open GEM-style recommendation foundation model (InterFormer / Kunlun / Wukong style).

Model code is free of parallelism and precision: gem-parallel and gem-precision apply them from outside.
"""

from gem_model.batch import GemBatch, JaggedSequence
from gem_model.config import ATTENTION_KINDS, CONFIG_NAMES, AttentionKind, GemConfig, get_config
from gem_model.features import FeatureSpec, SequenceFeature, SparseFeature
from gem_model.synthetic import random_batch, random_lengths

__version__ = "0.1.0"

__all__ = [
    "ATTENTION_KINDS",
    "CONFIG_NAMES",
    "AttentionKind",
    "FeatureSpec",
    "GemBatch",
    "GemConfig",
    "JaggedSequence",
    "SequenceFeature",
    "SparseFeature",
    "get_config",
    "random_batch",
    "random_lengths",
]
