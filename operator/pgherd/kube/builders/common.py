"""What every builder shares: the cluster's identity, owner reference, metadata, image, the restricted
security context and the S3 settings of the data plane."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pgherd.api.cluster import KIND, InitdbBootstrap, PostgresClusterSpec, S3Store
from pgherd.kube import names

Manifest = dict[str, Any]

# The postgres account of the official PostgreSQL image the pgherd image is built on (the Dockerfile's
# USER 999:999, the chart's podSecurityContext): numeric, so that the kubelet can enforce runAsNonRoot.
POSTGRES_UID = 999
POSTGRES_GID = 999

# Where the writable scratch space of a read-only root filesystem is: an emptyDir.
VOLUME_TMP = "tmp"
TMP_MOUNT = "/tmp"

# spec.backup.store.s3.endpointCA: its Secret's key, mounted as <S3_CA_MOUNT>/<S3_CA_FILE> whatever the key.
VOLUME_S3_CA = "s3-ca"
S3_CA_MOUNT = "/etc/pgherd/s3-ca"
S3_CA_FILE = "ca.crt"
# The CA's file is read by the postgres account (fsGroup); a CA certificate is no secret.
S3_CA_MODE = 0o444


@dataclass(frozen=True)
class ClusterRef:
    """One PostgresCluster as the builders need it. `image` is already resolved (`resolve_image`) and
    `revision` is the engine's `spec_revision(spec)`: the adapter computes both, once per pass."""

    name: str
    namespace: str
    uid: str
    spec: PostgresClusterSpec
    image: str
    revision: str
    log_format: str = "text"  # the operator's --log-format, which the agents follow


def owner_reference(ref: ClusterRef) -> Manifest:
    """The PostgresCluster as controller of an object: the garbage collector deletes the object with
    the cluster, and `blockOwnerDeletion` keeps a foreground deletion of the cluster waiting for it."""
    return cluster_owner(ref.name, ref.uid)


