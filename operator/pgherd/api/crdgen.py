"""Generate the CustomResourceDefinitions from the API models.

The models are the single source of truth: pydantic's JSON schema is turned into a Kubernetes
*structural* schema (no $ref, no anyOf for optionals, no titles), the CEL rules carried by the models
become `x-kubernetes-validations`, and each kind gets its printer columns and subresources here.
`pgherd crds` writes the result; a test fails when the committed files drift from it.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

from pgherd.api import backup, cluster, restore
from pgherd.api.common import CATEGORY, GROUP, VERSION

# Fields whose object default is `{}` so that the defaults inside them show in the stored object.
_DEFAULTED_OBJECTS = {"storage", "replication", "failover", "upgrade", "recovery", "networkPolicy"}
# Bounds that keep the CEL cost estimate of the API server low (rules iterate over these).
_MAX_PARAMETERS = 256
_MAX_VALUE_LENGTH = 4096


@dataclass(frozen=True)
class KindInfo:
    kind: str
    plural: str
    singular: str
    short_names: list[str]
    spec_model: type[BaseModel]
    status_model: type[BaseModel]
    printer_columns: list[dict[str, Any]]
    description: str
    spec_required: bool = True
    scale: dict[str, str] | None = None
    # Status lists whose items the API server keeps as written (see _lean_lists).
    lean_status_lists: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


def _age() -> dict[str, Any]:
    return {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}


KINDS: tuple[KindInfo, ...] = (
    KindInfo(
        kind=cluster.KIND,
        plural=cluster.PLURAL,
        singular=cluster.SINGULAR,
        short_names=cluster.SHORT_NAMES,
        spec_model=cluster.PostgresClusterSpec,
        description="A highly available PostgreSQL cluster managed by pgherd.",
        status_model=cluster.PostgresClusterStatus,
        spec_required=False,
        printer_columns=[
            {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
            {"name": "Instances", "type": "integer", "jsonPath": ".spec.instances"},
            {"name": "Ready", "type": "integer", "jsonPath": ".status.readyInstances"},
            {"name": "Primary", "type": "string", "jsonPath": ".status.currentPrimary"},
            _age(),
        ],
        scale={
            "specReplicasPath": ".spec.instances",
            "statusReplicasPath": ".status.instances",
            "labelSelectorPath": ".status.selector",
        },
        lean_status_lists=True,
    ),
    KindInfo(
        kind=backup.KIND,
        plural=backup.PLURAL,
        singular=backup.SINGULAR,
        short_names=backup.SHORT_NAMES,
        spec_model=backup.BackupSpec,
        description="A snapshot of a PostgresCluster, taken by a Job into the cluster's S3 store.",
        status_model=backup.BackupStatus,
        printer_columns=[
            {"name": "Cluster", "type": "string", "jsonPath": ".spec.cluster.name"},
            {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
            {"name": "Size", "type": "string", "jsonPath": ".status.size"},
            _age(),
        ],
    ),
    KindInfo(
        kind=restore.KIND,
        plural=restore.PLURAL,
        singular=restore.SINGULAR,
        short_names=restore.SHORT_NAMES,
        spec_model=restore.RestoreSpec,
        description="An in-place disaster recovery of a PostgresCluster from one of its snapshots.",
        status_model=restore.RestoreStatus,
        printer_columns=[
            {"name": "Cluster", "type": "string", "jsonPath": ".spec.cluster.name"},
            {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
            _age(),
        ],
    ),
)


def _resolve(node: Any, defs: dict[str, Any]) -> Any:
    """Inline $refs and turn pydantic's JSON schema idioms into structural-schema ones."""
    if isinstance(node, list):
        return [_resolve(item, defs) for item in node]
    if not isinstance(node, dict):
        return node
    node = dict(node)
    if "$ref" in node:
        target = copy.deepcopy(defs[node.pop("$ref").split("/")[-1]])
        # Keys beside the $ref (description, default) win over the target's.
        target.update(node)
        node = target
    if "anyOf" in node:
        variants = [v for v in node.pop("anyOf") if v.get("type") != "null"]
        if len(variants) != 1:
            raise ValueError(f"unsupported union in API model schema: {variants}")
        inner = dict(variants[0])
        inner.update(node)
        node = _resolve(inner, defs)
    if "allOf" in node and len(node["allOf"]) == 1:
        inner = dict(node.pop("allOf")[0])
        inner.update(node)
        node = _resolve(inner, defs)
    node.pop("title", None)
    if node.get("default", 0) is None:
        del node["default"]
    if node.get("x-kubernetes-preserve-unknown-fields") or node.get("additionalProperties") is False:
        # Structural schemas forbid additionalProperties beside properties: unknown fields are pruned
        # by the API server and refused by `kubectl --validate=strict`.
        node.pop("additionalProperties", None)
    if "const" in node:
        node["enum"] = [node.pop("const")]
    result: dict[str, Any] = {}
    for key, value in node.items():
        if key == "properties":
            result[key] = {name: _resolve(prop, defs) for name, prop in value.items()}
        elif key in ("items", "additionalProperties") and isinstance(value, dict):
            result[key] = _resolve(value, defs)
        else:
            result[key] = value
    if result.get("type") == "object" and "properties" in result:
        for name, prop in result["properties"].items():
            if name in _DEFAULTED_OBJECTS and prop.get("type") == "object" and "default" not in prop:
                prop["default"] = {}
    return _ordered(result)


