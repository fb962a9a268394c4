"""An emulated Kubernetes API server for the tests: kmock's ``KubernetesEmulator``, extended.

No kube-apiserver can run on the test machines. kmock 0.8's emulator is an in-memory object store
over HTTP that merges dicts; :class:`KubeEmulator` subclasses it and serves what kopf, the official
``kubernetes`` client, a thin aiohttp client and ``kubectl`` rely on, over real HTTP on 127.0.0.1:

* create: 201 with ``metadata.uid``, ``resourceVersion`` (one global increasing counter, as strings),
  ``generation`` 1, ``creationTimestamp``; ``generateName``; 409 AlreadyExists; 422 Invalid for a
  missing name, a name that is not a DNS subdomain (a DNS label for namespaces and services), bad
  label keys or values; 404 for a namespace that does not exist, 403 for one being terminated;
* ``generation`` grows only when something outside ``metadata`` and ``status`` changes (and once
  when a deletion is first recorded, as the real server does), ``resourceVersion`` on every change;
  a write that changes nothing is a no-op (no new resourceVersion, no watch event);
* PUT with a resourceVersion precondition (stale: 409 Conflict; none: 422 for custom resources),
  PATCH as ``application/merge-patch+json`` (RFC 7386), ``application/json-patch+json``
  (RFC 6902, a failed ``test`` answers 422 as kopf expects) and
  ``application/strategic-merge-patch+json`` (applied as a merge patch, see below; refused with
  415 for custom resources, as the real server refuses it); bodies are JSON (no Content-Type
  means JSON; protobuf answers 415);
* the status subresource (writes to ``/status`` change only ``status``; writes to the object keep
  its status; create drops it) for every kind whose discovery lists ``<plural>/status``, the CRDs'
  included; the scale subresource (autoscaling/v1 Scale: GET, PUT, PATCH) for the CRDs that declare
  it, with their specReplicasPath / statusReplicasPath / labelSelectorPath, and for StatefulSets,
  Deployments, ReplicaSets and ReplicationControllers;
* list and watch with ``labelSelector`` (``=``, ``==``, ``!=``, ``in``, ``notin``, ``key``,
  ``!key``, ``>``, ``<``) and ``fieldSelector`` (``=``, ``==``, ``!=`` on any dotted field:
  ``metadata.name``, ``metadata.namespace``, ``status.phase``, ``spec.nodeName``, ...); the list's
  ``metadata.resourceVersion``; watches from a resourceVersion (the events after it, from a cache of
  the last ``watch_cache_size`` events per resource; older ones answer 410 Gone) or from now with
  the current objects as ADDED first; ``timeoutSeconds``; an object that stops (starts) matching a
  selector is sent as DELETED (ADDED); DELETED carries the last state;
* delete: finalizers and ``deletionTimestamp`` (an object with finalizers is only marked, and goes
  when its last finalizer is removed; no finalizer can be added meanwhile), preconditions,
  ``propagationPolicy`` (Orphan removes the owner references; Background and Foreground delete
  the dependents named by ``ownerReferences[].uid``, recursively, once no other owner remains),
  ``deletecollection``; deleting a namespace deletes its content first; deleting a CRD removes its
  resource and objects; pods can be made to wait for their kubelet (``graceful_pod_deletion``);
  pod eviction (``kubectl drain``) deletes the pod unless a PodDisruptionBudget selecting it says
  ``status.disruptionsAllowed: 0`` (429);
* discovery (legacy ``/api``, ``/apis``, group and group-version documents) of the built-in
  resources (kmock's bundled list, from a K3s cluster) and of every CustomResourceDefinition stored,
  with the CRDs' short names, categories and subresources (scale as autoscaling/v1 Scale);
  creating a CRD object serves its resource; ``customresourcedefinitions`` are listable;
* ``kubectl get`` tables (``as=Table``) with the CRDs' additionalPrinterColumns;
* the CRD schema's defaults, and validators: callables that may refuse a create or an update
  with 422 and a message (:func:`pgherd_validator` checks pgherd objects with ``pgherd.api``);
  immutable fields of StatefulSets, Jobs, PVCs and immutable ConfigMaps/Secrets are refused as the
  real server refuses them; a PVC grows only when its StorageClass has ``allowVolumeExpansion``
  (else 403) and never shrinks; PVCs get the default StorageClass;
* a request log (:attr:`KubeEmulator.calls`): every resource request as an :class:`ApiCall`
  with its RBAC verb, group, resource, subresource, namespace, name, the user its bearer token maps
  to (``tokens``) and the HTTP status; :func:`calls_not_allowed` checks them against RBAC rules, and
  ``rbac`` enforces rules per user (403);
* serving: the ``kmock`` DSL still works (a reaction such as ``emulator['patch', kmock.resource(
  'apps/v1/statefulsets')] << 422`` answers instead of the emulation, which then does not change
  anything); :class:`LoopbackServer` serves an emulator in the current event loop,
  :class:`EmulatedApiServer` in a background thread (for kopf's KopfRunner and scripts);
  :func:`write_kubeconfig` points kubectl, kopf and the kubernetes client at it.

Usage (the fixtures of tests/kube/conftest.py wrap the same)::

    server = EmulatedApiServer(crds=[CRDS_DIR], validators=[pgherd_validator], tokens={"t": "me"})
    url = server.start()                       # http://127.0.0.1:PORT, served from a thread
    server.write_kubeconfig(path, token="t")   # for kubectl, or KUBECONFIG + kopf.login_with_kubeconfig
    kubernetes.client.ApiClient(kube_client_configuration(url, "t"))
    @kopf.on.login()                           # kopf takes the plain-http URL as it is
    def login(**_): return kopf_connection(url, "t")
    server.create(manifest); server.read("pgc", "default", "hippo"); server.calls  # on its loop
    server.stop()

    async with serving(KubeEmulator(crds=[CRDS_DIR])) as url: ...   # in the current event loop

What it does not do, compared with a real API server:

* no controllers: no scheduler, kubelet, StatefulSet, Job, Deployment, Endpoints, disruption or
  ServiceAccount token controllers; pods stay ``Pending`` and nothing creates pods. Only the garbage collector
  (owner cascade) and the namespace deletion run, synchronously within the deleting request
  (Foreground does not wait for the dependents' finalizers; an object whose owners never existed
  is not collected);
* strategic merge patch is a JSON merge patch: lists are replaced whole, never merged by key (no
  merging of containers, env or ports by name); ``$patch``/``$setElementOrder`` directives are
  dropped. Server-side apply (``application/apply-patch+yaml``) answers 415; ``dryRun`` answers 400;
  protobuf bodies answer 415, so kubectl's typed commands (``create configmap``, ``create
  secret``, ...) fail: use ``kubectl apply -f`` / ``create -f`` (JSON) instead;
* a custom resource's spec is validated only by a validator (the CRD's defaults are applied); its
  status, written through the status subresource, follows the CRD schema as on a real server (types,
  enums and required fields answer 422; unknown fields and nulls are pruned; defaults filled in; no
  CEL); built-in kinds are not validated beyond metadata, a few immutable fields
  and a PVC's storage request; no admission webhooks, quotas or limit ranges; no pod spec checks;
* no TLS; authentication is a bearer token mapped to a user name (or nobody); authorization only
  with ``rbac`` (ClusterRole-like rules per user, no bindings, no aggregation);
* ``generation`` is kept on every kind; no ``managedFields``, no field managers, no ``selfLink``;
  timestamps to the second; one storage per group/version: no conversion between versions;
* lists come in one page (``limit``/``continue`` ignored, the resourceVersion of a list is always
  the current one); no BOOKMARK events; watches are never converted to tables (``kubectl get -w``
  prints nothing useful); no protobuf, no aggregated discovery (clients fall back to the legacy
  documents); OpenAPI v3 documents list operations without schemas (enough for ``kubectl apply``
  to leave validation to the server), no OpenAPI v2 (``kubectl explain`` fails);
* services get a fake cluster IP from 10.96.0.0/16; PVCs stay ``Pending``.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import copy
import dataclasses
import datetime
import functools
import json
import random
import re
import threading
import uuid
import warnings
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import aiohttp
import aiohttp.test_utils
import aiohttp.web
import attrs
import jsonpatch
import jsonpointer
import kmock
import yaml
from kmock._internal.rendering import Response, StreamingError  # kmock 0.8 (pinned)

_T = TypeVar("_T")

REPO = Path(__file__).resolve().parents[2]
CRDS_DIR = REPO / "crds"

STANDARD_VERBS = ("create", "delete", "deletecollection", "get", "list", "patch", "update", "watch")
SUBRESOURCE_VERBS = ("get", "patch", "update")
DEFAULT_NAMESPACES = ("default", "kube-system", "kube-public", "kube-node-lease")
JSON_HEADERS = {"Content-Type": "application/json"}

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_QUALIFIED_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_GENERATE_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"  # the API server's: no vowels, no look-alikes
_PATH_TOKEN = re.compile(r"\.([^.\[\]]+)|\[(\d+)\]")

# Kinds the API server names with DNS labels rather than subdomains.
_LABEL_NAMED = {("", "namespaces"), ("", "services")}

# The built-in kinds with a scale subresource: (group, plural).
_BUILTIN_SCALE = {
    ("apps", "statefulsets"),
    ("apps", "deployments"),
    ("apps", "replicasets"),
    ("", "replicationcontrollers"),
}

# Groups in kmock's bundled list that a plain cluster does not serve (K3s add-ons).
_NOT_BUILTIN = {"metrics.k8s.io", "gateway.networking.k8s.io"}

# Spec fields that may change after creation, by kind; every other spec field is immutable.
_MUTABLE_SPEC = {
    ("apps", "statefulsets"): {
        "replicas",
        "ordinals",
        "template",
        "updateStrategy",
        "persistentVolumeClaimRetentionPolicy",
        "minReadySeconds",
    },
    ("", "persistentvolumeclaims"): {"resources", "volumeAttributesClassName"},
}
_IMMUTABLE_SPEC = {("batch", "jobs"): {"template", "selector", "completionMode"}}


# --------------------------------------------------------------------------------------------------
# Errors: the API server's Status documents.


class ApiError(Exception):
    """A failure answered as a ``Status`` document with its HTTP code, as the API server does."""

    def __init__(self, code: int, reason: str, message: str, details: Mapping[str, Any] | None = None):
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message
        self.details = dict(details or {})

    def status(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        }
        if self.details:
            body["details"] = self.details
        return body


class Refused(Exception):
    """Raised by a validator to refuse a write: answered 422 Invalid with these causes.

    ``causes`` is a message or a list of ``(field, message)`` pairs, such as
    ``[("spec.instances", "Invalid value: 20: must be at most 15")]``.
    """

    def __init__(self, causes: str | Sequence[tuple[str, str]]):
        self.causes: list[tuple[str, str]] = [("", causes)] if isinstance(causes, str) else list(causes)
        super().__init__("; ".join(f"{f}: {m}" if f else m for f, m in self.causes))


def _bad_request(message: str) -> ApiError:
    return ApiError(400, "BadRequest", message)


def _not_found_url() -> ApiError:
    return ApiError(404, "NotFound", "the server could not find the requested resource")


# --------------------------------------------------------------------------------------------------
# Resource types.


@dataclasses.dataclass(frozen=True)
class ScalePaths:
    """Where a kind keeps what its scale subresource shows (the CRD's ``subresources.scale``)."""

    spec_replicas_path: str
    status_replicas_path: str
    label_selector_path: str | None = None


@dataclasses.dataclass(frozen=True)
class ResourceType:
    """One served resource: what discovery says about it and how its objects behave."""

    group: str
    version: str
    plural: str
    kind: str
    singular: str
    namespaced: bool
    verbs: tuple[str, ...] = STANDARD_VERBS
    short_names: tuple[str, ...] = ()
    categories: tuple[str, ...] = ()
    subresources: frozenset[str] = frozenset()
    scale: ScalePaths | None = None
    printer_columns: tuple[Mapping[str, Any], ...] = ()
    schema: Mapping[str, Any] | None = None  # a CRD version's openAPIV3Schema
    crd: str | None = None  # the CustomResourceDefinition serving it

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.group, self.version, self.plural)

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def qualified(self) -> str:
        """``postgresclusters.pgherd.io``, ``pods``: as the API server names a resource in messages."""
        return f"{self.plural}.{self.group}" if self.group else self.plural

    @property
    def group_kind(self) -> str:
        """``PostgresCluster.pgherd.io``, ``Pod``: as the API server names a kind in messages."""
        return f"{self.kind}.{self.group}" if self.group else self.kind

    @property
    def ref(self) -> kmock.resource:
        return kmock.resource(self.group, self.version, self.plural)


