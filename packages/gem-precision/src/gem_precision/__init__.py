"""gem_precision."""

__version__ = "0.1.0"
