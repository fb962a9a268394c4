"""`pgherd crds`: write the CustomResourceDefinitions generated from the API models."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser("crds", help="write the CRDs generated from the API models")
    parser.add_argument("--out", type=Path, help="directory to write the CRDs to (default: print them)")
    parser.add_argument("--chart", type=Path, help="also write them to this chart's crds/ directory")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pgherd.api.crdgen import all_crds, render, write_crds

    if args.out is None and args.chart is None:
        sys.stdout.write("---\n".join(render(doc) for doc in all_crds().values()))
        return 0
    targets = [p for p in (args.out, args.chart) if p is not None]
    for path in write_crds(*targets):
        print(f"wrote {path}")
    return 0