@functools.cache
def builtin_resource_types() -> tuple[ResourceType, ...]:
    """The built-in resources of kmock's bundled discovery documents (taken from a K3s cluster)."""
    bundled = kmock.ResourcesArray()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # kmock 0.8 reads it with read_binary()
        bundled.load_bundled()
    types = []
    for res in bundled:
        info = bundled[res]
        if res.group in _NOT_BUILTIN or res.group is None or res.version is None or res.plural is None:
            continue
        scale = None
        if (res.group, res.plural) in _BUILTIN_SCALE:
            scale = ScalePaths(".spec.replicas", ".status.replicas", ".spec.selector")
        types.append(
            ResourceType(
                group=res.group,
                version=res.version,
                plural=res.plural,
                kind=info.kind or res.plural.capitalize(),
                singular=info.singular or (info.kind or res.plural).lower(),
                namespaced=bool(info.namespaced),
                verbs=tuple(sorted(info.verbs)) or STANDARD_VERBS,
                short_names=tuple(sorted(info.shortnames)),
                categories=tuple(sorted(info.categories)),
                subresources=frozenset(info.subresources),
                scale=scale,
            )
        )
    return tuple(types)


def crd_resource_types(crd: Mapping[str, Any]) -> list[ResourceType]:
    """The resources a CustomResourceDefinition serves: one per served version."""
    spec = crd["spec"]
    names = spec["names"]
    types = []
    for version in spec.get("versions") or ():
        if not version.get("served", True):
            continue
        subresources = version.get("subresources") or spec.get("subresources") or {}
        scale = None
        if "scale" in subresources:
            declared = subresources["scale"] or {}
            scale = ScalePaths(
                declared.get("specReplicasPath", ".spec.replicas"),
                declared.get("statusReplicasPath", ".status.replicas"),
                declared.get("labelSelectorPath"),
            )
        columns = version.get("additionalPrinterColumns") or spec.get("additionalPrinterColumns") or ()
        types.append(
            ResourceType(
                group=spec["group"],
                version=version["name"],
                plural=names["plural"],
                kind=names["kind"],
                singular=names.get("singular") or names["kind"].lower(),
                namespaced=spec.get("scope", "Namespaced") == "Namespaced",
                short_names=tuple(names.get("shortNames") or ()),
                categories=tuple(names.get("categories") or ()),
                subresources=frozenset(k for k in ("status", "scale") if k in subresources),
                scale=scale,
                printer_columns=tuple(columns),
                schema=(version.get("schema") or {}).get("openAPIV3Schema"),
                crd=crd["metadata"]["name"],
            )
        )
    return types


def load_manifests(*sources: str | Path | Mapping[str, Any]) -> list[dict[str, Any]]:
    """YAML documents from files, directories (every ``*.yaml`` in them, sorted) or dicts."""
    docs: list[dict[str, Any]] = []
    for source in sources:
        if isinstance(source, Mapping):
            docs.append(dict(source))
            continue
        path = Path(source)
        files = sorted(path.glob("*.yaml")) + sorted(path.glob("*.yml")) if path.is_dir() else [path]
        for file in files:
            docs.extend(doc for doc in yaml.safe_load_all(file.read_text()) if doc)
    return docs


def _version_priority(version: str) -> tuple[int, int, int]:
    """Kubernetes' version order: GA before beta before alpha, higher numbers first (sort ascending)."""
    match = re.fullmatch(r"v(\d+)(?:(alpha|beta)(\d+))?", version)
    if not match:
        return (3, 0, 0)
    stability = {"beta": 1, "alpha": 2}.get(match.group(2) or "", 0)
    return (stability, -int(match.group(1)), -int(match.group(3) or 0))


# --------------------------------------------------------------------------------------------------
# Paths, selectors, patches.


@dataclasses.dataclass(frozen=True)
class ApiTarget:
    """What a resource URL addresses: ``/apis/{group}/{version}[/namespaces/{ns}]/{plural}[/{name}[/{sub}]]``."""

    group: str
    version: str
    plural: str
    namespace: str | None
    name: str | None
    subresource: str | None


def parse_api_path(path: str) -> ApiTarget | None:
    """The resource a URL path addresses, or None for anything else (discovery, /version, ...)."""
    parts = [p for p in path.split("/") if p]
    if len(parts) >= 3 and parts[0] == "api":
        group, version, rest = "", parts[1], parts[2:]
    elif len(parts) >= 4 and parts[0] == "apis":
        group, version, rest = parts[1], parts[2], parts[3:]
    else:
        return None
    namespace = None
    namespace_subresource = len(rest) == 3 and group == "" and rest[2] in ("status", "finalize")
    if rest[0] == "namespaces" and len(rest) >= 3 and not namespace_subresource:
        namespace, rest = rest[1], rest[2:]
    return ApiTarget(
        group=group,
        version=version,
        plural=rest[0],
        namespace=namespace,
        name=rest[1] if len(rest) > 1 else None,
        subresource="/".join(rest[2:]) or None,
    )


def get_path(obj: Any, path: str) -> Any:
    """The value at a JSONPath-like ``.a.b[0].c`` (None when absent)."""
    value = obj
    for key, index in _PATH_TOKEN.findall(path):
        if key and isinstance(value, Mapping):
            value = value.get(key)
        elif index and isinstance(value, list) and int(index) < len(value):
            value = value[int(index)]
        else:
            return None
    return value


def set_path(obj: dict[str, Any], path: str, value: Any) -> None:
    """Set the value at a dotted ``.a.b.c`` path, creating the dicts on the way."""
    keys = [key for key, _ in _PATH_TOKEN.findall(path) if key]
    target = obj
    for key in keys[:-1]:
        target = target.setdefault(key, {})
    target[keys[-1]] = value


@dataclasses.dataclass(frozen=True)
class Requirement:
    """One requirement of a label selector: ``key op values``."""

    key: str
    op: str  # = != in notin exists !exists gt lt
    values: tuple[str, ...] = ()

    def matches(self, labels: Mapping[str, str]) -> bool:
        present = self.key in labels
        value = labels.get(self.key)
        if self.op in ("=", "in"):
            return present and value in self.values
        if self.op in ("!=", "notin"):
            return not present or value not in self.values
        if self.op == "exists":
            return present
        if self.op == "!exists":
            return not present
        try:
            number, bound = int(value or ""), int(self.values[0])
        except ValueError:
            return False
        return number > bound if self.op == "gt" else number < bound


def _split_top_level(text: str) -> list[str]:
    parts, depth, current = [], 0, ""
    for char in text:
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
            continue
        depth += {"(": 1, ")": -1}.get(char, 0)
        current += char
    parts.append(current)
    return [part.strip() for part in parts if part.strip()]


def parse_label_selector(text: str) -> list[Requirement]:
    """Parse a label selector as in ``?labelSelector=``; ValueError when it is not one."""
    requirements = []
    for part in _split_top_level(text or ""):
        if match := re.fullmatch(r"([^\s!=<>(),]+)\s+(in|notin)\s+\(([^()]*)\)", part):
            values = tuple(v.strip() for v in match.group(3).split(",") if v.strip())
            requirements.append(Requirement(match.group(1), match.group(2), values))
        elif match := re.fullmatch(r"!\s*([^\s!=<>(),]+)", part):
            requirements.append(Requirement(match.group(1), "!exists"))
        elif match := re.fullmatch(r"([^\s!=<>(),]+)\s*(==|=|!=|>|<)\s*([^\s!=<>(),]*)", part):
            op = {"==": "=", ">": "gt", "<": "lt"}.get(match.group(2), match.group(2))
            requirements.append(Requirement(match.group(1), op, (match.group(3),)))
        elif re.fullmatch(r"[^\s!=<>(),]+", part):
            requirements.append(Requirement(part, "exists"))
        else:
            raise ValueError(f"unable to parse requirement: {part!r}")
    return requirements


def parse_field_selector(text: str) -> list[tuple[str, str, str]]:
    """Parse a field selector into ``(path, op, value)`` with op ``=`` or ``!=``."""
    result = []
    for part in _split_top_level(text or ""):
        match = re.fullmatch(r"([A-Za-z0-9_.\-]+)\s*(==|=|!=)\s*(.*)", part)
        if not match:
            raise ValueError(f"invalid selector: {part!r}; can't understand {part!r}")
        result.append((match.group(1), "!=" if match.group(2) == "!=" else "=", match.group(3).strip()))
    return result


def _field_text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def selector_string(selector: Any) -> str | None:
    """A LabelSelector dict (matchLabels, matchExpressions) as its string form, as Scale shows it."""
    if not isinstance(selector, Mapping):
        return selector if isinstance(selector, str) else None
    parts = [f"{k}={v}" for k, v in sorted((selector.get("matchLabels") or {}).items())]
    for expr in selector.get("matchExpressions") or ():
        key, op, values = expr.get("key"), expr.get("operator"), expr.get("values") or []
        if op == "In":
            parts.append(f"{key} in ({','.join(values)})")
        elif op == "NotIn":
            parts.append(f"{key} notin ({','.join(values)})")
        elif op == "Exists":
            parts.append(str(key))
        elif op == "DoesNotExist":
            parts.append(f"!{key}")
    return ",".join(parts)


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch: dicts merge recursively, null deletes a key, anything else replaces."""
    if not isinstance(patch, Mapping):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, Mapping) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def _strip_directives(patch: Any) -> Any:
    """Drop strategic-merge-patch directives ($patch, $setElementOrder/..., $retainKeys, ...)."""
    if isinstance(patch, Mapping):
        return {k: _strip_directives(v) for k, v in patch.items() if not str(k).startswith("$")}
    if isinstance(patch, list):
        return [_strip_directives(item) for item in patch]
    return patch


def apply_patch(obj: Mapping[str, Any], patch: Any, content_type: str) -> Any:
    """Apply a PATCH body of the given Content-Type to an object; ApiError when it cannot."""
    media = content_type.split(";")[0].strip().lower()
    if media in ("application/merge-patch+json", "application/strategic-merge-patch+json"):
        if not isinstance(patch, Mapping):
            raise _bad_request("the body of a merge patch must be a JSON object")
        if media == "application/strategic-merge-patch+json":
            patch = _strip_directives(patch)
        return merge_patch(obj, patch)
    if media == "application/json-patch+json":
        if not isinstance(patch, list):
            raise _bad_request("the body of a JSON patch must be a JSON array of operations")
        try:
            return jsonpatch.apply_patch(copy.deepcopy(dict(obj)), patch)
        except (jsonpatch.JsonPatchException, jsonpointer.JsonPointerException, TypeError, KeyError) as exc:
            raise ApiError(
                422, "Invalid", f"the server rejected our request due to an error in our request: {exc}"
            ) from None
    raise ApiError(
        415,
        "UnsupportedMediaType",
        f'the body of the request was in an unknown format - accepted media types include: application/json-patch+json, application/merge-patch+json, application/strategic-merge-patch+json (got "{media}"; server-side apply is not emulated)',
    )


def apply_schema_defaults(schema: Mapping[str, Any], value: Any) -> Any:
    """Fill in an OpenAPI v3 schema's ``default`` values, as the API server does for custom resources."""
    if isinstance(value, dict):
        properties = schema.get("properties") or {}
        result = dict(value)
        for name, prop in properties.items():
            if name not in result and "default" in prop:
                result[name] = copy.deepcopy(prop["default"])
            if name in result:
                result[name] = apply_schema_defaults(prop, result[name])
        additional = schema.get("additionalProperties")
        if isinstance(additional, Mapping):
            for name in result:
                if name not in properties:
                    result[name] = apply_schema_defaults(additional, result[name])
        return result
    if isinstance(value, list) and isinstance(schema.get("items"), Mapping):
        return [apply_schema_defaults(schema["items"], item) for item in value]
    return value


_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "object": (dict,),
    "array": (list,),
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
}


