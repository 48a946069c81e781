"""The inference engine: tokens, blocks, batches. Knows nothing of SQL."""

__version__ = "0.1.0"