_KEY_ORDER = ("type", "description", "default", "enum", "format", "pattern", "minimum", "maximum")


def _ordered(node: dict[str, Any]) -> dict[str, Any]:
    """type and description first, so that the generated YAML reads like a hand-written CRD."""
    first = {key: node[key] for key in _KEY_ORDER if key in node}
    rest = {key: value for key, value in node.items() if key not in first}
    return {**first, **rest}


def structural_schema(model: type[BaseModel]) -> dict[str, Any]:
    """The OpenAPI v3 structural schema of one model, as a CRD version's schema needs it."""
    raw = model.model_json_schema(by_alias=True, mode="validation")
    defs = raw.pop("$defs", {})
    schema: dict[str, Any] = _resolve(raw, defs)
    return schema


def _bound_parameters(spec_schema: dict[str, Any]) -> None:
    params = spec_schema.get("properties", {}).get("parameters")
    if params is not None:
        params["maxProperties"] = _MAX_PARAMETERS
        params["additionalProperties"]["maxLength"] = _MAX_VALUE_LENGTH


def _status_schema(info: KindInfo) -> dict[str, Any]:
    schema = structural_schema(info.status_model)
    if info.lean_status_lists:
        _lean_lists(schema)
        return schema
    conditions = schema.get("properties", {}).get("conditions")
    if conditions is not None:
        conditions["x-kubernetes-list-type"] = "map"
        conditions["x-kubernetes-list-map-keys"] = ["type"]
        conditions["items"]["required"] = ["type", "status"]
    return schema


def _lean_lists(status: dict[str, Any]) -> None:
    """The status's lists of objects (conditions, members, certificates) keep their items as written,
    their fields named in the list's description.

    The operator writes this status at every change of every cluster, and the API server prunes,
    defaults and validates each item at every write and every read from etcd: 16-20 ms of its CPU per
    change with 500 clusters, 12-16 without (docs/kube.md, "A leaner status schema"). What the
    items hold is checked against the models by the tests instead (tests/kube/test_status_schema.py)."""
    for prop in status.get("properties", {}).values():
        items = prop.get("items")
        if prop.get("type") != "array" or not isinstance(items, dict) or "properties" not in items:
            continue
        lines = [prop.get("description") or items.get("description") or "", "Each item has:"]
        lines += [_field_line(name, sub) for name, sub in items["properties"].items()]
        prop["description"] = "\n".join(line for line in lines if line)
        prop["items"] = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
        ordered = _ordered(prop)
        prop.clear()
        prop.update(ordered)


def _field_line(name: str, schema: dict[str, Any]) -> str:
    kind = schema.get("type", "object")
    if "enum" in schema:
        kind += ": " + ", ".join(str(value) for value in schema["enum"])
    text = f"- {name} ({kind})"
    return f"{text}: {schema['description']}" if "description" in schema else text


def crd(info: KindInfo) -> dict[str, Any]:
    """The CustomResourceDefinition of one kind."""
    spec_schema = structural_schema(info.spec_model)
    if info.kind == cluster.KIND:
        _bound_parameters(spec_schema)
        spec_schema["default"] = {}
    root: dict[str, Any] = {
        "type": "object",
        "description": info.description,
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": spec_schema,
            "status": _status_schema(info),
        },
    }
    if info.spec_required:
        root["required"] = ["spec"]
    subresources: dict[str, Any] = {"status": {}}
    if info.scale:
        subresources["scale"] = dict(info.scale)
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{info.plural}.{GROUP}",
            "labels": {"app.kubernetes.io/name": "pgherd", "app.kubernetes.io/part-of": "pgherd"},
        },
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": info.kind,
                "listKind": f"{info.kind}List",
                "plural": info.plural,
                "singular": info.singular,
                "shortNames": list(info.short_names),
                "categories": [CATEGORY],
            },
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": root},
                    "subresources": subresources,
                    "additionalPrinterColumns": info.printer_columns,
                }
            ],
        },
    }


def all_crds() -> dict[str, dict[str, Any]]:
    """File name -> CRD, for every kind."""
    return {f"{GROUP}_{info.plural}.yaml": crd(info) for info in KINDS}


def render(document: dict[str, Any]) -> str:
    header = "# Generated by `pgherd crds` from operator/pgherd/api: do not edit by hand.\n"
    return header + yaml.safe_dump(document, sort_keys=False, width=100)


def write_crds(*directories: Path) -> list[Path]:
    written: list[Path] = []
    for directory in directories:
        directory.mkdir(parents=True, exist_ok=True)
        for name, document in all_crds().items():
            path = directory / name
            path.write_text(render(document))
            written.append(path)
    return written


def schema_for_kind(kind: str) -> dict[str, Any]:
    """The openAPIV3Schema of a kind, straight from the models (used by the offline admission check)."""
    for info in KINDS:
        if info.kind == kind:
            schema: dict[str, Any] = crd(info)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
            return schema
    raise KeyError(f"unknown kind {kind!r}: expected one of {[i.kind for i in KINDS]}")