def structural(schema: Mapping[str, Any], value: Any, path: str) -> tuple[Any, list[tuple[str, str]]]:
    """``value`` as a real API server stores it under a CRD's structural ``schema``: unknown fields
    pruned (unless ``x-kubernetes-preserve-unknown-fields``), nulls pruned where not ``nullable``,
    defaults filled in; and the type, enum and required errors it answers 422 for (no CEL)."""
    errors: list[tuple[str, str]] = []
    if schema.get("x-kubernetes-int-or-string"):
        if isinstance(value, bool) or not isinstance(value, int | str):
            errors.append((path, f"Invalid value: {json.dumps(value)}: must be an integer or a string"))
        return value, errors
    kind = schema.get("type")
    if kind in _JSON_TYPES and (
        not isinstance(value, _JSON_TYPES[kind])
        or (isinstance(value, bool) and kind in ("integer", "number"))
    ):
        errors.append(
            (path, f'Invalid value: "{type(value).__name__}": {path} in body must be of type {kind}')
        )
        return value, errors
    if "enum" in schema and value not in schema["enum"]:
        allowed = ", ".join(json.dumps(v) for v in schema["enum"])
        errors.append((path, f"Unsupported value: {json.dumps(value)}: supported values: {allowed}"))
    if isinstance(value, dict):
        properties = schema.get("properties") or {}
        additional = schema.get("additionalProperties")
        preserve = bool(schema.get("x-kubernetes-preserve-unknown-fields"))
        if not properties and (preserve or additional is True):
            return value, errors
        result: dict[str, Any] = {}
        for name, item in value.items():
            sub = properties.get(name)
            if sub is None and isinstance(additional, Mapping):
                sub = additional
            if sub is None:
                if preserve:
                    result[name] = item
                continue  # pruned
            if item is None and not sub.get("nullable"):
                continue  # pruned
            result[name], found = structural(sub, item, f"{path}.{name}")
            errors += found
        for name, sub in properties.items():
            if name not in result and "default" in sub:
                result[name] = copy.deepcopy(sub["default"])
        for name in schema.get("required") or []:
            if name not in result:
                errors.append((f"{path}.{name}", "Required value"))
        return result, errors
    if isinstance(value, list) and isinstance(schema.get("items"), Mapping):
        items = []
        for index, item in enumerate(value):
            stored, found = structural(schema["items"], item, f"{path}[{index}]")
            items.append(stored)
            errors += found
        return items, errors
    return value, errors


