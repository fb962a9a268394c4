"""Reading manifest files for every command that takes `-f FILE` (`validate`, `sandbox up`, `sandbox
apply`): one reader, one rule, one line per problem.

The rule: a file holds one or more YAML documents (separated by `---`; empty ones are skipped), each one
object (a mapping) of a pgherd kind: PostgresCluster, Backup or Restore. A YAML list is refused, a
Kubernetes `kind: List` included: write one object per document instead. Commands that need exactly one
object (`sandbox up`, `validate --old`) say so with ``single``, and which kinds they take with ``kinds``.
Every document is read and checked before the command uses any, so a bad document anywhere in the file
changes nothing.

A file that cannot be used raises ManifestError, whose message is one line naming the file and the
problem (missing, unreadable, not UTF-8, not YAML with the line and column, empty, a list, not an object,
no kind or an unknown one, too many documents): the commands print it as it is, never a traceback.
Whether an object is *valid* is admission's business (`pgherd.api.admission`), not this reader's.
"""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path
from typing import Any

import yaml

# pgherd.api's kinds (pgherd.api.crdgen.KINDS, checked by a test): spelled here so that reading a file
# needs neither pydantic nor the CRD generator.
KINDS: tuple[str, ...] = ("PostgresCluster", "Backup", "Restore")


class ManifestError(ValueError):
    """A manifest file a command cannot use; str() is one line: `FILE: problem`."""

    def __init__(self, path: Path, problem: str) -> None:
        self.path = path
        self.problem = " ".join(problem.split())
        super().__init__(f"{path}: {self.problem}")


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """PyYAML's error on one line, with the position of the problem (1-based, as editors count)."""
    if isinstance(exc, yaml.MarkedYAMLError):
        parts = [part for part in (exc.context, exc.problem) if part]
        mark = exc.problem_mark or exc.context_mark
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        return f"not valid YAML: {': '.join(parts) or 'a syntax error'}{where}"
    return f"not valid YAML: {exc}"


def _read_text(path: Path) -> str:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise ManifestError(path, "no such file") from None
    except IsADirectoryError:
        raise ManifestError(path, "is a directory, not a manifest file") from None
    except PermissionError:
        raise ManifestError(path, "cannot be read: permission denied") from None
    except OSError as exc:
        raise ManifestError(path, f"cannot be read: {exc.strerror or exc}") from None
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ManifestError(
            path, f"not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start}): not a YAML manifest"
        ) from None


def _describe(value: Any) -> str:
    if isinstance(value, list):
        return "a YAML list"
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, str):
        shown = value if len(value) <= 40 else value[:37] + "..."
        return f"a string ({shown!r})"
    if isinstance(value, bool):
        return f"a boolean ({str(value).lower()})"
    if isinstance(value, int | float):
        return f"a number ({value})"
    return f"a {type(value).__name__}"


def _one_of(kinds: Collection[str]) -> str:
    """'a PostgresCluster', 'a PostgresCluster or Backup', 'a PostgresCluster, Backup or Restore'."""
    names = list(kinds)
    return "a " + (names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}")


def _hint(text: str) -> str:
    return f" ({text})" if text else ""


def read_manifests(
    path: Path, *, single: bool = False, kinds: Collection[str] = KINDS, hint: str = ""
) -> list[dict[str, Any]]:
    """The objects of a manifest file, checked as the module says; ManifestError otherwise.
    ``single``: exactly one object; ``kinds``: the kinds the command takes (every pgherd kind by default);
    ``hint``: what to do instead, added to a refusal of the kind or of the number of documents."""
    text = _read_text(path)
    try:
        documents = [doc for doc in yaml.safe_load_all(text) if doc is not None]
    except yaml.YAMLError as exc:
        raise ManifestError(path, _yaml_problem(exc)) from None
    wanted = _one_of(kinds)
    if not documents:
        raise ManifestError(path, f"is empty: no manifest in it (expected {wanted})")
    if single and len(documents) > 1:
        raise ManifestError(
            path, f"holds {len(documents)} documents: expected exactly one object, {wanted}{_hint(hint)}"
        )
    for number, doc in enumerate(documents, 1):
        which = "the manifest" if len(documents) == 1 else f"document {number}"
        if not isinstance(doc, dict):
            hint = ": write one object per document, separated by ---" if isinstance(doc, list) else ""
            raise ManifestError(
                path, f"{which} is {_describe(doc)}, not an object with apiVersion, kind and metadata{hint}"
            )
        kind = doc.get("kind")
        if kind is None or kind == "":
            raise ManifestError(path, f"{which} has no kind: expected {wanted}")
        if not isinstance(kind, str):
            raise ManifestError(path, f"{which} has a kind that is {_describe(kind)}: expected {wanted}")
        if kind not in KINDS:
            hint = " (one object per document instead)" if kind == "List" else ""
            raise ManifestError(
                path, f"{which} is of kind {kind!r}, which pgherd does not know: expected {wanted}{hint}"
            )
        if kind not in kinds:
            raise ManifestError(path, f"{which} is a {kind}: expected {wanted}{_hint(hint)}")
    return documents
