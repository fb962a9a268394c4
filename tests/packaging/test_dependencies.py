"""The distribution's dependencies tell the truth: every third-party module pgherd imports is declared,
and every declared runtime dependency is imported by pgherd's code (an undeclared one works only where
something else happened to install it; an unused one widens what every install must trust)."""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
OWN = {"pgherd", "pgherd_backup", "tests", "e2e", "bench", "conftest"}


def _name(requirement: str) -> str:
    match = re.match(r"[A-Za-z0-9._-]+", requirement)
    assert match, requirement
    return re.sub(r"[-_.]+", "-", match.group(0)).lower()


def _imported(*roots: Path) -> dict[str, set[str]]:
    """Top-level third-party modules imported under `roots` -> the files importing them."""
    found: dict[str, set[str]] = {}
    local = {p.stem for root in roots for p in root.rglob("*.py")} | {
        p.name for root in roots for p in root.rglob("*") if p.is_dir()
    }
    for root in roots:
        for path in root.rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    top = name.split(".")[0]
                    if top not in sys.stdlib_module_names and top not in OWN | local and top != "__future__":
                        found.setdefault(top, set()).add(str(path.relative_to(REPO)))
    return found


def _distributions(modules: dict[str, set[str]]) -> dict[str, set[str]]:
    providers = packages_distributions()
    by_distribution: dict[str, set[str]] = {}
    for module, files in modules.items():
        assert module in providers, f"{module} (imported by {sorted(files)}) is installed by no distribution"
        for distribution in providers[module]:
            by_distribution.setdefault(_name(distribution), set()).update(files)
    return by_distribution


def test_every_runtime_import_is_declared_and_every_runtime_dependency_imported() -> None:
    declared = {_name(r) for r in PYPROJECT["project"]["dependencies"]}
    used = _distributions(_imported(REPO / "operator" / "pgherd", REPO / "backup" / "pgherd_backup"))
    undeclared = {d: sorted(files)[:3] for d, files in used.items() if d not in declared}
    assert not undeclared, f"imported but not declared in [project] dependencies: {undeclared}"
    unused = declared - set(used)
    assert not unused, f"declared but never imported by operator/ or backup/: {sorted(unused)}"


def test_every_test_import_is_declared_by_the_test_extra_or_the_runtime() -> None:
    declared = {_name(r) for r in PYPROJECT["project"]["dependencies"]}
    declared |= {_name(r) for r in PYPROJECT["project"]["optional-dependencies"]["test"]}
    used = _distributions(_imported(REPO / "tests", REPO / "e2e", REPO / "bench"))
    undeclared = {d: sorted(files)[:3] for d, files in used.items() if d not in declared}
    assert not undeclared, f"imported by tests but not declared in the test extra: {undeclared}"
