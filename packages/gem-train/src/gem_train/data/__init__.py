"""Datasets of gem-train: the synthetic ads world and MovieLens-100K, streamed as ``gem_model.GemBatch``."""
