"""The `pgherd` command: one entry point, one module per subcommand under pgherd.commands."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from pgherd import __version__
from pgherd.commands import crds, instance, operator, sandbox, validate


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pgherd",
        description="pgherd: highly available PostgreSQL on Kubernetes, and the same engine in a local sandbox.",
    )
    parser.add_argument("--version", action="version", version=f"pgherd {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    crds.register(sub)
    validate.register(sub)
    sandbox.register(sub)
    instance.register(sub)
    operator.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code: int = args.func(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away (`pgherd sandbox status --json | head -1`): not an error of ours. Point
        # stdout at /dev/null so that the interpreter's final flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    return code


if __name__ == "__main__":
    sys.exit(main())
