"""The spec revision: what a member must be restarted for (image, restart-only parameters, resources,
the agent's TLS flags).

Settings PostgreSQL applies on reload are not part of it: the adapter reloads them without a restart.
"""

from __future__ import annotations

import hashlib
import json

from pgherd.api.cluster import PostgresClusterSpec, TlsVersion

# postmaster-context settings: a change takes effect only after a restart.
RESTART_PARAMETERS = frozenset(
    {
        "autovacuum_max_workers",
        "autovacuum_worker_slots",
        "dynamic_shared_memory_type",
        "huge_page_size",
        "huge_pages",
        "io_method",
        "io_workers",
        "jit_provider",
        "max_connections",
        "max_files_per_process",
        "max_locks_per_transaction",
        "max_logical_replication_workers",
        "max_pred_locks_per_transaction",
        "max_prepared_transactions",
        "max_replication_slots",
        "max_wal_senders",
        "max_worker_processes",
        "min_dynamic_shared_memory",
        "old_snapshot_threshold",
        "shared_buffers",
        "shared_memory_type",
        "shared_preload_libraries",
        "superuser_reserved_connections",
        "reserved_connections",
        "track_activity_query_size",
        "track_commit_timestamp",
        "wal_buffers",
        "wal_decode_buffer_size",
    }
)


def spec_revision(spec: PostgresClusterSpec, image: str | None = None, restart: str | None = None) -> str:
    """A short, stable digest of what requires a restart; equal specs give equal revisions.

    ``image``: the image the platform gives the members for this spec (Kubernetes: spec.image, else the
    operator's postgresImage for spec.postgresVersion); None where members run no image (the sandbox).
    postgresVersion itself is not part of it: a member runs its data directory's own major, and a
    change of major is an upgrade (engine/upgrade.py), not a restart. Only when the image changes with
    it (a postgresImage per major) do the members restart into the new image, before the upgrade.

    ``restart``: the value of the annotation pgherd.io/restart, a person's request for a rolling restart:
    a new value is a new revision, which the rollout carries out. Absent, the digest is the one it was
    before the annotation existed (no cluster restarts when the operator is upgraded)."""
    parameters = {
        key.lower(): value
        for key, value in (spec.parameters or {}).items()
        if key.lower() in RESTART_PARAMETERS
    }
    resources = spec.resources.model_dump(mode="json", exclude_none=True) if spec.resources else {}
    payload: dict[str, object] = {
        "image": image or spec.image or "",
        "parameters": dict(sorted(parameters.items())),
        "resources": resources,
    }
    if restart:
        payload["restart"] = restart
    # Agent flags read at start; absent at their defaults, so that existing revisions stay as they were.
    if spec.superuser_network_access:
        payload["superuserNetworkAccess"] = True
    if spec.tls.min_protocol_version != TlsVersion.TLS_1_3:
        payload["tlsMinProtocolVersion"] = spec.tls.min_protocol_version.value
    digest = hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()
    return digest[:12]
