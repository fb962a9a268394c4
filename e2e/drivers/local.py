"""The `local` driver: one `pgherd sandbox` per driver, in its own directory, through the CLI.

Every operation is a `pgherd sandbox ...` command, exactly what a person types; nothing here reaches
into the sandbox's internals. The sandbox's own logs stay in its directory for the failure message.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import psycopg
import yaml

from e2e.driver import ClusterStatus, DriverError, Manifest, ManifestRefused, PollingDriver, member
from pgherd.local.layout import SandboxPaths, read_json

# The sandbox's `up` waits for a Running cluster: initdb plus two base backups on a busy 2-core machine.
UP_TIMEOUT = 180.0
COMMAND_TIMEOUT = 120.0
# How long the sandbox waits before restarting a dead member (kubelet's back-off). Longer than failure
# detection (3 s in the scenarios) so that a killed primary is failed over, not merely restarted in place.
RESTART_DELAY = float(os.environ.get("PGHERD_E2E_RESTART_DELAY", "6"))


def pgherd_command() -> list[str]:
    """The pgherd CLI of this interpreter's environment ($PGHERD_CLI overrides, e.g. an installed binary)."""
    override = os.environ.get("PGHERD_CLI")
    if override:
        return override.split()
    beside = Path(sys.executable).parent / "pgherd"
    return [str(beside)] if beside.exists() else [sys.executable, "-m", "pgherd.cli"]


def installed_postgres_major() -> int:
    """The newest PostgreSQL major installed under /usr/lib/postgresql (what the sandbox runs), else 16."""
    if os.environ.get("PGHERD_E2E_PG_VERSION"):
        return int(os.environ["PGHERD_E2E_PG_VERSION"])
    root = Path("/usr/lib/postgresql")
    majors = [int(p.name) for p in root.iterdir() if p.name.isdigit()] if root.is_dir() else []
    return max(majors, default=16)


