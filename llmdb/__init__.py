"""llmdb: run language models over database rows."""
