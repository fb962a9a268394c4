"""The adapter's tests on the real API server (e2e/localkube/apiserver_only.py): a small synchronous
client for the test's own requests (as the administrator), the audit log read back, and the operator's
identity as the chart makes it (its ServiceAccount, ClusterRole, Roles and bindings, rendered by helm and
created in the API server; a token from the TokenRequest API).

What the operator did is read from the API server's audit log (DIR/audit.log, one JSON line per request
at Metadata level: user, verb, resource, name, response code), never from a recorder of our own.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import ssl
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

import kopf
import yaml
from kopf.testing import KopfRunner

from pgherd.kube.api import Credentials, TokenFile
from pgherd.kube.handlers import Election, Operator, build
from pgherd.kube.loop import OperatorConfig

REPO = Path(__file__).resolve().parents[2]
JSON = dict[str, Any]
MERGE = "application/merge-patch+json"

# plural -> (API path prefix, kind, namespaced); "events" are events.k8s.io's (what pgherd writes).
RESOURCES: dict[str, tuple[str, str, bool]] = {
    "postgresclusters": ("/apis/pgherd.io/v1alpha1", "PostgresCluster", True),
    "backups": ("/apis/pgherd.io/v1alpha1", "Backup", True),
    "restores": ("/apis/pgherd.io/v1alpha1", "Restore", True),
    "pods": ("/api/v1", "Pod", True),
    "services": ("/api/v1", "Service", True),
    "secrets": ("/api/v1", "Secret", True),
    "configmaps": ("/api/v1", "ConfigMap", True),
    "serviceaccounts": ("/api/v1", "ServiceAccount", True),
    "persistentvolumeclaims": ("/api/v1", "PersistentVolumeClaim", True),
    "namespaces": ("/api/v1", "Namespace", False),
    "events": ("/apis/events.k8s.io/v1", "Event", True),
    "statefulsets": ("/apis/apps/v1", "StatefulSet", True),
    "jobs": ("/apis/batch/v1", "Job", True),
    "poddisruptionbudgets": ("/apis/policy/v1", "PodDisruptionBudget", True),
    "networkpolicies": ("/apis/networking.k8s.io/v1", "NetworkPolicy", True),
    "leases": ("/apis/coordination.k8s.io/v1", "Lease", True),
    "endpointslices": ("/apis/discovery.k8s.io/v1", "EndpointSlice", True),
    "roles": ("/apis/rbac.authorization.k8s.io/v1", "Role", True),
    "rolebindings": ("/apis/rbac.authorization.k8s.io/v1", "RoleBinding", True),
    "clusterroles": ("/apis/rbac.authorization.k8s.io/v1", "ClusterRole", False),
    "clusterrolebindings": ("/apis/rbac.authorization.k8s.io/v1", "ClusterRoleBinding", False),
    "flowschemas": ("/apis/flowcontrol.apiserver.k8s.io/v1", "FlowSchema", False),
    "prioritylevelconfigurations": (
        "/apis/flowcontrol.apiserver.k8s.io/v1",
        "PriorityLevelConfiguration",
        False,
    ),
    "validatingadmissionpolicies": (
        "/apis/admissionregistration.k8s.io/v1",
        "ValidatingAdmissionPolicy",
        False,
    ),
    "validatingadmissionpolicybindings": (
        "/apis/admissionregistration.k8s.io/v1",
        "ValidatingAdmissionPolicyBinding",
        False,
    ),
}
PLURALS = {kind: plural for plural, (_, kind, _) in RESOURCES.items()}


class ApiRefused(Exception):
    def __init__(self, status: int, body: JSON) -> None:
        super().__init__(f"{status}: {body.get('message') or body}")
        self.status, self.body = status, body


class Kube:
    """The administrator's requests (system:masters), synchronous, one connection each."""

    def __init__(self, url: str, tls: ssl.SSLContext) -> None:
        self.url, self.tls = url.rstrip("/"), tls

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        content_type: str = "application/json",
        params: Mapping[str, str] | None = None,
    ) -> JSON:
        url = self.url + path + (f"?{urlencode(params)}" if params else "")
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(url, data=data, method=method)
        request.add_header("Accept", "application/json")
        if data is not None:
            request.add_header("Content-Type", content_type)
        try:
            with urllib.request.urlopen(request, context=self.tls, timeout=30) as response:
                text = response.read()
        except urllib.error.HTTPError as exc:
            raw = exc.read()
            try:
                doc = json.loads(raw)
            except ValueError:
                doc = {"message": raw.decode(errors="replace")}
            raise ApiRefused(exc.code, doc) from None
        return json.loads(text) if text else {}

    @staticmethod
    def path(
        resource: str, namespace: str | None = None, name: str | None = None, subresource: str | None = None
    ) -> str:
        prefix, _, namespaced = RESOURCES[resource]
        parts = [prefix]
        if namespaced and namespace is not None:
            parts.append(f"namespaces/{quote(namespace, safe='')}")
        parts.append(resource)
        if name is not None:
            parts.append(quote(name, safe=""))
        if subresource is not None:
            parts.append(subresource)
        return "/".join(parts)

    def create(self, doc: JSON, namespace: str | None = None) -> JSON:
        resource = PLURALS[doc["kind"]]
        ns = namespace or (doc.get("metadata") or {}).get("namespace")
        return self.request("POST", self.path(resource, ns), doc)

    def read(self, resource: str, namespace: str | None, name: str) -> JSON | None:
        try:
            return self.request("GET", self.path(resource, namespace, name))
        except ApiRefused as exc:
            if exc.status == 404:
                return None
            raise

    def merge(
        self,
        resource: str,
        namespace: str | None,
        name: str,
        patch: JSON,
        *,
        subresource: str | None = None,
        dry_run: bool = False,
    ) -> JSON:
        return self.request(
            "PATCH",
            self.path(resource, namespace, name, subresource),
            patch,
            content_type=MERGE,
            params={"dryRun": "All"} if dry_run else None,
        )

    def remove(self, resource: str, namespace: str | None, name: str) -> bool:
        """Delete (background propagation, the API server's default); False if it was not there."""
        try:
            self.request("DELETE", self.path(resource, namespace, name))
        except ApiRefused as exc:
            if exc.status == 404:
                return False
            raise
        return True

    def items(self, resource: str, namespace: str | None) -> list[JSON]:
        return list(self.request("GET", self.path(resource, namespace)).get("items") or [])

    def token(
        self, namespace: str, service_account: str, seconds: int = 3600, *, bound_to: JSON | None = None
    ) -> str:
        """A token of that ServiceAccount from the TokenRequest API (as the kubelet gets a pod's).
        ``bound_to``: an object of the namespace (kind, name, uid of a Secret or Pod) the token lives
        with: deleting it invalidates the token at once, as a pod's token dies with its pod."""
        spec: JSON = {"expirationSeconds": seconds}
        if bound_to is not None:
            spec["boundObjectRef"] = {"apiVersion": "v1", **bound_to}
        doc = self.request(
            "POST",
            self.path("serviceaccounts", namespace, service_account, "token"),
            {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec},
        )
        return str(doc["status"]["token"])

    def allowed(self, user: str, groups: Sequence[str], attributes: JSON) -> bool:
        """The API server's own authorizer (SubjectAccessReview): may `user` do that?"""
        review = self.request(
            "POST",
            "/apis/authorization.k8s.io/v1/subjectaccessreviews",
            {
                "apiVersion": "authorization.k8s.io/v1",
                "kind": "SubjectAccessReview",
                "spec": {"user": user, "groups": list(groups), "resourceAttributes": attributes},
            },
        )
        return bool(review.get("status", {}).get("allowed"))

    def make_namespace(self, name: str) -> None:
        self.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})


