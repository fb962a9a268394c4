"""PostgreSQL's TLS on a member (`--pg-tls`): its certificates, its pg_hba, and how it reaches others.

- The server certificate and key (the agent's own, `--tls-cert/--tls-key`, unless `--pg-tls-cert/
  --pg-tls-key` give PostgreSQL the user's), the CA that certificate chains to (`--pg-tls-ca`, else the
  cluster CA `--tls-ca`: how members verify each other), the CAs whose client certificates PostgreSQL
  accepts (`--pg-client-ca`, else the cluster CA) and the replication account's client certificate
  (`--replication-cert/--replication-key`) are copied into `<agent dir>/tls` (0600, PostgreSQL's
  account): PostgreSQL and libpq refuse a key others may read, and a mounted Secret is read-only and
  root's. They are copied again when their source changes (a renewed Secret): the caller reloads.
- pg_hba.conf is written whole at every start: `hostssl` rules only, so that every plain TCP
  connection is refused (PostgreSQL's own "no encryption" message); replication and pg_rewind by
  client certificate alone; the superuser only on the Unix socket unless asked; scram-sha-256 for
  everyone else.
- Another member is reached with `sslmode=verify-ca` against the CA of the members' server certificate
  and with the replication certificate: only this cluster's members hold a certificate that CA signed
  (the cluster CA, or the user's, which the user keeps for these names). An upstream that does not
  speak TLS at all (a member of the same cluster still running a pgherd from before TLS, during the
  rollout that moves it to TLS) is reached as before, by password.
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import struct
from dataclasses import dataclass
from pathlib import Path

from pgherd_backup.agent.tls import write_private
from pgherd_backup.postgres.config import Setting
from pgherd_backup.postgres.process import give_to_pg, make_pg_dir

log = logging.getLogger("pgherd.agent")

TLS_VERSIONS = ("TLSv1.2", "TLSv1.3")
_SSL_REQUEST = struct.pack("!ii", 8, 80877103)


@dataclass(frozen=True)
class PgTlsFiles:
    server_cert: Path
    server_key: Path
    server_ca: Path  # what the server certificate chains to: sslrootcert towards other members
    client_ca: Path  # ssl_ca_file: whose client certificates PostgreSQL accepts
    client_cert: Path
    client_key: Path


class PgTls:
    """The member's TLS files for PostgreSQL and libpq, kept in `folder`."""

    def __init__(self, folder: Path, sources: PgTlsFiles, min_version: str = "TLSv1.3") -> None:
        if min_version not in TLS_VERSIONS:
            raise ValueError(f"the minimum TLS version must be one of {', '.join(TLS_VERSIONS)}")
        self.folder = folder
        self.sources = sources
        self.min_version = min_version
        self.files = PgTlsFiles(
            server_cert=folder / "server.crt",
            server_key=folder / "server.key",
            server_ca=folder / "ca.crt",
            client_ca=folder / "client-ca.crt",
            client_cert=folder / "replication.crt",
            client_key=folder / "replication.key",
        )
        self._installed: str | None = None

    def install(self) -> bool:
        """Copy the sources in when they changed; True when the copies changed (PostgreSQL should
        reload). A source that cannot be read keeps the last copies (a Secret being swapped)."""
        pairs = list(zip(_fields(self.sources), _fields(self.files), strict=True))
        try:
            contents = [source.read_bytes() for source, _ in pairs]
        except OSError as exc:
            if self._installed is None and not all(copy.exists() for _, copy in pairs):
                raise
            log.warning("cannot read a TLS file (%s): keeping the certificates in place", exc)
            return False
        digest = hashlib.sha256(b"\0".join(contents)).hexdigest()
        if digest == self._installed:
            return False
        make_pg_dir(self.folder, mode=0o700)
        for (_, copy), data in zip(pairs, contents, strict=True):
            if not copy.exists() or copy.read_bytes() != data:
                write_private(copy, data)
                give_to_pg(copy)
        changed = self._installed is not None
        self._installed = digest
        return changed

    def settings(self) -> dict[str, Setting]:
        return {
            "ssl": True,
            "ssl_cert_file": str(self.files.server_cert),
            "ssl_key_file": str(self.files.server_key),
            "ssl_ca_file": str(self.files.client_ca),
            "ssl_min_protocol_version": self.min_version,
        }

    def client_params(self) -> dict[str, str]:
        """libpq's parameters for a connection to another member of the cluster."""
        return {
            "sslmode": "verify-ca",
            "sslrootcert": str(self.files.server_ca),
            "sslcert": str(self.files.client_cert),
            "sslkey": str(self.files.client_key),
        }


def hba_lines(
    *, superuser: str, replication: str, superuser_network: bool, extra: tuple[str, ...] = ()
) -> list[str]:
    """pg_hba.conf with TLS: the first matching line decides, and a plain TCP connection matches none."""
    lines = [
        "# Written by pgherd at every start: edit the PostgresCluster, not this file.",
        "# The Unix socket lives in a directory only PostgreSQL's account can reach: pgherd's own tools.",
        "local all all trust",
        *extra,
        f"hostssl replication {replication} all cert",
        f"hostssl all {replication} all cert",  # pg_rewind reads files over a normal connection
    ]
    if superuser != replication:
        rule = "scram-sha-256" if superuser_network else "reject"
        lines.append(f"hostssl all {superuser} all {rule}")
    lines.append("hostssl all all all scram-sha-256")
    return lines


def write_hba(pgdata: Path, lines: list[str]) -> None:
    path = pgdata / "pg_hba.conf"
    tmp = pgdata / ".pg_hba.conf.tmp"
    tmp.write_text("".join(line + "\n" for line in lines))
    os.chmod(tmp, 0o600)
    give_to_pg(tmp)
    os.replace(tmp, path)


def speaks_tls(host: str, port: int, timeout: float = 3.0) -> bool | None:
    """Whether the PostgreSQL at host:port accepts TLS (its answer to an SSLRequest); None when it
    could not be asked (not listening, no answer)."""
    try:
        with socket.create_connection((host, port), timeout=timeout) as conn:
            conn.sendall(_SSL_REQUEST)
            answer = conn.recv(1)
    except OSError:
        return None
    if answer == b"S":
        return True
    if answer == b"N":
        return False
    return None


def _fields(files: PgTlsFiles) -> list[Path]:
    return [
        files.server_cert,
        files.server_key,
        files.server_ca,
        files.client_ca,
        files.client_cert,
        files.client_key,
    ]
