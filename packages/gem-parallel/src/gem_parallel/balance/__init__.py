"""Load balancing of jagged batches (filled in below)."""