# -- the audit log -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AuditEvent:
    """One request as the API server audited it (stage ResponseComplete, or ResponseStarted for a watch
    still open)."""

    audit_id: str
    stage: str
    user: str
    extra: Mapping[str, tuple[str, ...]]
    verb: str
    uri: str
    code: int
    group: str
    resource: str
    subresource: str
    namespace: str
    name: str
    message: str  # responseStatus.message (why a request was refused)
    user_agent: str = ""

    @classmethod
    def parse(cls, doc: JSON) -> AuditEvent:
        ref = doc.get("objectRef") or {}
        status = doc.get("responseStatus") or {}
        user = doc.get("user") or {}
        return cls(
            audit_id=str(doc.get("auditID", "")),
            stage=str(doc.get("stage", "")),
            user=str(user.get("username", "")),
            extra={k: tuple(v) for k, v in (user.get("extra") or {}).items()},
            verb=str(doc.get("verb", "")),
            uri=str(doc.get("requestURI", "")),
            code=int(status.get("code") or 0),
            group=str(ref.get("apiGroup", "")),
            resource=str(ref.get("resource", "")),
            subresource=str(ref.get("subresource", "")),
            namespace=str(ref.get("namespace", "")),
            name=str(ref.get("name", "")),
            message=str(status.get("message", "")),
            user_agent=str(doc.get("userAgent", "")),
        )

    @property
    def credential(self) -> str:
        """Which token: the API server's credential id of a ServiceAccount token, "JTI=<its jti>"."""
        values = self.extra.get("authentication.kubernetes.io/credential-id") or ("",)
        return values[0]

    @property
    def rbac_resource(self) -> str:
        return f"{self.resource}/{self.subresource}" if self.subresource else self.resource

    @property
    def write(self) -> bool:
        return self.verb in ("create", "update", "patch", "delete", "deletecollection")

    def short(self) -> str:
        where = "/".join(p for p in (self.namespace, self.name) if p)
        group = f"{self.group}/" if self.group else ""
        return f"{self.verb} {group}{self.rbac_resource} {where} -> {self.code}".replace("  ", " ")


