"""Where a sandbox keeps things: one directory holds its objects, status, members, jobs and S3 data."""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_DIR = Path(".sandbox")  # `pgherd sandbox ... --dir`'s default


@dataclass(frozen=True)
class SandboxPaths:
    root: Path

    @property
    def state_file(self) -> Path:
        return self.root / "sandbox.json"

    @property
    def status_file(self) -> Path:
        return self.root / "status.json"

    @property
    def objects(self) -> Path:
        return self.root / "objects"

    @property
    def cluster_object(self) -> Path:
        return self.objects / "cluster.json"

    @property
    def backups(self) -> Path:
        return self.objects / "backups"

    @property
    def restores(self) -> Path:
        return self.objects / "restores"

    @property
    def switchover_request(self) -> Path:
        return self.objects / "switchover.json"

    @property
    def rw_endpoint(self) -> Path:
        """The member the rw endpoint selects (the last SetPrimary), as a pod label would persist it."""
        return self.root / "rw-endpoint.json"

    @property
    def crash_point(self) -> Path:
        """Armed by `sandbox kill-supervisor --at-step`: the supervisor exits as if killed there."""
        return self.root / "crash-at.json"

    @property
    def crash_reached(self) -> Path:
        """Written by the supervisor as it exits at the armed crash point (what was armed)."""
        return self.root / "crash-reached.json"

    @property
    def members(self) -> Path:
        return self.root / "members"

    def member_dir(self, name: str) -> Path:
        return self.members / name

    def member_data(self, name: str) -> Path:
        return self.members / name / "data"

    def member_held(self, name: str) -> Path:
        """Present while the member's pod may not start (`sandbox kill --keep-down`: its node is gone)."""
        return self.members / name / "keep-down"

    def member_state(self, name: str) -> Path:
        return self.members / name / "member.json"

    def member_log(self, name: str) -> Path:
        return self.members / name / "postgres.log"

    def member_kept(self, name: str) -> Path:
        """Data directories a re-clone or a restore replaced, on the member's volume (its agent's
        <volume>/kept/<stamp>): never deleted but with the member's volume."""
        return self.members / name / "kept"

    @property
    def jobs(self) -> Path:
        return self.root / "jobs"

    @property
    def s3_root(self) -> Path:
        return self.root / "s3"

    @property
    def s3_tls(self) -> Path:
        """The embedded S3 server's certificate and key, and the sandbox's CA that signed them."""
        return self.root / "s3-tls"

    @property
    def s3_ca(self) -> Path:
        """An external store's CA (backup.store.s3.endpointCA), copied from AWS_CA_BUNDLE at `up`."""
        return self.root / "s3-ca.crt"

    @property
    def supervisor_log(self) -> Path:
        return self.root / "supervisor.log"

    @property
    def events_log(self) -> Path:
        return self.root / "events.log"

    @property
    def pid_file(self) -> Path:
        return self.root / "supervisor.pid"


def write_json(path: Path, data: Any) -> None:
    """Write atomically (temp file + rename): readers never see half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=str(path.parent))
    try:
        with os.fdopen(fd, "w") as handle:
            json.dump(data, handle, indent=2, sort_keys=True, default=str)
            handle.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_json(path: Path, default: Any = None) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return default
