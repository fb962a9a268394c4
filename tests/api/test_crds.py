"""The CRDs: generated from the models, committed without drift, valid for the Kubernetes versions we
support, structural, and carrying the names, columns and subresources of the contract."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import celpy
import kubernetes_validate
import pytest
import yaml

from pgherd.api.crdgen import all_crds, render

ROOT = Path(__file__).resolve().parents[2]
KUBERNETES_VERSIONS = ["1.30", "1.33"]


@pytest.mark.parametrize("directory", ["crds", "charts/pgherd/crds"])
def test_committed_crds_match_the_models(directory: str) -> None:
    generated = all_crds()
    committed = {p.name for p in (ROOT / directory).glob("*.yaml")}
    assert committed == set(generated), f"{directory}: run `make crds`"
    for name, document in generated.items():
        on_disk = (ROOT / directory / name).read_text()
        assert on_disk == render(document), f"{directory}/{name} drifted from the models: run `make crds`"


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("name", sorted(all_crds()))
def test_crd_is_valid_for_kubernetes(name: str, version: str) -> None:
    kubernetes_validate.validate(all_crds()[name], version, strict=True)


def _walk(node: Any, path: str = "") -> list[tuple[str, dict[str, Any]]]:
    found: list[tuple[str, dict[str, Any]]] = []
    if isinstance(node, dict):
        found.append((path, node))
        for key, value in node.get("properties", {}).items():
            found += _walk(value, f"{path}.{key}")
        for key in ("items", "additionalProperties"):
            if isinstance(node.get(key), dict):
                found += _walk(node[key], f"{path}[{key}]")
    return found


@pytest.mark.parametrize("name", sorted(all_crds()))
def test_schema_is_structural(name: str) -> None:
    schema = all_crds()[name]["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    for path, node in _walk(schema):
        assert "type" in node or node.get("x-kubernetes-preserve-unknown-fields"), f"{path}: no type"
        for forbidden in ("$ref", "anyOf", "oneOf", "allOf", "title", "const"):
            assert forbidden not in node, f"{path}: {forbidden} is not structural"
        assert not ("properties" in node and "additionalProperties" in node), f"{path}: both properties kinds"
        if "default" in node:
            assert node["default"] is not None, f"{path}: null default"


@pytest.mark.parametrize("name", sorted(all_crds()))
def test_cel_rules_compile_and_name_a_message(name: str) -> None:
    schema = all_crds()[name]["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    env = celpy.Environment()
    rules = [entry for _, node in _walk(schema) for entry in node.get("x-kubernetes-validations", [])]
    assert rules
    for entry in rules:
        env.compile(entry["rule"])
        assert entry["message"], entry["rule"]
        # Standard CEL only: the offline check must be able to run every rule.
        for kubernetes_only in ("quantity(", "isQuantity(", "lowerAscii(", "url(", "ip("):
            assert kubernetes_only not in entry["rule"]


def test_names_columns_and_subresources() -> None:
    crds = {doc["spec"]["names"]["kind"]: doc for doc in all_crds().values()}
    assert set(crds) == {"PostgresCluster", "Backup", "Restore"}
    expected_columns = {
        "PostgresCluster": ["Phase", "Instances", "Ready", "Primary", "Age"],
        "Backup": ["Cluster", "Phase", "Size", "Age"],
        "Restore": ["Cluster", "Phase", "Age"],
    }
    short = {"PostgresCluster": ["pgc"], "Backup": ["pgbackup"], "Restore": ["pgrestore"]}
    for kind, doc in crds.items():
        spec = doc["spec"]
        assert spec["group"] == "pgherd.io" and spec["scope"] == "Namespaced"
        assert spec["names"]["shortNames"] == short[kind]
        assert spec["names"]["categories"] == ["pgherd"]
        version = spec["versions"][0]
        assert version["name"] == "v1alpha1" and version["served"] and version["storage"]
        assert [c["name"] for c in version["additionalPrinterColumns"]] == expected_columns[kind]
        assert "status" in version["subresources"]
    scale = crds["PostgresCluster"]["spec"]["versions"][0]["subresources"]["scale"]
    assert scale["specReplicasPath"] == ".spec.instances"
    assert scale["statusReplicasPath"] == ".status.instances"


def test_spec_field_types_of_the_contract() -> None:
    cluster = yaml.safe_load(render(all_crds()["pgherd.io_postgresclusters.yaml"]))
    spec = cluster["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    assert spec["instances"]["type"] == "integer"
    assert (spec["instances"]["minimum"], spec["instances"]["maximum"]) == (1, 15)
    assert spec["postgresVersion"]["type"] == "integer"
    assert spec["failover"]["properties"]["detectionSeconds"]["minimum"] == 1
    assert spec["replication"]["properties"]["mode"]["enum"] == ["quorum", "async"]
    assert spec["recovery"]["properties"]["onQuorumLoss"]["enum"] == ["Wait", "RestoreFromBackup"]
    assert spec["backup"]["properties"]["compression"]["enum"] == ["zstd", "lz4", "gzip", "none"]
    status = cluster["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]
    assert len(status["phase"]["enum"]) == 14
    # The members' items are kept as written (crdgen._lean_lists); their fields are named in the list's
    # description, for kubectl explain, and checked against the model by tests/kube/test_status_schema.py.
    described = status["members"]["description"]
    for field in ("name", "role", "ready", "reachable", "timeline", "receivedLSN", "replayedLSN", "lagBytes"):
        assert f"\n- {field} (" in described, field
