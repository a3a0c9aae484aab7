"""The shipped run configs: the TOML files in this folder, by name (no imports: the command line lists them
without loading the config schema; :func:`gem_train.config.load_config` reads them)."""

__all__ = ["SHIPPED_CONFIGS"]

SHIPPED_CONFIGS: tuple[str, ...] = (
    "tiny-cpu",
    "movielens",
    "movielens-tuned",
    "base-h200",
    "large-h200",
    "movielens-parquet",
)
