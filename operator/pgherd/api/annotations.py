"""Annotations a person sets on a PostgresCluster to ask for something (the same on Kubernetes, with
`kubectl annotate`, and in the sandbox, with `pgherd sandbox annotate`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypedDict

# After a major upgrade, while a replica is kept on the old major (docs/upgrades.md): the value names
# the major the upgrade went to, so that an annotation left behind never acts on a later upgrade.
CONFIRM_UPGRADE = "pgherd.io/confirm-upgrade"
ROLLBACK_UPGRADE = "pgherd.io/rollback-upgrade"
# A refused or rolled-back upgrade is tried again when this takes a value it did not have then.
RETRY_UPGRADE = "pgherd.io/retry-upgrade"
UPGRADE_ANNOTATIONS = (CONFIRM_UPGRADE, ROLLBACK_UPGRADE, RETRY_UPGRADE)
# A rolling restart of every member when this takes a new value (`kubectl pgherd restart` writes the
# time): the value is part of the spec revision, so the engine's ordinary rollout restarts the members
# in its safe order (replicas most lagging first, then a switchover, the old primary last).
RESTART = "pgherd.io/restart"
# Every certificate pgherd issued for the cluster is issued again when this takes a value it did not
# have at the last renewal (any text; `date +%s` will do).
ROTATE_CERTIFICATES = "pgherd.io/rotate-certificates"


class UpgradeRequests(TypedDict):
    confirm_upgrade: str | None
    rollback_upgrade: str | None
    retry_upgrade: str | None


def upgrade_requests(metadata: Mapping[str, Any]) -> UpgradeRequests:
    """The ClusterView fields of the upgrade annotations in a cluster object's ``metadata``."""
    annotations = metadata.get("annotations") or {}

    def value(key: str) -> str | None:
        found = annotations.get(key)
        return None if found is None else str(found)

    return {
        "confirm_upgrade": value(CONFIRM_UPGRADE),
        "rollback_upgrade": value(ROLLBACK_UPGRADE),
        "retry_upgrade": value(RETRY_UPGRADE),
    }


def restart_request(metadata: Mapping[str, Any]) -> str | None:
    """The value of the restart annotation in a cluster object's ``metadata`` (None: never asked)."""
    found = (metadata.get("annotations") or {}).get(RESTART)
    return None if found is None or str(found) == "" else str(found)


def rotate_request(metadata: Mapping[str, Any]) -> str | None:
    """The value of the rotate-certificates annotation in a cluster object's ``metadata`` (None: never
    asked)."""
    found = (metadata.get("annotations") or {}).get(ROTATE_CERTIFICATES)
    return None if found is None or str(found) == "" else str(found)
