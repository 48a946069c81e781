"""The `llmdb` command."""

from __future__ import annotations

import argparse
import sys

from llmdb.engine.models import ModelLoadError
from llmdb.engine.registry import register_model, registered_models


def _models(args: argparse.Namespace) -> int:
    if args.action == "add":
        path = register_model(args.name, args.path)
        print(f"registered {args.name} -> {path}")
    else:
        for name, path in sorted(registered_models().items()):
            print(f"{name}\t{path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="llmdb", description="Run language models over rows.")
    sub = ap.add_subparsers(dest="command", required=True)
    models = sub.add_parser("models", help="list or register models")
    msub = models.add_subparsers(dest="action", required=True)
    add = msub.add_parser("add", help="register a GGUF file or HF directory under a name")
    add.add_argument("name")
    add.add_argument("path")
    msub.add_parser("list", help="list registered models")
    models.set_defaults(func=_models)
    args = ap.parse_args(argv)
    try:
        return args.func(args)
    except (ModelLoadError, ValueError) as e:
        print(f"llmdb: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
