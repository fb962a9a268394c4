"""A 3-member Patroni cluster on localkube, for the failover bench: Patroni's Kubernetes DCS, as
Patroni's own kubernetes/patroni_k8s.yaml runs it.

The objects (pure builders below, applied in one `kubectl apply`): a namespace under the `restricted`
Pod Security Standard; a ServiceAccount with the Role Patroni's Kubernetes DCS needs; a Secret of
passwords (never on a command line: the members read them from env secretKeyRef) and a TLS Secret; the
configuration in a ConfigMap; a StatefulSet of 3 members on the project's image with Patroni added
(bench/patroni/Dockerfile), their data on the cluster's local-path claims; and the leader Service with
no selector, whose Endpoints Patroni writes (`use_endpoints`: the leader key and the leader's address
change in one write). The write loop connects to that Service's ClusterIP through kube-proxy, as
pgherd's goes through its `-rw` Service.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import secrets
import subprocess
import time
import urllib.error
import urllib.request
from base64 import b64encode
from pathlib import Path
from typing import Any

import psycopg
import yaml
from bench._patroni import Timing, http_json, settled_replicas, view_leader
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from e2e.drivers.kube import Kube, kubectl_binary
from e2e.drivers.localkube import LocalKube, restricted_namespace
from psycopg.conninfo import make_conninfo

SCOPE = "bench"
MEMBERS = 3
CONTAINER = "patroni"
POSTGRES_PORT = 5432
REST_PORT = 8008
DATA_MOUNT = "/pgdata"
TLS_MOUNT = "/etc/patroni/tls"
LABELS = {"application": "patroni", "cluster-name": SCOPE}

Object = dict[str, Any]


# -- builders (no I/O) ---------------------------------------------------------------------------------


def rbac(namespace: str) -> list[Object]:
    """What Patroni's Kubernetes DCS uses with use_endpoints (its docs/kubernetes.rst and the example's
    Role): its Endpoints (leader, -config, -sync, -failover) created, read, watched and patched; the
    pods read, watched and labelled (role labels, member state in annotations); the -config Service
    created (it keeps the endpoints controller off the -config Endpoints; also made here)."""
    meta = {"name": "patroni", "namespace": namespace}
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": meta,
            "rules": [
                {
                    "apiGroups": [""],
                    "resources": ["endpoints"],
                    "verbs": ["get", "list", "watch", "create", "patch", "update"],
                },
                {
                    "apiGroups": [""],
                    "resources": ["pods"],
                    "verbs": ["get", "list", "watch", "patch", "update"],
                },
                {"apiGroups": [""], "resources": ["services"], "verbs": ["create"]},
            ],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": meta,
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "patroni"},
            "subjects": [{"kind": "ServiceAccount", "name": "patroni", "namespace": namespace}],
        },
    ]


def patroni_config(timing: Timing, *, synchronous: bool, postgres_bin: str) -> Object:
    """patroni.yml without its secrets and per-pod values (those come from the env). The dynamic
    settings are bench/_patroni.py's, so that the sandbox and localkube rows compare."""
    return {
        "scope": SCOPE,
        "log": {"level": "INFO"},
        "restapi": {"listen": f"0.0.0.0:{REST_PORT}"},
        # The leader Endpoints' port named as the Service's: kube-proxy routes by port name.
        "kubernetes": {
            "use_endpoints": True,
            "labels": LABELS,
            "ports": [{"name": "postgresql", "port": POSTGRES_PORT}],
        },
        "bootstrap": {
            "dcs": {
                "ttl": timing.ttl,
                "loop_wait": timing.loop_wait,
                "retry_timeout": timing.retry_timeout,
                "maximum_lag_on_failover": 1048576,
                "synchronous_mode": synchronous,
                "postgresql": {
                    "use_pg_rewind": True,
                    "use_slots": True,
                    "parameters": {
                        "wal_level": "replica",
                        "hot_standby": "on",
                        "wal_log_hints": "on",
                        "max_wal_senders": 10,
                        "max_replication_slots": 10,
                        "max_connections": 100,
                        "password_encryption": "scram-sha-256",
                    },
                },
            },
            "initdb": [{"encoding": "UTF8"}, {"locale": "C"}, {"auth-host": "scram-sha-256"}],
        },
        "postgresql": {
            "listen": f"0.0.0.0:{POSTGRES_PORT}",
            "data_dir": f"{DATA_MOUNT}/data",
            "bin_dir": postgres_bin,
            "pgpass": "/tmp/pgpass",
            "authentication": {
                "superuser": {"username": "postgres"},
                "replication": {"username": "replicator"},
            },
            # Passwords over TCP everywhere; the write loop connects with TLS, as pgherd's does.
            "pg_hba": [
                "local all all trust",
                "host replication replicator 0.0.0.0/0 scram-sha-256",
                "host all all 0.0.0.0/0 scram-sha-256",
            ],
            "parameters": {
                "unix_socket_directories": "/tmp",
                "ssl": "on",
                "ssl_cert_file": f"{TLS_MOUNT}/tls.crt",
                "ssl_key_file": f"{TLS_MOUNT}/tls.key",
            },
        },
        "tags": {},
    }


