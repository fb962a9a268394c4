"""The conditions the engine reports (metav1.Condition without the timestamps, which the adapter adds
when a condition's status changes)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class ConditionType(StrEnum):
    READY = "Ready"  # every member ready, primary writable, nothing in progress
    PRIMARY_AVAILABLE = "PrimaryAvailable"
    QUORUM_HEALTHY = "QuorumHealthy"  # a majority of the voters reachable; sync standbys in place
    QUORUM_COMMIT = "QuorumCommit"  # commits wait for a majority (True) or the primary alone (False)
    PROGRESSING = "Progressing"  # an operation runs (True) / was aborted (False) / none (absent)
    CONTINUOUS_ARCHIVING = "ContinuousArchiving"
    LAST_BACKUP_SUCCEEDED = "LastBackupSucceeded"
    # With recovery.onQuorumLoss RestoreFromBackup and recovery.backup naming a Backup: whether it can be
    # restored (False at once when it cannot, e.g. Expired: its snapshot deleted by retention).
    RECOVERY_BACKUP_AVAILABLE = "RecoveryBackupAvailable"
    # Whether the cluster runs spec.postgresVersion; False while upgrading, after a refused preflight or
    # a rollback (the reason says which); True with reason OldMajorKept while the way back is kept.
    POSTGRES_VERSION_REACHED = "PostgresVersionReached"
    WAITING = "Waiting"  # why the engine takes no action while the cluster is not Running
    # Kubernetes only (set by the adapter, not the engine): pods the kubelet or the scheduler cannot
    # start (a missing Secret or key, an image not found, a crash loop, no node with room).
    PODS_HEALTHY = "PodsHealthy"
    # Kubernetes only: the certificates pgherd issued are valid and their last renewal, if due, was
    # written; False with the reason when a renewal failed (the API server refused) or one expired.
    CERTIFICATES_VALID = "CertificatesValid"


@dataclass(frozen=True)
class Condition:
    type: ConditionType
    status: bool | None  # None: Unknown
    reason: str
    message: str = ""

    @property
    def status_text(self) -> str:
        return "Unknown" if self.status is None else ("True" if self.status else "False")


def true(kind: ConditionType, reason: str, message: str = "") -> Condition:
    return Condition(kind, True, reason, message)


def false(kind: ConditionType, reason: str, message: str = "") -> Condition:
    return Condition(kind, False, reason, message)


def unknown(kind: ConditionType, reason: str, message: str = "") -> Condition:
    return Condition(kind, None, reason, message)
