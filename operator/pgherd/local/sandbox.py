"""`pgherd sandbox`: a PostgresCluster on this machine, driven by the same engine as on Kubernetes."""

from __future__ import annotations

import contextlib
import copy
import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pgherd.local.dsns import SandboxDsns
from pgherd.local.layout import SandboxPaths, read_json, write_json
from pgherd.local.objects import ObjectStore
from pgherd.local.pods import Credentials
from pgherd.local.ports import free_port, free_port_range
from pgherd.local.postgres.resolve import PostgresInstall, PostgresUnavailable, resolve
from pgherd.local.s3server import S3ServerUnavailable, S3Tls, choose_backend
from pgherd.local.state import MemberState, S3Endpoint, SandboxState, binaries_missing
from pgherd_backup.postgres.process import grant_traverse

EMBEDDED_BUCKET = "pgherd"
EMBEDDED_SECRET = "pgherd-sandbox-s3"
# The embedded store's endpointCA: the sandbox's own CA, which signs its S3 server's certificate.
EMBEDDED_CA_SECRET = "pgherd-sandbox-s3-ca"
# Each member is its own `pgherd instance run` process, driven through its API (as on Kubernetes). The
# other mode of old, "inline" (the supervisor driving PostgreSQL itself), was removed.
MEMBER_MODES = ("agent",)


class SandboxError(RuntimeError):
    """A sandbox command that cannot be done; the message says why and what to do."""