class AuditLog:
    """DIR/audit.log, read as it grows: one entry per request, in the order they started to be answered
    (ResponseComplete; a watch from its ResponseStarted on, replaced by its ResponseComplete once it
    ends). A request whose token was refused (401) is audited apart, before any user is known, with
    one ResponseStarted only: those are in ``unauthenticated``, not in ``events``."""

    def __init__(self, path: Path, kube: Kube) -> None:
        self.path, self.kube = path, kube
        self._offset = 0
        self._partial = b""
        self.events: list[AuditEvent] = []
        self.unauthenticated: list[AuditEvent] = []
        self._open: dict[str, int] = {}  # audit id of a watch still open -> its index in events

    def read(self) -> list[AuditEvent]:
        """Every request logged so far."""
        with open(self.path, "rb") as handle:
            handle.seek(self._offset)
            chunk = handle.read()
        self._offset += len(chunk)
        lines = (self._partial + chunk).split(b"\n")
        self._partial = lines.pop()  # an unfinished last line: read again next time
        for line in lines:
            if not line.strip():
                continue
            event = AuditEvent.parse(json.loads(line))
            if event.stage == "ResponseStarted" and event.code == 401 and not event.user:
                self.unauthenticated.append(event)
            elif event.stage == "ResponseStarted" and event.verb == "watch":
                self._open[event.audit_id] = len(self.events)
                self.events.append(event)
            elif event.stage == "ResponseComplete":
                index = self._open.pop(event.audit_id, None)
                if index is None:
                    self.events.append(event)
                else:
                    self.events[index] = event
        return self.events

    def fence(self, timeout: float = 10.0) -> int:
        """Wait until every request answered before this call is in the log; the number of events then
        (a mark for `since`). A request the API server answered is written to the log once its handler
        returns, a moment after the client has the answer: a request of our own made now, found in the
        log, is past every earlier one, give or take a write in flight, hence the short pause."""
        name = f"audit-fence-{uuid.uuid4().hex[:12]}"
        with contextlib.suppress(ApiRefused):
            self.kube.request("GET", Kube.path("configmaps", "default", name))
        deadline = time.monotonic() + timeout
        while not any(e.name == name for e in self.read()[-200:]):
            if time.monotonic() > deadline:
                raise AssertionError(f"the fence request {name} is not in {self.path} after {timeout:.0f} s")
            time.sleep(0.05)
        time.sleep(0.1)
        return len(self.read())

    def of(self, user: str, since: int = 0, *, credential: str | None = None) -> list[AuditEvent]:
        """The completed requests of `user` (and of that token, when `credential` is given)."""
        return [
            e
            for e in self.read()[since:]
            if e.user == user and (credential is None or e.credential == credential)
        ]