def _env_secret(name: str, key: str) -> Object:
    return {"name": name, "valueFrom": {"secretKeyRef": {"name": "patroni-credentials", "key": key}}}


def _env_field(name: str, path: str) -> Object:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


def statefulset(namespace: str, image: str) -> Object:
    """Three members under the `restricted` standard; each restarts its container in place on a
    crash (the kubelet) and keeps its data across pod deletions (its claim)."""
    container = {
        "name": CONTAINER,
        "image": image,
        "imagePullPolicy": "Never",
        "command": ["patroni", "/etc/patroni/patroni.yml"],
        "env": [
            _env_field("POD_IP", "status.podIP"),
            _env_field("PATRONI_NAME", "metadata.name"),
            _env_field("PATRONI_KUBERNETES_NAMESPACE", "metadata.namespace"),
            {"name": "PATRONI_KUBERNETES_POD_IP", "value": "$(POD_IP)"},
            {"name": "PATRONI_RESTAPI_CONNECT_ADDRESS", "value": f"$(POD_IP):{REST_PORT}"},
            {"name": "PATRONI_POSTGRESQL_CONNECT_ADDRESS", "value": f"$(POD_IP):{POSTGRES_PORT}"},
            _env_secret("PATRONI_SUPERUSER_PASSWORD", "superuser-password"),
            _env_secret("PATRONI_REPLICATION_PASSWORD", "replication-password"),
            {"name": "PATRONI_RESTAPI_USERNAME", "value": "bench"},
            _env_secret("PATRONI_RESTAPI_PASSWORD", "restapi-password"),
        ],
        "ports": [
            {"name": "postgresql", "containerPort": POSTGRES_PORT},
            {"name": "patroni", "containerPort": REST_PORT},
        ],
        "readinessProbe": {
            "httpGet": {"path": "/readiness", "port": REST_PORT},
            "periodSeconds": 2,
            "timeoutSeconds": 2,
        },
        "volumeMounts": [
            {"name": "pgdata", "mountPath": DATA_MOUNT},
            {"name": "config", "mountPath": "/etc/patroni/patroni.yml", "subPath": "patroni.yml"},
            {"name": "tls", "mountPath": TLS_MOUNT, "readOnly": True},
        ],
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
        },
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {"name": SCOPE, "namespace": namespace, "labels": LABELS},
        "spec": {
            "replicas": MEMBERS,
            "serviceName": f"{SCOPE}-config",
            # Patroni elects its own leader: the members need not start one after another.
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": LABELS},
            "template": {
                "metadata": {"labels": LABELS},
                "spec": {
                    "serviceAccountName": "patroni",
                    "securityContext": {
                        "runAsNonRoot": True,
                        "runAsUser": 999,
                        "runAsGroup": 999,
                        "fsGroup": 999,
                        # Not again on a claim already made: its setgid, group-writable bits on the data
                        # directory would make PostgreSQL refuse to start (a deleted pod made again).
                        "fsGroupChangePolicy": "OnRootMismatch",
                        "seccompProfile": {"type": "RuntimeDefault"},
                    },
                    # A deletion is a drain's: SIGTERM, Patroni stops PostgreSQL and gives up the leader key.
                    "terminationGracePeriodSeconds": 30,
                    "containers": [container],
                    "volumes": [
                        {"name": "config", "configMap": {"name": "patroni-config"}},
                        # Owned by root, group fsGroup: PostgreSQL accepts a key of 0640 owned by root.
                        {"name": "tls", "secret": {"secretName": "patroni-tls", "defaultMode": 0o640}},
                    ],
                },
            },
            "volumeClaimTemplates": [
                {
                    "metadata": {"name": "pgdata"},
                    "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}},
                }
            ],
        },
    }