def _now() -> str:
    return datetime.datetime.now(tz=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _age(timestamp: str) -> str:
    try:
        then = datetime.datetime.strptime(timestamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.UTC)
    except (TypeError, ValueError):
        return "<unknown>"
    seconds = max(0, int((datetime.datetime.now(tz=datetime.UTC) - then).total_seconds()))
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= 2 * size:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def _spec_part(obj: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in obj.items() if k not in ("metadata", "status", "apiVersion", "kind")}


# --------------------------------------------------------------------------------------------------
# The request log and RBAC.


@dataclasses.dataclass
class ApiCall:
    """One resource request, as RBAC sees it: ``verb`` is an RBAC verb (get, list, watch, create,
    update, patch, delete, deletecollection); ``user`` the name its bearer token maps to (None
    without a known token); ``code`` the HTTP status (0 while a watch is still streaming)."""

    verb: str
    api_group: str
    version: str
    resource: str
    subresource: str | None
    namespace: str | None
    name: str | None
    user: str | None = None
    code: int = 0

    @property
    def rbac_resource(self) -> str:
        """``pods/status``, ``postgresclusters``: the resource as an RBAC rule names it."""
        return f"{self.resource}/{self.subresource}" if self.subresource else self.resource

    def astuple(self) -> tuple[str, str, str, str | None, str | None, str | None]:
        """``(verb, apiGroup, resource, subresource, namespace, name)``."""
        return (self.verb, self.api_group, self.resource, self.subresource, self.namespace, self.name)


def rule_allows(rule: Mapping[str, Any], call: ApiCall) -> bool:
    """Whether one RBAC PolicyRule (a Role's or ClusterRole's ``rules[]`` item) allows a request."""
    groups = rule.get("apiGroups") or []
    resources = rule.get("resources") or []
    verbs = rule.get("verbs") or []
    names = rule.get("resourceNames") or []
    if "*" not in groups and call.api_group not in groups:
        return False
    wanted = call.rbac_resource
    if not (
        "*" in resources
        or wanted in resources
        or (call.subresource and f"*/{call.subresource}" in resources)
        or (call.subresource and f"{call.resource}/*" in resources)
    ):
        return False
    if "*" not in verbs and call.verb not in verbs:
        return False
    return not names or (call.name is not None and call.name in names)


def calls_not_allowed(calls: Iterable[ApiCall], rules: Iterable[Mapping[str, Any]]) -> list[ApiCall]:
    """The requests that no rule allows (each distinct request once), e.g. against the chart's ClusterRole."""
    rules = list(rules)
    seen: set[tuple[Any, ...]] = set()
    result = []
    for call in calls:
        key = (call.verb, call.api_group, call.rbac_resource, call.name)
        if key in seen:
            continue
        seen.add(key)
        if not any(rule_allows(rule, call) for rule in rules):
            result.append(call)
    return result


def rbac_verb(method: str, target: ApiTarget, params: Mapping[str, str]) -> str:
    """The RBAC verb of a request."""
    method = method.upper()
    if method == "GET":
        if params.get("watch", "").lower() in ("true", "1"):
            return "watch"
        return "get" if target.name else "list"
    if method == "DELETE":
        return "delete" if target.name else "deletecollection"
    return {"POST": "create", "PUT": "update", "PATCH": "patch"}.get(method, method.lower())


# --------------------------------------------------------------------------------------------------
# Validators.


@dataclasses.dataclass(frozen=True)
class Admission:
    """What a validator sees: the candidate object as it would be stored, and the stored one."""

    operation: str  # CREATE | UPDATE
    resource: ResourceType
    subresource: str | None  # None, "status" or "scale"
    object: dict[str, Any]
    old_object: dict[str, Any] | None
    user: str | None


Validator = Callable[[Admission], Mapping[str, Any] | None]
"""Returns None to accept, a mapping to store instead (a mutating admission), or raises Refused."""


def pgherd_validator(admission: Admission) -> dict[str, Any] | None:
    """Validate pgherd.io objects with ``pgherd.api.admission`` (what ``pgherd validate`` does): the
    CRD schema, its defaults and its CEL rules (with the transition rules on updates). Status
    writes and writes that leave the spec as it was are not checked (CEL in Python costs tens of
    milliseconds per object); a refused object answers 422 with every reason."""
    if admission.resource.group != "pgherd.io" or admission.subresource == "status":
        return None
    old = admission.old_object
    if old is not None and _spec_part(admission.object) == _spec_part(old):
        return None  # a metadata-only write (kopf's annotations, finalizers): the spec passed before
    from pgherd.api.admission import ManifestRefused, admit

    try:
        admitted = admit(admission.object, admission.old_object)
    except ManifestRefused as exc:
        raise Refused([(error.path, error.message) for error in exc.errors]) from None
    result = dict(admitted)
    if "status" in admission.object:
        result["status"] = admission.object["status"]
    return result


# --------------------------------------------------------------------------------------------------
# The emulator.


@dataclasses.dataclass(frozen=True)
class _Event:
    rv: int
    type: str
    obj: dict[str, Any]
    old: dict[str, Any] | None


@dataclasses.dataclass(frozen=True)
class _Filter:
    namespace: str | None
    name: str | None
    labels: list[Requirement]
    fields: list[tuple[str, str, str]]

    def matches(self, obj: Mapping[str, Any] | None) -> bool:
        if obj is None:
            return False
        meta = obj.get("metadata") or {}
        if self.namespace is not None and meta.get("namespace") != self.namespace:
            return False
        if self.name is not None and meta.get("name") != self.name:
            return False
        labels = meta.get("labels") or {}
        if not all(req.matches(labels) for req in self.labels):
            return False
        for path, op, value in self.fields:
            if (_field_text(get_path(obj, "." + path)) == value) != (op == "="):
                return False
        return True


Key = tuple[str | None, str]  # (namespace, name)


@attrs.define(kw_only=True)
class KubeEmulator(kmock.KubernetesEmulator):
    """kmock's Kubernetes emulator behaving like a real API server (see the module's docstring).

    Options: ``crds`` (files, directories or dicts of CustomResourceDefinitions to store at start;
    :data:`CRDS_DIR` for pgherd's), ``validators``, ``tokens`` (bearer token -> user name),
    ``require_token`` (401 without a known token), ``rbac`` (user -> PolicyRules, enforced with
    403; users not in it are not checked), ``namespaces`` created at start, ``strict_namespaces``
    (False: namespaces spring into existence when used), ``graceful_pod_deletion`` (pods with a
    ``spec.nodeName`` are only marked until deleted with gracePeriodSeconds=0, as a kubelet does),
    ``watch_cache_size`` (events kept per resource for watches from a resourceVersion),
    ``history_limit`` (versions kept per object in kmock's ``objects``; None: all),
    ``record_requests`` (False: kmock's ``requests`` list is not kept; ``calls`` always is).

    The store is changed only from the event loop the emulator serves in: from other threads, go
    through :class:`EmulatedApiServer` (whose helpers hop onto that loop).
    """

    crds: Sequence[str | Path | Mapping[str, Any]] = ()
    validators: list[Validator] = attrs.field(factory=list)
    tokens: Mapping[str, str] = attrs.field(factory=dict)
    require_token: bool = False
    rbac: Mapping[str, Sequence[Mapping[str, Any]]] | None = None
    namespaces: Sequence[str] = DEFAULT_NAMESPACES
    strict_namespaces: bool = True
    graceful_pod_deletion: bool = False
    watch_cache_size: int = 10_000
    history_limit: int | None = 20
    record_requests: bool = True
    record_calls: bool = True

    calls: list[ApiCall] = attrs.field(factory=list, init=False)
    _types: dict[tuple[str, str, str], ResourceType] = attrs.field(factory=dict, init=False)
    _store: dict[tuple[str, str, str], dict[Key, dict[str, Any]]] = attrs.field(factory=dict, init=False)
    _uids: dict[str, tuple[tuple[str, str, str], Key]] = attrs.field(factory=dict, init=False)
    _dependents: dict[str, set[tuple[tuple[str, str, str], Key]]] = attrs.field(factory=dict, init=False)
    _policies: dict[str, str] = attrs.field(factory=dict, init=False)
    _log: dict[tuple[str, str, str], list[_Event]] = attrs.field(factory=dict, init=False)
    _log_floor: dict[tuple[str, str, str], int] = attrs.field(factory=dict, init=False)
    _wakeups: dict[tuple[str, str, str], asyncio.Event] = attrs.field(factory=dict, init=False)
    _contexts: dict[int, tuple[ApiTarget, str, str | None]] = attrs.field(factory=dict, init=False)
    _rv: int = attrs.field(default=0, init=False)
    _ips: int = attrs.field(default=0, init=False)
    _stopping: bool = attrs.field(default=False, init=False)
    _own_payloads: set[int] = attrs.field(factory=set, init=False)

    def __attrs_post_init__(self) -> None:
        # kmock's scaffold: discovery routes (served by the overrides below) and the 404 fallback.
        # Not KubernetesEmulator's own routes and state: this class keeps its own store.
        kmock.KubernetesScaffold.__attrs_post_init__(self)
        self.fallback[self._is_resource_request] << self._serve_resource
        # The same discovery documents with a trailing slash (the kubernetes client asks for /apis/).
        self.fallback["get", re.compile(r"/api/")] << self._serve_api
        self.fallback["get", re.compile(r"/apis/")] << self._serve_apis
        self.fallback["get", re.compile(r"/apis/[^/]+/")] << self._serve_group
        self.fallback["get", re.compile(r"/(api/[^/]+|apis/[^/]+/[^/]+)/")] << self._serve_version
        self.fallback["get", re.compile(r"/openapi/v3(/.*)?")] << self._serve_openapi
        self.fallback["get", re.compile(r"/(healthz|livez|readyz)")] << b"ok"
        self._own_payloads = {id(payload) for payload in self._payloads}
        for rt in builtin_resource_types():
            self._register(rt)
        for name in self.namespaces:
            self.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
        for doc in load_manifests(*self.crds):
            self.create(doc)

    # ---------------------------------------------------------------------------------------------
    # Resource types.

    def _register(self, rt: ResourceType) -> None:
        self._types[rt.key] = rt
        self._store.setdefault(rt.key, {})
        self.resources[rt.ref] = kmock.ResourceInfo(
            namespaced=rt.namespaced,
            kind=rt.kind,
            singular=rt.singular,
            verbs=set(rt.verbs),
            shortnames=set(rt.short_names),
            categories=set(rt.categories),
            subresources=set(rt.subresources),
        )

    def _unregister_crd(self, crd_name: str) -> None:
        for rt in [rt for rt in self._types.values() if rt.crd == crd_name]:
            for key in list(self._store.get(rt.key, {})):
                self._drop(rt, key, "Background")
            del self._types[rt.key]
            del self.resources[rt.ref]
            self._wake(rt)

    @property
    def resource_types(self) -> list[ResourceType]:
        return list(self._types.values())

    def resource_type(self, ref: str) -> ResourceType:
        """A served resource by ``group/version/plural``, ``v1/plural``, plural, singular, short name
        or kind (the preferred version); KeyError when none is served."""
        parts = ref.split("/")
        if len(parts) == 3 and tuple(parts) in self._types:
            return self._types[(parts[0], parts[1], parts[2])]
        if len(parts) == 2 and ("", parts[0], parts[1]) in self._types:
            return self._types[("", parts[0], parts[1])]
        plural, _, group = ref.partition(".")
        candidates = [
            rt
            for rt in self._types.values()
            if (
                ref in (rt.plural, rt.singular, rt.kind)
                or ref.lower() in rt.short_names
                or ref == rt.kind.lower()
            )
            or (group and plural == rt.plural and group == rt.group)
        ]
        if not candidates:
            raise KeyError(f"no resource {ref!r} is served")
        candidates.sort(key=lambda rt: (rt.group != "", _version_priority(rt.version)))
        return candidates[0]

    def _type_of(self, body: Mapping[str, Any]) -> ResourceType:
        api_version, kind = body.get("apiVersion", ""), body.get("kind", "")
        for rt in self._types.values():
            if rt.api_version == api_version and rt.kind == kind:
                return rt
        raise KeyError(f"no resource serves {api_version} {kind}")

    # ---------------------------------------------------------------------------------------------
    # The store: synchronous, atomic within the event loop.

    def _next_rv(self) -> int:
        self._rv += 1
        return self._rv

    @property
    def resource_version(self) -> str:
        """The current (latest) resourceVersion."""
        return str(self._rv)

    def _key(self, rt: ResourceType, namespace: str | None, name: str) -> Key:
        return (namespace if rt.namespaced else None, name)

    def _get(self, rt: ResourceType, namespace: str | None, name: str) -> dict[str, Any]:
        obj = self._store[rt.key].get(self._key(rt, namespace, name))
        if obj is None:
            raise ApiError(
                404,
                "NotFound",
                f'{rt.qualified} "{name}" not found',
                {"name": name, "group": rt.group, "kind": rt.plural},
            )
        return obj

    def _invalid(self, rt: ResourceType, name: str, causes: Sequence[tuple[str, str]]) -> ApiError:
        texts = [f"{field}: {message}" if field else message for field, message in causes]
        summary = texts[0] if len(texts) == 1 else "[" + ", ".join(texts) + "]"
        return ApiError(
            422,
            "Invalid",
            f'{rt.group_kind} "{name}" is invalid: {summary}',
            {
                "name": name,
                "group": rt.group,
                "kind": rt.kind,
                "causes": [{"reason": "FieldValueInvalid", "message": m, "field": f} for f, m in causes],
            },
        )

    def _check_metadata(self, rt: ResourceType, meta: Mapping[str, Any]) -> list[tuple[str, str]]:
        causes = []
        name = meta.get("name", "")
        label_named = (rt.group, rt.plural) in _LABEL_NAMED
        pattern, limit = (_DNS_LABEL, 63) if label_named else (_DNS_SUBDOMAIN, 253)
        if not isinstance(name, str) or not pattern.match(name) or len(name) > limit:
            what = "RFC 1123 label" if label_named else "RFC 1123 subdomain"
            causes.append(
                (
                    "metadata.name",
                    f"Invalid value: {json.dumps(name)}: a lowercase {what} must consist of lower case alphanumeric characters, '-' or '.', and must start and end with an alphanumeric character",
                )
            )
        for field in ("labels", "annotations"):
            entries = meta.get(field) or {}
            if not isinstance(entries, Mapping):
                causes.append((f"metadata.{field}", "Invalid value: must be a map of strings"))
                continue
            for key, value in entries.items():
                prefix, _, short = key.rpartition("/")
                if (prefix and (not _DNS_SUBDOMAIN.match(prefix) or len(prefix) > 253)) or not (
                    _QUALIFIED_NAME.match(short) and len(short) <= 63
                ):
                    causes.append(
                        (
                            f"metadata.{field}",
                            f"Invalid value: {json.dumps(key)}: name part must be a valid qualified name",
                        )
                    )
                if not isinstance(value, str):
                    causes.append(
                        (f"metadata.{field}.{key}", f"Invalid value: {json.dumps(value)}: must be a string")
                    )
                elif field == "labels" and value and not (_QUALIFIED_NAME.match(value) and len(value) <= 63):
                    causes.append(
                        (
                            f"metadata.labels.{key}",
                            f"Invalid value: {json.dumps(value)}: a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character (at most 63)",
                        )
                    )
        for ref in meta.get("ownerReferences") or ():
            if not all(
                isinstance(ref, Mapping) and ref.get(k) for k in ("apiVersion", "kind", "name", "uid")
            ):
                causes.append(
                    ("metadata.ownerReferences", "Invalid value: apiVersion, kind, name and uid are required")
                )
        return causes

    def _admit(
        self,
        operation: str,
        rt: ResourceType,
        old: dict[str, Any] | None,
        candidate: dict[str, Any],
        subresource: str | None,
        user: str | None,
    ) -> dict[str, Any]:
        if rt.schema is not None and subresource != "status":
            metadata = candidate.get("metadata")
            candidate = apply_schema_defaults(
                rt.schema, {k: v for k, v in candidate.items() if k != "metadata"}
            )
            candidate["metadata"] = metadata
        name = candidate["metadata"].get("name", "")
        status_schema = ((rt.schema or {}).get("properties") or {}).get("status")
        if status_schema is not None and subresource == "status" and "status" in candidate:
            candidate["status"], causes = structural(status_schema, candidate["status"], "status")
            if causes:
                raise self._invalid(rt, name, causes)
        for validator in self.validators:
            admission = Admission(operation, rt, subresource, copy.deepcopy(candidate), old, user)
            try:
                replaced = validator(admission)
            except Refused as exc:
                raise self._invalid(rt, name, exc.causes) from None
            if replaced is not None:
                metadata = candidate["metadata"]
                candidate = copy.deepcopy(dict(replaced))
                candidate["metadata"] = metadata  # validators never change what the server owns
        return candidate

    def _check_namespace_open(self, namespace: str) -> None:
        ns_type = self._types[("", "v1", "namespaces")]
        ns = self._store[ns_type.key].get((None, namespace))
        if ns is None:
            if self.strict_namespaces:
                raise ApiError(
                    404,
                    "NotFound",
                    f'namespaces "{namespace}" not found',
                    {"name": namespace, "kind": "namespaces"},
                )
            self.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}})
        elif ns["metadata"].get("deletionTimestamp"):
            raise ApiError(
                403,
                "Forbidden",
                f"unable to create new content in namespace {namespace} because it is being terminated",
            )

    def create_object(
        self, rt: ResourceType, namespace: str | None, body: Any, *, user: str | None = None
    ) -> dict[str, Any]:
        """Create an object as POST does; returns the stored object."""
        if not isinstance(body, Mapping) or not isinstance(body.get("metadata", {}), Mapping):
            raise _bad_request("the body of the request was in an unknown format: expected an object")
        if body.get("apiVersion") not in (None, rt.api_version) or body.get("kind") not in (None, rt.kind):
            raise _bad_request(
                f"the API version and kind in the data ({body.get('apiVersion')}, {body.get('kind')}) do not match the expected ones ({rt.api_version}, {rt.kind})"
            )
        obj = copy.deepcopy(dict(body))
        obj["apiVersion"], obj["kind"] = rt.api_version, rt.kind
        meta = obj["metadata"] = dict(obj.get("metadata") or {})
        if rt.namespaced:
            if namespace is None:
                raise _not_found_url()
            if meta.get("namespace") not in (None, "", namespace):
                raise _bad_request(
                    "the namespace of the provided object does not match the namespace sent on the request"
                )
            meta["namespace"] = namespace
            self._check_namespace_open(namespace)
        else:
            meta.pop("namespace", None)
        store = self._store[rt.key]
        if not meta.get("name"):
            prefix = meta.get("generateName")
            if not prefix:
                raise self._invalid(
                    rt, "", [("metadata.name", "Required value: name or generateName is required")]
                )
            while True:
                meta["name"] = prefix + "".join(random.choices(_GENERATE_ALPHABET, k=5))
                if self._key(rt, namespace, meta["name"]) not in store:
                    break
        name = meta["name"]
        causes = self._check_metadata(rt, meta)
        if causes:
            raise self._invalid(rt, str(name), causes)
        key = self._key(rt, namespace, name)
        if key in store:
            raise ApiError(
                409,
                "AlreadyExists",
                f'{rt.qualified} "{name}" already exists',
                {"name": name, "group": rt.group, "kind": rt.plural},
            )
        for field in (
            "resourceVersion",
            "deletionTimestamp",
            "deletionGracePeriodSeconds",
            "selfLink",
            "managedFields",
        ):
            meta.pop(field, None)
        meta["uid"] = str(uuid.uuid4())
        meta["creationTimestamp"] = _now()
        meta["generation"] = 1
        self._prepare_create(rt, obj)
        obj = self._admit("CREATE", rt, None, obj, None, user)
        _drop_empty(obj["metadata"])
        obj["metadata"]["resourceVersion"] = str(self._next_rv())
        self._put(rt, key, obj, None)
        self._emit(rt, "ADDED", obj, None)
        if rt.key == ("apiextensions.k8s.io", "v1", "customresourcedefinitions"):
            for served in crd_resource_types(obj):
                self._register(served)
        return obj

    def _prepare_create(self, rt: ResourceType, obj: dict[str, Any]) -> None:
        """What the real server's strategies do on create for the kinds it knows."""
        if "status" in rt.subresources:
            obj.pop("status", None)
        kind = (rt.group, rt.plural)
        if kind == ("", "pods"):
            obj["status"] = {"phase": "Pending"}
        elif kind == ("", "namespaces"):
            obj.setdefault("spec", {"finalizers": ["kubernetes"]})
            obj["status"] = {"phase": "Active"}
            obj["metadata"].setdefault("labels", {})["kubernetes.io/metadata.name"] = obj["metadata"]["name"]
        elif kind == ("", "persistentvolumeclaims"):
            obj["status"] = {"phase": "Pending"}
            spec = obj.setdefault("spec", {})
            if "storageClassName" not in spec and (default := self._default_storage_class()):
                spec["storageClassName"] = default
        elif kind == ("", "services"):
            spec = obj.setdefault("spec", {})
            if spec.get("clusterIP") != "None" and spec.get("type") != "ExternalName":
                self._ips += 1
                spec["clusterIP"] = f"10.96.{self._ips // 250}.{self._ips % 250 + 1}"
                spec["clusterIPs"] = [spec["clusterIP"]]
            spec.setdefault("type", "ClusterIP")
        elif kind == ("apiextensions.k8s.io", "customresourcedefinitions"):
            spec, names = obj.get("spec") or {}, (obj.get("spec") or {}).get("names") or {}
            if obj["metadata"]["name"] != f"{names.get('plural')}.{spec.get('group')}":
                raise self._invalid(
                    rt,
                    obj["metadata"]["name"],
                    [("metadata.name", 'Invalid value: must be spec.names.plural+"."+spec.group')],
                )
            obj["status"] = {
                "acceptedNames": names,
                "conditions": [
                    {
                        "type": "NamesAccepted",
                        "status": "True",
                        "reason": "NoConflicts",
                        "lastTransitionTime": _now(),
                    },
                    {
                        "type": "Established",
                        "status": "True",
                        "reason": "InitialNamesAccepted",
                        "lastTransitionTime": _now(),
                    },
                ],
                "storedVersions": [v["name"] for v in spec.get("versions") or () if v.get("storage")],
            }

    def _default_storage_class(self) -> str | None:
        for obj in self._store.get(("storage.k8s.io", "v1", "storageclasses"), {}).values():
            annotations = obj["metadata"].get("annotations") or {}
            if annotations.get("storageclass.kubernetes.io/is-default-class") == "true":
                return str(obj["metadata"]["name"])
        return None

    def replace_object(
        self,
        rt: ResourceType,
        namespace: str | None,
        name: str,
        body: Any,
        *,
        subresource: str | None = None,
        user: str | None = None,
    ) -> dict[str, Any]:
        """Replace an object (or its status) as PUT does; returns the stored object."""
        old = self._get(rt, namespace, name)
        if not isinstance(body, Mapping) or not isinstance(body.get("metadata", {}), Mapping):
            raise _bad_request("the body of the request was in an unknown format: expected an object")
        meta = body.get("metadata") or {}
        if meta.get("name") not in (None, name):
            raise _bad_request(
                f"the name of the object ({meta.get('name')}) does not match the name on the URL ({name})"
            )
        if rt.namespaced and meta.get("namespace") not in (None, "", namespace):
            raise _bad_request(
                "the namespace of the provided object does not match the namespace sent on the request"
            )
        self._check_precondition(rt, old, meta.get("resourceVersion"))
        if not meta.get("resourceVersion") and rt.crd is not None:
            raise self._invalid(
                rt,
                name,
                [("metadata.resourceVersion", "Invalid value: 0x0: must be specified for an update")],
            )
        new = copy.deepcopy(dict(body))
        new.setdefault("metadata", {})
        new["metadata"].setdefault("name", name)
        if rt.namespaced:
            new["metadata"].setdefault("namespace", namespace)
        return self._commit_update(rt, old, new, subresource, user)

    def patch_object(
        self,
        rt: ResourceType,
        namespace: str | None,
        name: str,
        patch: Any,
        content_type: str = "application/merge-patch+json",
        *,
        subresource: str | None = None,
        user: str | None = None,
    ) -> dict[str, Any]:
        """Patch an object (or its status) as PATCH does; returns the stored object."""
        old = self._get(rt, namespace, name)
        patched = apply_patch(old, patch, content_type)
        if not isinstance(patched, dict):
            raise self._invalid(rt, name, [("", "Invalid value: the patched object is not an object")])
        if isinstance(patch, Mapping) and isinstance(patch.get("metadata"), Mapping):
            self._check_precondition(rt, old, patch["metadata"].get("resourceVersion"))
        return self._commit_update(rt, old, patched, subresource, user)

    def _check_precondition(self, rt: ResourceType, old: Mapping[str, Any], resource_version: Any) -> None:
        if resource_version and str(resource_version) != old["metadata"]["resourceVersion"]:
            name = old["metadata"]["name"]
            raise ApiError(
                409,
                "Conflict",
                f'Operation cannot be fulfilled on {rt.qualified} "{name}": the object has been modified; please apply your changes to the latest version and try again',
                {"name": name, "group": rt.group, "kind": rt.plural},
            )

    def _commit_update(
        self,
        rt: ResourceType,
        old: dict[str, Any],
        new: dict[str, Any],
        subresource: str | None,
        user: str | None,
        *,
        admit: bool = True,
    ) -> dict[str, Any]:
        name = old["metadata"]["name"]
        old_meta = old["metadata"]
        if not isinstance(new.get("metadata", {}), Mapping):
            raise self._invalid(rt, name, [("metadata", "Invalid value: must be an object")])
        if subresource == "status":
            candidate = copy.deepcopy(old)
            if "status" in new:
                candidate["status"] = copy.deepcopy(new["status"])
            else:
                candidate.pop("status", None)
        else:
            candidate = copy.deepcopy(new)
            meta = candidate["metadata"] = dict(candidate.get("metadata") or {})
            for field in ("name", "namespace"):
                if meta.get(field, old_meta.get(field)) != old_meta.get(field):
                    raise self._invalid(
                        rt, name, [(f"metadata.{field}", "Invalid value: field is immutable")]
                    )
            for field in (
                "uid",
                "creationTimestamp",
                "deletionTimestamp",
                "deletionGracePeriodSeconds",
                "generation",
                "name",
                "namespace",
            ):
                if field in old_meta:
                    meta[field] = old_meta[field]
                else:
                    meta.pop(field, None)
            meta.pop("managedFields", None)
            meta.pop("selfLink", None)
            candidate["apiVersion"], candidate["kind"] = rt.api_version, rt.kind
            if "status" in rt.subresources:
                if "status" in old:
                    candidate["status"] = copy.deepcopy(old["status"])
                else:
                    candidate.pop("status", None)
            if old_meta.get("deletionTimestamp"):
                added = set(meta.get("finalizers") or ()) - set(old_meta.get("finalizers") or ())
                if added:
                    raise self._invalid(
                        rt,
                        name,
                        [
                            (
                                "metadata.finalizers",
                                f"Forbidden: no new finalizers can be added if the object is being deleted, found new finalizers {sorted(added)}",
                            )
                        ],
                    )
            causes = self._check_metadata(rt, meta) + self._check_immutable(rt, old, candidate)
            if causes:
                raise self._invalid(rt, name, causes)
        candidate["metadata"]["resourceVersion"] = old_meta["resourceVersion"]
        if admit:
            candidate = self._admit("UPDATE", rt, old, candidate, subresource, user)
        _drop_empty(candidate["metadata"])
        if candidate == old:
            return old  # a no-op: no new resourceVersion, no event
        if _spec_part(candidate) != _spec_part(old):
            candidate["metadata"]["generation"] = int(old_meta.get("generation") or 0) + 1
        candidate["metadata"]["resourceVersion"] = str(self._next_rv())
        key = self._key(rt, old_meta.get("namespace"), name)
        self._put(rt, key, candidate, old)
        self._emit(rt, "MODIFIED", candidate, old)
        if self._releasable(rt, candidate):
            self._drop(rt, key, "Background")
        return candidate

    def _check_immutable(
        self, rt: ResourceType, old: Mapping[str, Any], new: Mapping[str, Any]
    ) -> list[tuple[str, str]]:
        kind = (rt.group, rt.plural)
        old_spec, new_spec = old.get("spec") or {}, new.get("spec") or {}
        causes = []
        if kind in _MUTABLE_SPEC:
            allowed = _MUTABLE_SPEC[kind]
            if {k: v for k, v in old_spec.items() if k not in allowed} != {
                k: v for k, v in new_spec.items() if k not in allowed
            }:
                fields = ", ".join(f"'{f}'" for f in sorted(allowed))
                causes.append(
                    (
                        "spec",
                        f"Forbidden: updates to {rt.singular} spec for fields other than {fields} are forbidden",
                    )
                )
        for field in _IMMUTABLE_SPEC.get(kind, ()):
            if old_spec.get(field) != new_spec.get(field):
                causes.append((f"spec.{field}", "Invalid value: field is immutable"))
        if kind == ("", "persistentvolumeclaims"):
            causes += self._check_resize(old_spec, new_spec)
        fixed = ("data", "binaryData", "stringData", "immutable")
        immutable = kind in (("", "configmaps"), ("", "secrets")) and old.get("immutable")
        if immutable and any(old.get(k) != new.get(k) for k in fixed):
            causes.append(("data", "Forbidden: field is immutable when `immutable` is set"))
        return causes

    def _check_resize(
        self, old_spec: Mapping[str, Any], new_spec: Mapping[str, Any]
    ) -> list[tuple[str, str]]:
        def size(spec: Mapping[str, Any]) -> Any:
            return get_path(spec, ".resources.requests.storage")

        before, after = size(old_spec), size(new_spec)
        if before == after:
            return []
        if _quantity(after) < _quantity(before):
            return [
                ("spec.resources.requests.storage", "Forbidden: field can not be less than previous value")
            ]
        classes = self._store.get(("storage.k8s.io", "v1", "storageclasses"), {})
        storage_class = classes.get((None, str(new_spec.get("storageClassName") or "")))
        if storage_class is None or not storage_class.get("allowVolumeExpansion"):
            raise ApiError(
                403,
                "Forbidden",
                "persistentvolumeclaims is forbidden: only dynamically provisioned pvc can be resized and the storageclass that provisions the pvc must support resize",
            )
        return []

    def _releasable(self, rt: ResourceType, obj: Mapping[str, Any]) -> bool:
        """Whether a marked object can go: no finalizers left, no kubelet to wait for."""
        meta = obj["metadata"]
        if not meta.get("deletionTimestamp") or meta.get("finalizers"):
            return False
        return not (
            rt.key == ("", "v1", "pods")
            and self.graceful_pod_deletion
            and meta.get("deletionGracePeriodSeconds")
        )

    def delete_object(
        self,
        rt: ResourceType,
        namespace: str | None,
        name: str,
        options: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Delete an object as DELETE does (DeleteOptions in ``options``); returns its last state."""
        obj = self._get(rt, namespace, name)
        options = options or {}
        meta = obj["metadata"]
        preconditions = options.get("preconditions") or {}
        if preconditions.get("uid") and preconditions["uid"] != meta["uid"]:
            raise ApiError(
                409,
                "Conflict",
                f"Precondition failed: UID in precondition: {preconditions['uid']}, UID in object meta: {meta['uid']}",
            )
        self._check_precondition(rt, obj, preconditions.get("resourceVersion"))
        policy = options.get("propagationPolicy") or (
            "Orphan" if options.get("orphanDependents") else "Background"
        )
        if policy not in ("Orphan", "Background", "Foreground"):
            raise _bad_request(f"propagationPolicy: Unsupported value: {json.dumps(policy)}")
        key = self._key(rt, namespace, name)
        if rt.key == ("", "v1", "namespaces"):
            return self._delete_namespace(rt, key, obj, policy)
        grace: int | None = None
        if rt.key == ("", "v1", "pods") and self.graceful_pod_deletion and get_path(obj, ".spec.nodeName"):
            asked = options.get("gracePeriodSeconds")
            grace = (
                int(asked)
                if asked is not None
                else int(get_path(obj, ".spec.terminationGracePeriodSeconds") or 30)
            )
        if meta.get("finalizers") or grace:
            if meta.get("deletionTimestamp") and not (
                grace is not None and grace < int(meta.get("deletionGracePeriodSeconds") or 0)
            ):
                return obj
            marked = copy.deepcopy(obj)
            first = not meta.get("deletionTimestamp")
            when = datetime.datetime.now(tz=datetime.UTC) + datetime.timedelta(seconds=grace or 0)
            marked["metadata"]["deletionTimestamp"] = when.strftime("%Y-%m-%dT%H:%M:%SZ")
            marked["metadata"]["deletionGracePeriodSeconds"] = grace or 0
            if first:
                marked["metadata"]["generation"] = int(meta.get("generation") or 0) + 1
            marked["metadata"]["resourceVersion"] = str(self._next_rv())
            self._policies[meta["uid"]] = policy
            self._put(rt, key, marked, obj)
            self._emit(rt, "MODIFIED", marked, obj)
            if self._releasable(rt, marked):
                return self._drop(rt, key, policy)
            return marked
        return self._drop(rt, key, policy)

    def evict(self, namespace: str | None, name: str, eviction: Any = None) -> dict[str, Any]:
        """POST pods/NAME/eviction (``kubectl drain``): 429 when a PodDisruptionBudget selecting the
        pod says ``status.disruptionsAllowed: 0``, else the pod is deleted (its grace period
        applies). No disruption controller runs: a PDB without a status allows the eviction."""
        pods = self._types[("", "v1", "pods")]
        pod = self._get(pods, namespace, name)
        labels = pod["metadata"].get("labels") or {}
        for pdb in self.select(self._types[("policy", "v1", "poddisruptionbudgets")], namespace):
            selector = selector_string(get_path(pdb, ".spec.selector")) or ""
            requirements = parse_label_selector(selector)
            selects = bool(requirements) and all(req.matches(labels) for req in requirements)
            if selects and get_path(pdb, ".status.disruptionsAllowed") == 0:
                raise ApiError(
                    429,
                    "TooManyRequests",
                    "Cannot evict pod as it would violate the pod's disruption budget.",
                    {
                        "causes": [
                            {
                                "reason": "DisruptionBudget",
                                "message": f"The disruption budget {pdb['metadata']['name']} needs more healthy pods",
                            }
                        ]
                    },
                )
        options = (eviction or {}).get("deleteOptions") or {} if isinstance(eviction, Mapping) else {}
        self.delete_object(pods, namespace, name, options)
        return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201}

    def _delete_namespace(
        self, rt: ResourceType, key: Key, obj: dict[str, Any], policy: str
    ) -> dict[str, Any]:
        """The namespace controller's part: mark Terminating, delete the content, then the namespace."""
        if not obj["metadata"].get("deletionTimestamp"):
            marked = copy.deepcopy(obj)
            marked["metadata"]["deletionTimestamp"] = _now()
            marked["metadata"]["deletionGracePeriodSeconds"] = 0
            marked["status"] = {"phase": "Terminating"}
            marked["metadata"]["resourceVersion"] = str(self._next_rv())
            self._put(rt, key, marked, obj)
            self._emit(rt, "MODIFIED", marked, obj)
            obj = marked
        namespace = key[1]
        for other in list(self._types.values()):
            if not other.namespaced:
                continue
            for other_key in [k for k in self._store.get(other.key, {}) if k[0] == namespace]:
                if other_key in self._store[other.key]:
                    self.delete_object(other, namespace, other_key[1], {"propagationPolicy": "Background"})
        return self._finish_namespace(namespace) or obj

    def _finish_namespace(self, namespace: str) -> dict[str, Any] | None:
        rt = self._types[("", "v1", "namespaces")]
        ns = self._store[rt.key].get((None, namespace))
        if ns is None or not ns["metadata"].get("deletionTimestamp") or ns["metadata"].get("finalizers"):
            return None
        for other in self._types.values():
            if other.namespaced and any(k[0] == namespace for k in self._store.get(other.key, {})):
                return None
        return self._drop(rt, (None, namespace), "Background")

    def _drop(self, rt: ResourceType, key: Key, policy: str) -> dict[str, Any]:
        """Remove an object for good: DELETED (with its last state), then its dependents."""
        obj = self._store[rt.key][key]
        final = copy.deepcopy(obj)
        final["metadata"]["resourceVersion"] = str(self._next_rv())
        self._put(rt, key, None, obj)
        self._emit(rt, "DELETED", final, obj)
        uid = obj["metadata"]["uid"]
        policy = self._policies.pop(uid, policy)
        if rt.key == ("apiextensions.k8s.io", "v1", "customresourcedefinitions"):
            self._unregister_crd(key[1])
        self._collect(uid, policy)
        if rt.namespaced and key[0] is not None:
            self._finish_namespace(key[0])
        return final

    def _collect(self, owner_uid: str, policy: str) -> None:
        """The garbage collector: orphan or delete what the owner's uid owned."""
        for rt_key, key in sorted(self._dependents.pop(owner_uid, set()), key=repr):
            rt = self._types.get(rt_key)
            dependent = self._store.get(rt_key, {}).get(key)
            if rt is None or dependent is None:
                continue
            refs = dependent["metadata"].get("ownerReferences") or []
            remaining = [ref for ref in refs if ref.get("uid") != owner_uid]
            if policy == "Orphan" or any(ref.get("uid") in self._uids for ref in remaining):
                new = copy.deepcopy(dependent)
                new["metadata"]["ownerReferences"] = remaining
                self._commit_update(rt, dependent, new, None, None, admit=False)
            else:
                self.delete_object(rt, key[0], key[1], {"propagationPolicy": "Background"})

    def _put(
        self, rt: ResourceType, key: Key, obj: dict[str, Any] | None, old: dict[str, Any] | None
    ) -> None:
        """Store (or drop, when obj is None) an object; keep the indexes and kmock's ``objects``."""
        store = self._store[rt.key]
        if obj is None:
            store.pop(key, None)
        else:
            store[key] = obj
        for ref in (old or {}).get("metadata", {}).get("ownerReferences") or ():
            self._dependents.get(ref.get("uid"), set()).discard((rt.key, key))
        for ref in (obj or {}).get("metadata", {}).get("ownerReferences") or ():
            self._dependents.setdefault(ref.get("uid"), set()).add((rt.key, key))
        if old is not None and obj is None:
            self._uids.pop(old["metadata"]["uid"], None)
        if obj is not None:
            self._uids[obj["metadata"]["uid"]] = (rt.key, key)
        mirror_key = (rt.ref, key[0], key[1])
        if mirror_key in self._objects:
            history = self._objects[mirror_key].history
            history.append(obj)
            if self.history_limit is not None and len(history) > self.history_limit:
                del history[: len(history) - self.history_limit]
        elif obj is not None:
            self._objects[mirror_key] = obj

    def _emit(self, rt: ResourceType, kind: str, obj: dict[str, Any], old: dict[str, Any] | None) -> None:
        log = self._log.setdefault(rt.key, [])
        log.append(_Event(int(obj["metadata"]["resourceVersion"]), kind, obj, old))
        if len(log) > 2 * self.watch_cache_size:
            cut = len(log) - self.watch_cache_size
            self._log_floor[rt.key] = log[cut - 1].rv
            del log[:cut]
        self._wake(rt)

    def _wake(self, rt: ResourceType) -> None:
        event = self._wakeups.pop(rt.key, None)
        if event is not None:
            event.set()

    def select(
        self,
        rt: ResourceType,
        namespace: str | None = None,
        label_selector: str | None = None,
        field_selector: str | None = None,
    ) -> list[dict[str, Any]]:
        """The stored objects of a resource matching the selectors, ordered by namespace and name."""
        selection = self._filter(namespace, None, label_selector, field_selector)
        store = self._store.get(rt.key, {})
        return [
            store[key]
            for key in sorted(store, key=lambda k: (k[0] or "", k[1]))
            if selection.matches(store[key])
        ]

    def _filter(
        self, namespace: str | None, name: str | None, labels: str | None, fields: str | None
    ) -> _Filter:
        try:
            return _Filter(
                namespace, name, parse_label_selector(labels or ""), parse_field_selector(fields or "")
            )
        except ValueError as exc:
            raise _bad_request(str(exc)) from None

    # ---------------------------------------------------------------------------------------------
    # The synchronous helpers for tests (in the emulator's event loop; see EmulatedApiServer).

    def create(self, body: Mapping[str, Any], *, namespace: str | None = None) -> dict[str, Any]:
        """Create an object from a manifest (its apiVersion and kind pick the resource)."""
        rt = self._type_of(body)
        namespace = (
            namespace
            or (body.get("metadata") or {}).get("namespace")
            or ("default" if rt.namespaced else None)
        )
        return self.create_object(rt, namespace, body)

    def read(self, ref: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        """An object as stored, or None."""
        rt = self.resource_type(ref)
        return self._store[rt.key].get(self._key(rt, namespace, name))

    def items(
        self,
        ref: str,
        namespace: str | None = None,
        *,
        label_selector: str | None = None,
        field_selector: str | None = None,
    ) -> list[dict[str, Any]]:
        """The objects of a resource (all namespaces when namespace is None)."""
        return self.select(self.resource_type(ref), namespace, label_selector, field_selector)

    def merge(
        self,
        ref: str,
        namespace: str | None,
        name: str,
        patch: Mapping[str, Any],
        *,
        subresource: str | None = None,
    ) -> dict[str, Any]:
        """Merge-patch an object (or its status with subresource="status")."""
        return self.patch_object(self.resource_type(ref), namespace, name, patch, subresource=subresource)

    def remove(self, ref: str, namespace: str | None, name: str, **options: Any) -> dict[str, Any] | None:
        """Delete an object (options as DeleteOptions' fields); None when it did not exist."""
        try:
            return self.delete_object(self.resource_type(ref), namespace, name, options)
        except ApiError as exc:
            if exc.code == 404:
                return None
            raise

    def end_watches(self) -> None:
        """End every watch stream now (before the server stops, so that it stops at once)."""
        self._stopping = True
        for event in self._wakeups.values():
            event.set()
        self._wakeups.clear()

    # ---------------------------------------------------------------------------------------------
    # HTTP.

    async def __call__(self, raw_request: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        target = parse_api_path(raw_request.path)
        if target is None:
            return await super().__call__(raw_request)
        # kmock 0.8's path parser fails on some resource URLs (GET /api/v1/namespaces) and misreads
        # others (/api/v1/namespaces/NAME): resource requests are parsed here, the rest by kmock.
        body = await raw_request.read()
        text = body.decode("utf-8", errors="replace")
        try:
            data = json.loads(text) if text.strip() else None
        except ValueError:
            data = None
        request = kmock.Request(
            id=len(self._requests),
            raw_request=raw_request,
            url=raw_request.url,
            method=raw_request.method,
            params=dict(raw_request.query),
            headers=dict(raw_request.headers),
            cookies=dict(raw_request.cookies),
            body=body,
            text=text,
            data=data,
            action=_kmock_action(raw_request.method, target, raw_request.query),
            resource=kmock.resource(target.group, target.version, target.plural),
            namespace=target.namespace,
            name=target.name,
            subresource=target.subresource,
        )
        self._requests.append(request)
        try:
            return await self._handle(request)
        except StreamingError as exc:  # the stream had begun: it can only be cut short
            response: aiohttp.web.StreamResponse = exc.args[0]
            with contextlib.suppress(ConnectionError):
                await response.write_eof()
            return response
        except Exception as exc:
            failure = ApiError(500, "InternalError", f"the emulator failed: {exc!r}")
            return aiohttp.web.json_response(failure.status(), status=500)

    def _is_resource_request(self, request: kmock.Request) -> bool:
        return id(request) in self._contexts

    def _user(self, request: kmock.Request) -> tuple[str | None, ApiError | None]:
        header = next((v for k, v in request.headers.items() if k.lower() == "authorization"), "")
        token = header[7:].strip() if header.lower().startswith("bearer ") else None
        user = self.tokens.get(token) if token else None
        if user is None and self.require_token:
            return None, ApiError(401, "Unauthorized", "Unauthorized")
        return user, None

    async def _handle(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        target = parse_api_path(request.url.path)
        if target is None:
            return await kmock.RawHandler._handle(self, request)
        user, failure = self._user(request)
        verb = rbac_verb(str(request.method.value), target, request.params)
        call = ApiCall(
            verb,
            target.group,
            target.version,
            target.plural,
            target.subresource,
            target.namespace,
            target.name,
            user,
        )
        if self.record_calls:
            self.calls.append(call)
        rules = self.rbac.get(user or "") if self.rbac is not None else None
        if failure is None and rules is not None and not any(rule_allows(rule, call) for rule in rules):
            where = f'in the namespace "{target.namespace}"' if target.namespace else "at the cluster scope"
            failure = ApiError(
                403,
                "Forbidden",
                f'{call.rbac_resource} is forbidden: User "{user}" cannot {verb} resource "{call.rbac_resource}" in API group "{target.group}" {where}',
            )
        if failure is not None:
            call.code = failure.code
            return aiohttp.web.json_response(failure.status(), status=failure.code)
        self._contexts[id(request)] = (target, verb, user)
        try:
            if any(id(payload) not in self._own_payloads for payload in self._payloads):
                # A test's reactions come first (kmock's DSL), this emulation is their fallback.
                response = await kmock.RawHandler._handle(self, request)
            else:
                # Straight to the emulation: kmock's matching looks through every past request.
                response = await self._respond(request, *self._serve(request))
        except BaseException:
            call.code = 500
            raise
        finally:
            self._contexts.pop(id(request), None)
            if not self.record_requests:
                with contextlib.suppress(ValueError):
                    self._requests.remove(request)
        call.code = response.status
        return response

    def _serve(self, request: kmock.Request) -> tuple[int, Any]:
        target, verb, user = self._contexts[id(request)]
        try:
            return self._dispatch(request, target, verb, user)
        except ApiError as exc:
            return exc.code, exc.status()

    def _serve_resource(self, request: kmock.Request) -> Response:
        status, payload = self._serve(request)
        return Response(status=status, payload=payload, headers=JSON_HEADERS)

    async def _respond(self, request: kmock.Request, status: int, payload: Any) -> aiohttp.web.StreamResponse:
        """Render a result without kmock: JSON, or a watch stream of JSON lines."""
        if not isinstance(payload, AsyncIterator):
            return aiohttp.web.json_response(payload, status=status)
        raw = getattr(request, "_raw_request", None)
        assert raw is not None
        response = aiohttp.web.StreamResponse(status=status, headers=JSON_HEADERS)
        await response.prepare(raw)
        with contextlib.suppress(ConnectionError):
            async for item in payload:
                if item:
                    await response.write(json.dumps(item).encode() + b"\n")
            await response.write_eof()
        return response

    def _dispatch(
        self, request: kmock.Request, target: ApiTarget, verb: str, user: str | None
    ) -> tuple[int, Any]:
        rt = self._types.get((target.group, target.version, target.plural))
        if rt is None or (target.namespace is not None and not rt.namespaced):
            raise _not_found_url()
        namespace, name, sub = target.namespace, target.name, target.subresource
        if rt.namespaced and namespace is None and verb not in ("list", "watch", "deletecollection"):
            raise _not_found_url()
        if sub is not None and sub not in rt.subresources:
            raise _not_found_url()
        if sub is None and verb not in rt.verbs:
            raise ApiError(
                405,
                "MethodNotAllowed",
                f"the server does not allow this method on the requested resource ({verb} {rt.qualified})",
            )
        content_type = next((v for k, v in request.headers.items() if k.lower() == "content-type"), "")
        if request.body and content_type and "json" not in content_type:  # none means JSON
            raise ApiError(
                415,
                "UnsupportedMediaType",
                f'the body of the request was in an unknown format - accepted media types include: application/json (got "{content_type}")',
            )
        if "dryRun" in request.params:
            raise _bad_request("dryRun is not emulated")
        params = request.params
        accept = next((v for k, v in request.headers.items() if k.lower() == "accept"), "")
        as_table = "as=Table" in accept
        if verb == "get":
            assert name is not None
            obj = self._get(rt, namespace, name)
            if sub == "scale":
                return 200, self._scale_view(rt, obj)
            return 200, self._table(rt, [obj]) if as_table and sub is None else obj
        if verb == "list":
            items = self.select(rt, namespace, params.get("labelSelector"), params.get("fieldSelector"))
            if as_table:
                return 200, self._table(rt, items)
            kind = f"{rt.kind}List"
            return 200, {
                "apiVersion": rt.api_version,
                "kind": kind,
                "metadata": {"resourceVersion": self.resource_version},
                "items": items,
            }
        if verb == "watch":
            return 200, self._watch(request, rt, namespace, name)
        if verb == "create" and sub == "eviction" and rt.key == ("", "v1", "pods"):
            assert name is not None
            return 201, self.evict(namespace, name, request.data)
        if verb == "create":
            if sub is not None or name is not None:
                raise ApiError(
                    405, "MethodNotAllowed", "the server does not allow this method on the requested resource"
                )
            return 201, self.create_object(rt, namespace, request.data, user=user)
        if verb == "deletecollection":
            options = self._delete_options(request)
            chosen = self.select(rt, namespace, params.get("labelSelector"), params.get("fieldSelector"))
            gone = [
                self.delete_object(rt, meta.get("namespace"), meta["name"], options)
                for meta in (item["metadata"] for item in chosen)
                if self._key(rt, meta.get("namespace"), meta["name"]) in self._store[rt.key]
            ]
            listing = {"resourceVersion": self.resource_version}
            return 200, {
                "apiVersion": rt.api_version,
                "kind": f"{rt.kind}List",
                "metadata": listing,
                "items": gone,
            }
        assert name is not None
        if verb == "update":
            if sub == "scale":
                return 200, self._scale_write(rt, namespace, name, request.data, user)
            return 200, self.replace_object(rt, namespace, name, request.data, subresource=sub, user=user)
        if verb == "patch":
            if rt.crd is not None and content_type.startswith("application/strategic-merge-patch+json"):
                raise ApiError(
                    415,
                    "UnsupportedMediaType",
                    "the body of the request was in an unknown format - accepted media types include: application/json-patch+json, application/merge-patch+json, application/apply-patch+yaml (strategic merge patch is not supported for custom resources)",
                )
            if sub == "scale":
                view = self._scale_view(rt, self._get(rt, namespace, name))
                return 200, self._scale_write(
                    rt, namespace, name, apply_patch(view, request.data, content_type), user
                )
            return 200, self.patch_object(
                rt, namespace, name, request.data, content_type, subresource=sub, user=user
            )
        if verb == "delete":
            return 200, self.delete_object(rt, namespace, name, self._delete_options(request))
        raise ApiError(
            405,
            "MethodNotAllowed",
            f"the server does not allow this method on the requested resource ({verb})",
        )

    @staticmethod
    def _delete_options(request: kmock.Request) -> dict[str, Any]:
        """DeleteOptions from the body, then from the query."""
        options = dict(request.data) if isinstance(request.data, Mapping) else {}
        query = request.params
        if "propagationPolicy" in query:
            options["propagationPolicy"] = query["propagationPolicy"]
        if "gracePeriodSeconds" in query:
            options["gracePeriodSeconds"] = int(query["gracePeriodSeconds"])
        if "orphanDependents" in query:
            options["orphanDependents"] = query["orphanDependents"] == "true"
        return options

    def _scale_view(self, rt: ResourceType, obj: Mapping[str, Any]) -> dict[str, Any]:
        assert rt.scale is not None
        meta = obj["metadata"]
        status: dict[str, Any] = {"replicas": int(get_path(obj, rt.scale.status_replicas_path) or 0)}
        if rt.scale.label_selector_path and (
            selector := selector_string(get_path(obj, rt.scale.label_selector_path))
        ):
            status["selector"] = selector
        return {
            "apiVersion": "autoscaling/v1",
            "kind": "Scale",
            "metadata": {
                k: meta[k]
                for k in ("name", "namespace", "uid", "resourceVersion", "creationTimestamp")
                if k in meta
            },
            "spec": {"replicas": int(get_path(obj, rt.scale.spec_replicas_path) or 0)},
            "status": status,
        }

    def _scale_write(
        self, rt: ResourceType, namespace: str | None, name: str, scale: Any, user: str | None
    ) -> dict[str, Any]:
        assert rt.scale is not None
        old = self._get(rt, namespace, name)
        if not isinstance(scale, Mapping):
            raise _bad_request("the body of the request was in an unknown format: expected a Scale")
        self._check_precondition(rt, old, (scale.get("metadata") or {}).get("resourceVersion"))
        replicas = get_path(scale, ".spec.replicas")
        if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 0:
            raise self._invalid(
                rt,
                name,
                [
                    (
                        "spec.replicas",
                        f"Invalid value: {json.dumps(replicas)}: must be greater than or equal to 0",
                    )
                ],
            )
        new = copy.deepcopy(old)
        set_path(new, rt.scale.spec_replicas_path, replicas)
        return self._scale_view(rt, self._commit_update(rt, old, new, "scale", user))

    def _table(self, rt: ResourceType, objs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        columns: list[Mapping[str, Any]] = list(rt.printer_columns)
        if not columns:
            columns = [{"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}]
            if rt.key == ("", "v1", "pods"):
                columns.insert(0, {"name": "Status", "type": "string", "jsonPath": ".status.phase"})
        definitions = [
            {"name": "Name", "type": "string", "format": "name", "description": "Name", "priority": 0}
        ]
        for column in columns:
            definitions.append(
                {
                    "name": column["name"],
                    "type": "string" if column.get("type") == "date" else column.get("type", "string"),
                    "format": column.get("format", ""),
                    "description": column.get("description", ""),
                    "priority": column.get("priority", 0),
                }
            )
        rows = []
        for obj in objs:
            cells: list[Any] = [obj["metadata"]["name"]]
            for column in columns:
                value = get_path(obj, column.get("jsonPath", ""))
                cells.append(_age(value) if column.get("type") == "date" and value else value)
            rows.append({"cells": cells, "object": obj})
        return {
            "apiVersion": "meta.k8s.io/v1",
            "kind": "Table",
            "metadata": {"resourceVersion": self.resource_version},
            "columnDefinitions": definitions,
            "rows": rows,
        }

    def _watch(
        self, request: kmock.Request, rt: ResourceType, namespace: str | None, name: str | None
    ) -> AsyncIterator[Any]:
        params = request.params
        selection = self._filter(namespace, name, params.get("labelSelector"), params.get("fieldSelector"))
        since = params.get("resourceVersion", "")
        try:
            timeout = float(params["timeoutSeconds"]) if params.get("timeoutSeconds") else None
        except ValueError:
            raise _bad_request("timeoutSeconds must be a number") from None
        if since in ("", "0"):
            initial = [obj for obj in self.select(rt) if selection.matches(obj)]
            position = self._rv
        else:
            try:
                position = int(since)
            except ValueError:
                raise _bad_request(f"invalid resourceVersion {since!r}") from None
            initial = []
        raw = getattr(request, "_raw_request", None)
        return self._stream(rt, selection, initial, position, timeout, raw)

    async def _stream(
        self,
        rt: ResourceType,
        selection: _Filter,
        initial: list[dict[str, Any]],
        position: int,
        timeout: float | None,
        raw: aiohttp.web.BaseRequest | None,
    ) -> AsyncIterator[Any]:
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        yield b""  # send the headers now, even if nothing happens for a while
        for obj in initial:
            yield {"type": "ADDED", "object": obj}
        while not self._stopping and rt.key in self._types:
            if position < self._log_floor.get(rt.key, 0):
                gone = ApiError(
                    410, "Expired", f"too old resource version: {position} ({self._log_floor[rt.key]})"
                )
                yield {"type": "ERROR", "object": gone.status()}
                return
            log = self._log.get(rt.key, [])
            pending = log[bisect.bisect_right(log, position, key=lambda event: event.rv) :]
            for event in pending:
                position = event.rv
                if (out := self._watch_event(event, selection)) is not None:
                    yield out
            if pending:
                continue
            remaining = 1.0 if deadline is None else deadline - loop.time()
            if remaining <= 0:
                return
            wakeup = self._wakeups.setdefault(rt.key, asyncio.Event())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(wakeup.wait(), timeout=min(remaining, 1.0))
            if raw is not None and (raw.transport is None or raw.transport.is_closing()):
                return

    @staticmethod
    def _watch_event(event: _Event, selection: _Filter) -> dict[str, Any] | None:
        now = selection.matches(event.obj)
        if event.type != "MODIFIED":
            return {"type": event.type, "object": event.obj} if now else None
        before = selection.matches(event.old)
        if now:
            return {"type": "MODIFIED" if before else "ADDED", "object": event.obj}
        return {"type": "DELETED", "object": event.obj} if before else None

    # ---------------------------------------------------------------------------------------------
    # Discovery (kmock's routes, served from this emulator's resource types).

    def _groups(self) -> dict[str, list[str]]:
        groups: dict[str, list[str]] = {}
        for rt in self._types.values():
            versions = groups.setdefault(rt.group, [])
            if rt.version not in versions:
                versions.append(rt.version)
        for versions in groups.values():
            versions.sort(key=_version_priority)
        return groups

    def _group_doc(self, group: str, versions: list[str]) -> dict[str, Any]:
        entries = [{"groupVersion": f"{group}/{v}", "version": v} for v in versions]
        return {"name": group, "versions": entries, "preferredVersion": entries[0]}

    async def _serve_root(self, request: kmock.Request) -> Any:
        paths = {
            "/api",
            "/api/v1",
            "/apis",
            "/version",
            "/healthz",
            "/livez",
            "/readyz",
            "/openapi/v2",
            "/openapi/v3",
        }
        for group, versions in self._groups().items():
            if group:
                paths.add(f"/apis/{group}")
                paths.update(f"/apis/{group}/{v}" for v in versions)
        return {"paths": sorted(paths)}

    async def _serve_api(self, request: kmock.Request) -> Any:
        server = f"{request.url.host}:{request.url.port}"
        return {
            "kind": "APIVersions",
            "versions": ["v1"],
            "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": server}],
        }

    async def _serve_apis(self, request: kmock.Request) -> Any:
        groups = [self._group_doc(g, v) for g, v in self._groups().items() if g]
        return {"kind": "APIGroupList", "apiVersion": "v1", "groups": groups}

    async def _serve_group(self, request: kmock.Request) -> Any:
        group = request.url.path.strip("/").split("/")[1]
        versions = self._groups().get(group)
        if not versions or not group:
            return Response(status=404, payload=_not_found_url().status(), headers=JSON_HEADERS)
        return {"kind": "APIGroup", "apiVersion": "v1", **self._group_doc(group, versions)}

    async def _serve_version(self, request: kmock.Request) -> Any:
        parts = request.url.path.strip("/").split("/")
        group, version = ("", parts[1]) if parts[0] == "api" else (parts[1], parts[2])
        types = [rt for rt in self._types.values() if rt.group == group and rt.version == version]
        if not types:
            return Response(status=404, payload=_not_found_url().status(), headers=JSON_HEADERS)
        resources: list[dict[str, Any]] = []
        for rt in types:
            entry: dict[str, Any] = {
                "name": rt.plural,
                "singularName": rt.singular,
                "namespaced": rt.namespaced,
                "kind": rt.kind,
                "verbs": list(rt.verbs),
            }
            if rt.short_names:
                entry["shortNames"] = list(rt.short_names)
            if rt.categories:
                entry["categories"] = list(rt.categories)
            resources.append(entry)
            for sub in sorted(rt.subresources):
                sub_entry: dict[str, Any] = {
                    "name": f"{rt.plural}/{sub}",
                    "singularName": "",
                    "namespaced": rt.namespaced,
                    "kind": rt.kind,
                }
                if sub == "scale":
                    sub_entry.update(group="autoscaling", version="v1", kind="Scale")
                sub_entry["verbs"] = list(SUBRESOURCE_VERBS) if sub in ("status", "scale") else ["get"]
                resources.append(sub_entry)
        group_version = f"{group}/{version}" if group else version
        return {
            "kind": "APIResourceList",
            "apiVersion": "v1",
            "groupVersion": group_version,
            "resources": resources,
        }

    async def _serve_openapi(self, request: kmock.Request) -> Any:
        """OpenAPI v3 documents with no schemas: each group-version lists the PATCH operation of
        each resource with the ``fieldValidation`` parameter, which tells kubectl that the server
        validates (so that ``kubectl apply`` needs no schema of its own)."""
        groups = self._groups()
        path = request.url.path.strip("/").split("/")[2:]
        if not path:
            return {
                "paths": {
                    (f"apis/{g}/{v}" if g else f"api/{v}"): {
                        "serverRelativeURL": f"/openapi/v3/{'apis/' + g if g else 'api'}/{v}"
                    }
                    for g, versions in groups.items()
                    for v in versions
                }
            }
        group, version = (
            ("", path[1]) if path[0] == "api" and len(path) == 2 else ("/".join(path[1:-1]), path[-1])
        )
        paths: dict[str, Any] = {}
        for rt in self._types.values():
            if (rt.group, rt.version) != (group, version):
                continue
            prefix = f"/apis/{group}/{version}" if group else f"/api/{version}"
            scope = "/namespaces/{namespace}" if rt.namespaced else ""
            paths[f"{prefix}{scope}/{rt.plural}/{{name}}"] = {
                "patch": {
                    "x-kubernetes-group-version-kind": {
                        "group": rt.group,
                        "version": rt.version,
                        "kind": rt.kind,
                    },
                    "parameters": [{"name": "fieldValidation", "in": "query", "schema": {"type": "string"}}],
                    "responses": {},
                }
            }
        if not paths:
            return Response(status=404, payload=_not_found_url().status(), headers=JSON_HEADERS)
        return {
            "openapi": "3.0.0",
            "info": {"title": "Kubernetes (emulated)", "version": "v1.33.0"},
            "paths": paths,
            "components": {"schemas": {}},
        }

    async def _serve_server_version(self, request: kmock.Request) -> Any:
        return {
            "major": "1",
            "minor": "33",
            "gitVersion": "v1.33.0-pgherd-emulated",
            "gitCommit": "0000000000000000000000000000000000000000",
            "gitTreeState": "clean",
            "buildDate": "2025-01-01T00:00:00Z",
            "goVersion": "go1.24",
            "compiler": "gc",
            "platform": "linux/amd64",
        }

    @property
    def base_url(self) -> str:
        """The URL of the first server serving this emulator, without a trailing slash."""
        return str(self.url).rstrip("/")


def _kmock_action(method: str, target: ApiTarget, query: Mapping[str, str]) -> kmock.action | None:
    """The kmock action of a request (for kmock's DSL filters), as kmock itself guesses it."""
    if method == "GET" and query.get("watch") in ("true", "1"):
        return kmock.action.WATCH
    if target.name is None:
        return {"GET": kmock.action.LIST, "POST": kmock.action.CREATE}.get(method)
    return {"GET": kmock.action.FETCH, "PATCH": kmock.action.UPDATE, "DELETE": kmock.action.DELETE}.get(
        method
    )


def _drop_empty(meta: dict[str, Any]) -> None:
    """The API server omits empty finalizers, labels, annotations and owner references."""
    for field in ("finalizers", "labels", "annotations", "ownerReferences"):
        if field in meta and not meta[field]:
            del meta[field]


_SUFFIXES = {
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
    "Pi": 2**50,
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "P": 10**15,
}


def _quantity(text: Any) -> float:
    """A Kubernetes quantity (10Gi, 500M, 1.5) in units; 0 when absent or unreadable."""
    match = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", str(text or "0"))
    if not match:
        return 0.0
    return float(match.group(1)) * _SUFFIXES.get(match.group(2), 1)


# --------------------------------------------------------------------------------------------------
# Serving.


@attrs.mutable
class LoopbackServer(kmock.Server):
    """kmock's Server without its aiohttp resolver interception (a process-wide monkeypatch that
    must be undone in LIFO order): the emulator is reached at its real 127.0.0.1 URL, from any
    thread or process. Watches are ended before the server stops, so that it stops at once."""

    async def __aenter__(self) -> LoopbackServer:
        if self._managed_server is not None:
            raise RuntimeError("The server can be started only once.")
        if isinstance(self.handler, KubeEmulator):
            self.handler._stopping = False  # an emulator may be served again after a stop
        self._managed_server = aiohttp.test_utils.RawTestServer(
            self.handler, host=self._host, port=self._port
        )
        await self._managed_server.start_server()
        self._managed_client = aiohttp.ClientSession(self._managed_server.make_url("/"))
        self.handler.servers.append(self)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.handler.servers.remove(self)
        if isinstance(self.handler, KubeEmulator):
            self.handler.end_watches()
        assert self._managed_client is not None and self._managed_server is not None
        await self._managed_client.close()
        await self._managed_server.close()
        self._managed_client = None
        self._managed_server = None


class EmulatedApiServer:
    """A :class:`KubeEmulator` served on 127.0.0.1 from a background thread with its own event loop,
    for code that blocks the caller's loop (kopf's KopfRunner, the kubernetes client, scripts)::

        server = EmulatedApiServer(crds=[CRDS_DIR])
        url = server.start()
        ...
        server.stop()

    Keyword arguments go to :class:`KubeEmulator`. A stopped server can be started again: the same
    store, on a new port unless ``port`` was given. The helpers (``create``, ``read``, ``items``,
    ``merge``, ``remove``, ``call``) run on the server's loop and wait for the result.
    """

    def __init__(
        self, emulator: KubeEmulator | None = None, *, host: str = "127.0.0.1", port: int = 0, **options: Any
    ):
        self.emulator = emulator if emulator is not None else KubeEmulator(**options)
        self.host = host
        self.port = port
        self._url: str | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._failure: BaseException | None = None

    @property
    def url(self) -> str:
        if self._url is None:
            raise RuntimeError("the server is not started")
        return self._url

    def start(self, timeout: float = 10.0) -> str:
        """Start serving; returns the URL (``http://127.0.0.1:PORT``)."""
        if self._thread is not None:
            raise RuntimeError("the server is already started")
        self._ready.clear()
        self._url, self._loop, self._failure = None, None, None
        self._thread = threading.Thread(target=self._run, name="kube-emulator", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError("the emulated API server did not start")
        if self._failure is not None:
            raise RuntimeError("the emulated API server failed to start") from self._failure
        return self.url

    def stop(self, timeout: float = 10.0) -> None:
        """Stop serving (watches end at once); idempotent."""
        if self._thread is None:
            return
        if self._loop is not None and self._stop is not None and not self._loop.is_closed():
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout)
        self._thread = None

    def __enter__(self) -> EmulatedApiServer:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:
            self._failure = exc
            self._ready.set()

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        async with (
            self.emulator,
            LoopbackServer(self.emulator, host=self.host, port=self.port or None) as server,
        ):
            self._url = str(server.url).rstrip("/")
            self._ready.set()
            await self._stop.wait()

    def call(self, fn: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
        """Run ``fn(*args, **kwargs)`` on the server's event loop and return its result."""
        if self._loop is None:
            raise RuntimeError("the server is not started")

        async def run() -> _T:
            return fn(*args, **kwargs)

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(timeout=30)

    def create(self, body: Mapping[str, Any], *, namespace: str | None = None) -> dict[str, Any]:
        return copy.deepcopy(self.call(self.emulator.create, body, namespace=namespace))

    def read(self, ref: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        return copy.deepcopy(self.call(self.emulator.read, ref, namespace, name))

    def items(self, ref: str, namespace: str | None = None, **selectors: Any) -> list[dict[str, Any]]:
        return copy.deepcopy(self.call(self.emulator.items, ref, namespace, **selectors))

    def merge(
        self, ref: str, namespace: str | None, name: str, patch: Mapping[str, Any], **kwargs: Any
    ) -> dict[str, Any]:
        return copy.deepcopy(self.call(self.emulator.merge, ref, namespace, name, patch, **kwargs))

    def remove(self, ref: str, namespace: str | None, name: str, **options: Any) -> dict[str, Any] | None:
        return copy.deepcopy(self.call(self.emulator.remove, ref, namespace, name, **options))

    @property
    def calls(self) -> list[ApiCall]:
        """The request log (a snapshot)."""
        return list(self.call(lambda: list(self.emulator.calls)))

    def write_kubeconfig(
        self, path: str | Path, *, token: str = "emulator", namespace: str = "default"
    ) -> Path:
        """Write a kubeconfig for this server (see :func:`write_kubeconfig`)."""
        return write_kubeconfig(path, self.url, token=token, namespace=namespace)


@contextlib.asynccontextmanager
async def serving(
    emulator: KubeEmulator, host: str = "127.0.0.1", port: int | None = None
) -> AsyncIterator[str]:
    """Serve an emulator in the current event loop; yields its URL."""
    async with emulator, LoopbackServer(emulator, host=host, port=port) as server:
        yield str(server.url).rstrip("/")


def write_kubeconfig(
    path: str | Path,
    server: str,
    *,
    token: str = "emulator",
    namespace: str = "default",
    name: str = "emulated",
) -> Path:
    """Write a kubeconfig with one context: plain http to ``server``, a bearer ``token``."""
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": name, "cluster": {"server": server}}],
        "users": [{"name": name, "user": {"token": token}}],
        "contexts": [{"name": name, "context": {"cluster": name, "user": name, "namespace": namespace}}],
        "current-context": name,
        "preferences": {},
    }
    target = Path(path)
    target.write_text(yaml.safe_dump(config, sort_keys=False))
    target.chmod(0o600)
    return target


def kube_client_configuration(url: str, token: str | None = "emulator") -> Any:
    """A ``kubernetes.client.Configuration`` for the emulator at ``url`` (plain http, a token)."""
    import kubernetes.client

    configuration = kubernetes.client.Configuration(host=url)
    if token:
        configuration.api_key = {"authorization": token}
        configuration.api_key_prefix = {"authorization": "Bearer"}
    return configuration


def kopf_connection(url: str, token: str | None = "emulator", namespace: str = "default") -> Any:
    """What an ``@kopf.on.login`` handler returns to reach the emulator (kopf takes plain http)."""
    import kopf

    return kopf.ConnectionInfo(
        server=url, scheme="Bearer" if token else None, token=token, default_namespace=namespace
    )


def iter_manifests(text: str) -> Iterator[dict[str, Any]]:
    """The documents of a multi-document YAML text."""
    yield from (doc for doc in yaml.safe_load_all(text) if doc)
