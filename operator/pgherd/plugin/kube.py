"""The plugin's one door to the API server: the connection kubectl would make (``--kubeconfig``,
``--context``, ``--namespace``; KUBECONFIG, ~/.kube/config, the context's namespace; in a pod, its
ServiceAccount), and every request, answered as plain JSON.

Every request names its verb and resource, so that a refusal reads as kubectl's would: no such
object (and the namespace looked in), or no permission (the verb, the resource, the user). Objects
are read raw (``_preload_content=False``) and parsed here: the same documents on every version of the
`kubernetes` client, fields it does not model included.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes.client.exceptions import ApiException
from kubernetes.config.config_exception import ConfigException

from pgherd.kube import names
from pgherd.plugin.errors import PluginError

JSON = dict[str, Any]
MERGE_PATCH = "application/merge-patch+json"
IN_CLUSTER_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
# Labels of the operator's Deployment as the chart writes them (charts/pgherd/templates/_helpers.tpl).
OPERATOR_SELECTOR = "app.kubernetes.io/part-of=pgherd,app.kubernetes.io/component=operator"
REQUEST_TIMEOUT = 30.0


class _Raw(Protocol):
    """The raw answer of a generated method called with ``_preload_content=False``."""

    data: bytes
    status: int

    def stream(self, amt: int | None = ..., decode_content: bool | None = ...) -> Iterator[bytes]: ...

    def release_conn(self) -> None: ...


@dataclass(frozen=True)
class Target:
    """What the person asked for: kubectl's global flags."""

    kubeconfig: str | None = None
    context: str | None = None
    namespace: str | None = None


def _kubeconfig_path(given: str | None) -> str:
    return given or os.environ.get("KUBECONFIG") or str(Path("~/.kube/config").expanduser())


def _first_existing(paths: str) -> bool:
    return any(Path(p).expanduser().exists() for p in paths.split(os.pathsep) if p)


def connect(target: Target) -> Kube:
    """A client as kubectl would make it from ``target``; a missing or broken kubeconfig is one line."""
    configuration = k8s.Configuration()
    path = _kubeconfig_path(target.kubeconfig)
    in_cluster = (
        target.kubeconfig is None and not _first_existing(path) and "KUBERNETES_SERVICE_HOST" in os.environ
    )
    try:
        if in_cluster:
            k8s_config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
            namespace = target.namespace or IN_CLUSTER_NAMESPACE.read_text().strip()
            context = "in-cluster"
        else:
            if not _first_existing(path):
                raise PluginError(
                    f"no kubeconfig at {path}: pass --kubeconfig, set KUBECONFIG, or run in a pod with a"
                    " ServiceAccount"
                )
            contexts, current = k8s_config.list_kube_config_contexts(config_file=path)  # type: ignore[no-untyped-call]
            chosen = target.context or (current or {}).get("name")
            found = next((c for c in contexts or [] if c.get("name") == chosen), None)
            if found is None:
                known = ", ".join(sorted(str(c.get("name")) for c in contexts or [])) or "none"
                raise PluginError(f"no context {chosen!r} in {path} (contexts: {known})")
            k8s_config.load_kube_config(  # type: ignore[no-untyped-call]
                config_file=path, context=chosen, client_configuration=configuration, persist_config=False
            )
            namespace = target.namespace or (found.get("context") or {}).get("namespace") or "default"
            context = str(chosen)
    except (ConfigException, OSError, ValueError) as exc:
        raise PluginError(f"cannot load the Kubernetes configuration ({path}): {exc}") from None
    return Kube(k8s.ApiClient(configuration), str(namespace), context)


