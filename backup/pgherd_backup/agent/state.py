"""What the agent remembers across its own restarts, on the member's volume (`agent/state.json`).

A fence must survive a restarted agent (a pod deleted while fenced must not come back running), and so
must the orders that shape the next start: the upstream to follow, the revision running, the role the
member had when it was fenced (Unfence starts a primary again only if it was one), the data kept aside,
and a restore in progress (what a restarted agent must finish or report) and how the last one ended.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class AgentState:
    fenced: bool = False
    demoted: bool = False  # fenced but running read-only with no upstream
    role_at_fence: str | None = None  # primary | replica | None (unknown)
    upstream: str | None = None  # the conninfo or host:port it was last told to follow
    revision: str | None = None
    kept_aside: list[str] = field(default_factory=list)
    crashes: int = 0
    last_crash_at: str | None = None
    # A restore in progress: {requestId, snapshot, target, stage, startedAt, keptAside} (see restoring.py)
    restore: dict[str, Any] | None = None
    last_action: dict[str, Any] | None = None  # wire.ActionOutcome of the last long action
    # A major upgrade in progress: {requestId, major, fromMajor, stage, newData, keptAside} (upgrading.py)
    upgrade: dict[str, Any] | None = None
    # What the last upgrade check read from the running server (encoding, locale, extensions, major)
    upgrade_facts: dict[str, Any] | None = None

    @classmethod
    def load(cls, path: Path) -> AgentState:
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            return cls()
        except (OSError, ValueError):
            # Unreadable: start from the safe side (fenced, so that nothing starts before an order).
            return cls(fenced=True)
        known = {key: raw[key] for key in cls.__dataclass_fields__ if key in raw}
        return cls(**known)

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        with tmp.open("w") as handle:
            json.dump(asdict(self), handle, indent=2, sort_keys=True)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