def token_credential(token: str) -> str:
    """The audit log's credential id of a ServiceAccount token: "JTI=" and its `jti` claim."""
    payload = token.split(".")[1]
    claims = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    return f"JTI={claims['jti']}"


# -- the chart's RBAC ---------------------------------------------------------------------------------


def find_helm() -> str | None:
    local = REPO / ".tools" / "bin" / "helm"
    return (
        os.environ.get("HELM") or shutil.which("helm") or (str(local) if os.access(local, os.X_OK) else None)
    )


def render_chart(release: str, namespace: str, *values: str) -> list[JSON]:
    """`helm template` of charts/pgherd: every document."""
    helm = find_helm()
    if helm is None:
        raise AssertionError("helm not found: run `make setup` (scripts/ensure-helm.sh)")
    rendered = subprocess.run(
        [helm, "template", release, str(REPO / "charts" / "pgherd"), "--namespace", namespace, *values],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    return [doc for doc in yaml.safe_load_all(rendered) if doc]


RBAC_KINDS = ("ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding")


@dataclass(frozen=True)
class Rule:
    """One rule of a Role (namespace set: there only) or ClusterRole (namespace None: everywhere)."""

    namespace: str | None
    api_groups: tuple[str, ...]
    resources: tuple[str, ...]
    verbs: tuple[str, ...]
    names: tuple[str, ...] = ()

    def allows(self, event: AuditEvent) -> bool:
        if self.namespace is not None and event.namespace != self.namespace:
            return False
        # create is authorized without a name (the object does not exist yet), as list and watch are.
        name = "" if event.verb in ("create", "list", "watch") else event.name
        return (
            ("*" in self.api_groups or event.group in self.api_groups)
            and ("*" in self.resources or event.rbac_resource in self.resources)
            and ("*" in self.verbs or event.verb in self.verbs)
            and (not self.names or name in self.names)
        )


def rules_of(docs: Iterable[JSON]) -> list[Rule]:
    found = []
    for doc in docs:
        if doc["kind"] not in ("ClusterRole", "Role"):
            continue
        namespace = doc["metadata"].get("namespace") if doc["kind"] == "Role" else None
        for rule in doc.get("rules") or []:
            found.append(
                Rule(
                    namespace,
                    tuple(rule.get("apiGroups") or ()),
                    tuple(rule.get("resources") or ()),
                    tuple(rule.get("verbs") or ()),
                    tuple(rule.get("resourceNames") or ()),
                )
            )
    return found


def not_granted(events: Iterable[AuditEvent], rules: Sequence[Rule]) -> list[AuditEvent]:
    """The resource requests (each distinct one once) that no rule grants."""
    seen: set[tuple[str, ...]] = set()
    result = []
    for event in events:
        if not event.resource:
            continue  # discovery (/api, /apis, /version): the default system:discovery role's
        key = (event.verb, event.group, event.rbac_resource, event.namespace, event.name)
        if key in seen:
            continue
        seen.add(key)
        if not any(rule.allows(event) for rule in rules):
            result.append(event)
    return result


@dataclass
class ChartIdentity:
    """The operator as the chart installs it: release `release` in `namespace`, watching `watched`;
    its ServiceAccount, rules, the Lease name its Deployment is given, and a token."""

    kube: Kube
    server: str
    ca_file: Path
    release: str
    namespace: str
    watched: str
    docs: list[JSON]
    token: str = ""
    tokens: list[str] = field(default_factory=list)

    @property
    def service_account(self) -> str:
        (sa,) = [d for d in self.docs if d["kind"] == "ServiceAccount"]
        return str(sa["metadata"]["name"])

    @property
    def user(self) -> str:
        return f"system:serviceaccount:{self.namespace}:{self.service_account}"

    @property
    def groups(self) -> list[str]:
        return ["system:serviceaccounts", f"system:serviceaccounts:{self.namespace}", "system:authenticated"]

    @property
    def lease(self) -> str:
        (deployment,) = [d for d in self.docs if d["kind"] == "Deployment"]
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        (value,) = [e["value"] for e in container["env"] if e["name"] == "PGHERD_LEADER_ELECTION_LEASE"]
        return str(value)

    @property
    def rules(self) -> list[Rule]:
        return rules_of(self.docs)

    def new_token(self) -> str:
        """Another token of the ServiceAccount (a second replica's): told apart in the audit log by
        its credential id."""
        token = self.kube.token(self.namespace, self.service_account)
        self.tokens.append(token)
        return token

    def credentials(self, token: str | None = None, *, token_file: Path | None = None) -> Credentials:
        """``token_file``: the token is that file's, followed as it changes (the in-cluster way)."""
        context = ssl.create_default_context(cafile=str(self.ca_file))
        follow = TokenFile(token_file) if token_file is not None else None
        return Credentials(
            server=self.server, token=token or self.token, ssl_context=context, token_file=follow
        )

    def login(self, token: str | None = None) -> kopf.ConnectionInfo:
        """What kopf logs in with: the same server, token and CA."""
        return kopf.ConnectionInfo(
            server=self.server, ca_path=str(self.ca_file), token=token or self.token, scheme="Bearer"
        )


def install_chart_rbac(
    kube: Kube,
    *,
    server: str,
    ca_file: Path,
    release: str,
    namespace: str,
    watched: str,
    edit: Callable[[list[JSON]], None] | None = None,
) -> ChartIdentity:
    """Render the chart (release `release` in `namespace`, watchNamespaces={watched}) and create its
    ServiceAccount, ClusterRole, Roles and bindings; not its Deployment (the operator runs in the test).
    `edit(docs)` may change the rendered documents first (a rule taken out). Returns once the API
    server's authorizer grants the ServiceAccount its rules (RBAC is applied from a cache)."""
    docs = render_chart(release, namespace, "--set", f"watchNamespaces={{{watched}}}")
    if edit is not None:
        edit(docs)
    for doc in docs:
        if doc["kind"] in RBAC_KINDS:
            kube.create(doc)
    identity = ChartIdentity(kube, server, ca_file, release, namespace, watched, docs)
    probes = [_probe(rule, watched) for rule in identity.rules]
    deadline = time.monotonic() + 10
    while not all(kube.allowed(identity.user, identity.groups, probe) for probe in probes):
        if time.monotonic() > deadline:
            raise AssertionError(f"the chart's rules are not in force for {identity.user} after 10 s")
        time.sleep(0.05)
    identity.token = kube.token(namespace, identity.service_account)
    identity.tokens.append(identity.token)
    return identity


def _probe(rule: Rule, watched: str) -> JSON:
    """A request that `rule` grants, as SubjectAccessReview attributes."""
    resource, _, subresource = rule.resources[0].partition("/")
    attributes: JSON = {
        "namespace": rule.namespace or watched,
        "verb": rule.verbs[0],
        "group": rule.api_groups[0],
        "resource": resource,
    }
    if subresource:
        attributes["subresource"] = subresource
    if rule.names:
        attributes["name"] = rule.names[0]
    return attributes


@contextlib.contextmanager
def running_as(
    identity: ChartIdentity,
    *,
    election: Election | None = None,
    token: str | None = None,
    token_file: Path | None = None,
    config: OperatorConfig | None = None,
) -> Iterator[Operator]:
    """`pgherd operator` in this process (kopf's KopfRunner, the handlers of pgherd.kube.handlers) as
    the chart's ServiceAccount, watching `identity.watched`; stopped when the block ends.
    ``token_file``: its token is that file's (as in a pod, where the kubelet rotates it)."""
    operator = Operator(
        config=config or OperatorConfig(steady_interval=0.2, busy_interval=0.1, idle_interval=0.2),
        election=election,
        credentials=identity.credentials(token, token_file=token_file),
        login_info=identity.login(token),
    )
    registry, settings = build(operator)
    with KopfRunner(
        ["run", "--standalone", "--namespace", identity.watched],
        registry=registry,
        settings=settings,
        timeout=60,
    ) as runner:
        yield operator
    assert runner.exception is None, runner.output


def chart_election(identity: ChartIdentity, replica: str, **timing: float) -> Election:
    """--leader-elect as the chart's Deployment runs it: the Lease it names, in the release namespace."""
    return Election(namespace=identity.namespace, name=identity.lease, identity=replica, **timing)