class Kube:
    """Requests in one namespace (``namespace``), as plain JSON documents."""

    def __init__(self, api_client: k8s.ApiClient, namespace: str, context: str = "") -> None:
        self.api_client = api_client
        self.namespace = namespace
        self.context = context
        self.core = k8s.CoreV1Api(api_client)
        self.apps = k8s.AppsV1Api(api_client)
        self.batch = k8s.BatchV1Api(api_client)
        self.custom = k8s.CustomObjectsApi(api_client)

    @property
    def server(self) -> str:
        return str(self.api_client.configuration.host)

    # -- the way every request goes -----------------------------------------------------------------

    def call(
        self,
        verb: str,
        resource: str,
        name: str | None,
        request: Callable[[], Any],
        *,
        namespace: str | None = "",
    ) -> Any:
        """``request()``, its refusal turned into a PluginError naming the verb and the resource."""
        where = self.namespace if namespace == "" else namespace
        try:
            return request()
        except ApiException as exc:
            raise refusal(exc, verb, resource, name, where) from None
        except PluginError:
            raise
        except Exception as exc:  # the transport's (urllib3, ssl, sockets): the server cannot be reached
            if isinstance(exc, OSError) or type(exc).__module__.split(".")[0] in ("urllib3", "ssl", "socket"):
                raise PluginError(f"cannot reach the API server {self.server}: {exc}") from None
            raise

    def _json(
        self, verb: str, resource: str, name: str | None, request: Callable[[], Any], **kw: Any
    ) -> JSON:
        raw: _Raw = self.call(verb, resource, name, request, **kw)
        document: JSON = json.loads(raw.data) if raw.data else {}
        return document

    # -- pgherd's objects -----------------------------------------------------------------------------

    def get_custom(self, plural: str, name: str) -> JSON:
        return self._json(
            "get",
            f"{plural}.{names.GROUP}",
            name,
            lambda: self.custom.get_namespaced_custom_object(
                names.GROUP, names.VERSION, self.namespace, plural, name, _preload_content=False,
                _request_timeout=REQUEST_TIMEOUT,
            ),
        )  # fmt: skip

    def cluster(self, name: str) -> JSON:
        """The PostgresCluster ``name``: a missing one is an error naming the namespace looked in."""
        try:
            return self.get_custom(names.PLURAL_CLUSTERS, name)
        except NotFound:
            raise PluginError(
                f"no PostgresCluster {name!r} in namespace {self.namespace!r} (kubectl get pgc -A lists"
                " them all; -n NAMESPACE looks elsewhere)"
            ) from None

    def list_custom(self, plural: str) -> list[JSON]:
        doc = self._json(
            "list",
            f"{plural}.{names.GROUP}",
            None,
            lambda: self.custom.list_namespaced_custom_object(
                names.GROUP, names.VERSION, self.namespace, plural, _preload_content=False,
                _request_timeout=REQUEST_TIMEOUT,
            ),
        )  # fmt: skip
        return list(doc.get("items") or [])

    def create_custom(self, plural: str, body: JSON) -> JSON:
        name = (body.get("metadata") or {}).get("name")
        return self._json(
            "create",
            f"{plural}.{names.GROUP}",
            name,
            lambda: self.custom.create_namespaced_custom_object(
                names.GROUP, names.VERSION, self.namespace, plural, body, _preload_content=False,
                _request_timeout=REQUEST_TIMEOUT,
            ),
        )  # fmt: skip

    def patch_cluster(self, name: str, patch: JSON) -> JSON:
        """A merge patch of the PostgresCluster (its annotations, spec.paused)."""
        return self._json(
            "patch",
            f"{names.PLURAL_CLUSTERS}.{names.GROUP}",
            name,
            lambda: self.custom.patch_namespaced_custom_object(
                names.GROUP, names.VERSION, self.namespace, names.PLURAL_CLUSTERS, name, patch,
                _content_type=MERGE_PATCH, _preload_content=False, _request_timeout=REQUEST_TIMEOUT,
            ),
        )  # fmt: skip

    # -- Kubernetes' own objects ------------------------------------------------------------------------

    def pods(self, selector: str) -> list[JSON]:
        doc = self._json(
            "list",
            "pods",
            None,
            lambda: self.core.list_namespaced_pod(
                self.namespace,
                label_selector=selector,
                _preload_content=False,
                _request_timeout=REQUEST_TIMEOUT,
            ),
        )
        return list(doc.get("items") or [])

    def pod(self, name: str) -> JSON:
        return self._json(
            "get",
            "pods",
            name,
            lambda: self.core.read_namespaced_pod(
                name, self.namespace, _preload_content=False, _request_timeout=REQUEST_TIMEOUT
            ),
        )

    def delete_pod(self, name: str) -> None:
        self.call(
            "delete",
            "pods",
            name,
            lambda: self.core.delete_namespaced_pod(
                name, self.namespace, _preload_content=False, _request_timeout=REQUEST_TIMEOUT
            ),
        )

    def pvcs(self, selector: str) -> list[JSON]:
        doc = self._json(
            "list",
            "persistentvolumeclaims",
            None,
            lambda: self.core.list_namespaced_persistent_volume_claim(
                self.namespace,
                label_selector=selector,
                _preload_content=False,
                _request_timeout=REQUEST_TIMEOUT,
            ),
        )
        return list(doc.get("items") or [])

    def jobs(self, selector: str) -> list[JSON]:
        doc = self._json(
            "list",
            "jobs.batch",
            None,
            lambda: self.batch.list_namespaced_job(
                self.namespace,
                label_selector=selector,
                _preload_content=False,
                _request_timeout=REQUEST_TIMEOUT,
            ),
        )
        return list(doc.get("items") or [])

    def statefulset(self, name: str) -> JSON:
        return self._json(
            "get",
            "statefulsets.apps",
            name,
            lambda: self.apps.read_namespaced_stateful_set(
                name, self.namespace, _preload_content=False, _request_timeout=REQUEST_TIMEOUT
            ),
        )

    def events(self, field_selector: str | None = None) -> list[JSON]:
        """core/v1 Events of the namespace (events.k8s.io ones included: one store, two views)."""
        doc = self._json(
            "list",
            "events",
            None,
            lambda: self.core.list_namespaced_event(
                self.namespace, field_selector=field_selector, _preload_content=False,
                _request_timeout=REQUEST_TIMEOUT,
            ),
        )  # fmt: skip
        return list(doc.get("items") or [])

    def certificate_parts(
        self, secret: str, keys: tuple[str, ...] = (names.KEY_TLS_CERT, names.KEY_CA_CERT)
    ) -> dict[str, str]:
        """Only the certificates (public) of Secret ``secret``, decoded: every other key of its data (a
        private key, a password) is dropped as soon as the answer is parsed, never kept or shown."""
        import base64

        doc = self._json(
            "get",
            "secrets",
            secret,
            lambda: self.core.read_namespaced_secret(
                secret, self.namespace, _preload_content=False, _request_timeout=REQUEST_TIMEOUT
            ),
        )
        data = doc.get("data") or {}
        found = {key: base64.b64decode(data[key]).decode("ascii", "replace") for key in keys if key in data}
        del data, doc
        return found

    def operator_deployments(self) -> list[JSON]:
        """The pgherd operator's Deployments, in any namespace, found by the chart's labels."""
        doc = self._json(
            "list",
            "deployments.apps",
            None,
            lambda: self.apps.list_deployment_for_all_namespaces(
                label_selector=OPERATOR_SELECTOR, _preload_content=False, _request_timeout=REQUEST_TIMEOUT
            ),
            namespace=None,
        )
        return list(doc.get("items") or [])

    def pods_in(self, namespace: str, selector: str) -> list[JSON]:
        doc = self._json(
            "list",
            "pods",
            None,
            lambda: self.core.list_namespaced_pod(
                namespace, label_selector=selector, _preload_content=False, _request_timeout=REQUEST_TIMEOUT
            ),
            namespace=namespace,
        )
        return list(doc.get("items") or [])

    # -- streams ----------------------------------------------------------------------------------------

    def log_lines(
        self,
        pod: str,
        container: str,
        *,
        namespace: str | None = None,
        follow: bool = False,
        since_seconds: int | None = None,
        tail_lines: int | None = None,
    ) -> Iterator[str]:
        """The container's log, one line at a time, each prefixed by the API server's RFC 3339 time."""
        where = namespace or self.namespace
        raw: _Raw = self.call(
            "get",
            "pods/log",
            pod,
            lambda: self.core.read_namespaced_pod_log(
                pod, where, container=container, follow=follow, timestamps=True, since_seconds=since_seconds,
                tail_lines=tail_lines, _preload_content=False, _request_timeout=None if follow else REQUEST_TIMEOUT,
            ),
            namespace=where,
        )  # fmt: skip
        pending = b""
        try:
            for chunk in raw.stream(amt=None, decode_content=False):
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    yield line.decode("utf-8", "replace")
            if pending:
                yield pending.decode("utf-8", "replace")
        finally:
            raw.release_conn()


class NotFound(PluginError):
    """The object does not exist (404)."""


_USER = re.compile(r'User "([^"]+)"')


def refusal(
    exc: ApiException, verb: str, resource: str, name: str | None, namespace: str | None
) -> PluginError:
    """The API server's refusal in words: what was asked, where, and why."""
    what = f"{resource} {name!r}" if name else resource
    where = f" in namespace {namespace!r}" if namespace else " in any namespace"
    message = _message(exc)
    if exc.status == 404:
        return NotFound(f"no {what}{where}")
    if exc.status == 403:
        user = _USER.search(message)
        who = f" as {user.group(1)}" if user else ""
        return PluginError(f"no permission to {verb} {what}{where}{who}: the API server refused (403)")
    if exc.status == 401:
        return PluginError(f"the API server refused the credentials (401) to {verb} {what}: log in again")
    return PluginError(f"cannot {verb} {what}{where}: {exc.status} {message or exc.reason}")


def _message(exc: ApiException) -> str:
    body = exc.body
    if isinstance(body, bytes):
        body = body.decode("utf-8", "replace")
    try:
        doc = json.loads(body) if body else {}
    except ValueError:
        return str(body or "")
    return str(doc.get("message") or "") if isinstance(doc, Mapping) else ""
