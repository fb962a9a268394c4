"""The admission corpus (tests/api/manifests) against the real API server with pgherd's CRDs: every bad
manifest is refused by kube-apiserver itself (schema, CEL and its cost budget), with the words the
offline check gives; every transition (an update of a stored object: the CEL transition rules, such as
postgresVersion only going up and alone) is refused or accepted as the offline check says."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from .realkube import ApiRefused, Kube

CORPUS = Path(__file__).resolve().parents[1] / "api" / "manifests"
BAD = sorted((CORPUS / "bad").glob("*.yaml"))
TRANSITIONS = sorted(p for p in (CORPUS / "transitions").iterdir() if p.is_dir())


def _load(path: Path, namespace: str) -> dict[str, Any]:
    doc = yaml.safe_load(path.read_text())
    doc.setdefault("metadata", {})["namespace"] = namespace
    return doc


def _expectation(path: Path) -> tuple[str, str]:
    text = path.read_text().splitlines()[0].removeprefix("# expect: ")
    field, _, words = text.partition(": ")
    return field, words


@pytest.mark.parametrize("path", BAD, ids=lambda p: p.stem)
def test_the_api_server_refuses_each_bad_manifest(kube: Kube, namespace: str, path: Path) -> None:
    field, words = _expectation(path)
    doc = _load(path, namespace)
    # As kubectl sends it (--validate=strict, its default): an unknown field is refused, not pruned.
    url = kube.path(
        "postgresclusters" if doc["kind"] == "PostgresCluster" else f"{doc['kind'].lower()}s", namespace
    )
    with pytest.raises(ApiRefused) as refused:
        kube.request("POST", url, doc, params={"fieldValidation": "Strict"})
    if path.stem == "wrong-api-version":
        # Sent to the only version served, v1alpha1 (kubectl would find no such kind at all).
        assert refused.value.status == 400 and 'in version "v1"' in str(refused.value)
        return
    # A strict decoding error (an unknown field) is a 400; the schema's and the rules' a 422.
    assert refused.value.status in (400, 422), refused.value
    message = str(refused.value)
    assert field in message and words in message, message


@pytest.mark.parametrize("case", TRANSITIONS, ids=lambda p: p.name)
def test_the_api_server_applies_each_transition_rule(kube: Kube, namespace: str, case: Path) -> None:
    old, new = _load(case / "old.yaml", namespace), _load(case / "new.yaml", namespace)
    stored = kube.create(old)
    new["metadata"]["resourceVersion"] = stored["metadata"]["resourceVersion"]
    field, words = _expectation(case / "new.yaml")
    resource = f"{old['kind'].lower()}s"
    path = kube.path(resource, namespace, old["metadata"]["name"])
    if field == "accepted":
        kube.request("PUT", path, new)
        return
    with pytest.raises(ApiRefused) as refused:
        kube.request("PUT", path, new)
    message = str(refused.value)
    assert refused.value.status == 422 and field in message and words in message, message
