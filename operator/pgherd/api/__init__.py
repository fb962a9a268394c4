"""The pgherd API (group pgherd.io, version v1alpha1): the single source of truth for the CRDs."""

from pgherd.api.backup import Backup, BackupPhase, BackupStatus, BackupTarget
from pgherd.api.cluster import (
    Compression,
    OnQuorumLoss,
    Phase,
    PostgresCluster,
    PostgresClusterSpec,
    PostgresClusterStatus,
    PrimaryUpdateMethod,
    ReplicationMode,
)
from pgherd.api.common import API_VERSION, GROUP, VERSION, Condition, RecoveryTarget
from pgherd.api.restore import Restore, RestorePhase, RestoreStatus

__all__ = [
    "API_VERSION",
    "GROUP",
    "VERSION",
    "Backup",
    "BackupPhase",
    "BackupStatus",
    "BackupTarget",
    "Compression",
    "Condition",
    "OnQuorumLoss",
    "Phase",
    "PostgresCluster",
    "PostgresClusterSpec",
    "PostgresClusterStatus",
    "PrimaryUpdateMethod",
    "RecoveryTarget",
    "ReplicationMode",
    "Restore",
    "RestorePhase",
    "RestoreStatus",
]
