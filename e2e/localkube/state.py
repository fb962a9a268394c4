"""DIR/state.json: what `up` started and changed, written as it goes (so that `down` undoes a failed
`up` too), and what the e2e driver needs to find: settings and ports, processes, versions, the S3
store, the image, the chart's release.

    {"dir", "settings": {bridge, pod_cidr, service_cidr, ports: {base, NAME: port}}, "binDir",
     "versions": "<the build's stamp line>", "processes": {NAME: {pid, startTime}} (also in
     DIR/pids/NAME.json from the moment each starts), "host": {ipForward, bridgeNfCallIptables,
     preexisting}, "bridge", "s3": {endpoint, bucket, accessKeyId, region, secret}, "image",
     "postgresImage", "postgresMajor", "operator": {release, namespace} | null, "ready", "upSeconds"}
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from e2e.localkube.processes import Process, forget, recorded
from e2e.localkube.settings import Layout, Settings


class State:
    def __init__(self, layout: Layout, data: dict[str, Any] | None = None) -> None:
        self.layout = layout
        self.data: dict[str, Any] = data if data is not None else {}

    @classmethod
    def load(cls, layout: Layout) -> State:
        """The state of the cluster in DIR (empty when `up` never ran there)."""
        try:
            return cls(layout, json.loads(layout.state.read_text()))
        except FileNotFoundError:
            return cls(layout)

    def save(self) -> None:
        tmp = self.layout.state.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=2, sort_keys=True) + "\n")
        os.replace(tmp, self.layout.state)

    def update(self, **changes: Any) -> None:
        self.data.update(changes)
        self.save()

    @property
    def settings(self) -> Settings | None:
        raw = self.data.get("settings")
        return Settings.from_json(raw) if raw else None

    @property
    def bin_dir(self) -> Path | None:
        raw = self.data.get("binDir")
        return Path(raw) if raw else None

    # -- processes ---------------------------------------------------------------------------------

    def add_process(self, process: Process) -> None:
        self.data.setdefault("processes", {})[process.name] = process.to_json()
        self.save()

    def process(self, name: str) -> Process | None:
        return next((process for process in self.processes() if process.name == name), None)

    def processes(self) -> list[Process]:
        """Those recorded here and those whose pid file DIR/pids holds (a process `up` started just
        before it was killed)."""
        found = {
            name: Process.from_json(name, raw) for name, raw in (self.data.get("processes") or {}).items()
        }
        for process in recorded(self.layout):
            found.setdefault(process.name, process)
        return list(found.values())

    def forget_process(self, name: str) -> None:
        (self.data.get("processes") or {}).pop(name, None)
        forget(self.layout, name)
        self.save()

    def running(self) -> list[Process]:
        return [process for process in self.processes() if process.alive]
