"""pgherd's own Events (events.k8s.io/v1) on a PostgresCluster (or a Backup, a Restore): every decision
the engine acts on and what it did (``post``: each is one-off, told once), and what it finds wrong
(``record``: the same reason and note are not posted again within ``REPEAT_AFTER`` seconds, so that a
condition that lasts, or an effect seen again before the watch shows it, never floods the API server)."""

from __future__ import annotations

import logging
import os
import secrets
import time
from typing import Any

from pgherd.engine.actions import RecordEvent
from pgherd.kube import names
from pgherd.kube.api import ApiError, KubeApi
from pgherd_backup.timestamps import now_rfc3339

log = logging.getLogger("pgherd.kube.events")

REPEAT_AFTER = 300.0
CONTROLLER = "pgherd.io/operator"


class Events:
    def __init__(self, api: KubeApi) -> None:
        self.api = api
        self._posted: dict[tuple[str, str, str], float] = {}

    async def record(self, obj: dict[str, Any], event: RecordEvent) -> None:
        """Posted unless the same was, on the same object, within ``REPEAT_AFTER`` seconds."""
        meta = obj["metadata"]
        key = (meta.get("uid") or meta["name"], event.reason, event.message)
        now = time.monotonic()
        if now - self._posted.get(key, -REPEAT_AFTER) < REPEAT_AFTER:
            return
        self._posted[key] = now
        await self.post(obj, event)

    async def post(self, obj: dict[str, Any], event: RecordEvent) -> None:
        """Posted, whatever was before: a decision is told each time it is taken."""
        meta = obj["metadata"]
        log.info(
            "event %s %s: %s",
            "Warning" if event.warning else "Normal",
            event.reason,
            event.message,
            extra={"namespace": meta["namespace"], **_cluster_of(obj)},
        )
        body = {
            "apiVersion": "events.k8s.io/v1",
            "kind": "Event",
            "metadata": {"name": f"{meta['name']}.{secrets.token_hex(8)}", "namespace": meta["namespace"]},
            "eventTime": now_rfc3339(6),
            "reportingController": CONTROLLER,
            "reportingInstance": os.environ.get("POD_NAME") or "pgherd-operator",
            "action": event.reason,
            "reason": event.reason,
            "note": event.message[:1024],
            "type": "Warning" if event.warning else "Normal",
            "regarding": {
                "apiVersion": obj.get("apiVersion") or names.API_VERSION,
                "kind": obj.get("kind") or "PostgresCluster",
                "name": meta["name"],
                "namespace": meta["namespace"],
                "uid": meta.get("uid"),
            },
        }
        try:
            await self.api.create("Event", meta["namespace"], body)
        except ApiError as exc:  # an Event is never worth failing an operation for
            log.warning(
                "event %s on %s/%s not posted: %s", event.reason, meta["namespace"], meta["name"], exc
            )


def _cluster_of(obj: dict[str, Any]) -> dict[str, str]:
    """The cluster an Event's object is, or belongs to (a Backup's, a Restore's spec.cluster.name)."""
    if obj.get("kind", "PostgresCluster") == "PostgresCluster":
        return {"cluster": obj["metadata"]["name"]}
    name = ((obj.get("spec") or {}).get("cluster") or {}).get("name")
    return {"cluster": str(name)} if name else {}
