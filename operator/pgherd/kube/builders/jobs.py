"""The backup Jobs: a snapshot (`pgherd-backup snapshot`) for a Backup, and retention (`pgherd-backup
prune`). Isolated from the members: a Job streams from a member over the replication protocol and
uploads to S3 itself, so a slow upload never weighs on PostgreSQL's pod, and a failed one is retried
by the Job controller, not by the database.

The result travels in the container's termination message: the command writes its compact JSON
summary (at most 4096 bytes, `--result-file`) to /dev/termination-log, the kubelet copies it into the
pod's status, and the operator reads it there (`job_result`) before it deletes the Job; hence no
ttlSecondsAfterFinished, which could remove the Job before the operator has read it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from pgherd.api.cluster import SNAPSHOT_DEADLINE_SECONDS, S3Store
from pgherd.kube import names
from pgherd.kube.builders.common import (
    ClusterRef,
    Manifest,
    container_security_context,
    metadata,
    pod_security_context,
    s3_ca_volume,
    s3_env,
    s3_store,
    store_url,
    tmp_volume,
)
from pgherd.kube.builders.statefulset import SECRET_MODE

TERMINATION_LOG = "/dev/termination-log"
CONTAINER_SNAPSHOT = "snapshot"
CONTAINER_PRUNE = "prune"
# A failed snapshot is tried again twice (a new pod, a new upload: a failed one leaves nothing behind).
BACKOFF_LIMIT = 2
# A snapshot of a large database streams for hours; six hours (SNAPSHOT_DEADLINE_SECONDS, from the API:
# also the bound of backup.jobStartTimeoutSeconds) bound one that hangs. A pod that cannot start fails
# its Backup much sooner, after backup.jobStartTimeoutSeconds (the operator deletes the Job then).

# Pruning lists and deletes objects: an hour is plenty.
PRUNE_DEADLINE_SECONDS = 3600

_PLAIN = re.compile(r"^[A-Za-z0-9._:/-]+$")


def _conninfo(params: Mapping[str, str]) -> str:
    """A libpq key=value string, values single-quoted (with \\ and ' escaped) when not plain."""
    parts = []
    for key, value in params.items():
        if not _PLAIN.match(value):
            value = "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"
        parts.append(f"{key}={value}")
    return " ".join(parts)


# The snapshot Job's copy of the agents' Secret (key -> file): the CA the members' PostgreSQL certificate
# chains to (the cluster's, or the user's: spec.tls.serverCertSecret) and the replication account's
# client certificate and key, never the members' server key nor the token's digest.
VOLUME_REPLICATION_TLS = "replication-tls"
REPLICATION_TLS_KEYS = {
    names.KEY_POSTGRES_CA: names.KEY_CA_CERT,
    names.KEY_REPLICATION_CERT: names.KEY_REPLICATION_CERT,
    names.KEY_REPLICATION_KEY: names.KEY_REPLICATION_KEY,
}


def source_dsn(host: str, port: int = names.POSTGRES_PORT) -> str:
    """The snapshot's source: the member at `host` as the replication account, by its client
    certificate alone (pg_hba's `cert`: no password), over TLS that verifies the member against the
    CA of its certificate (verify-ca: a member may be reached by its pod IP, which no certificate names).
    `pgherd-backup snapshot` copies the key into a private file first when libpq would refuse its
    mode."""
    folder = names.REPLICATION_TLS_MOUNT
    return _conninfo(
        {
            "host": host,
            "port": str(port),
            "user": names.REPLICATION_USER,
            "dbname": "postgres",
            "application_name": "pgherd-snapshot",
            "connect_timeout": "10",
            "sslmode": "verify-ca",
            "sslrootcert": f"{folder}/{names.KEY_CA_CERT}",
            "sslcert": f"{folder}/{names.KEY_REPLICATION_CERT}",
            "sslkey": f"{folder}/{names.KEY_REPLICATION_KEY}",
        }
    )


def replication_tls_volume(ref: ClusterRef) -> tuple[Manifest, Manifest]:
    """(volume, mount) of what a snapshot Job needs of the agents' Secret (`REPLICATION_TLS_KEYS`)."""
    volume = {
        "name": VOLUME_REPLICATION_TLS,
        "secret": {
            "secretName": names.secret_agent(ref.name),
            "defaultMode": SECRET_MODE,
            "items": [{"key": key, "path": path} for key, path in REPLICATION_TLS_KEYS.items()],
        },
    }
    mount = {"name": VOLUME_REPLICATION_TLS, "mountPath": names.REPLICATION_TLS_MOUNT, "readOnly": True}
    return volume, mount


def _store(ref: ClusterRef) -> S3Store:
    store = s3_store(ref.spec)
    if store is None:
        raise ValueError(f"PostgresCluster {ref.name} has no backup.store: no snapshot or prune Job")
    return store


def _store_volumes(ref: ClusterRef) -> list[tuple[Manifest, Manifest]]:
    """What a Job needs mounted to reach the store: the endpoint's CA, when it has one."""
    s3_ca = s3_ca_volume(_store(ref))
    return [s3_ca] if s3_ca is not None else []


def _job(
    ref: ClusterRef,
    name: str,
    component: str,
    container: Manifest,
    *,
    deadline: int,
    labels: Mapping[str, str],
    extra_owner: Manifest | None = None,
    volumes: Sequence[tuple[Manifest, Manifest]] = (),
) -> Manifest:
    tmp, tmp_mount = tmp_volume()
    meta = metadata(ref, name, component, labels)
    if extra_owner is not None:
        meta["ownerReferences"].append(extra_owner)
    container = {
        **container,
        "image": ref.image,
        "securityContext": container_security_context(),
        "volumeMounts": [tmp_mount, *(mount for _, mount in volumes)],
        "terminationMessagePath": TERMINATION_LOG,
        # The summary when the command wrote one; on a failure without it, the tail of its log.
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": meta,
        "spec": {
            "backoffLimit": BACKOFF_LIMIT,
            "activeDeadlineSeconds": deadline,
            "template": {
                "metadata": {"labels": dict(meta["labels"])},
                "spec": {
                    "restartPolicy": "Never",
                    "serviceAccountName": names.service_account(ref.name),
                    "automountServiceAccountToken": False,
                    "enableServiceLinks": False,
                    "securityContext": pod_security_context(),
                    "containers": [container],
                    "volumes": [tmp, *(volume for volume, _ in volumes)],
                },
            },
        },
    }


def snapshot_command(ref: ClusterRef, source_host: str, source_port: int = names.POSTGRES_PORT) -> list[str]:
    store = _store(ref)
    compression = ref.spec.backup.compression.value if ref.spec.backup is not None else "zstd"
    return [
        "pgherd-backup",
        "snapshot",
        "--store",
        store_url(store),
        "--cluster",
        ref.name,
        "--source",
        source_dsn(source_host, source_port),
        "--compression",
        compression,
        "--verify",  # the Backup's `verified`: every object read back before the Job completes
        "--result-file",
        TERMINATION_LOG,
    ]


def snapshot_job(
    ref: ClusterRef,
    backup: str,
    source_host: str,
    *,
    source_port: int = names.POSTGRES_PORT,
    member: str | None = None,
    backup_uid: str | None = None,
) -> Manifest:
    """The snapshot Job of Backup `backup`, streaming from the member at `source_host` (the address of
    the member the engine chose; `member`, its name, becomes the label pgherd.io/member). With
    `backup_uid` the Backup is a second, non-controlling owner: the garbage collector then removes the
    Job when the Backup is deleted (a running snapshot stops)."""
    extra_owner = None
    if backup_uid is not None:
        extra_owner = {
            "apiVersion": names.API_VERSION,
            "kind": "Backup",
            "name": backup,
            "uid": backup_uid,
            "controller": False,
            "blockOwnerDeletion": False,
        }
    container: Manifest = {
        "name": CONTAINER_SNAPSHOT,
        "command": snapshot_command(ref, source_host, source_port),
        "env": s3_env(_store(ref)),
    }
    return _job(
        ref,
        names.snapshot_job(backup),
        names.COMPONENT_SNAPSHOT,
        container,
        deadline=SNAPSHOT_DEADLINE_SECONDS,
        labels={names.LABEL_BACKUP: backup, **({names.LABEL_MEMBER: member} if member else {})},
        extra_owner=extra_owner,
        volumes=[replication_tls_volume(ref), *_store_volumes(ref)],
    )


def prune_command(ref: ClusterRef, keep_last: int | None, keep_within: str | None) -> list[str]:
    if keep_last is None and keep_within is None:
        raise ValueError("prune needs keep_last and/or keep_within: it refuses to guess what to keep")
    command = [
        "pgherd-backup",
        "prune",
        "--store",
        store_url(_store(ref)),
        "--cluster",
        ref.name,
    ]
    if keep_last is not None:
        command += ["--keep-last", str(keep_last)]
    if keep_within is not None:
        command += ["--keep-within", keep_within]
    return [*command, "--result-file", TERMINATION_LOG]


def prune_job(ref: ClusterRef, stamp: str, keep_last: int | None, keep_within: str | None) -> Manifest:
    """The retention Job `<cluster>-prune-<stamp>` (`stamp`: the adapter's, e.g. 20250131t030000)."""
    container: Manifest = {
        "name": CONTAINER_PRUNE,
        "command": prune_command(ref, keep_last, keep_within),
        "env": s3_env(_store(ref)),
    }
    return _job(
        ref,
        names.prune_job(ref.name, stamp),
        names.COMPONENT_PRUNE,
        container,
        deadline=PRUNE_DEADLINE_SECONDS,
        labels={},
        volumes=_store_volumes(ref),
    )


def job_result(pod: Mapping[str, Any]) -> dict[str, Any] | None:
    """The JSON summary a finished Job pod left in its termination message, or None (still running, or
    it failed before writing one: the message then holds the log's tail, see `job_error`)."""
    message = job_message(pod)
    if not message:
        return None
    try:
        value = json.loads(message)
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


def job_error(pod: Mapping[str, Any]) -> str | None:
    """The last line of a failed Job pod's termination message (its log's tail), for a status field."""
    if job_result(pod) is not None:
        return None
    lines = [line for line in (job_message(pod) or "").splitlines() if line.strip()]
    return lines[-1][:500] if lines else None


def job_message(pod: Mapping[str, Any]) -> str | None:
    for status in (pod.get("status") or {}).get("containerStatuses") or []:
        terminated = (status.get("state") or {}).get("terminated") or {}
        if terminated.get("message"):
            return str(terminated["message"])
    return None
