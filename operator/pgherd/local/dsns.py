"""The sandbox's connection strings, one way for the supervisor and for `sandbox status`.

As on Kubernetes: applications by TLS, verifying the server against the sandbox's CA (the members'
certificates carry 127.0.0.1); the superuser on the members' Unix sockets only; the snapshot Jobs by
the replication account's client certificate.
"""

from __future__ import annotations

from collections.abc import Sequence

from pgherd.local.layout import SandboxPaths
from pgherd.local.pods import REPLICATION_USER, Credentials
from pgherd.local.state import SandboxState
from pgherd_backup.agent.options import socket_dir


def _quote(value: str) -> str:
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _dsn(parts: dict[str, str]) -> str:
    return " ".join(f"{key}={_quote(value)}" for key, value in parts.items())


class SandboxDsns:
    def __init__(self, paths: SandboxPaths, state: SandboxState, credentials: Credentials) -> None:
        self.paths, self.state, self.credentials = paths, state, credentials

    def app(self, ports: Sequence[int], **extra: str) -> str:
        """The application's account through TLS (verify-full), to these members in turn."""
        return _dsn(
            {
                "host": ",".join("127.0.0.1" for _ in ports),
                "port": ",".join(str(p) for p in ports),
                "user": self.state.app_user,
                "password": self.state.app_password,
                "dbname": self.state.app_database,
                "sslmode": "verify-full",
                "sslrootcert": str(self.credentials.ca),
                "connect_timeout": "2",
                **extra,
            }
        )

    def superuser(self, members: Sequence[tuple[str, int]], dbname: str = "postgres", **extra: str) -> str:
        """The superuser on the members' Unix sockets ((name, port) each)."""
        sockets = [
            str(socket_dir(self.paths.member_dir(n) / "agent", self.paths.member_data(n))) for n, _ in members
        ]
        return _dsn(
            {
                "host": ",".join(sockets),
                "port": ",".join(str(p) for _, p in members),
                "user": "postgres",
                "dbname": dbname,
                "connect_timeout": "2",
                **extra,
            }
        )

    def replication(self, port: int) -> str:
        """The replication account by its client certificate (a snapshot Job's source)."""
        return _dsn(
            {
                "host": "127.0.0.1",
                "port": str(port),
                "user": REPLICATION_USER,
                "dbname": "postgres",
                "sslmode": "verify-ca",
                "sslrootcert": str(self.credentials.ca),
                "sslcert": str(self.credentials.replication_cert),
                "sslkey": str(self.credentials.replication_key),
                "connect_timeout": "5",
            }
        )
