"""The sandbox's platform state: what a Kubernetes cluster would hold (ports, secrets, pod state)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from pgherd.local.layout import SandboxPaths, read_json, write_json
from pgherd.local.postgres.pins import pinned
from pgherd.local.postgres.resolve import fetch_command, postgres_environment


@dataclass
class S3Endpoint:
    endpoint: str
    access_key: str
    secret_key: str
    region: str = "us-east-1"
    embedded: bool = True
    pid: int | None = None
    port: int | None = None
    # The CA an https endpoint is verified with (the store's endpointCA); None: the system's CAs.
    ca_file: str | None = None

    def env(self) -> dict[str, str]:
        env = {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_REGION": self.region,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
        }
        if self.ca_file:
            env["AWS_CA_BUNDLE"] = self.ca_file
        return env


@dataclass
class SandboxState:
    """sandbox.json: fixed at `up`, read by every command and the supervisor."""

    cluster: str
    base_port: int
    store_url: str  # s3://bucket/path
    s3: S3Endpoint
    superuser_password: str
    app_user: str
    app_database: str
    app_password: str
    restart_delay: float = 10.0
    tick: float = 0.25  # seconds between two observations of a steady cluster (0.2 while acting)
    # The PostgreSQL programs every member and job runs (PG_BIN), resolved from spec.postgresVersion at
    # `up` (pgherd.local.postgres); None only in a sandbox from before: the newest of this machine.
    pg_bindir: str | None = None
    pg_libdir: str | None = None  # a fetched wheel's own libraries (LD_LIBRARY_PATH); None: the system's
    postgres_major: int | None = None  # the major those programs are, fixed for the sandbox's life
    # The agents' ports, one per ordinal like base_port (None only in a sandbox from before the agents).
    agent_base_port: int | None = None
    # The agents' metrics ports (GET /metrics), one per ordinal; None in a sandbox from before: none served.
    metrics_base_port: int | None = None
    # Every member is its own `pgherd instance run` process; "inline" (the supervisor driving
    # PostgreSQL itself) was removed: a sandbox still marked so is refused with what to do.
    members: str = "agent"

    def postgres_env(self) -> dict[str, str]:
        """The environment variables that make the agents and jobs run the sandbox's PostgreSQL."""
        return postgres_environment(self.pg_bindir, self.pg_libdir)

    def port_of(self, ordinal: int) -> int:
        return self.base_port + ordinal

    def agent_port_of(self, ordinal: int) -> int:
        if self.agent_base_port is None:
            raise ValueError("this sandbox has no agent ports (it ran its members inline): create it again")
        return self.agent_base_port + ordinal

    def metrics_port_of(self, ordinal: int) -> int | None:
        return None if self.metrics_base_port is None else self.metrics_base_port + ordinal

    def save(self, paths: SandboxPaths) -> None:
        write_json(paths.state_file, asdict(self))

    @classmethod
    def load(cls, paths: SandboxPaths) -> SandboxState:
        data = read_json(paths.state_file)
        if data is None:
            raise FileNotFoundError(
                f"no sandbox in {paths.root}: run `pgherd sandbox up -f FILE --dir {paths.root}`"
            )
        data["s3"] = S3Endpoint(**data["s3"])
        return cls(**data)


def binaries_missing(state: SandboxState) -> str | None:
    """Why the sandbox's PostgreSQL programs cannot run any more (a fetched major deleted from the
    cache, a package removed), with how to get them back; None when they are there."""
    if state.pg_bindir is None or Path(state.pg_bindir, "postgres").is_file():
        return None
    major = state.postgres_major
    how = "install them again"
    if state.pg_libdir is not None and major is not None and pinned(major) is not None:
        how = f"run `{fetch_command(major)}`"  # a fetched major: fetched again into the same place
    return f"PostgreSQL {major}'s programs are gone from {state.pg_bindir}: {how}"


@dataclass
class MemberState:
    """A member's platform state, like a pod's: the supervisor is its only writer."""

    name: str
    ordinal: int
    port: int
    revision: str | None = None
    fenced: bool = False
    demoted: bool = False  # fenced, and started read-only on the engine's Demote: it may run
    wanted: bool = True  # the platform keeps it running (False: deleted or stopped on purpose)
    restart_at: float | None = None  # monotonic-free wall time of the next restart attempt
    restarts: int = 0
    cloned_from: str | None = None  # unused since the members run on agents (read from older files)
    notes: list[str] = field(default_factory=list)

    def save(self, paths: SandboxPaths) -> None:
        write_json(paths.member_state(self.name), asdict(self))

    @classmethod
    def load(cls, paths: SandboxPaths, name: str) -> MemberState | None:
        data: dict[str, Any] | None = read_json(paths.member_state(name))
        if data is None:
            return None
        # A file written before may hold fields since removed (``seed``: its pod's seed flags, before
        # the actuator seeded the members): read past them.
        known = {f.name for f in fields(cls)}
        return cls(**{key: value for key, value in data.items() if key in known})
