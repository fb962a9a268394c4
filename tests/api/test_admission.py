"""Good and bad manifests through the offline admission check (schema, unknown fields, CEL rules).

Every bad manifest names what it expects in its first line (`# expect: <path>: <words>`) and must be
refused for that one reason only: so each rule has at least one manifest that only it catches.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from pgherd.api.admission import ManifestRefused, admit
from pgherd.api.crdgen import all_crds

ROOT = Path(__file__).resolve().parents[2]
CORPUS = Path(__file__).parent / "manifests"
GOOD = sorted((ROOT / "examples").glob("*.yaml")) + sorted((CORPUS / "good").glob("*.yaml"))
BAD = sorted((CORPUS / "bad").glob("*.yaml"))
TRANSITIONS = sorted(p for p in (CORPUS / "transitions").iterdir() if p.is_dir())


def _load(path: Path) -> dict[str, Any]:
    doc = yaml.safe_load(path.read_text())
    assert isinstance(doc, dict)
    return doc


def _expectation(path: Path) -> tuple[str, str]:
    first = path.read_text().splitlines()[0]
    assert first.startswith("# expect: "), f"{path.name} must start with '# expect: <path>: <words>'"
    text = first.removeprefix("# expect: ")
    field, _, words = text.partition(": ")
    return field, words


def test_corpus_is_not_empty() -> None:
    assert len(GOOD) >= 10 and len(BAD) >= 40 and len(TRANSITIONS) >= 5


@pytest.mark.parametrize("path", GOOD, ids=lambda p: p.name)
def test_good_manifest_is_accepted(path: Path) -> None:
    for doc in yaml.safe_load_all(path.read_text()):
        admitted = admit(doc)
        assert admitted["kind"] == doc["kind"]


@pytest.mark.parametrize("path", BAD, ids=lambda p: p.stem)
def test_bad_manifest_is_refused_for_its_reason_only(path: Path) -> None:
    field, words = _expectation(path)
    with pytest.raises(ManifestRefused) as refused:
        admit(_load(path))
    errors = refused.value.errors
    assert len(errors) == 1, f"expected one reason, got: {[str(e) for e in errors]}"
    assert errors[0].path == field
    assert words in errors[0].message
    # The message a person sees names the field.
    assert field in str(refused.value)


@pytest.mark.parametrize("case", TRANSITIONS, ids=lambda p: p.name)
def test_transition(case: Path) -> None:
    old, new = _load(case / "old.yaml"), _load(case / "new.yaml")
    admit(old)  # the stored object was valid
    admit(new)  # the new object is valid on its own: only the transition can refuse it
    field, words = _expectation(case / "new.yaml")
    if field == "accepted":
        admit(new, old=old)
        return
    with pytest.raises(ManifestRefused) as refused:
        admit(new, old=old)
    assert [e.path for e in refused.value.errors] == [field]
    assert words in refused.value.errors[0].message


def _all_rules() -> list[str]:
    found: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for entry in node.get("x-kubernetes-validations", []):
                found.append(entry["message"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    for document in all_crds().values():
        walk(document)
    return found


def test_every_cel_rule_has_a_manifest_that_only_it_catches() -> None:
    """Each rule's message must be the single reason of at least one bad manifest or transition."""
    caught: set[str] = set()
    for path in BAD + [case / "new.yaml" for case in TRANSITIONS]:
        caught.add(_expectation(path)[1])
    messages = _all_rules()
    assert len(messages) >= 10
    uncovered = [m for m in messages if not any(words in m for words in caught)]
    assert not uncovered, f"CEL rules with no bad manifest: {uncovered}"


def test_defaults_are_applied_like_the_api_server() -> None:
    admitted = admit(
        {"apiVersion": "pgherd.io/v1alpha1", "kind": "PostgresCluster", "metadata": {"name": "d"}}
    )
    spec = admitted["spec"]
    assert spec["instances"] == 3
    assert spec["failover"] == {"enabled": True, "detectionSeconds": 5}
    assert spec["upgrade"] == {"primaryUpdateMethod": "switchover", "keepOldMajorFor": "1h"}
    assert spec["recovery"] == {"onQuorumLoss": "Wait", "backup": "latest"}
    assert spec["storage"]["size"] == "1Gi"


def test_all_problems_are_reported_at_once() -> None:
    manifest = _load(CORPUS / "bad" / "instances-too-many.yaml")
    manifest["spec"]["storage"] = {"size": "big"}
    with pytest.raises(ManifestRefused) as refused:
        admit(manifest)
    assert {e.path for e in refused.value.errors} == {"spec.instances", "spec.storage.size"}