class LocalDriver(PollingDriver):
    name = "local"

    def __init__(
        self, workdir: Path, *, command: Sequence[str] | None = None, restart_delay: float = RESTART_DELAY
    ) -> None:
        self.restart_delay = restart_delay
        self.workdir = Path(workdir)
        self.dir = self.workdir / "sandbox"
        self.manifest_dir = self.workdir / "manifests"
        self.manifest_dir.mkdir(parents=True, exist_ok=True)
        self.command = list(command) if command else pgherd_command()
        self.postgres_version = installed_postgres_major()
        self.cluster: str | None = None
        self._cluster_manifest: dict[str, Any] | None = None
        self._applied = 0
        self._armed: tuple[str, int] | None = None
        self._started = False
        self._rw_dsn: str | None = None
        self._member_dsns: dict[str, str] = {}

    # -- running the CLI --------------------------------------------------------------------------------

    def _sandbox(
        self, *args: str, timeout: float = COMMAND_TIMEOUT, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        argv = [*self.command, "sandbox", *args, "--dir", str(self.dir)]
        # Files, not pipes: `up` and `resume` leave a supervisor behind that must not hold our pipes open.
        with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
            try:
                code = subprocess.run(
                    argv, stdout=out, stderr=err, stdin=subprocess.DEVNULL, timeout=timeout
                ).returncode
            except subprocess.TimeoutExpired as exc:
                out.seek(0)
                err.seek(0)
                raise DriverError(
                    f"`{' '.join(argv)}` did not finish within {timeout:.0f} s\n"
                    f"stdout:\n{out.read()[-4000:]}\nstderr:\n{err.read()[-4000:]}\n{self.describe()}"
                ) from exc
            out.seek(0)
            err.seek(0)
            result = subprocess.CompletedProcess(argv, code, out.read(), err.read())
        if check and result.returncode != 0:
            raise DriverError(self._failure(result))
        return result

    def _failure(self, result: subprocess.CompletedProcess[str]) -> str:
        return (
            f"`{' '.join(result.args)}` exited with {result.returncode}\n"
            f"stdout:\n{result.stdout[-4000:]}\nstderr:\n{result.stderr[-4000:]}\n{self.describe()}"
        )

    # -- the Driver interface -----------------------------------------------------------------------------

    def apply(self, manifest: Manifest) -> None:
        doc = dict(manifest)
        kind = str(doc.get("kind"))
        name = str((doc.get("metadata") or {}).get("name"))
        self._applied += 1
        path = self.manifest_dir / f"{self._applied:02d}-{kind.lower()}-{name}.yaml"
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
        first_cluster = kind == "PostgresCluster" and not self._started
        if first_cluster:
            self.cluster = name
            result = self._sandbox(
                "up",
                "-f",
                str(path),
                "--restart-delay",
                str(self.restart_delay),
                "--timeout",
                str(UP_TIMEOUT),  # the sandbox's own message beats our subprocess timeout
                timeout=UP_TIMEOUT + 30,
                check=False,
            )
            self._started = result.returncode == 0 or self.dir.exists()
        else:
            result = self._sandbox("apply", "-f", str(path), check=False)
        if result.returncode != 0:
            old = self._cluster_manifest if kind == "PostgresCluster" and not first_cluster else None
            if _admission_refuses(doc, old):
                raise ManifestRefused(f"{kind} {name!r} refused: {(result.stderr or result.stdout).strip()}")
            raise DriverError(self._failure(result))
        if kind == "PostgresCluster":
            self._cluster_manifest = doc

    def backup_store(self) -> dict[str, Any]:
        stored = read_json(SandboxPaths(self.dir).cluster_object) or {}
        return dict(stored["spec"]["backup"]["store"]["s3"])

    def status(self) -> ClusterStatus:
        result = self._sandbox("status", "--json", timeout=60)
        try:
            status = cast(ClusterStatus, json.loads(result.stdout))
        except json.JSONDecodeError as exc:
            raise DriverError(
                f"`sandbox status --json` printed no JSON: {exc}\n{result.stdout[-2000:]}"
            ) from exc
        if status.get("rwDsn"):
            self._rw_dsn = status["rwDsn"]
        for m in status.get("members") or []:
            if m.get("dsn"):
                self._member_dsns[m["name"]] = str(m["dsn"])
        return status

    def kill(
        self, member: str, wipe: bool = False, keep_down: bool = False, postgres_only: bool = False
    ) -> None:
        """A lost pod (the member's agent and PostgreSQL together); ``postgres_only``: a crashed
        PostgreSQL under a live agent; ``keep_down``: not started again until bring_back()."""
        flags = [
            *(["--wipe"] if wipe else []),
            *(["--postgres-only"] if postgres_only else []),
            *(["--keep-down"] if keep_down else []),
        ]
        self._sandbox("kill", member, *flags)

    def bring_back(self, member: str) -> None:
        self._sandbox("start", member)

    def switchover(self, to: str | None = None) -> None:
        # The sandbox's command returns once the switchover is done (or failed: DriverError).
        self._sandbox("switchover", *(["--to", to] if to else []))

    def kill_operator(self, at_step: str | None = None, done: int = 0) -> None:
        if at_step is None:
            self._sandbox("kill-supervisor")
            return
        self._sandbox(
            "kill-supervisor", "--at-step", at_step, "--done", str(done), "--timeout", "180", timeout=200
        )

    def arm_operator_kill(self, at_step: str, done: int = 0) -> None:
        # The supervisor's own crash point: exact, whatever the machine's load.
        self._sandbox("kill-supervisor", "--at-step", at_step, "--done", str(done), "--no-wait")
        self._armed = (at_step, done)

    def wait_operator_killed(self, timeout: float = 200) -> None:
        # Read from the sandbox's files, not through the CLI: arming again could race with the exit.
        if self._armed is None:
            raise DriverError("no operator kill was armed")
        at_step, done = self._armed
        self._armed = None
        paths = SandboxPaths(self.dir)
        deadline = time.monotonic() + timeout
        while read_json(paths.crash_reached) != {"step": at_step, "done": done}:
            if time.monotonic() > deadline:
                raise DriverError(
                    f"the supervisor did not reach step {at_step!r} with {done} done within {timeout:.0f} s"
                    f"\n{self.describe()}"
                )
            time.sleep(0.05)
        # The crash point exits right after writing it: wait until the process is gone (or a zombie).
        stat = Path(f"/proc/{paths.pid_file.read_text().strip()}/stat")
        while time.monotonic() < deadline:
            try:
                if stat.read_text().rsplit(")", 1)[1].split()[0] == "Z":
                    break
            except (FileNotFoundError, ProcessLookupError):
                break
            time.sleep(0.02)

    def resume_operator(self) -> None:
        self._sandbox("resume", timeout=UP_TIMEOUT)

    def annotate(self, key: str, value: str | None) -> None:
        self._sandbox("annotate", f"{key}={value}" if value is not None else f"{key}-")

    def break_upgrade(self, member: str, major: int) -> None:
        control = self.dir / "members" / member / "upgrade" / f"pgdata-{major}" / "global" / "pg_control"
        if not control.exists():
            raise DriverError(f"{control} does not exist: no upgrade check ran on {member}")
        control.unlink()

    def superuser_value(self, query: str) -> str | None:
        """The one value `query` returns, as the superuser on the primary's Unix socket: the sandbox
        status's superuserDsn (the only place the superuser may log in)."""
        result = self._sandbox("status", "--json", timeout=60)
        dsn = json.loads(result.stdout).get("superuserDsn")
        if not dsn:
            raise DriverError(f"the sandbox status has no superuserDsn\n{self.describe()}")
        with psycopg.connect(dsn, autocommit=True) as conn:
            row = conn.execute(query).fetchone()
        return None if row is None or row[0] is None else str(row[0])

    def rw_dsn(self) -> str:
        # Cached from the last status(): the write loop asks at every reconnect and must not wait on a CLI.
        if self._rw_dsn is None:
            self.status()
        if not self._rw_dsn:
            raise DriverError(f"the sandbox status has no rwDsn\n{self.describe()}")
        return self._rw_dsn

    def member_dsn(self, name: str) -> str:
        if name not in self._member_dsns:
            status = self.status()
            found = member(status, name)
            if found is None or not found.get("dsn"):
                raise DriverError(f"member {name} has no dsn in the sandbox status\n{self.describe()}")
        return self._member_dsns[name]

    def describe(self) -> str:
        lines = [f"local sandbox: {self.dir} (manifests in {self.manifest_dir})"]
        if not self.dir.exists():
            return lines[0] + " (removed)"
        lines.append(
            f"  logs: {self.dir}/supervisor.log, events.log, members/*/postgres.log, members/*/agent.log"
        )
        # Enough of the supervisor's log to cover an operation (a rollout's switchover, a failover).
        for name, count in (("events.log", 20), ("supervisor.log", 80)):
            log = self.dir / name
            if log.exists():
                lines.append(f"  last lines of {name}:")
                lines.extend(f"    {line}" for line in log.read_text(errors="replace").splitlines()[-count:])
        return "\n".join(lines)

    def down(self, *, keep: bool = False) -> None:
        if not (self.dir / "sandbox.json").exists():
            return
        self._sandbox("down", *(["--keep-data"] if keep else []), timeout=COMMAND_TIMEOUT)
        self._started = False


def _admission_refuses(doc: dict[str, Any], old: dict[str, Any] | None) -> bool:
    """Whether pgherd's own admission check refuses the manifest: tells a refusal from a failure."""
    from pgherd.api.admission import ManifestRefused as Refused
    from pgherd.api.admission import admit

    try:
        admit(doc, old=old)
    except Refused:
        return True
    return False
