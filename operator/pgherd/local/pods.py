"""The sandbox's pods: one `pgherd instance run` process per member, and the cluster's credentials.

This is the kubelet's part of the sandbox: start a member's agent with its flags, say
whether it still runs, stop it (SIGTERM, then SIGKILL after a bound) or kill it with its PostgreSQL (a
lost pod). It knows processes, directories and ports; what happens inside a member is the agent's.

An agent runs in its own session, so that it outlives the supervisor (a restarted operator finds its
pods running); its pid is kept in the member's folder with the command line it was started with.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from datetime import datetime, timedelta
from pathlib import Path

from pgherd.api.annotations import ROTATE_CERTIFICATES
from pgherd.local.layout import SandboxPaths
from pgherd.local.state import SandboxState
from pgherd_backup.agent.client import AgentClient, Connections
from pgherd_backup.agent.tls import certificate_facts, write_private
from pgherd_backup.postgres import postmaster

# Every ordinal the cluster may use gets a certificate at once: members added later need no new CA.
MAX_MEMBERS = 16
# The replication account, as on Kubernetes: by its client certificate, never the superuser.
REPLICATION_USER = "streaming_replica"
STOP_BOUND = 20.0  # SIGTERM -> SIGKILL; a replica stops at once, a primary checkpoints first


def pgherd_command() -> list[str]:
    """The pgherd CLI of this installation."""
    beside = Path(sys.executable).with_name("pgherd")
    return [str(beside)] if beside.exists() else [sys.executable, "-m", "pgherd.cli"]


class Credentials:
    """`pgherd instance certs` output in <sandbox>/certs (0700, files 0600), plus the sandbox's own
    passwords written beside it, so that the agents and `sandbox status` DSNs agree."""

    def __init__(self, paths: SandboxPaths, state: SandboxState) -> None:
        self.folder = paths.root / "certs"
        self.state = state

    @property
    def ca(self) -> Path:
        return self.folder / "ca.crt"

    @property
    def token(self) -> str:
        return (self.folder / "token").read_text().strip()

    def cert(self, member: str) -> tuple[Path, Path]:
        return self.folder / f"{member}.crt", self.folder / f"{member}.key"

    @property
    def token_digest(self) -> Path:
        return self.folder / "token.sha256"

    @property
    def superuser_password(self) -> Path:
        return self.folder / "superuser-password"

    @property
    def app_password(self) -> Path:
        return self.folder / "app-password"

    @property
    def replication_password(self) -> Path:
        return self.folder / "replication-password"

    @property
    def replication_cert(self) -> Path:
        return self.folder / f"{REPLICATION_USER}.client.crt"

    @property
    def replication_key(self) -> Path:
        return self.folder / f"{REPLICATION_USER}.client.key"

    @property
    def rotated_for(self) -> Path:
        """The value of pgherd.io/rotate-certificates the certificates were last issued for."""
        return self.folder / "rotated-for"

    def _issue(self, lifetime: timedelta | None = None) -> None:
        """Every member's certificate and the replication account's, issued (again) by the CA in place,
        valid for `lifetime` (spec.tls.certificateLifetime)."""
        names = [f"{self.state.cluster}-{i}" for i in range(MAX_MEMBERS)]
        command = [*pgherd_command(), "instance", "certs", "--cluster", self.state.cluster]
        command += ["--out", str(self.folder)]
        if lifetime is not None:
            command += ["--lifetime", f"{int(lifetime.total_seconds())}s"]
        for name in names:
            command += ["--member", name]
        command += ["--client", REPLICATION_USER]
        result = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
        if result.returncode != 0:
            raise RuntimeError(f"pgherd instance certs failed: {result.stderr.strip()[-500:]}")

    def renewal(self, request: str | None, lifetime: timedelta, now: datetime) -> str | None:
        """Why the certificates must be issued again, as on Kubernetes, or None: asked for by a value of
        pgherd.io/rotate-certificates not seen at the last renewal, two thirds of their lifetime
        passed, or valid longer than `lifetime` now asks."""
        if request is not None and not (
            self.rotated_for.exists() and self.rotated_for.read_text().strip() == request
        ):
            return f"asked for by {ROTATE_CERTIFICATES}={request}"
        facts = [
            certificate_facts(path.read_text())
            for path in (self.cert(f"{self.state.cluster}-0")[0], self.replication_cert)
        ]
        if any(now >= f.renew_at for f in facts):
            return "two thirds of their lifetime have passed"
        if any(f.not_after - now > lifetime for f in facts):
            return f"valid longer than the certificateLifetime of {lifetime}"
        return None

    def renew(self, request: str | None, lifetime: timedelta, now: datetime) -> str | None:
        """The members' and the replication account's certificates issued again (the CA and token kept)
        in place, where the agents pick them up without a restart, when `renewal` says why: the why."""
        why = self.renewal(request, lifetime, now)
        if why is None:
            return None
        self._issue(lifetime)
        if request is not None:
            write_private(self.rotated_for, (request + "\n").encode())
        return why

    def ensure(self, lifetime: timedelta | None = None) -> None:
        if not (self.folder / "token").exists() or not self.replication_cert.exists():
            self._issue(lifetime)
        # The sandbox's passwords (sandbox.json) are the ones its DSNs print: the agents use them.
        for path, value in (
            (self.superuser_password, self.state.superuser_password),
            (self.app_password, self.state.app_password),
        ):
            if not path.exists() or path.read_text().strip() != value:
                path.unlink(missing_ok=True)
                write_private(path, (value + "\n").encode())


class Pods:
    """The agent processes of a sandbox's members."""

    def __init__(self, paths: SandboxPaths, state: SandboxState, credentials: Credentials) -> None:
        self.paths = paths
        self.state = state
        self.credentials = credentials
        self._children: dict[str, subprocess.Popen[bytes]] = {}
        self._clients: dict[tuple[str, int], AgentClient] = {}
        self._connections = Connections()  # the /status polls' kept connections (the process' own)

    # -- where things are ------------------------------------------------------------------------------
    def pid_file(self, name: str) -> Path:
        return self.paths.member_dir(name) / "agent.pid"

    def log_file(self, name: str) -> Path:
        return self.paths.member_dir(name) / "agent.log"

    def parameters_file(self, name: str) -> Path:
        return self.paths.member_dir(name) / "parameters.conf"

    def url(self, ordinal: int) -> str:
        return f"https://127.0.0.1:{self.state.agent_port_of(ordinal)}"

    def metrics_url(self, ordinal: int) -> str | None:
        port = self.state.metrics_port_of(ordinal)
        return None if port is None else f"http://127.0.0.1:{port}/metrics"

    def client(self, name: str, ordinal: int) -> AgentClient:
        """The member's agent client, made once (its TLS context loads the CA; each call connects)."""
        key = (name, ordinal)
        client = self._clients.get(key)
        if client is None:
            # Connecting by IP: the certificate is checked against the member's name.
            client = self._clients[key] = AgentClient(
                self.url(ordinal),
                ca_file=self.credentials.ca,
                token=self.credentials.token,
                server_hostname=name,
                action_timeout=60.0,
                connections=self._connections,
            )
        return client

    # -- the pod's life ---------------------------------------------------------------------------------
    def command(self, name: str, ordinal: int, revision: str | None) -> list[str]:
        cert, key = self.credentials.cert(name)
        command = [
            *pgherd_command(),
            "instance",
            "run",
            "--cluster",
            self.state.cluster,
            "--member",
            name,
            "--pgdata",
            str(self.paths.member_data(name)),
            "--pg-log",
            str(self.paths.member_log(name)),
            "--listen",
            "127.0.0.1",
            "--port",
            str(self.state.agent_port_of(ordinal)),
            "--pg-port",
            str(self.state.port_of(ordinal)),
            "--metrics-port",  # 0: a sandbox made before the agents served metrics has no ports for them
            str(self.state.metrics_port_of(ordinal) or 0),
            "--pg-listen",
            "127.0.0.1",
            "--tls-cert",
            str(cert),
            "--tls-key",
            str(key),
            "--tls-ca",
            str(self.credentials.ca),
            "--token-file",
            str(self.credentials.token_digest),
            "--superuser-password-file",
            str(self.credentials.superuser_password),
            "--replication-user",
            REPLICATION_USER,
            "--replication-password-file",
            str(self.credentials.replication_password),
            "--pg-tls",
            "--replication-cert",
            str(self.credentials.replication_cert),
            "--replication-key",
            str(self.credentials.replication_key),
            "--app-user",
            self.state.app_user,
            "--app-database",
            self.state.app_database,
            "--app-password-file",
            str(self.credentials.app_password),
            "--parameters-file",
            str(self.parameters_file(name)),
            "--store",
            self.state.store_url,
            "--stop-timeout",
            "5",
            # A terminating primary waits for a switchover only on Kubernetes: the sandbox deletes
            # members the engine chose, never its primary.
            "--terminate-wait",
            "0",
        ]
        if revision:
            command += ["--revision", revision]
        return command

    def start(self, name: str, ordinal: int, revision: str | None, env: Mapping[str, str]) -> int:
        """Start the member's agent (no-op when it runs); its pid. Its agent seeds nothing on its own
        (``--seed none``): an empty volume waits for the actuator's seed, as on Kubernetes."""
        running = self.pid(name)
        if running is not None:
            return running
        folder = self.paths.member_dir(name)
        folder.mkdir(parents=True, exist_ok=True)
        environment = {**os.environ, **env, **self.state.postgres_env()}
        with self.log_file(name).open("ab") as log:
            process = subprocess.Popen(
                self.command(name, ordinal, revision),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=environment,
                cwd=str(folder),
            )
        self._children[name] = process
        self.pid_file(name).write_text(f"{process.pid}\n")
        return process.pid

    def pid(self, name: str) -> int | None:
        """The pid of the member's running agent, else None."""
        child = self._children.get(name)
        if child is not None:
            if child.poll() is None:
                return child.pid
            del self._children[name]  # reaped: a dead pod
            return None
        try:
            pid = int(self.pid_file(name).read_text().strip())
        except (OSError, ValueError):
            return None
        return pid if _is_agent_of(pid, name) else None

    def running(self, name: str) -> bool:
        return self.pid(name) is not None

    def started_at(self, name: str) -> float | None:
        """When the member's agent was last started (wall time), None if never."""
        try:
            return self.pid_file(name).stat().st_mtime
        except OSError:
            return None

    def stop(self, name: str, bound: float = STOP_BOUND) -> None:
        """SIGTERM (a clean shutdown of PostgreSQL), then SIGKILL of the pod after `bound`."""
        pid = self.pid(name)
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + bound
            while time.monotonic() < deadline and self.pid(name) is not None:
                time.sleep(0.1)
        self.kill(name)

    def kill(self, name: str) -> None:
        """SIGKILL the agent and its PostgreSQL together: a lost pod."""
        pid = self.pid(name)
        if pid is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            child = self._children.pop(name, None)
            if child is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    child.wait(5)
        # PostgreSQL runs in a session of its own (the agent starts it through pg_ctl): kill it too.
        postmaster.kill(self.paths.member_data(name))


def kill_pod(paths: SandboxPaths, name: str, *, postgres_only: bool = False) -> None:
    """What `pgherd sandbox kill` does, from another process than the supervisor."""
    if not postgres_only:
        try:
            pid = int((paths.member_dir(name) / "agent.pid").read_text().strip())
        except (OSError, ValueError):
            pid = None
        if pid is not None and _is_agent_of(pid, name):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    postmaster.kill(paths.member_data(name))


def stop_pod(paths: SandboxPaths, name: str, bound: float = STOP_BOUND) -> None:
    """SIGTERM a member's agent and wait (`sandbox down`), SIGKILL after `bound`."""
    try:
        pid = int((paths.member_dir(name) / "agent.pid").read_text().strip())
    except (OSError, ValueError):
        return
    if not _is_agent_of(pid, name):
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + bound
    while time.monotonic() < deadline and _is_agent_of(pid, name):
        time.sleep(0.1)
    kill_pod(paths, name)


def _is_agent_of(pid: int, name: str) -> bool:
    """`pid` runs `pgherd instance run --member name` (not a recycled pid), and is not a zombie."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    if stat.rsplit(")", 1)[-1].split()[0] == "Z":
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
        return False
    return b"instance" in argv and name.encode() in argv
