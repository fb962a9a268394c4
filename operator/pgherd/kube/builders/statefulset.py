"""The members' StatefulSet: one pod per member, each running the instance agent (`pgherd instance
run`) as PID 1, configured through PGHERD_* variables (docs/agent.md), with its data on a PVC.

The StatefulSet only keeps pods and volumes in existence: updateStrategy OnDelete leaves the order of
restarts to the operator (replicas first, the primary last, after a switchover), and nothing in the pod
decides a role: the agent starts an existing data directory read-only and waits for the operator.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from decimal import Decimal, InvalidOperation
from typing import Any

from pgherd.kube import names
from pgherd.kube.builders.common import (
    ClusterRef,
    Manifest,
    app_account,
    container_security_context,
    env_value,
    metadata,
    pod_security_context,
    s3_ca_volume,
    s3_env,
    s3_store,
    store_url,
    tmp_volume,
)

AGENT_COMMAND = ["pgherd", "instance", "run"]

# Long enough for a switchover before the primary's PostgreSQL stops. On SIGTERM a primary's agent
# waits `grace - 2 x stop-timeout - 3` seconds (97 s with the agent's 10 s stop timeout) for the
# operator to move the primary elsewhere (drain writes, let the target catch up, promote, re-point),
# then checkpoints and shuts down within the remaining 23 s. A switchover takes seconds; the margin
# covers an operator that has to notice the termination first and a target that lags.
TERMINATION_GRACE_SECONDS = 120

# Probes (docs/agent.md: what they mean). The startup probe keeps liveness away while a member starts
# or replays WAL after a crash: up to an hour (3600 x 1 s) — seeding itself runs behind an action and
# answers /startupz with 200, but a first start after a large restore replays a lot of WAL. Every 1 s:
# readiness is not probed before it passes, so its period delays a restarted primary's return to the
# -rw Service (10 s held a crashed primary restarted in place out of it for up to 10 s more).
STARTUP_PERIOD_SECONDS = 1
STARTUP_FAILURE_THRESHOLD = 3600
# Liveness restarts the container only when PostgreSQL should run and cannot: 60 s of failures, longer
# than the agent's own crash restarts back off (30 s), so the agent always gets its chance first.
LIVENESS_PERIOD_SECONDS = 10
LIVENESS_FAILURE_THRESHOLD = 6
# Readiness decides the Services' endpoints (-rw, -ro, -r): short, so that a new primary serves soon.
READINESS_PERIOD_SECONDS = 2
READINESS_FAILURE_THRESHOLD = 2

# Secret kinds mounted under names.SECRETS_MOUNT/<kind>/password.
SECRET_KINDS = ("superuser", "replication", "app")
VOLUME_CONFIG = "config"
VOLUME_AGENT = "agent"
# spec.monitoring.customQueries: its ConfigMap as a whole directory (not subPath: an edit reaches the pod).
VOLUME_CUSTOM_QUERIES = "custom-queries"
CUSTOM_QUERIES_MOUNT = "/etc/pgherd/custom-queries"
# Secret files readable by the postgres group only: with fsGroup they belong to root:999.
SECRET_MODE = 0o440


def password_file(kind: str) -> str:
    """Where a pod finds the password of `kind` (superuser, replication, app)."""
    return f"{names.SECRETS_MOUNT}/{kind}/{names.KEY_PASSWORD}"


def _secret_name(cluster: str, kind: str) -> str:
    return {
        "superuser": names.secret_superuser,
        "replication": names.secret_replication,
        "app": names.secret_app,
    }[kind](cluster)


def agent_env(ref: ClusterRef) -> list[Manifest]:
    """The agent's configuration: every PGHERD_* variable is a flag of `pgherd instance run`
    (tests/kube/test_builders.py checks them against its parser), except the PGHERD_S3_* settings the
    data plane's S3 client reads."""
    user, database = app_account(ref)
    env: list[Manifest] = [
        env_value("PGHERD_CLUSTER", ref.name),
        {"name": "PGHERD_MEMBER", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        env_value("PGHERD_PGDATA", names.PGDATA),
        env_value("PGHERD_REVISION", ref.revision),
        env_value("PGHERD_PORT", str(names.AGENT_PORT)),
        env_value("PGHERD_METRICS_PORT", str(names.METRICS_PORT)),
        env_value("PGHERD_PG_PORT", str(names.POSTGRES_PORT)),
        env_value("PGHERD_TLS_CERT", f"{names.AGENT_TLS_MOUNT}/{names.KEY_TLS_CERT}"),
        env_value("PGHERD_TLS_KEY", f"{names.AGENT_TLS_MOUNT}/{names.KEY_TLS_KEY}"),
        env_value("PGHERD_TLS_CA", f"{names.AGENT_TLS_MOUNT}/{names.KEY_CA_CERT}"),
        env_value("PGHERD_TOKEN_FILE", f"{names.AGENT_TLS_MOUNT}/{names.KEY_TOKEN_DIGEST}"),
        env_value("PGHERD_SUPERUSER", names.SUPERUSER),
        env_value("PGHERD_SUPERUSER_PASSWORD_FILE", password_file("superuser")),
        env_value("PGHERD_REPLICATION_USER", names.REPLICATION_USER),
        env_value("PGHERD_REPLICATION_PASSWORD_FILE", password_file("replication")),
        # PostgreSQL's TLS (docs/agent.md): its own files of the agents' Secret (the agent's certificate
        # and the cluster CA, or the user's: spec.tls), the replication account authenticates by its
        # client certificate, plain TCP is refused.
        env_value("PGHERD_PG_TLS", "true"),
        env_value("PGHERD_PG_TLS_CERT", f"{names.AGENT_TLS_MOUNT}/{names.KEY_POSTGRES_CERT}"),
        env_value("PGHERD_PG_TLS_KEY", f"{names.AGENT_TLS_MOUNT}/{names.KEY_POSTGRES_KEY}"),
        env_value("PGHERD_PG_TLS_CA", f"{names.AGENT_TLS_MOUNT}/{names.KEY_POSTGRES_CA}"),
        env_value("PGHERD_PG_CLIENT_CA", f"{names.AGENT_TLS_MOUNT}/{names.KEY_CLIENT_CA}"),
        env_value("PGHERD_REPLICATION_CERT", f"{names.AGENT_TLS_MOUNT}/{names.KEY_REPLICATION_CERT}"),
        env_value("PGHERD_REPLICATION_KEY", f"{names.AGENT_TLS_MOUNT}/{names.KEY_REPLICATION_KEY}"),
        env_value("PGHERD_PG_TLS_MIN_VERSION", ref.spec.tls.min_protocol_version.value),
        env_value("PGHERD_APP_USER", user),
        env_value("PGHERD_APP_DATABASE", database),
        env_value("PGHERD_APP_PASSWORD_FILE", password_file("app")),
        env_value("PGHERD_PARAMETERS_FILE", f"{names.CONFIG_MOUNT}/{names.PARAMETERS_FILE}"),
        # Never seeds on its own: the operator decides how each member is seeded (POST /actions/seed).
        env_value("PGHERD_SEED", "none"),
        env_value("PGHERD_GRACE_PERIOD", str(TERMINATION_GRACE_SECONDS)),
        # spec.postgresVersion's programs for a new member's initdb; a member with data runs its data
        # directory's own major (an image made for upgrades carries both: docs/upgrades.md).
        env_value("PG_BIN", postgres_bindir(ref.spec.postgres_version)),
    ]
    if ref.spec.superuser_network_access:
        env.append(env_value("PGHERD_SUPERUSER_NETWORK_ACCESS", "true"))
    if ref.log_format != "text":
        # Only then: a template with no log setting stays as it was (text is the agent's default).
        env.append(env_value("PGHERD_LOG_FORMAT", ref.log_format))
        env.append(env_value("PGHERD_NAMESPACE", ref.namespace))
    queries = ref.spec.monitoring.custom_queries
    if queries is not None:
        env.append(env_value("PGHERD_CUSTOM_QUERIES", f"{CUSTOM_QUERIES_MOUNT}/{queries.key}"))
    store = s3_store(ref.spec)
    if store is not None:
        env.append(env_value("PGHERD_STORE", store_url(store)))
        env.extend(s3_env(store))
    return env


def postgres_bindir(major: int) -> str:
    """Where the image carries PostgreSQL ``major``'s programs (the Debian layout of the official
    PostgreSQL images and of the pgherd image)."""
    return f"/usr/lib/postgresql/{major}/bin"


def _probe(path: str, period: int, failures: int, timeout: int) -> Manifest:
    # The kubelet does not verify the certificate of an HTTPS probe: the agent's own CA is enough.
    return {
        "httpGet": {"path": path, "port": "agent", "scheme": "HTTPS"},
        "periodSeconds": period,
        "timeoutSeconds": timeout,
        "failureThreshold": failures,
        "successThreshold": 1,
    }


def _volumes(ref: ClusterRef) -> tuple[list[Manifest], list[Manifest]]:
    """(volumes, mounts) of a member pod besides its data volume: /tmp, the ConfigMap, the agent's
    Secret and one password per account (only the `password` key is projected)."""
    tmp, tmp_mount = tmp_volume()
    volumes: list[Manifest] = [
        tmp,
        {"name": VOLUME_CONFIG, "configMap": {"name": names.configmap(ref.name)}},
        {
            "name": VOLUME_AGENT,
            "secret": {
                "secretName": names.secret_agent(ref.name),
                "defaultMode": SECRET_MODE,
                "items": [
                    {"key": key, "path": key}
                    for key in (
                        names.KEY_TLS_CERT,
                        names.KEY_TLS_KEY,
                        names.KEY_CA_CERT,
                        names.KEY_TOKEN_DIGEST,
                        names.KEY_REPLICATION_CERT,
                        names.KEY_REPLICATION_KEY,
                        names.KEY_POSTGRES_CERT,
                        names.KEY_POSTGRES_KEY,
                        names.KEY_POSTGRES_CA,
                        names.KEY_CLIENT_CA,
                    )
                ],
            },
        },
    ]
    mounts: list[Manifest] = [
        {"name": names.VOLUME_DATA, "mountPath": names.DATA_MOUNT},
        tmp_mount,
        {"name": VOLUME_CONFIG, "mountPath": names.CONFIG_MOUNT, "readOnly": True},
        {"name": VOLUME_AGENT, "mountPath": names.AGENT_TLS_MOUNT, "readOnly": True},
    ]
    for kind in SECRET_KINDS:
        volume = f"secret-{kind}"
        volumes.append(
            {
                "name": volume,
                "secret": {
                    "secretName": _secret_name(ref.name, kind),
                    "defaultMode": SECRET_MODE,
                    "items": [{"key": names.KEY_PASSWORD, "path": names.KEY_PASSWORD}],
                },
            }
        )
        mounts.append({"name": volume, "mountPath": f"{names.SECRETS_MOUNT}/{kind}", "readOnly": True})
    queries = ref.spec.monitoring.custom_queries
    if queries is not None:
        # optional: a missing ConfigMap does not keep the pod from starting (the agent reports it)
        volumes.append(
            {"name": VOLUME_CUSTOM_QUERIES, "configMap": {"name": queries.config_map_name, "optional": True}}
        )
        mounts.append({"name": VOLUME_CUSTOM_QUERIES, "mountPath": CUSTOM_QUERIES_MOUNT, "readOnly": True})
    store = s3_store(ref.spec)
    s3_ca = s3_ca_volume(store) if store is not None else None
    if s3_ca is not None:  # WAL archiving and fetching, and restores, verify the store's endpoint with it
        volumes.append(s3_ca[0])
        mounts.append(s3_ca[1])
    return volumes, mounts


def _resources(ref: ClusterRef) -> Manifest:
    resources = ref.spec.resources
    if resources is None:
        return {}
    out: Manifest = {}
    if resources.requests:
        out["requests"] = dict(resources.requests)
    if resources.limits:
        out["limits"] = dict(resources.limits)
    return out


def _container(ref: ClusterRef, mounts: list[Manifest]) -> Manifest:
    return {
        "name": names.CONTAINER_POSTGRES,
        "image": ref.image,
        "command": list(AGENT_COMMAND),
        "env": agent_env(ref),
        "ports": [
            {"name": "postgres", "containerPort": names.POSTGRES_PORT, "protocol": "TCP"},
            {"name": "agent", "containerPort": names.AGENT_PORT, "protocol": "TCP"},
            # GET /metrics in plain HTTP (docs/monitoring.md): what a PodMonitor and the NetworkPolicy name
            {"name": "metrics", "containerPort": names.METRICS_PORT, "protocol": "TCP"},
        ],
        "startupProbe": _probe("/startupz", STARTUP_PERIOD_SECONDS, STARTUP_FAILURE_THRESHOLD, 5),
        "livenessProbe": _probe("/healthz", LIVENESS_PERIOD_SECONDS, LIVENESS_FAILURE_THRESHOLD, 5),
        "readinessProbe": _probe("/readyz", READINESS_PERIOD_SECONDS, READINESS_FAILURE_THRESHOLD, 2),
        "resources": _resources(ref),
        "securityContext": container_security_context(),
        "volumeMounts": mounts,
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }


def pod_labels(ref: ClusterRef) -> dict[str, str]:
    """A member pod's labels: the selector's, the common ones and the revision its template carries
    (the operator adds `pgherd.io/role` itself)."""
    return {
        **names.common_labels(ref.name, names.COMPONENT_POSTGRES),
        **names.selector_labels(ref.name),
        names.LABEL_REVISION: ref.revision,
    }


def volume_claim_template(ref: ClusterRef) -> Manifest:
    storage = ref.spec.storage
    spec: Manifest = {
        "accessModes": ["ReadWriteOnce"],
        "resources": {"requests": {"storage": storage.size}},
    }
    if storage.storage_class_name:
        spec["storageClassName"] = storage.storage_class_name
    return {
        "metadata": {
            "name": names.VOLUME_DATA,
            "labels": names.common_labels(ref.name, names.COMPONENT_POSTGRES),
        },
        "spec": spec,
    }


def statefulset(ref: ClusterRef, *, replicas: int | None = None) -> Manifest:
    """The members' StatefulSet; `replicas` defaults to `spec.instances` (the adapter passes the
    engine's count while it scales)."""
    volumes, mounts = _volumes(ref)
    selector = names.selector_labels(ref.name)
    pod_spec: Manifest = {
        "serviceAccountName": names.service_account(ref.name),
        # The pods never call the Kubernetes API (docs/rbac.md, "Members' pods").
        "automountServiceAccountToken": False,
        # No <SERVICE>_PORT variables: a Service named "pgherd" would otherwise inject PGHERD_PORT.
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": TERMINATION_GRACE_SECONDS,
        "securityContext": pod_security_context(),
        "affinity": {
            "podAntiAffinity": {
                "preferredDuringSchedulingIgnoredDuringExecution": [
                    {
                        "weight": 100,
                        "podAffinityTerm": {
                            "labelSelector": {"matchLabels": dict(selector)},
                            "topologyKey": "kubernetes.io/hostname",
                        },
                    }
                ]
            }
        },
        "containers": [_container(ref, mounts)],
        "volumes": volumes,
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": metadata(ref, names.statefulset(ref.name), names.COMPONENT_POSTGRES),
        "spec": {
            "replicas": ref.spec.instances if replicas is None else replicas,
            "serviceName": names.service_headless(ref.name),
            "podManagementPolicy": "Parallel",
            "updateStrategy": {"type": "OnDelete"},
            "persistentVolumeClaimRetentionPolicy": {"whenDeleted": "Retain", "whenScaled": "Retain"},
            "selector": {"matchLabels": dict(selector)},
            "template": {
                "metadata": {
                    "labels": pod_labels(ref),
                    "annotations": {
                        names.ANNOTATION_REVISION: ref.revision,
                        "kubectl.kubernetes.io/default-container": names.CONTAINER_POSTGRES,
                    },
                },
                "spec": pod_spec,
            },
            "volumeClaimTemplates": [volume_claim_template(ref)],
        },
    }


# --- what may change in place -----------------------------------------------------------------------

# The StatefulSet fields the API server accepts in an update (everything else in spec is immutable).
PATCHABLE_SPEC_FIELDS = (
    "replicas",
    "template",
    "updateStrategy",
    "persistentVolumeClaimRetentionPolicy",
    "minReadySeconds",
    "ordinals",
    "revisionHistoryLimit",
)
# Immutable fields the builder sets, in the order they are reported.
IMMUTABLE_SPEC_FIELDS = ("selector", "serviceName", "podManagementPolicy", "volumeClaimTemplates")


def patchable(desired: Manifest) -> Manifest:
    """The patch body for what may change in place: the labels, replicas, the pod template, the update
    strategy and the retention policy. Send it as a JSON merge patch (application/merge-patch+json):
    lists (containers, env, volumes) are then replaced whole, so a removed variable really goes."""
    spec = desired["spec"]
    return {
        "metadata": {"labels": dict(desired["metadata"].get("labels", {}))},
        "spec": {key: spec[key] for key in PATCHABLE_SPEC_FIELDS if key in spec},
    }


def immutable_fields_changed(existing: Mapping[str, Any], desired: Mapping[str, Any]) -> list[str]:
    """The immutable fields (`spec.<field>`) whose desired value differs from the existing StatefulSet's:
    the adapter never patches them (the API server would refuse the whole update); it recreates the
    StatefulSet (orphaning the pods) or reports why it cannot. Fields the API server defaults in the
    existing object (a PVC template's volumeMode, its status) are not differences, and quantities are
    compared by value (1024Mi is 1Gi)."""
    old, new = existing.get("spec", {}), desired.get("spec", {})
    changed: list[str] = []
    for field in IMMUTABLE_SPEC_FIELDS:
        if field == "volumeClaimTemplates":
            same = _same_claim_templates(old.get(field) or [], new.get(field) or [])
        else:
            same = old.get(field) == new.get(field)
        if not same:
            changed.append(f"spec.{field}")
    return changed


def _same_claim_templates(old: Sequence[Any], new: Sequence[Any]) -> bool:
    if len(old) != len(new):
        return False
    return all(_contains(o, n) for o, n in zip(old, new, strict=True))


def _contains(existing: Any, desired: Any, key: str = "") -> bool:
    """Whether `existing` holds everything `desired` sets (dicts may hold more: the server's defaults)."""
    if isinstance(desired, Mapping):
        if not isinstance(existing, Mapping):
            return False
        return all(k in existing and _contains(existing[k], v, k) for k, v in desired.items())
    if isinstance(desired, list):
        return (
            isinstance(existing, list)
            and len(existing) == len(desired)
            and all(_contains(e, d) for e, d in zip(existing, desired, strict=True))
        )
    if key == "storage" and isinstance(existing, str) and isinstance(desired, str):
        return quantity(existing) == quantity(desired)
    return bool(existing == desired)


_SUFFIXES = {
    "Ki": Decimal(2**10),
    "Mi": Decimal(2**20),
    "Gi": Decimal(2**30),
    "Ti": Decimal(2**40),
    "Pi": Decimal(2**50),
    "Ei": Decimal(2**60),
    "m": Decimal("0.001"),
    "k": Decimal(10**3),
    "M": Decimal(10**6),
    "G": Decimal(10**9),
    "T": Decimal(10**12),
    "P": Decimal(10**15),
    "E": Decimal(10**18),
}


def quantity(text: str) -> Decimal | str:
    """A Kubernetes quantity's value (the text itself when it is not one): 1Gi == 1024Mi."""
    value = text.strip()
    for suffix in sorted(_SUFFIXES, key=len, reverse=True):
        if value.endswith(suffix):
            number, factor = value[: -len(suffix)], _SUFFIXES[suffix]
            break
    else:
        number, factor = value, Decimal(1)
    try:
        return Decimal(number) * factor
    except InvalidOperation:
        return text


_quantity = quantity  # the name pgherd.kube.objects imported first
