"""The operator's rights against its requests, both ways, from the API server's audit log (localkube):
every request of the operator's ServiceAccount granted by authorization, and every verb the rules bound
to it grant used by some request.

A right counts as used by a request that authorization allowed, whatever the answer (a 404 of a `get`,
a 409 of a `create`, a 422 of admission): the request needed it. One right is checked by admission
rather than requested: `update` of `postgresclusters/finalizers`, which `OwnerReferencesPermissionEnforcement`
asks of whoever sets an owner reference with `blockOwnerDeletion` (every object the operator creates
for a cluster); it counts as used when that plugin is on and such creates were admitted.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

JSON = dict[str, Any]
DECISION = "authorization.k8s.io/decision"
OWNER_REFERENCES_PLUGIN = "OwnerReferencesPermissionEnforcement"
# (group, resource, verb) that admission checks; with the kinds whose admitted creates show it was.
ADMISSION_CHECKED: dict[tuple[str, str, str], frozenset[str]] = {
    ("pgherd.io", "postgresclusters/finalizers", "update"): frozenset(
        {"statefulsets", "services", "configmaps", "serviceaccounts", "secrets", "poddisruptionbudgets"}
    ),
}


@dataclass(frozen=True)
class Request:
    """One request as the audit log recorded it (stage ResponseComplete; a watch still open: ResponseStarted)."""

    verb: str
    group: str
    resource: str  # with its subresource: "pods/status"
    namespace: str
    name: str
    code: int
    allowed: bool  # authorization's decision
    uri: str

    @classmethod
    def parse(cls, event: Mapping[str, Any]) -> Request:
        ref = event.get("objectRef") or {}
        resource = str(ref.get("resource", ""))
        if ref.get("subresource"):
            resource = f"{resource}/{ref['subresource']}"
        return cls(
            verb=str(event.get("verb", "")),
            group=str(ref.get("apiGroup", "")),
            resource=resource,
            namespace=str(ref.get("namespace", "")),
            name=str(ref.get("name", "")),
            code=int((event.get("responseStatus") or {}).get("code") or 0),
            allowed=(event.get("annotations") or {}).get(DECISION) == "allow",
            uri=str(event.get("requestURI", "")),
        )

    def short(self) -> str:
        where = "/".join(p for p in (self.namespace, self.name) if p)
        return f"{self.verb} {self.group + '/' if self.group else ''}{self.resource} {where} -> {self.code}"


def requests_of(user: str, events: Iterable[Mapping[str, Any]]) -> list[Request]:
    """The resource requests of `user` (discovery, /api and /apis, is everyone's and left out), one entry
    per request: its ResponseComplete, or the ResponseStarted of a watch still open at the end."""
    done: dict[str, Request] = {}
    for event in events:
        if (event.get("user") or {}).get("username") != user or not (event.get("objectRef") or {}):
            continue
        stage = event.get("stage")
        if stage == "ResponseComplete" or (stage == "ResponseStarted" and event.get("verb") == "watch"):
            done[str(event.get("auditID"))] = Request.parse(event)
    return list(done.values())


@dataclass(frozen=True)
class Grant:
    """One verb on one resource: everywhere (namespace None, a ClusterRole bound cluster-wide) or in one
    namespace; `names` empty unless the rule names its objects."""

    group: str
    resource: str
    verb: str
    names: tuple[str, ...] = ()
    namespace: str | None = None

    def allows(self, request: Request) -> bool:
        if self.namespace is not None and request.namespace != self.namespace:
            return False
        # create, list and watch are authorized without a name (resourceNames cannot restrict them).
        name = "" if request.verb in ("create", "list", "watch") else request.name
        return (self.group, self.resource, self.verb) == (request.group, request.resource, request.verb) and (
            not self.names or name in self.names
        )

    def short(self) -> str:
        names = f" {','.join(self.names)}" if self.names else ""
        where = f" in {self.namespace}" if self.namespace else ""
        return f"{self.verb} {self.group + '/' if self.group else ''}{self.resource}{names}{where}"


def grants_of(rules: Iterable[Mapping[str, Any]], namespace: str | None = None) -> set[Grant]:
    """The rules of a Role (`namespace`) or ClusterRole (None), one Grant per group, resource and verb."""
    out: set[Grant] = set()
    for rule in rules:
        names = tuple(sorted(rule.get("resourceNames") or ()))
        for group in rule.get("apiGroups") or ():
            for resource in rule.get("resources") or ():
                for verb in rule.get("verbs") or ():
                    out.add(Grant(group, resource, verb, names, namespace))
    return out


def bound_grants(
    subject: tuple[str, str],
    bindings: Iterable[JSON],
    cluster_roles: Mapping[str, JSON],
    roles: Mapping[tuple[str, str], JSON],
) -> set[Grant]:
    """Every Grant the ServiceAccount `subject` (namespace, name) holds through `bindings` (RoleBindings
    and ClusterRoleBindings as the API returns them)."""
    out: set[Grant] = set()
    for binding in bindings:
        holds = any(
            s.get("kind") == "ServiceAccount" and (s.get("namespace"), s.get("name")) == subject
            for s in binding.get("subjects") or ()
        )
        if not holds:
            continue
        ref = binding["roleRef"]
        namespace = str(binding["metadata"]["namespace"]) if binding["kind"] == "RoleBinding" else None
        if ref["kind"] == "ClusterRole":
            role = cluster_roles.get(ref["name"])
        else:
            role = roles.get((str(namespace), ref["name"]))
        if role is not None:
            out |= grants_of(role.get("rules") or (), namespace)
    return out


def refused(requests: Iterable[Request]) -> list[str]:
    """Requests authorization denied: a 403 of admission (a namespace being deleted) is not one."""
    return sorted({r.short() for r in requests if r.code == 403 and not r.allowed})


def ungranted(requests: Iterable[Request], grants: Iterable[Grant]) -> list[str]:
    """Requests no grant covers (whatever the API server answered)."""
    held = list(grants)
    return sorted({r.short() for r in requests if not any(g.allows(r) for g in held)})


def unused(
    grants: Iterable[Grant], requests: Sequence[Request], admission_plugins: Iterable[str]
) -> list[str]:
    """The grants no allowed request used; ADMISSION_CHECKED ones count as used when their plugin is on
    and the operator's creates of owned objects were admitted (2xx)."""
    allowed = [r for r in requests if r.allowed]
    plugins = set(admission_plugins)
    left = []
    for grant in grants:
        if any(grant.allows(r) for r in allowed):
            continue
        owned = ADMISSION_CHECKED.get((grant.group, grant.resource, grant.verb))
        if (
            owned is not None
            and OWNER_REFERENCES_PLUGIN in plugins
            and any(r.verb == "create" and r.resource in owned and 200 <= r.code < 300 for r in allowed)
        ):
            continue
        left.append(grant.short())
    return sorted(left)
