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
    PGHERD_E2E_S3_CA_SECRET          NAMESPACE/NAME of a Secret holding ca.crt, the private CA of an https
                                     endpoint (a MinIO with its own CA), copied as `pgherd-e2e-s3-ca` and
                                     named by the store's endpointCA

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

import contextlib
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

from e2e.driver import DriverError
from e2e.drivers.kube import (
    POSTGRES_PORT,
    REPO_ROOT,
    S3_CA_KEYS,
    S3_CA_SECRET,
    S3_KEYS,
    S3_SECRET,
    Kube,
    KubeDriver,
    env,
    store_at,
)

_FORWARDING = re.compile(r"Forwarding from 127\.0\.0\.1:(\d+) -> ")
_SESSION_PATH = time.strftime("e2e-%Y%m%d-%H%M%S", time.gmtime())


def chart_image_values(image: str) -> list[str]:
    """`helm --set` arguments running `image` (REPOSITORY[:TAG]) as the operator. The chart's default
    postgresImage is then `image` too: it carries every major the scenarios run."""
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
    return store_at(
        endpoint,
        env("PGHERD_E2E_S3_BUCKET", "pgherd-e2e"),
        env("PGHERD_E2E_S3_PATH", _SESSION_PATH),
        private_ca=bool(os.environ.get("PGHERD_E2E_S3_CA_SECRET")),
    )


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


class KindDriver(KubeDriver):
    name = "kind"
    _operator_installed: ClassVar[bool] = False

    def __init__(self, workdir: Path, cluster: str) -> None:
        super().__init__(
            workdir,
            cluster,
            Kube(),
            postgres_version=int(env("PGHERD_E2E_PG_VERSION", "16")),
            store=s3_store(),
        )
        self.operator_namespace = env("PGHERD_E2E_OPERATOR_NAMESPACE", "pgherd-system")
        self.release = env("PGHERD_E2E_RELEASE", "pgherd")
        self._forwarders: dict[str, PodForwarder] = {}
        self._proxy: ServiceProxy | None = None
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
        self.copy_secret(namespace, name, S3_SECRET, S3_KEYS)
        ca = os.environ.get("PGHERD_E2E_S3_CA_SECRET")
        if ca:
            if "/" not in ca:
                raise DriverError(f"PGHERD_E2E_S3_CA_SECRET must be NAMESPACE/NAME (found {ca!r})")
            namespace, _, name = ca.partition("/")
            self.copy_secret(namespace, name, S3_CA_SECRET, S3_CA_KEYS)

    # -- the operator and connections ------------------------------------------------------------------

    def status_rw_dsn(self) -> str | None:
        return self.dsn("127.0.0.1", self._proxy.port) if self._proxy is not None else None

    def rw_dsn(self) -> str:
        if self._proxy is None:
            self._proxy = ServiceProxy(self.kube, self.namespace, f"{self.cluster}-rw", self._forwarder)
        return self.dsn("127.0.0.1", self._proxy.port)

    def member_dsn(self, name: str) -> str:
        return self.dsn("127.0.0.1", self._forwarder(name).port(), self.member_host(name))

    def _forwarder(self, pod: str) -> PodForwarder:
        if pod not in self._forwarders:
            self._forwarders[pod] = PodForwarder(self.kube, self.namespace, pod)
        return self._forwarders[pod]

    def describe(self) -> str:
        lines = [
            f"kind: namespace {self.namespace}, operator in {self.operator_namespace}; look with",
            f"  kubectl -n {self.namespace} get postgrescluster,backups.pgherd.io,restores.pgherd.io,pods,pvc,events",
            f"  kubectl -n {self.operator_namespace} logs deployment/{self.release}",
        ]
        lines.extend(self.kube_state())
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
