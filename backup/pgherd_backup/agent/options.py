"""The agent's configuration (from flags and PGHERD_* variables, parsed by `pgherd instance run`) and
the places it keeps things on the member's volume.

Volume layout (the volume is the directory holding the data directory):
  <volume>/<pgdata>           PostgreSQL's data directory
  <volume>/<pgdata>.log       PostgreSQL's log (default)
  <volume>/agent/state.json   what the agent remembers across its restarts (see state.py)
  <volume>/agent/pgpass       the passwords PostgreSQL's clients (walreceiver, pg_basebackup) use
  <volume>/agent/archive-failure  why archive_command (wal-push) last failed, until it succeeds
  <volume>/agent/run/         PostgreSQL's Unix socket: the agent's own connections, no password
  <volume>/kept/<stamp>/      data directories a re-clone replaced: kept on the same volume, never deleted
  <volume>/.pgherd-agent.lock the agent's flock for its life: one agent at a time (volumelock.py)
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from pgherd_backup import logformat
from pgherd_backup.errors import UsageError
from pgherd_backup.postgres import parameters as user_parameters
from pgherd_backup.postgres.config import Setting

if TYPE_CHECKING:
    from pgherd_backup.store import Store

SEED_METHODS = ("none", "initdb", "basebackup", "snapshot")
METRICS_PORT = 9187  # GET /metrics, plain HTTP (docs/monitoring.md)
_MAX_SOCKET_DIR = 90  # AF_UNIX paths are limited to 108 bytes; PostgreSQL adds "/.s.PGSQL.<port>"


@dataclass(frozen=True)
class AgentOptions:
    cluster: str
    member: str
    pgdata: Path
    token_file: Path
    namespace: str | None = None  # the pod's (in its JSON log lines); None outside Kubernetes
    log_format: str = "text"  # text | json (pgherd_backup.logformat)
    listen: str = "0.0.0.0"
    port: int = 8008
    metrics_port: int = METRICS_PORT  # 0: no metrics served
    custom_queries: Path | None = None  # the users' metric queries (YAML), read again when it changes
    pg_port: int = 5432
    pg_listen: str = "*"
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_ca: Path | None = None
    no_tls: bool = False
    # PostgreSQL's own TLS (agent/pgtls.py): its server certificate is --tls-cert/--tls-key, the CA
    # --tls-ca; the replication account authenticates by its client certificate. The --pg-tls-* files,
    # when given, are PostgreSQL's instead (the user's certificates: the agent keeps the cluster CA's).
    pg_tls: bool = False
    replication_cert: Path | None = None
    replication_key: Path | None = None
    pg_tls_cert: Path | None = None
    pg_tls_key: Path | None = None
    pg_tls_ca: Path | None = None  # what --pg-tls-cert chains to: members verify each other by it
    pg_client_ca: Path | None = None  # PostgreSQL's ssl_ca_file: whose client certificates it accepts
    pg_tls_min_version: str = "TLSv1.3"
    superuser_network_access: bool = False
    seed: str = "none"
    upstream: str | None = None
    snapshot: str | None = None
    recovery_target: str | None = None
    store: str | None = None
    superuser: str = "postgres"
    superuser_password_file: Path | None = None
    replication_user: str | None = None  # default: the superuser
    replication_password_file: Path | None = None  # default: the superuser's
    app_user: str | None = None
    app_database: str | None = None
    app_password_file: Path | None = None
    hba: tuple[str, ...] = ()  # pg_hba.conf lines added at initdb (default: password auth from anywhere)
    parameters: Mapping[str, Setting] = field(default_factory=dict)
    parameters_file: Path | None = None  # read again at every start: parameters of a new revision
    revision: str | None = None
    stop_timeout: float = 10.0
    grace_period: float = 30.0
    terminate_wait: float | None = None
    ready_lag_bytes: int = 16 << 20
    # /readyz keeps a replica that lost its upstream this long (status.serving)
    route_grace: float = 10.0
    pg_log: Path | None = None
    start_timeout: float = 120.0
    state_dir: Path | None = None
    kept_dir: Path | None = None

    def __post_init__(self) -> None:
        if self.log_format not in logformat.FORMATS:
            raise UsageError(
                f"--log-format {self.log_format!r}: expected one of {', '.join(logformat.FORMATS)}"
            )
        if self.seed not in SEED_METHODS:
            raise UsageError(f"--seed {self.seed!r}: expected one of {', '.join(SEED_METHODS)}")
        if self.seed == "basebackup" and not self.upstream:
            raise UsageError("--seed basebackup needs --upstream (the member to clone)")
        if self.seed == "snapshot" and not self.store:
            raise UsageError("--seed snapshot needs --store (and the S3 credentials in the environment)")
        if not self.no_tls and not (self.tls_cert and self.tls_key):
            raise UsageError(
                "TLS needs --tls-cert and --tls-key (make them with `pgherd instance certs`); "
                "--no-tls is for tests and the sandbox only"
            )
        if self.pg_tls:
            missing = [
                flag
                for flag, value in (
                    ("--tls-cert", self.tls_cert),
                    ("--tls-key", self.tls_key),
                    ("--tls-ca", self.tls_ca),
                    ("--replication-cert", self.replication_cert),
                    ("--replication-key", self.replication_key),
                    ("--replication-user", self.replication_user),
                )
                if not value
            ]
            if missing:
                raise UsageError(f"--pg-tls needs {', '.join(missing)}")
            if (self.pg_tls_cert is None) != (self.pg_tls_key is None):
                raise UsageError("--pg-tls-cert and --pg-tls-key go together")
            if self.replication_user == self.superuser:
                raise UsageError("--pg-tls needs a replication user other than the superuser")
            if self.pg_tls_min_version not in ("TLSv1.2", "TLSv1.3"):
                raise UsageError("--pg-tls-min-version: TLSv1.2 or TLSv1.3")
        if not self.cluster or not self.member:
            raise UsageError("--cluster and --member are required")
        if not 0 <= self.metrics_port <= 65535:
            raise UsageError(f"--metrics-port {self.metrics_port}: a port number, or 0 to serve no metrics")

    @property
    def volume(self) -> Path:
        return self.pgdata.parent

    @property
    def agent_dir(self) -> Path:
        return self.state_dir or self.volume / "agent"

    @property
    def state_file(self) -> Path:
        return self.agent_dir / "state.json"

    @property
    def tls_dir(self) -> Path:
        return self.agent_dir / "tls"

    @property
    def passfile(self) -> Path:
        return self.agent_dir / "pgpass"

    @property
    def archive_failure_file(self) -> Path:
        """Why wal-push last failed (written by archive_command, read for /status)."""
        return self.agent_dir / "archive-failure"

    @property
    def socket_dir(self) -> Path:
        return socket_dir(self.agent_dir, self.pgdata)

    @property
    def wal_socket(self) -> Path:
        return self.socket_dir / "wal.sock"

    @property
    def skip_archive_file(self) -> Path:
        """While it exists, a standby's restore_command answers "not archived" unasked (Instance.skip_archive)."""
        return self.socket_dir / "skip-archive"

    @property
    def kept(self) -> Path:
        return self.kept_dir or self.volume / "kept"

    @property
    def log_file(self) -> Path:
        return self.pg_log or self.volume / f"{self.pgdata.name}.log"

    @property
    def replication_role(self) -> str:
        return self.replication_user or self.superuser

    def open_store(self) -> Store:
        """The member's backup store (--store, --cluster), with the S3 settings of the environment."""
        from pgherd_backup.store import S3Settings, Store, StoreLocation

        if not self.store:
            raise UsageError("no backup store: the agent runs without --store")
        return Store(StoreLocation.parse(self.store, self.cluster), S3Settings.from_env())

    @property
    def wait_for_switchover(self) -> float:
        """How long a terminating primary waits for the operator: what the grace period leaves after a
        CHECKPOINT, a fast shutdown and an immediate one, each bounded by --stop-timeout."""
        if self.terminate_wait is not None:
            return max(0.0, self.terminate_wait)
        return max(0.0, self.grace_period - 2 * self.stop_timeout - 3)


def socket_dir(agent_dir: Path, pgdata: Path) -> Path:
    """Where a member's PostgreSQL listens on its Unix socket: `<agent dir>/run`, or a short path of
    /tmp when that would be too long for AF_UNIX."""
    inside = agent_dir / "run"
    if len(str(inside)) <= _MAX_SOCKET_DIR:
        return inside
    digest = hashlib.sha256(str(pgdata).encode()).hexdigest()[:16]
    return Path("/tmp") / f"pgherd-{digest}"


def read_parameters(path: Path) -> dict[str, Setting]:
    """PostgreSQL parameters from a file: `name = value` lines ('#' comments), as postgresql.conf.
    What no user may set (pgherd's own settings, commands, paths: pgherd_backup.postgres.parameters)
    is refused, whoever wrote the file."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise UsageError(f"cannot read the parameters file {path} ({exc.strerror})") from None
    try:
        return dict(user_parameters.parse(text, str(path)))
    except user_parameters.ParameterError as exc:
        raise UsageError(str(exc)) from None
