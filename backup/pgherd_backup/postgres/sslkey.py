"""A client key libpq will use. libpq refuses a private key file that others may read: one owned by
root with more than u=rw,g=r (0640), any other with more than u=rw (0600). A key mounted from a Secret
is root's, group-readable through fsGroup, which passes; but under a user namespace (or another
kubelet's defaults) root shows as another owner and the same file is refused. Such a key is copied into
a private file (0600, in a 0700 directory) for the connection's lifetime, as the agent copies its own
(agent/pgtls.py)."""

from __future__ import annotations

import contextlib
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

from pgherd_backup.agent.tls import write_private


def libpq_accepts(path: Path) -> bool:
    """libpq's own rule on a client key's mode (fe-secure-openssl.c)."""
    info = path.stat()
    if info.st_uid == 0:
        return not info.st_mode & (stat.S_IWGRP | stat.S_IXGRP | stat.S_IRWXO)
    return not info.st_mode & (stat.S_IRWXG | stat.S_IRWXO)


@contextlib.contextmanager
def usable_sslkey(dsn: str) -> Iterator[str]:
    """`dsn` itself, or, when its `sslkey` is a file libpq would refuse, `dsn` with a private copy of
    it (removed on exit). A key that cannot be read is left to libpq, which says why."""
    from psycopg.conninfo import conninfo_to_dict, make_conninfo

    key = conninfo_to_dict(dsn).get("sslkey")
    try:
        refused = bool(key) and not libpq_accepts(Path(str(key)))
        data = Path(str(key)).read_bytes() if refused else b""
    except OSError:
        refused = False
    if not refused:
        yield dsn
        return
    with tempfile.TemporaryDirectory(prefix="pgherd-sslkey-") as folder:
        copy = Path(folder) / "client.key"
        write_private(copy, data)
        yield make_conninfo(dsn, sslkey=str(copy))
