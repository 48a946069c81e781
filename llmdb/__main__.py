"""`python -m llmdb`: the `llmdb` command."""

from llmdb.cli import entry

if __name__ == "__main__":
    entry()