@dataclass
class Sandbox:
    root: Path

    @property
    def paths(self) -> SandboxPaths:
        return SandboxPaths(self.root)

    @property
    def objects(self) -> ObjectStore:
        return ObjectStore(self.paths)

    def state(self) -> SandboxState:
        try:
            return SandboxState.load(self.paths)
        except FileNotFoundError as exc:
            raise SandboxError(str(exc)) from None

    # --- up -------------------------------------------------------------------------------------------
    def up(
        self,
        manifest: dict[str, Any],
        *,
        timeout: float = 300,
        restart_delay: float = 10.0,
        members: str = "agent",
    ) -> dict[str, Any]:
        check_members_mode(members)
        if self.paths.state_file.exists():
            raise SandboxError(
                f"a sandbox already exists in {self.root}: `pgherd sandbox apply -f` changes it,"
                f" `pgherd sandbox down --dir {self.root}` removes it"
            )
        if manifest.get("kind") != "PostgresCluster":
            raise SandboxError(
                "`sandbox up` needs a PostgresCluster manifest (apply Backups and Restores later)"
            )
        from pgherd.api.admission import admit  # here: `status` and `down` need no pydantic nor CEL

        spec_doc = manifest.get("spec")
        backup_doc = spec_doc.get("backup") if isinstance(spec_doc, dict) else None
        store = backup_doc.get("store") if isinstance(backup_doc, dict) else None
        s3_doc = store.get("s3") if isinstance(store, dict) else None
        if not all(isinstance(part, dict | None) for part in (spec_doc, backup_doc, store, s3_doc)):
            admit(manifest)  # not an object where the schema wants one: refused, naming the field
        if store is None:
            _require_embedded_s3()  # before anything is written: the supervisor would die at start-up
        s3_port = free_port()
        ca_source: Path | None = None  # an external store's CA file, copied into the sandbox
        if store is None:
            # The embedded S3 server becomes the store, before admission: rules that need a store
            # (recovery.onQuorumLoss: RestoreFromBackup, schedules) then hold. It serves HTTPS with a
            # certificate of the sandbox's own CA, which the store names, as a MinIO with its own CA.
            s3 = S3Endpoint(
                endpoint=f"https://127.0.0.1:{s3_port}",
                access_key="pgherd",
                secret_key=secrets.token_hex(16),
                embedded=True,
                port=s3_port,
                ca_file=str(S3Tls.in_dir(self.paths.s3_tls.resolve()).ca),
            )
            store_url = f"s3://{EMBEDDED_BUCKET}/sandbox"
            manifest = copy.deepcopy(manifest)
            spec_copy = manifest["spec"] = dict(manifest.get("spec") or {})
            backup = spec_copy["backup"] = dict(spec_copy.get("backup") or {})
            backup["store"] = {
                "s3": {
                    "bucket": EMBEDDED_BUCKET,
                    "path": "sandbox",
                    "endpoint": s3.endpoint,
                    "forcePathStyle": True,
                    "credentials": {"secretName": EMBEDDED_SECRET},
                    "endpointCA": {"secretName": EMBEDDED_CA_SECRET},
                }
            }
        else:
            s3_spec = s3_doc or {}
            access = os.environ.get("AWS_ACCESS_KEY_ID")
            secret = os.environ.get("AWS_SECRET_ACCESS_KEY")
            if not access or not secret:
                raise SandboxError(
                    "the manifest's backup.store points to an external S3: export AWS_ACCESS_KEY_ID and"
                    " AWS_SECRET_ACCESS_KEY (the sandbox's stand-in for the credentials Secret)"
                )
            if s3_spec.get("endpointCA") is not None:
                ca_source = _endpoint_ca_file(os.environ.get("AWS_CA_BUNDLE"))
            s3 = S3Endpoint(
                endpoint=s3_spec.get("endpoint")
                or f"https://s3.{s3_spec.get('region', 'us-east-1')}.amazonaws.com",
                access_key=access,
                secret_key=secret,
                region=s3_spec.get("region", "us-east-1"),
                embedded=False,
                ca_file=str(self.paths.s3_ca.resolve()) if ca_source is not None else None,
            )
            store_url = f"s3://{s3_spec.get('bucket')}/{s3_spec.get('path', '')}".rstrip("/")
        admitted = admit(manifest)  # before anything is written: a refused manifest leaves no directory
        postgres = _postgres_of(int(admitted["spec"]["postgresVersion"]))  # likewise
        self.root.mkdir(parents=True, exist_ok=True)
        grant_traverse(self.root)
        if s3.embedded:
            S3Tls.issue(self.paths.s3_tls)
        elif ca_source is not None:
            shutil.copyfile(ca_source, self.paths.s3_ca)
            self.paths.s3_ca.chmod(0o644)  # read by the members' PostgreSQL (archive_command)
        name = admitted["metadata"]["name"]
        spec = admitted["spec"]
        initdb = ((spec.get("bootstrap") or {}).get("initdb")) or {}
        # PostgreSQL's, the agents' and their metrics' ports: three ranges apart, one port per ordinal each
        base_port = free_port_range(16)
        agent_base_port = free_port_range(16)
        state = SandboxState(
            cluster=name,
            base_port=base_port,
            store_url=store_url,
            s3=s3,
            superuser_password=secrets.token_urlsafe(18),
            app_user=initdb.get("owner", "app"),
            app_database=initdb.get("database", "app"),
            app_password=secrets.token_urlsafe(18),
            restart_delay=restart_delay,
            agent_base_port=agent_base_port,
            metrics_base_port=free_port_range(16),
            pg_bindir=str(postgres.bindir),
            pg_libdir=None if postgres.libdir is None else str(postgres.libdir),
            postgres_major=postgres.major,
        )
        state.save(self.paths)
        self.objects.apply(manifest)
        self.start_supervisor()
        return self.wait_for_phase({"Running"}, timeout=timeout, fail_on={"Failed"})

    def start_supervisor(self) -> int:
        if self.supervisor_pid() is not None:
            raise SandboxError(f"a supervisor already runs for {self.root} (pid {self.supervisor_pid()})")
        log = self.paths.supervisor_log.open("ab")
        try:
            process = subprocess.Popen(
                [sys.executable, "-m", "pgherd.local.supervisor", "--dir", str(self.root.resolve())],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                cwd=str(self.root.resolve()),
            )
        finally:
            log.close()
        self.paths.pid_file.write_text(f"{process.pid}\n")
        return process.pid

    def supervisor_pid(self) -> int | None:
        try:
            pid = int(self.paths.pid_file.read_text().strip())
        except (FileNotFoundError, ValueError):
            return None
        return pid if _alive(pid) else None

    def wait_for_phase(
        self,
        phases: set[str],
        *,
        timeout: float,
        fail_on: set[str] = frozenset(),  # type: ignore[assignment]
    ) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        status: dict[str, Any] = {}
        while time.monotonic() < deadline:
            status = self.status()
            if status.get("phase") in phases:
                return status
            if status.get("phase") in fail_on:
                break
            if self.supervisor_pid() is None:
                raise SandboxError(f"the supervisor is not running: see {self.paths.supervisor_log}")
            time.sleep(0.5)
        raise SandboxError(
            f"the cluster is {status.get('phase', 'not reporting')} ({status.get('message', '')}), not"
            f" {'/'.join(sorted(phases))}, after {timeout:.0f}s: see `pgherd sandbox status --dir {self.root}`"
            f" and {self.paths.supervisor_log}"
        )

    # --- status ---------------------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        state = self.state()
        recorded: dict[str, Any] = read_json(self.paths.status_file, {}) or {}
        members = recorded.get("members", [])
        addresses = [(str(m["name"]), int(m["port"])) for m in members] or [
            (f"{state.cluster}-0", state.base_port)
        ]
        dsns = SandboxDsns(self.paths, state, Credentials(self.paths, state))
        rw = dsns.app([port for _, port in addresses], target_session_attrs="read-write")
        objects = self.objects
        return {
            "cluster": state.cluster,
            "phase": recorded.get("phase", "Pending"),
            "message": recorded.get("message", ""),
            "primary": recorded.get("currentPrimary"),
            "targetPrimary": recorded.get("targetPrimary"),
            "instances": recorded.get("instances", 0),
            "readyInstances": recorded.get("readyInstances", 0),
            "timeline": recorded.get("timeline"),
            "members": members,
            "rwDsn": rw,
            "superuserDsn": dsns.superuser(addresses, target_session_attrs="read-write"),
            "conditions": recorded.get("conditions", []),
            "operation": recorded.get("operation"),
            "backups": [
                {
                    "name": b["metadata"]["name"],
                    "phase": (b.get("status") or {}).get("phase", "Pending"),
                    "backupId": (b.get("status") or {}).get("backupId"),
                    "size": (b.get("status") or {}).get("size"),
                    "verified": (b.get("status") or {}).get("verified"),
                    "postgresVersion": (b.get("status") or {}).get("postgresVersion"),
                    "error": (b.get("status") or {}).get("error"),
                }
                for b in objects.backups()
            ],
            "restores": [
                {
                    "name": r["metadata"]["name"],
                    "phase": (r.get("status") or {}).get("phase", "Pending"),
                    "error": (r.get("status") or {}).get("error"),
                    "keptData": (r.get("status") or {}).get("keptData"),
                }
                for r in objects.restores()
            ],
            "postgresVersion": recorded.get("postgresVersion") or state.postgres_major,
            "postgresBin": _bindir_of(recorded.get("postgresVersion"), state),
            "store": state.store_url,
            "s3Endpoint": state.s3.endpoint,
            "supervisorRunning": self.supervisor_pid() is not None,
            "updatedAt": recorded.get("updatedAt"),
        }

    # --- changes ----------------------------------------------------------------------------------------
    def apply(self, manifest: dict[str, Any]) -> str:
        state = self.state()
        if manifest.get("kind") == "PostgresCluster":
            _upgrade_programs(state.postgres_major, manifest)
            stored = self.objects.cluster()
            store = ((stored.get("spec") or {}).get("backup") or {}).get("store")
            spec = manifest.get("spec") or {}
            backup = (spec.get("backup") or {}) if isinstance(spec, dict) else None
            if store is not None and isinstance(backup, dict) and not backup.get("store"):
                # keep the embedded store (anything not an object is left to admission to refuse)
                manifest = {**manifest, "spec": {**spec, "backup": {**backup, "store": store}}}
        return self.objects.apply(manifest)

    def kill(
        self, member: str, *, wipe: bool = False, postgres_only: bool = False, keep_down: bool = False
    ) -> None:
        """kill -9 a member: its agent and PostgreSQL together (a lost pod), or with ``postgres_only``
        PostgreSQL alone (a crashed server under a live agent); ``wipe``: its data directory too;
        ``keep_down``: its pod is not started again until start() (it cannot be scheduled)."""
        from pgherd.local.pods import kill_pod

        self._member(member)
        if keep_down:
            self.paths.member_held(member).touch()
        kill_pod(self.paths, member, postgres_only=postgres_only)
        if wipe:
            shutil.rmtree(self.paths.member_data(member), ignore_errors=True)

    def start(self, member: str) -> None:
        """Let a member kept down by kill(keep_down=True) start again: the platform restarts its pod."""
        self._member(member)
        self.paths.member_held(member).unlink(missing_ok=True)

    def _member(self, member: str) -> None:
        state = self.state()
        known = MemberState.load(self.paths, member)
        if known is None or not self.paths.member_dir(member).exists():
            raise SandboxError(f"no member {member!r} in cluster {state.cluster}")

    def switchover(self, to: str | None, *, timeout: float = 90) -> dict[str, Any]:
        before = self.status()
        if to is not None and to not in {m["name"] for m in before["members"]}:
            raise SandboxError(f"no member {to!r} in cluster {before['cluster']}")
        if to is not None and to == before["primary"]:
            return before
        result_file = self.paths.objects / "switchover-result.json"
        result_file.unlink(missing_ok=True)
        request_id = self.objects.request_switchover(to)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            result = read_json(result_file)
            if result is not None and result.get("id") == request_id:
                status = self.status()
                if result.get("result") != "done":
                    raise SandboxError(f"switchover to {result.get('to')} {result.get('result')}")
                return status
            time.sleep(0.2)
        raise SandboxError(
            f"the switchover did not complete within {timeout:.0f}s: see `pgherd sandbox status`"
        )

    def kill_supervisor(self, at_step: str | None = None, done: int = 0, timeout: float = 120) -> None:
        """SIGKILL the supervisor now, or (``at_step``) arm a crash point and wait until the supervisor
        exits by itself the moment its recorded operation reaches that step with ``done`` members done
        (``timeout`` 0: arm it and return)."""
        pid = self.supervisor_pid()
        if pid is None:
            raise SandboxError("the supervisor is not running")
        if at_step is not None:
            self.paths.crash_reached.unlink(missing_ok=True)
            write_json(self.paths.crash_point, {"step": at_step, "done": done})
            if timeout <= 0:
                return
            deadline = time.monotonic() + timeout
            while _alive(pid):
                if time.monotonic() > deadline:
                    self.paths.crash_point.unlink(missing_ok=True)
                    raise SandboxError(
                        f"the supervisor did not reach step {at_step!r} with {done} done within {timeout:.0f}s"
                    )
                time.sleep(0.05)
            return
        os.kill(pid, signal.SIGKILL)
        for _ in range(50):
            if not _alive(pid):
                return
            time.sleep(0.1)

    def resume(self) -> int:
        state = self.state()
        if state.members != "agent" or state.agent_base_port is None:
            raise SandboxError(
                f"the sandbox in {self.root} runs its members inline, a mode that was removed: remove it "
                f"(`pgherd sandbox down --dir {self.root}`) and create it again"
            )
        missing = binaries_missing(state)
        if missing is not None:
            raise SandboxError(missing)
        if state.s3.embedded:
            _require_embedded_s3()
        return self.start_supervisor()

    def down(self, *, keep_data: bool = False) -> None:
        state = self.state()
        pid = self.supervisor_pid()
        if pid is not None:
            os.kill(pid, signal.SIGTERM)
            for _ in range(100):
                if not _alive(pid):
                    break
                time.sleep(0.1)
            else:
                os.kill(pid, signal.SIGKILL)
        from pgherd.local.jobs import LocalJobs

        for job in LocalJobs(self.paths).all():
            job.kill()
        if self.paths.members.is_dir():
            from pgherd.local.pods import stop_pod

            # Every pod at once: a clean shutdown each, its PostgreSQL killed after a bound.
            stopping = [
                threading.Thread(target=stop_pod, args=(self.paths, folder.name))
                for folder in self.paths.members.iterdir()
            ]
            for thread in stopping:
                thread.start()
            for thread in stopping:
                thread.join()
        if state.s3.embedded and state.s3.pid and _alive(state.s3.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(state.s3.pid, signal.SIGTERM)
        if not keep_data:
            shutil.rmtree(self.root, ignore_errors=True)


def _endpoint_ca_file(bundle: str | None) -> Path:
    """The CA file of an external store's endpointCA: AWS_CA_BUNDLE, the sandbox's stand-in for the
    Secret it names (as AWS_ACCESS_KEY_ID is for the credentials)."""
    if not bundle:
        raise SandboxError(
            "the manifest's backup.store.s3.endpointCA names a Secret holding the S3 endpoint's CA: export"
            " AWS_CA_BUNDLE=<that CA's file> (the sandbox's stand-in for the Secret)"
        )
    path = Path(bundle)
    if not path.is_file():
        raise SandboxError(f"AWS_CA_BUNDLE={bundle}: no such file (the S3 endpoint's CA, PEM)")
    return path


def check_members_mode(members: str) -> None:
    """`--members`: only `agent` remains; the removed `inline` mode is refused with what to do."""
    if members not in MEMBER_MODES:
        raise SandboxError(
            f"--members {members}: the sandbox runs every member on its own agent (`pgherd instance run`);"
            " the inline mode was removed. Drop --members (and PGHERD_SANDBOX_MEMBERS)"
        )


def _bindir_of(major: int | None, state: SandboxState) -> str | None:
    """The bin directory of the major the cluster runs (another than the sandbox's first after an
    upgrade)."""
    if major is None or major == state.postgres_major:
        return state.pg_bindir
    try:
        return str(resolve(major).bindir)
    except PostgresUnavailable:
        return None


def _upgrade_programs(running: int | None, manifest: dict[str, Any]) -> None:
    """A manifest that raises postgresVersion (a major upgrade, admission refuses a lower one) is
    refused before it is stored when the new major's programs are not here (with how to get them):
    the upgrade's preflight would only find out later."""
    spec = manifest.get("spec")
    wanted = spec.get("postgresVersion") if isinstance(spec, dict) else None
    if isinstance(wanted, int) and not isinstance(wanted, bool) and running is not None and wanted > running:
        _postgres_of(wanted)


def _postgres_of(major: int) -> PostgresInstall:
    """The programs of the cluster's major (this machine's, or a fetched wheel's), or SandboxError
    saying how to get them."""
    try:
        return resolve(major)
    except PostgresUnavailable as exc:
        raise SandboxError(str(exc)) from None


def _require_embedded_s3() -> None:
    """The embedded S3 server can run here (the `sandbox` extra's rclone, rclone on PATH, or moto)."""
    try:
        choose_backend()
    except S3ServerUnavailable as exc:
        raise SandboxError(str(exc)) from None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        # Not our child (the supervisor outlives the `up` that started it): once it exited, it stays a
        # zombie until whoever adopted it reaps it, a second or more in a container. It is gone.
        try:
            with open(f"/proc/{pid}/stat") as stat:
                return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
        except (FileNotFoundError, ProcessLookupError):
            return False
        except (OSError, IndexError):
            return True
    return done == 0
