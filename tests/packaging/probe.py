"""Run by the Python of an installed pgherd (a fresh virtualenv), never by the test runner's own.

    python probe.py imports    every module of pgherd and pgherd_backup imports, and every third-party
                               import in them (lazy ones included) is installed: JSON {"errors": [...],
                               "files": {"pgherd": ".../site-packages/pgherd/__init__.py", ...}}
    python probe.py commands   every command path of the console scripts, subcommands included:
                               JSON {"pgherd": [["crds"], ["sandbox", "up"], ...], "pgherd-backup": ...,
                               "kubectl-pgherd": [["status"], ["upgrade", "confirm"], ...]}

It uses the standard library and the installed packages only: nothing of the checkout, nothing of pytest.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import json
import pkgutil
import sys
from collections.abc import Iterator
from pathlib import Path

PACKAGES = ("pgherd", "pgherd_backup")


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imported(tree: ast.AST) -> Iterator[tuple[str, int]]:
    """(module, line) of each absolute import, at any depth, except under `if TYPE_CHECKING:`."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and _type_checking(node):
            yield from (item for child in node.orelse for item in _imported(child))
            continue
        if isinstance(node, ast.Import):
            yield from ((alias.name, node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module, node.lineno
        yield from _imported(node)


def imports() -> tuple[list[str], dict[str, str]]:
    errors: list[str] = []
    files: dict[str, str] = {}
    for name in PACKAGES:
        package = importlib.import_module(name)
        files[name] = str(package.__file__)
        for info in pkgutil.walk_packages(package.__path__, f"{name}."):
            try:
                importlib.import_module(info.name)
            except Exception as exc:  # every failure, not only the first
                errors.append(f"import {info.name}: {type(exc).__name__}: {exc}")
        root = Path(package.__path__[0])
        for path in sorted(root.rglob("*.py")):
            for module, line in _imported(ast.parse(path.read_text(), str(path))):
                top = module.split(".")[0]
                if top in sys.stdlib_module_names or top in PACKAGES:
                    continue
                if importlib.util.find_spec(top) is None:
                    where = path.relative_to(root.parent)
                    errors.append(f"{where}:{line} imports {module}, which is not installed")
    return errors, files


def _paths(parser: argparse.ArgumentParser, prefix: list[str]) -> Iterator[list[str]]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield [*prefix, name]
                yield from _paths(sub, [*prefix, name])


def commands() -> dict[str, list[list[str]]]:
    from pgherd.cli import build_parser as pgherd_parser
    from pgherd.plugin.cli import build_parser as plugin_parser
    from pgherd_backup.cli import build_parser as backup_parser

    return {
        "pgherd": list(_paths(pgherd_parser(), [])),
        "pgherd-backup": list(_paths(backup_parser(), [])),
        "kubectl-pgherd": list(_paths(plugin_parser(), [])),
    }


def main() -> int:
    what = sys.argv[1] if len(sys.argv) == 2 else ""
    if what == "imports":
        errors, files = imports()
        print(json.dumps({"errors": errors, "files": files}))
    elif what == "commands":
        print(json.dumps(commands()))
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
