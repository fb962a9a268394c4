"""Which volume held each member's data: the evidence that a member's data is gone while its pod is not
running (not scheduled, its node gone).

A member's agent tells whether its volume holds data, but only while its pod runs. A pod that cannot be
scheduled says nothing, and an automatic recovery needs positive evidence that a majority's data is
gone. The evidence here: the operator saw the member's data on the PVC with uid U, and the member's
claim now has another uid (deleted and made again by the StatefulSet controller: a new, empty volume) or
no longer exists. Nothing recorded means nothing known: a member never seen with data, or every member
of a cluster an older operator created, is never taken for lost.

The record lives on the PostgresCluster (annotation ``pgherd.io/volumes``: member -> PVC uid), so that
a restarted operator, or the next Lease holder, keeps the evidence. It is written only when it changes.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping

from pgherd.kube import names
from pgherd.kube.api import JSON, KubeApi
from pgherd.kube.observe import ClusterObjects
from pgherd_backup.agent.wire import Status

log = logging.getLogger("pgherd.kube")


class Volumes:
    def __init__(self, api: KubeApi, namespace: str, cluster: str) -> None:
        self.api = api
        self.namespace = namespace
        self.cluster = cluster
        self.held: dict[str, str] = {}  # member -> uid of the PVC its data was seen on

    def load(self, cluster: JSON) -> None:
        text = (cluster["metadata"].get("annotations") or {}).get(names.ANNOTATION_VOLUMES)
        self.held = parse(text)

    def lost(self, objects: ClusterObjects) -> set[str]:
        """Members whose recorded volume is gone: their claim deleted, or made again under another uid."""
        uids = objects.volume_uids()
        return {member for member, uid in self.held.items() if uids.get(member) != uid}

    async def remember(self, objects: ClusterObjects, statuses: Mapping[str, Status | None]) -> None:
        """Record the volume of every member whose agent reports data on it; forget members removed."""
        uids = objects.volume_uids()
        held = {m: uid for m, uid in self.held.items() if m in uids or m in objects.member_names()}
        for member, status in statuses.items():
            uid = uids.get(member)
            if status is not None and status.data_present and uid is not None:
                held[member] = uid
        if held == self.held:
            return
        await self.api.patch(
            "PostgresCluster",
            self.namespace,
            self.cluster,
            {"metadata": {"annotations": {names.ANNOTATION_VOLUMES: json.dumps(held, sort_keys=True)}}},
        )
        self.held = held


def parse(text: str | None) -> dict[str, str]:
    if not text:
        return {}
    try:
        data = json.loads(text)
    except ValueError:
        data = None
    if not isinstance(data, dict) or not all(isinstance(v, str) for v in data.values()):
        log.warning("ignoring an unreadable %s annotation: %r", names.ANNOTATION_VOLUMES, text)
        return {}
    return {str(k): v for k, v in data.items()}
