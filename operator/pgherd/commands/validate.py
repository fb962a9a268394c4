"""`pgherd validate -f FILE`: refuse a bad manifest offline, exactly as the API server would."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import yaml


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "validate", help="check pgherd manifests against the CRD schemas and CEL rules, offline"
    )
    parser.add_argument(
        "-f", "--filename", type=Path, action="append", required=True, help="manifest file(s)"
    )
    parser.add_argument("--old", type=Path, help="the stored object, to check an update (transition rules)")
    parser.set_defaults(func=run)


def load_documents(path: Path) -> list[dict[str, Any]]:
    """The YAML documents of a file (empty documents skipped); a clear error for anything else."""
    with path.open() as handle:
        documents = [doc for doc in yaml.safe_load_all(handle) if doc is not None]
    for doc in documents:
        if not isinstance(doc, dict):
            raise ValueError(f"{path}: every YAML document must be a mapping (a Kubernetes object)")
    return documents


def run(args: argparse.Namespace) -> int:
    from pgherd.api.admission import ManifestRefused, admit

    old = None
    if args.old is not None:
        old_docs = load_documents(args.old)
        old = old_docs[0] if old_docs else None
    failed = 0
    for path in args.filename:
        try:
            documents = load_documents(path)
        except (OSError, yaml.YAMLError, ValueError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            failed += 1
            continue
        for doc in documents:
            name = (doc.get("metadata") or {}).get("name", "?")
            try:
                admit(doc, old=old)
            except ManifestRefused as exc:
                print(f"{path}: {exc}", file=sys.stderr)
                failed += 1
            else:
                print(f"{path}: {doc.get('kind')} {name!r} is valid")
    return 1 if failed else 0