def cluster_owner(name: str, uid: str) -> Manifest:
    """The owner reference to the PostgresCluster ``name`` (its ``uid``)."""
    return {
        "apiVersion": names.API_VERSION,
        "kind": KIND,
        "name": name,
        "uid": uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def metadata(
    ref: ClusterRef, name: str, component: str, extra_labels: Mapping[str, str] | None = None
) -> Manifest:
    """An owned object's metadata: its name in the cluster's namespace, the common labels (with
    `pgherd.io/cluster`) and the owner reference. Never a secret value: labels are listed freely."""
    return {
        "name": name,
        "namespace": ref.namespace,
        "labels": {**names.common_labels(ref.name, component), **(extra_labels or {})},
        "ownerReferences": [owner_reference(ref)],
    }


def resolve_image(spec: PostgresClusterSpec, template: str, default: str) -> str:
    """The image of the cluster's pods and Jobs: `spec.image` when set; else `template` (the operator's
    PGHERD_POSTGRES_IMAGE) with "{major}" replaced by `spec.postgresVersion`; else `default`."""
    if spec.image:
        return spec.image
    if template:
        return template.replace("{major}", str(spec.postgres_version))
    return default


def app_account(ref: ClusterRef) -> tuple[str, str]:
    """(owner, database) of the application: bootstrap.initdb's, `app`/`app` by default and for a
    cluster bootstrapped from a backup (whose roles come from the snapshot)."""
    initdb = ref.spec.effective_bootstrap.initdb or InitdbBootstrap()
    return initdb.owner, initdb.database


def pod_security_context() -> Manifest:
    """The restricted Pod Security Standard at pod level. fsGroup makes the data volume writable by
    the postgres account; `OnRootMismatch` changes ownership only on a fresh volume, since a recursive
    chown/chmod of an existing data directory on every start is slow on large volumes and gives its
    files group-write, which PostgreSQL refuses (the data directory must be 0700 or 0750)."""
    return {
        "runAsNonRoot": True,
        "runAsUser": POSTGRES_UID,
        "runAsGroup": POSTGRES_GID,
        "fsGroup": POSTGRES_GID,
        "fsGroupChangePolicy": "OnRootMismatch",
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def container_security_context() -> Manifest:
    """The restricted Pod Security Standard at container level, with a read-only root filesystem:
    everything a container writes goes to its volumes (data, /tmp), nothing to the image."""
    return {
        "runAsNonRoot": True,
        "runAsUser": POSTGRES_UID,
        "runAsGroup": POSTGRES_GID,
        "allowPrivilegeEscalation": False,
        "privileged": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def tmp_volume() -> tuple[Manifest, Manifest]:
    """(volume, mount) of the writable /tmp a read-only root filesystem lacks: the data plane falls back
    to /tmp for Unix sockets whose path would be too long, and Python and libpq tools may write there."""
    return {"name": VOLUME_TMP, "emptyDir": {}}, {"name": VOLUME_TMP, "mountPath": TMP_MOUNT}


def s3_store(spec: PostgresClusterSpec) -> S3Store | None:
    """The cluster's backup store (`spec.backup.store.s3`), if any."""
    if spec.backup is None or spec.backup.store is None:
        return None
    return spec.backup.store.s3


def store_url(store: S3Store) -> str:
    """`s3://bucket/path`, as `pgherd-backup --store` and the agent's `--store` take it."""
    path = store.path.strip("/")
    return f"s3://{store.bucket}/{path}" if path else f"s3://{store.bucket}"


def env_value(name: str, value: str) -> Manifest:
    return {"name": name, "value": value}


def env_secret(name: str, secret: str, key: str) -> Manifest:
    """A variable from a Secret's key: the kubelet reads the Secret, the pod spec holds no value."""
    return {"name": name, "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}}


def s3_env(store: S3Store) -> list[Manifest]:
    """The variables `pgherd_backup.store.S3Settings.from_env` reads: credentials from the user's
    Secret (never a value in a pod spec), endpoint and region. Path-style addressing is forced only
    when `forcePathStyle` is true; otherwise the data plane's own rule applies (path style with a
    custom endpoint, such as MinIO; virtual-hosted on AWS)."""
    credentials = store.credentials
    env = [
        env_secret("AWS_ACCESS_KEY_ID", credentials.secret_name, credentials.access_key_id_key),
        env_secret("AWS_SECRET_ACCESS_KEY", credentials.secret_name, credentials.secret_access_key_key),
        env_value("AWS_REGION", store.region),
    ]
    if store.endpoint:
        env.append(env_value("AWS_ENDPOINT_URL", store.endpoint))
    if store.force_path_style:
        env.append(env_value("PGHERD_S3_FORCE_PATH_STYLE", "true"))
    if store.endpoint_ca is not None:
        env.append(env_value("AWS_CA_BUNDLE", f"{S3_CA_MOUNT}/{S3_CA_FILE}"))  # the path, never the content
    return env


def s3_ca_volume(store: S3Store) -> tuple[Manifest, Manifest] | None:
    """(volume, mount) of the endpoint's CA (`endpointCA`), read-only, or None without one (the system's
    CAs verify). Optional: a missing Secret or key leaves the file absent, so that the members still
    start and the data plane's S3 client names the missing CA where archiving and backups report their
    failures, rather than every pod waiting in ContainerCreating behind a kubelet Event."""
    ca = store.endpoint_ca
    if ca is None:
        return None
    volume = {
        "name": VOLUME_S3_CA,
        "secret": {
            "secretName": ca.secret_name,
            "defaultMode": S3_CA_MODE,
            "items": [{"key": ca.key, "path": S3_CA_FILE}],
            "optional": True,
        },
    }
    return volume, {"name": VOLUME_S3_CA, "mountPath": S3_CA_MOUNT, "readOnly": True}
