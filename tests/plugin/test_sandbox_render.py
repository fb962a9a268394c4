"""`pgherd sandbox status` prints with the renderer of `kubectl pgherd status`, from the same status
document: the sandbox's cluster object, the status its supervisor writes (status.json), its Backups and
Restores, each member at its port. `--json` stays the sandbox's own document."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from engine.builders import settled
from pgherd.commands.sandbox import _status_document
from pgherd.engine import decide
from pgherd.local.layout import SandboxPaths, write_json
from pgherd.local.objects import ObjectStore
from pgherd.plugin.render import render
from pgherd.plugin.summary import summarize


class _Sandbox:
    """What `_status_document` reads of a Sandbox: its paths, objects and supervisor."""

    def __init__(self, root: Path) -> None:
        self.paths = SandboxPaths(root)
        self.objects = ObjectStore(self.paths)

    def supervisor_pid(self) -> int | None:
        return 4242


def _supervisor_status() -> dict[str, Any]:
    """status.json as the supervisor writes it (local/supervisor.py write_status), of a settled cluster."""
    spec, view, status = settled()
    decision = decide(spec, view, status)
    members = [
        {
            "name": m.name,
            "role": "primary" if m.name == "pg-0" else "replica",
            "ready": True,
            "reachable": True,
            "port": 5433 + m.ordinal,
            "timeline": 1,
            "version": "16.4",
            "receivedLSN": "0/3000060",
            "replayedLSN": "0/3000060",
            "lagBytes": 0 if m.name != "pg-0" else None,
            "streaming": m.name != "pg-0",
            "startError": None,
        }
        for m in view.members
    ]
    return {
        "phase": decision.phase.value,
        "message": decision.message,
        "conditions": [
            {"type": c.type.value, "status": c.status_text, "reason": c.reason, "message": c.message}
            for c in decision.conditions
        ],
        "currentPrimary": "pg-0",
        "instances": 3,
        "readyInstances": 3,
        "members": members,
        "timeline": 1,
        "postgresVersion": 16,
        "operation": None,
        "engine": decision.status.to_dict(),
        "updatedAt": "2026-01-01T12:00:00Z",
    }


def test_the_sandbox_status_is_rendered_by_the_plugins_renderer(tmp_path: Path) -> None:
    sandbox = _Sandbox(tmp_path)
    tmp_path.mkdir(exist_ok=True)
    write_json(sandbox.paths.cluster_object, {"apiVersion": "pgherd.io/v1alpha1", "kind": "PostgresCluster",
               "metadata": {"name": "pg", "generation": 1}, "spec": {"instances": 3, "postgresVersion": 16}})  # fmt: skip
    recorded = _supervisor_status()
    write_json(sandbox.paths.status_file, recorded)
    status = {"members": recorded["members"], "supervisorRunning": True}
    document = _status_document(sandbox, status)
    json.dumps(document)
    text = render(summarize(document))
    assert text.startswith("PostgresCluster pg: Running\n")
    assert "Operator: sandbox supervisor (pid 4242)" in text
    row = next(line.split() for line in text.splitlines() if line.strip().startswith("pg-1 "))
    assert row[:5] == ["pg-1", "replica", "yes", "1", "0/3000060"] and "127.0.0.1:5434" in row
    assert 'synchronous_standby_names: ANY 1 ("pg-1", "pg-2")' in text
    assert "Certificates" not in text  # the sandbox's are not read
