"""The `kind` driver: the operator's Helm chart and kubectl against a kind (or any) Kubernetes cluster.

Each driver gets its own namespace (`pgherd-e2e-<cluster>`, deleted by down()); the operator is
installed once per session from charts/pgherd unless $PGHERD_E2E_INSTALL=0 says it is already there.

    PGHERD_E2E_DRIVER=kind           select this driver
    PGHERD_E2E_IMAGE=pgherd:e2e      the image to run (load it first: kind load docker-image pgherd:e2e)
    PGHERD_E2E_KUBE_CONTEXT=kind-... kubectl/helm context (default: the current one)
    PGHERD_E2E_OPERATOR_NAMESPACE    where the operator runs (default pgherd-system)
    PGHERD_E2E_RELEASE               the Helm release, also the Deployment's name (default pgherd)
    PGHERD_E2E_INSTALL=0             do not install or upgrade the chart
    PGHERD_E2E_S3_ENDPOINT           an S3 server the pods reach (e.g. the MinIO of e2e/kind/install-minio.sh):
                                     a PostgresCluster applied without spec.backup.store gets this store
                                     (as the sandbox gives its embedded one), so Backups and Restores work
    PGHERD_E2E_S3_BUCKET             its bucket (default pgherd-e2e; it must exist)
    PGHERD_E2E_S3_SECRET             NAMESPACE/NAME of a Secret holding AWS_ACCESS_KEY_ID and
                                     AWS_SECRET_ACCESS_KEY, copied as `pgherd-e2e-s3` into each cluster's namespace
    PGHERD_E2E_S3_PATH               the prefix in the bucket (default e2e-<UTC time of the session>: a
                                     rerun against the same bucket starts from an empty archive)

How the scenarios' operations map to Kubernetes:
  kill(member)          kubectl delete pod <member> --grace-period=0 --force (the StatefulSet recreates it)
  kill(member, wipe)    the same after deleting the pod's PVC (a lost volume)
  switchover(to)        annotation pgherd.io/switchover-to=<member|any> on the PostgresCluster; the
                        operator removes it once the switchover is done or refused
  kill_operator()       scale the operator Deployment to 0 and force-delete its pod
  resume_operator()     scale it back to 1 and wait for the rollout
  rw_dsn()              a local TCP proxy: each connection goes to the pod behind the `<cluster>-rw`
                        Service's endpoints at that moment, through `kubectl port-forward pod/...`
                        (port-forward to a Service pins one pod and would outlive a failover)
  member_dsn(name)      kubectl port-forward pod/<name>
Credentials come from the Secret `<cluster>-app` (keys username, password, dbname).
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import selectors
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar, cast

import yaml

from e2e.driver import (
    ClusterStatus,
    DriverError,
    Manifest,
    ManifestRefused,
    MemberStatus,
    ObjectStatus,
    PollingDriver,
    operation_at,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
SWITCHOVER_ANNOTATION = "pgherd.io/switchover-to"
POSTGRES_PORT = 5432
S3_SECRET = "pgherd-e2e-s3"
S3_KEYS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
_FORWARDING = re.compile(r"Forwarding from 127\.0\.0\.1:(\d+) -> ")
_SESSION_PATH = time.strftime("e2e-%Y%m%d-%H%M%S", time.gmtime())


def _env(name: str, default: str) -> str:
    return os.environ.get(name) or default


def chart_image_values(image: str) -> list[str]:
    """`helm --set` arguments running `image` (REPOSITORY[:TAG]) as the operator. The chart's default
    postgresImage is then `<image>-pg{major}`: e2e/kind/build-image.sh loads that tag too."""
    last = image.split("/")[-1]
    repository, _, tag = image.rpartition(":") if ":" in last else (image, "", "")
    values = ["--set", f"image.repository={repository}", "--set", "image.pullPolicy=IfNotPresent"]
    if tag:
        values += ["--set", f"image.tag={tag}"]
    return values


def s3_store() -> dict[str, Any] | None:
    """The backup store given to clusters applied without one ($PGHERD_E2E_S3_ENDPOINT), else None."""
    endpoint = os.environ.get("PGHERD_E2E_S3_ENDPOINT")
    if not endpoint:
        return None
    return {
        "s3": {
            "bucket": _env("PGHERD_E2E_S3_BUCKET", "pgherd-e2e"),
            "path": _env("PGHERD_E2E_S3_PATH", _SESSION_PATH),
            "endpoint": endpoint,
            "forcePathStyle": True,
            "credentials": {"secretName": S3_SECRET},
        }
    }


def with_store(manifest: Manifest, store: dict[str, Any] | None) -> dict[str, Any]:
    """A copy of `manifest`; a PostgresCluster without spec.backup.store gets `store`."""
    doc = dict(manifest)
    if store is None or doc.get("kind") != "PostgresCluster":
        return doc
    spec = dict(doc.get("spec") or {})
    backup = dict(spec.get("backup") or {})
    if backup.get("store"):
        return doc
    backup["store"] = store
    spec["backup"] = backup
    doc["spec"] = spec
    return doc


class Kube:
    """kubectl and helm with the configured context; failures raise DriverError with their output."""

    def __init__(self) -> None:
        context = os.environ.get("PGHERD_E2E_KUBE_CONTEXT")
        self.kubectl = [_env("KUBECTL", "kubectl"), *(["--context", context] if context else [])]
        self.helm = [_env("HELM", "helm"), *(["--kube-context", context] if context else [])]

    def run(
        self, *args: str, input: str | None = None, check: bool = True, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        return self._run([*self.kubectl, *args], input=input, check=check, timeout=timeout)

    def run_helm(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        return self._run([*self.helm, *args], input=None, check=True, timeout=timeout)

    def json(self, *args: str) -> Any:
        return json.loads(self.run(*args, "-o", "json").stdout)

    @staticmethod
    def _run(
        argv: list[str], *, input: str | None, check: bool, timeout: float
    ) -> subprocess.CompletedProcess[str]:
        try:
            result = subprocess.run(argv, input=input, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            raise DriverError(f"`{' '.join(argv)}` did not finish within {timeout:.0f} s") from exc
        if check and result.returncode != 0:
            raise DriverError(
                f"`{' '.join(argv)}` exited with {result.returncode}: {result.stderr.strip() or result.stdout.strip()}"
            )
        return result


class PodForwarder:
    """`kubectl port-forward pod/<name> :5432`, restarted when it died (the pod was deleted)."""

    def __init__(self, kube: Kube, namespace: str, pod: str) -> None:
        self.kube, self.namespace, self.pod = kube, namespace, pod
        self._proc: subprocess.Popen[str] | None = None
        self._port: int | None = None
        self._lock = threading.Lock()

    def port(self, timeout: float = 15.0) -> int:
        with self._lock:
            if self._proc is not None and self._proc.poll() is None and self._port is not None:
                return self._port
            self.close_locked()
            argv = [
                *self.kube.kubectl,
                "-n",
                self.namespace,
                "port-forward",
                "--address",
                "127.0.0.1",
                f"pod/{self.pod}",
                f":{POSTGRES_PORT}",
            ]
            self._proc = subprocess.Popen(
                argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, stdin=subprocess.DEVNULL
            )
            assert self._proc.stdout is not None
            deadline = time.monotonic() + timeout
            selector = selectors.DefaultSelector()
            selector.register(self._proc.stdout, selectors.EVENT_READ)
            output = ""
            while time.monotonic() < deadline and self._proc.poll() is None:
                if selector.select(timeout=0.5):
                    line = self._proc.stdout.readline()
                    output += line
                    found = _FORWARDING.search(line)
                    if found:
                        self._port = int(found.group(1))
                        # Drain the rest of kubectl's output so that its pipe never fills up.
                        threading.Thread(target=self._proc.stdout.read, daemon=True).start()
                        return self._port
            self.close_locked()
            raise DriverError(f"kubectl port-forward to pod {self.pod} did not start: {output.strip()}")

    def close_locked(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout=5)
        self._proc, self._port = None, None

    def close(self) -> None:
        with self._lock:
            self.close_locked()


class ServiceProxy:
    """A local TCP listener whose every connection is piped to the pod currently behind a Service."""

    def __init__(
        self, kube: Kube, namespace: str, service: str, forwarder: Callable[[str], PodForwarder]
    ) -> None:
        self.kube, self.namespace, self.service = kube, namespace, service
        self._forwarder = forwarder
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        self._closed = threading.Event()
        threading.Thread(target=self._accept, name=f"proxy-{service}", daemon=True).start()

    def current_pod(self) -> str | None:
        result = self.kube.run(
            "-n", self.namespace, "get", "endpoints", self.service,
            "-o", "jsonpath={.subsets[*].addresses[*].targetRef.name}", check=False, timeout=10,
        )  # fmt: skip
        names = result.stdout.split()
        return names[0] if result.returncode == 0 and names else None

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        with client:
            pod = self.current_pod()
            if pod is None:
                return  # no primary behind the Service: the client sees the connection closed
            try:
                upstream = socket.create_connection(("127.0.0.1", self._forwarder(pod).port()), timeout=5)
            except (OSError, DriverError):
                return
            with upstream:
                upstream.settimeout(None)
                _pipe(client, upstream)

    def close(self) -> None:
        self._closed.set()
        self._listener.close()


def _pipe(a: socket.socket, b: socket.socket) -> None:
    selector = selectors.DefaultSelector()
    selector.register(a, selectors.EVENT_READ, b)
    selector.register(b, selectors.EVENT_READ, a)
    while True:
        for key, _ in selector.select():
            source = cast(socket.socket, key.fileobj)
            try:
                data = source.recv(65536)
            except OSError:
                return
            if not data:
                return
            cast(socket.socket, key.data).sendall(data)


class KindDriver(PollingDriver):
    name = "kind"
    poll_interval = 1.0
    _operator_installed: ClassVar[bool] = False

    def __init__(self, workdir: Path, cluster: str) -> None:
        self.workdir = Path(workdir)
        self.cluster = cluster
        self.kube = Kube()
        self.namespace = f"pgherd-e2e-{cluster}"[:63]
        self.operator_namespace = _env("PGHERD_E2E_OPERATOR_NAMESPACE", "pgherd-system")
        self.release = _env("PGHERD_E2E_RELEASE", "pgherd")
        self.postgres_version = int(_env("PGHERD_E2E_PG_VERSION", "16"))
        self._forwarders: dict[str, PodForwarder] = {}
        self._proxy: ServiceProxy | None = None
        self._credentials: dict[str, str] | None = None
        self._applied = 0
        self._store = s3_store()
        self._ensure_operator()
        self.kube.run("create", "namespace", self.namespace, check=False)
        if self._store is not None:
            self._copy_s3_secret()

    # -- set-up --------------------------------------------------------------------------------------------

    def _ensure_operator(self) -> None:
        if KindDriver._operator_installed or os.environ.get("PGHERD_E2E_INSTALL") == "0":
            return
        image = os.environ.get("PGHERD_E2E_IMAGE")
        values = chart_image_values(image) if image else []
        self.kube.run_helm(
            "upgrade", "--install", self.release, str(REPO_ROOT / "charts" / "pgherd"),
            "--namespace", self.operator_namespace, "--create-namespace", "--wait", "--timeout", "5m", *values,
        )  # fmt: skip
        KindDriver._operator_installed = True

    def _copy_s3_secret(self) -> None:
        """The S3 keys ($PGHERD_E2E_S3_SECRET) into this cluster's namespace, where its pods read them."""
        source = os.environ.get("PGHERD_E2E_S3_SECRET")
        if not source or "/" not in source:
            raise DriverError(
                f"PGHERD_E2E_S3_ENDPOINT is set: PGHERD_E2E_S3_SECRET must name the Secret of its keys as"
                f" NAMESPACE/NAME (found {source!r})"
            )
        namespace, _, name = source.partition("/")
        data = self.kube.json("-n", namespace, "get", "secret", name).get("data") or {}
        missing = [key for key in S3_KEYS if key not in data]
        if missing:
            raise DriverError(f"the Secret {source} lacks {', '.join(missing)}")
        secret = {
            "apiVersion": "v1",
            "kind": "Secret",
            "type": "Opaque",
            "metadata": {"name": S3_SECRET, "namespace": self.namespace},
            "data": {key: data[key] for key in S3_KEYS},
        }
        # On stdin, never on a command line or in the workdir: the keys stay out of logs and artifacts.
        self.kube.run("apply", "-f", "-", input=json.dumps(secret))

    # -- the Driver interface --------------------------------------------------------------------------

    def apply(self, manifest: Manifest) -> None:
        self._applied += 1
        doc = with_store(manifest, self._store)
        path = self.workdir / f"{self._applied:02d}-{str(doc.get('kind')).lower()}.yaml"
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
        result = self.kube.run("-n", self.namespace, "apply", "-f", str(path), check=False)
        if result.returncode != 0:
            message = result.stderr.strip() or result.stdout.strip()
            if "is invalid" in message or "denied the request" in message or "Invalid value" in message:
                raise ManifestRefused(message)
            raise DriverError(f"kubectl apply of {path} failed: {message}\n{self.describe()}")

    def status(self) -> ClusterStatus:
        cluster = self.kube.json("-n", self.namespace, "get", "postgrescluster", self.cluster)
        raw = cluster.get("status") or {}
        members: list[MemberStatus] = [
            {
                "name": m["name"],
                "role": m.get("role", "unknown"),
                "ready": bool(m.get("ready")),
                "port": None,
                "dsn": None,
                "lagBytes": m.get("lagBytes"),
                "timeline": m.get("timeline"),
            }
            for m in raw.get("members") or []
        ]
        return {
            "phase": raw.get("phase"),
            "message": raw.get("message"),
            "primary": raw.get("currentPrimary"),
            "members": members,
            "rwDsn": self._dsn(self._proxy.port) if self._proxy is not None else None,
            "backups": self._objects("backups.pgherd.io", with_id=True),
            "restores": self._objects("restores.pgherd.io", with_id=False),
            "conditions": raw.get("conditions") or [],
            "operation": raw.get("operation"),
            "instances": raw.get("instances"),
            "readyInstances": raw.get("readyInstances"),
        }

    def _objects(self, resource: str, *, with_id: bool) -> list[ObjectStatus]:
        """This cluster's Backups or Restores (fully qualified: `backups` alone may name another API's kind)."""
        items = self.kube.json("-n", self.namespace, "get", resource).get("items", [])
        found: list[ObjectStatus] = []
        for item in items:
            if (item.get("spec") or {}).get("cluster", {}).get("name") != self.cluster:
                continue
            status = item.get("status") or {}
            entry: ObjectStatus = {
                "name": item["metadata"]["name"],
                "phase": status.get("phase"),
                "error": status.get("error"),
            }
            if with_id:
                entry["backupId"] = status.get("backupId")
            else:
                entry["keptData"] = status.get("keptData")
            found.append(entry)
        return found

    def kill(self, member: str, wipe: bool = False) -> None:
        claims: list[str] = []
        if wipe:
            pod = self.kube.json("-n", self.namespace, "get", "pod", member)
            claims = [
                v["persistentVolumeClaim"]["claimName"]
                for v in pod["spec"].get("volumes", [])
                if v.get("persistentVolumeClaim")
            ]
            for claim in claims:
                self.kube.run("-n", self.namespace, "delete", "pvc", claim, "--wait=false")
        self.kube.run(
            "-n", self.namespace, "delete", "pod", member, "--grace-period=0", "--force", "--wait=false"
        )
        for claim in claims:
            self.kube.run(
                "-n", self.namespace, "wait", "--for=delete", f"pvc/{claim}", "--timeout=120s", check=False
            )
            # A pod recreated while its old claim was still terminating would wait forever for it: recreate it.
            phase = self.kube.run(
                "-n", self.namespace, "get", "pod", member, "-o", "jsonpath={.status.phase}", check=False
            )
            if phase.stdout.strip() == "Pending":
                self.kube.run(
                    "-n",
                    self.namespace,
                    "delete",
                    "pod",
                    member,
                    "--grace-period=0",
                    "--force",
                    "--wait=false",
                )

    def switchover(self, to: str | None = None) -> None:
        target = to or "any"
        self.kube.run(
            "-n", self.namespace, "annotate", "postgrescluster", self.cluster, f"{SWITCHOVER_ANNOTATION}={target}", "--overwrite"
        )  # fmt: skip
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            annotations = (
                self.kube.json("-n", self.namespace, "get", "postgrescluster", self.cluster)["metadata"].get(
                    "annotations"
                )
                or {}
            )
            if SWITCHOVER_ANNOTATION not in annotations:
                primary = self.status().get("primary")
                if to is not None and primary != to:
                    raise DriverError(
                        f"switchover to {to} was not done (primary {primary}): see the cluster's Events\n{self.describe()}"
                    )
                return
            time.sleep(1)
        raise DriverError(
            f"the operator did not act on {SWITCHOVER_ANNOTATION}={target} within 120 s\n{self.describe()}"
        )

    def kill_operator(self, at_step: str | None = None, done: int = 0) -> None:
        if at_step is not None:
            # No crash point in a real operator: kill it as soon as the status shows the step.
            self.wait_for(operation_at(at_step, done), 180, f"the operation to reach step {at_step!r}")
        ns = ("-n", self.operator_namespace)
        self.kube.run(*ns, "scale", "deployment", self.release, "--replicas=0")
        selector = f"app.kubernetes.io/instance={self.release},app.kubernetes.io/component=operator"
        self.kube.run(*ns, "delete", "pod", "-l", selector, "--grace-period=0", "--force", "--wait=false")

    def resume_operator(self) -> None:
        ns = ("-n", self.operator_namespace)
        self.kube.run(*ns, "scale", "deployment", self.release, "--replicas=1")
        self.kube.run(*ns, "rollout", "status", f"deployment/{self.release}", "--timeout=180s", timeout=200)

    def rw_dsn(self) -> str:
        if self._proxy is None:
            self._proxy = ServiceProxy(self.kube, self.namespace, f"{self.cluster}-rw", self._forwarder)
        return self._dsn(self._proxy.port)

    def member_dsn(self, name: str) -> str:
        return self._dsn(self._forwarder(name).port())

    def _forwarder(self, pod: str) -> PodForwarder:
        if pod not in self._forwarders:
            self._forwarders[pod] = PodForwarder(self.kube, self.namespace, pod)
        return self._forwarders[pod]

    def _dsn(self, port: int) -> str:
        if self._credentials is None:
            secret = self.kube.json("-n", self.namespace, "get", "secret", f"{self.cluster}-app")
            data = secret.get("data") or {}
            self._credentials = {k: base64.b64decode(v).decode() for k, v in data.items()}
        c = self._credentials
        return (
            f"host=127.0.0.1 port={port} user={c.get('username', 'app')} password={c.get('password', '')}"
            f" dbname={c.get('dbname', 'app')} connect_timeout=5"
        )

    def describe(self) -> str:
        lines = [
            f"kind: namespace {self.namespace}, operator in {self.operator_namespace}; look with",
            f"  kubectl -n {self.namespace} get postgrescluster,backups.pgherd.io,restores.pgherd.io,pods,pvc,events",
            f"  kubectl -n {self.operator_namespace} logs deployment/{self.release}",
        ]
        logs = self.kube.run(
            "-n",
            self.operator_namespace,
            "logs",
            f"deployment/{self.release}",
            "--tail=20",
            check=False,
            timeout=20,
        )
        if logs.returncode == 0:
            lines.append("  last operator log lines:")
            lines.extend(f"    {line}" for line in logs.stdout.splitlines())
        return "\n".join(lines)

    def down(self, *, keep: bool = False) -> None:
        if self._proxy is not None:
            self._proxy.close()
            self._proxy = None
        for forwarder in self._forwarders.values():
            forwarder.close()
        self._forwarders.clear()
        if not keep:
            self.kube.run(
                "delete",
                "namespace",
                self.namespace,
                "--wait=true",
                "--timeout=300s",
                check=False,
                timeout=320,
            )