def services(namespace: str) -> list[Object]:
    """The leader Service (no selector: its Endpoints are Patroni's leader key, with the leader's
    address) and the headless -config Service that keeps the endpoints controller off -config."""
    port = {"name": "postgresql", "port": POSTGRES_PORT, "targetPort": POSTGRES_PORT}
    return [
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": SCOPE, "namespace": namespace, "labels": LABELS},
            "spec": {"type": "ClusterIP", "ports": [port]},
        },
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": f"{SCOPE}-config", "namespace": namespace, "labels": LABELS},
            "spec": {"clusterIP": "None"},
        },
    ]


def secrets_of(namespace: str, passwords: dict[str, str], cert: bytes, key: bytes) -> list[Object]:
    def data(values: dict[str, bytes]) -> dict[str, str]:
        return {k: b64encode(v).decode() for k, v in values.items()}

    return [
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": "patroni-credentials", "namespace": namespace},
            "type": "Opaque",
            "data": data({k: v.encode() for k, v in passwords.items()}),
        },
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": "patroni-tls", "namespace": namespace},
            "type": "kubernetes.io/tls",
            "data": data({"tls.crt": cert, "tls.key": key}),
        },
    ]


def self_signed(dns_names: list[str]) -> tuple[bytes, bytes]:
    """A self-signed server certificate for the leader Service's names (the client trusts it alone)."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, dns_names[0])])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=2))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(n) for n in dns_names]), critical=False)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return cert.public_bytes(serialization.Encoding.PEM), key_pem


# -- the cluster -----------------------------------------------------------------------------------------


class PatroniKubeCluster:
    """The objects above in `namespace` of the localkube cluster, and what the bench does to them."""

    def __init__(
        self,
        localkube: LocalKube,
        namespace: str,
        image: str,
        timing: Timing,
        *,
        synchronous: bool,
        workdir: Path,
    ) -> None:
        self.localkube = localkube
        self.namespace = namespace
        self.image = image
        self.timing = timing
        self.synchronous = synchronous
        self.workdir = workdir
        self.kube = Kube(
            kubeconfig=localkube.kubeconfig, cache_dir=workdir / "kubectl-cache", kubectl=kubectl_binary()
        )
        major = int(localkube.state.get("postgresMajor") or 16)
        self.postgres_bin = f"/usr/lib/postgresql/{major}/bin"
        self.passwords = {
            "superuser-password": secrets.token_urlsafe(24),
            "replication-password": secrets.token_urlsafe(24),
            "restapi-password": secrets.token_urlsafe(24),
        }
        self.service_host = f"{SCOPE}.{namespace}.svc"
        self.ca_file = workdir / "patroni-ca.crt"
        self._pod_ips: dict[str, str] = {}

    def _ns(self, *args: str, **kwargs: Any) -> subprocess.CompletedProcess[str]:
        return self.kube.run("-n", self.namespace, *args, **kwargs)

    # -- life cycle --------------------------------------------------------------------------------------

    def start(self, timeout: float = 300.0) -> None:
        phase = self.kube.run(
            "get", "namespace", self.namespace, "-o", "jsonpath={.status.phase}", check=False
        )
        if phase.returncode == 0:  # left by an earlier run: start from nothing
            self.kube.run("delete", "namespace", self.namespace, "--wait=true", timeout=320)
        cert, key = self_signed([self.service_host, f"{SCOPE}.{self.namespace}.svc.cluster.local"])
        self.ca_file.write_bytes(cert)
        config = yaml.safe_dump(
            patroni_config(self.timing, synchronous=self.synchronous, postgres_bin=self.postgres_bin),
            sort_keys=False,
        )
        config_map = {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": "patroni-config", "namespace": self.namespace},
            "data": {"patroni.yml": config},
        }
        objects = [
            restricted_namespace(self.namespace),
            *rbac(self.namespace),
            *secrets_of(self.namespace, self.passwords, cert, key),
            config_map,
            *services(self.namespace),
            statefulset(self.namespace, self.image),
        ]
        # On stdin: the Secrets never appear on a command line.
        self.kube.run(
            "apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": objects})
        )
        self.wait_healthy(timeout)

    def stop(self) -> None:
        self.kube.run("delete", "namespace", self.namespace, "--wait=false", check=False, timeout=60)

    # -- what the bench reads --------------------------------------------------------------------------

    def rw_dsn(self) -> str:
        ip = self._ns("get", "service", SCOPE, "-o", "jsonpath={.spec.clusterIP}").stdout.strip()
        return make_conninfo(
            host=self.service_host,
            hostaddr=ip,
            port=str(POSTGRES_PORT),
            user="postgres",
            password=self.passwords["superuser-password"],
            dbname="postgres",
            sslmode="verify-full",
            sslrootcert=str(self.ca_file),
            connect_timeout="5",
        )

    def pod_ips(self) -> dict[str, str]:
        pods = self.kube.json("-n", self.namespace, "get", "pods", "-l", f"cluster-name={SCOPE}")["items"]
        found = {
            p["metadata"]["name"]: str(p["status"]["podIP"])
            for p in pods
            if (p.get("status") or {}).get("podIP") and not p["metadata"].get("deletionTimestamp")
        }
        self._pod_ips = found
        return found

    def cluster_view(self) -> dict[str, Any] | None:
        """Patroni's own view (GET /cluster) from the first member whose REST API answers."""
        for ip in self.pod_ips().values():
            view = http_json(f"http://{ip}:{REST_PORT}/cluster")
            if isinstance(view, dict):
                return view
        return None

    def leader(self) -> str | None:
        return view_leader(self.cluster_view())

    def healthy(self) -> bool:
        replicas = settled_replicas(self.cluster_view(), MEMBERS, synchronous=self.synchronous)
        if replicas is None:
            return False
        # As bench/_patroni.py: Patroni's lag is as of the leader's last loop; ask PostgreSQL.
        return all(self._streaming(str(x.get("host"))) for x in replicas)

    def _streaming(self, address: str) -> bool:
        dsn = make_conninfo(
            hostaddr=address,
            port=str(POSTGRES_PORT),
            user="postgres",
            password=self.passwords["superuser-password"],
            dbname="postgres",
            sslmode="require",
            connect_timeout="2",
        )
        try:
            with psycopg.connect(dsn, autocommit=True) as conn:
                row = conn.execute("SELECT status FROM pg_stat_wal_receiver").fetchone()
        except psycopg.Error:
            return False
        return row is not None and row[0] == "streaming"

    def wait_healthy(self, timeout: float = 600.0) -> None:
        """Healthy, and the leader Service routes to a writable member (the Endpoints Patroni wrote,
        mirrored into an EndpointSlice, applied by kube-proxy)."""
        deadline = time.monotonic() + timeout
        while not (self.healthy() and self._writable()):
            if time.monotonic() > deadline:
                view = json.dumps(self.cluster_view(), indent=1)
                raise TimeoutError(
                    f"timed out after {timeout:.0f} s waiting for a healthy Patroni cluster in"
                    f" {self.namespace}; look with kubectl --kubeconfig {self.localkube.kubeconfig}"
                    f" -n {self.namespace} get pods,endpoints; logs -l cluster-name={SCOPE}\n{view}"
                )
            time.sleep(0.5)

    def _writable(self) -> bool:
        with contextlib.suppress(psycopg.Error), psycopg.connect(self.rw_dsn(), connect_timeout=2) as conn:
            return conn.execute("SELECT NOT pg_is_in_recovery()").fetchone() == (True,)
        return False

    # -- what the bench does ---------------------------------------------------------------------------

    def kill_if_running(self, member: str) -> bool:
        """SIGKILL of the member's container (Patroni is its init: PostgreSQL dies with it)."""
        return self.localkube.kill_container(self.namespace, member, CONTAINER)

    def delete_pod(self, member: str) -> None:
        """A graceful deletion, as a drain or a person does, returning once the pod is gone; the
        StatefulSet makes it again."""
        self._ns("delete", "pod", member, timeout=300)

    def switchover(self, attempts: int = 3) -> None:
        """POST /switchover on the leader's REST API (its pod IP), as `patronictl switchover --force`
        does; retried while a just-restarted member is not ready for it."""
        for attempt in range(1, attempts + 1):
            leader = self.leader()
            ip = self.pod_ips().get(leader or "")
            if leader and ip:
                status, body = _http_post(
                    f"http://{ip}:{REST_PORT}/switchover",
                    {"leader": leader},
                    ("bench", self.passwords["restapi-password"]),
                )
                if status == 200:
                    return
            else:
                status, body = 0, f"no leader with an address ({leader})"
            if attempt == attempts:
                raise RuntimeError(f"Patroni's switchover failed ({status}): {body[-1500:]}")
            time.sleep(2)
            self.wait_healthy()


def _http_post(url: str, body: dict[str, Any], auth: tuple[str, str]) -> tuple[int, str]:
    token = b64encode(f"{auth[0]}:{auth[1]}".encode()).decode()
    request = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Basic {token}"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")
    except OSError as exc:
        return 0, str(exc)
