"""`pgherd validate -f FILE`: refuse a bad manifest offline, exactly as the API server would."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pgherd.commands.manifests import ManifestError, read_manifests


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "validate", help="check pgherd manifests against the CRD schemas and CEL rules, offline"
    )
    parser.add_argument(
        "-f", "--filename", type=Path, action="append", required=True, help="manifest file(s)"
    )
    parser.add_argument("--old", type=Path, help="the stored object, to check an update (transition rules)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pgherd.api.admission import ManifestRefused, admit

    old = None
    if args.old is not None:
        try:
            (old,) = read_manifests(args.old, single=True)
        except ManifestError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
    failed = 0
    for path in args.filename:
        try:
            documents = read_manifests(path)
        except ManifestError as exc:
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
