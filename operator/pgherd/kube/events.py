"""pgherd's own Events (events.k8s.io/v1) on a PostgresCluster: failover, switchover, fencing, backups,
refusals. The same reason and note are not posted again within ``REPEAT_AFTER`` seconds, so that a
condition that lasts never floods the API server."""

from __future__ import annotations

import logging
import os
import secrets
import time
from datetime import UTC, datetime
from typing import Any

from pgherd.engine.actions import RecordEvent
from pgherd.kube import names
from pgherd.kube.api import ApiError, KubeApi

log = logging.getLogger("pgherd.kube.events")

REPEAT_AFTER = 300.0
CONTROLLER = "pgherd.io/operator"


class Events:
    def __init__(self, api: KubeApi) -> None:
        self.api = api
        self._posted: dict[tuple[str, str, str], float] = {}

    async def record(self, obj: dict[str, Any], event: RecordEvent) -> None:
        meta = obj["metadata"]
        key = (meta.get("uid") or meta["name"], event.reason, event.message)
        now = time.monotonic()
        if now - self._posted.get(key, -REPEAT_AFTER) < REPEAT_AFTER:
            return
        self._posted[key] = now
        body = {
            "apiVersion": "events.k8s.io/v1",
            "kind": "Event",
            "metadata": {"name": f"{meta['name']}.{secrets.token_hex(8)}", "namespace": meta["namespace"]},
            "eventTime": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
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
