"""`llmdb serve`: the engine behind an OpenAI-compatible HTTP API (app.py)."""
