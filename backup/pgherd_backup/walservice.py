"""A local answer to restore_command's most frequent question (is this WAL file archived at all?),
and archive_command's push without a process of its own.

A standby whose upstream is gone polls the archive for its next segment, and at every timeline switch
PostgreSQL probes the archive for a history file that does not exist yet. Through `pgherd-backup
wal-fetch` each probe starts a Python process: 0.2-0.5 s on a loaded machine, and several of them sit
inside the write outage of a failover or a switchover (the promoted member's promote request waits for
the poll in flight, its new timeline waits for a probe, the other replicas wait for another one).

This service keeps one warm S3 client and answers over a Unix socket:

    GET /wal/<name>?pgdata=<data directory>       404: not archived, 200: archived, 400/503: no answer
    POST /archive/<name>?pgdata=<data directory>  200: pg_wal/<name> archived (as wal-push does it)

restore_command asks it with curl (milliseconds) and takes only a 404 as "not archived"; on 200, and
whenever the service does not answer, it runs wal-fetch, which downloads, checks and prefetches as
before. So the service being down, absent, or curl missing, changes the speed and nothing else.

archive_command asks it to push a file PostgreSQL handed over (its `.ready` mark) and takes only a
200 as done; anything else runs wal-push. A primary's shutdown waits for its archiver (PostgreSQL
switches to a new segment at shutdown and archives the last one), so wal-push's start-up was part of
every switchover's outage. The S3 connections are kept between requests (s3lite's idle pool).

A segment's miss is remembered for MISS_TTL: a standby without its upstream asks for the same segment
at every retry, and again inside a failover's timeline switch (an S3 HEAD each, 20-140 ms on
localkube). One archived meanwhile is found at most MISS_TTL later; until then PostgreSQL tries
streaming and comes back to the archive, as it does for any file not archived yet. Only for a standby
(standby.signal in its data directory): an archive recovery (a restore) ends at its first miss, which
must not be one from a moment before. A history file's miss is never remembered: a promotion chooses
its new timeline as one whose history the archive does not hold, and a stale answer could let two
promotions choose the same.

For the same MISS_TTL after a history file lands in a standby's pg_wal (its WAL receiver stores the
new timeline's when the upstream was promoted), a segment is answered "not archived" unasked: the
standby asks for the one it reads, on the new timeline and on the old, before it streams again from an
upstream that has both; each HEAD then competed with the new primary's uploads of the same moment
(26-113 ms on localkube, with the first quorum commit after a switchover waiting for it). An answer
that is wrong costs the same as a remembered miss: a try at streaming, then the archive again. Neither
answer is given while the agent promotes its PostgreSQL (`promoting`): the end of a standby's recovery
reads what the archive holds, and a stale "not archived" would end it short of WAL the archive has.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import socketserver
import threading
import time
import urllib.parse
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

from pgherd_backup.errors import BackupError
from pgherd_backup.layout import Layout
from pgherd_backup.postgres.control import read_system_id
from pgherd_backup.store import Store
from pgherd_backup.wal import note_archive_outcome, push
from pgherd_backup.walnames import is_wal_name

# AF_UNIX paths are limited to 108 bytes; a longer one is replaced by a short one under /tmp.
_MAX_SOCKET_PATH = 100
MISS_TTL = 1.0  # seconds a "not archived" answer is given again without asking the store


def socket_path_for(directory: Path) -> Path:
    """Where the service of `directory` listens: inside it when the path is short enough."""
    inside = directory / "wal.sock"
    if len(str(inside)) <= _MAX_SOCKET_PATH:
        return inside
    return Path("/tmp") / f"pgherd-wal-{hashlib.sha256(str(directory).encode()).hexdigest()[:16]}.sock"


class _Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True
    store: Store
    data_root: Path
    failure_file: str | None  # wal-push's note of its last failure, removed after a success
    promoting: Callable[[], bool]  # the agent promotes its PostgreSQL: every answer is the store's
    miss_ttl: float
    misses: dict[str, float]  # archive key -> until when it is answered "not archived" unasked
    misses_lock: threading.Lock

    def missed(self, key: str) -> bool:
        with self.misses_lock:
            return self.misses.get(key, 0.0) > time.monotonic()

    def remember_miss(self, key: str) -> None:
        now = time.monotonic()
        with self.misses_lock:
            if len(self.misses) > 1024:
                self.misses = {k: until for k, until in self.misses.items() if until > now}
            self.misses[key] = now + self.miss_ttl


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def do_GET(self) -> None:
        self._reply(self._answer())

    def do_POST(self) -> None:
        self._reply(self._archive())

    def _reply(self, status: int) -> None:
        self.send_response(status)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _target(self, verb: str) -> tuple[str, Path] | None:
        """(WAL file name, data directory) of `/<verb>/<name>?pgdata=<dir>`, when well formed and the
        directory is one of those this service was started for."""
        url = urllib.parse.urlsplit(self.path)
        parts = url.path.strip("/").split("/")
        pgdata_text = urllib.parse.parse_qs(url.query).get("pgdata", [""])[0]
        if len(parts) != 2 or parts[0] != verb or not is_wal_name(parts[1]) or not pgdata_text:
            return None
        pgdata = Path(pgdata_text).resolve()
        if not pgdata.is_relative_to(self.server.data_root):
            return None
        return parts[1], pgdata

    def _answer(self) -> int:
        target = self._target("wal")
        if target is None:
            return 400
        name, pgdata = target
        try:
            key = Layout(self.server.store.location, read_system_id(pgdata)).wal_key(name)
            # A standby asks again; a recovery does not, nor a standby being promoted: the end of its
            # recovery reads what the archive holds, and a stale "not archived" would end it short.
            standby = (pgdata / "standby.signal").exists() and not self.server.promoting()
            if standby and self.server.missed(key):
                return 404
            if standby and not name.endswith(".history") and self._switching_timeline(pgdata):
                return 404
            found = self.server.store.exists(key)
        except (BackupError, OSError, ValueError):
            return 503  # no answer: the caller asks wal-fetch, which reports the problem properly
        if not found and standby and not name.endswith(".history"):
            self.server.remember_miss(key)
        return 200 if found else 404

    def _switching_timeline(self, pgdata: Path) -> bool:
        """Whether a history file landed in pg_wal less than miss_ttl ago: the WAL receiver stores the
        new timeline's when its upstream was promoted, and the standby then asks for the segment it
        reads on both timelines before it streams again, from an upstream that has them."""
        horizon = time.time() - self.server.miss_ttl
        with os.scandir(pgdata / "pg_wal") as entries:
            return any(e.name.endswith(".history") and e.stat().st_mtime > horizon for e in entries)

    def _archive(self) -> int:
        """archive_command's push of pg_wal/<name>, as wal-push does it (the same object, the same
        refusal to overwrite different content); 200 once it is stored. Any other answer and the
        caller runs wal-push, which reports the problem properly."""
        target = self._target("archive")
        if target is None:
            return 400
        name, pgdata = target
        if not (pgdata / "pg_wal" / "archive_status" / f"{name}.ready").exists():
            return 409  # only what PostgreSQL hands to archive_command: never a segment still written
        try:
            push(self.server.store, pgdata / "pg_wal" / name, system_id=read_system_id(pgdata))
        except (BackupError, OSError, ValueError):
            return 503
        note_archive_outcome(self.server.failure_file, None)
        return 200

    def log_message(self, format: str, *args: Any) -> None:
        pass  # one request per restore_command call: nothing worth a log line


class WalService:
    """The service for the data directories under `data_root`, reading the archive of `store`."""

    def __init__(
        self,
        store: Store,
        socket_path: Path,
        data_root: Path,
        miss_ttl: float = MISS_TTL,
        failure_file: Path | None = None,
        promoting: Callable[[], bool] = lambda: False,
    ) -> None:
        self.socket_path = socket_path
        self._promoting = promoting
        self._server: _Server | None = None
        self.store = store
        self._failure_file = failure_file
        self._data_root = data_root.resolve()
        self._miss_ttl = miss_ttl

    def start(self) -> WalService:
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()  # left by a process that was killed
        server = _Server(str(self.socket_path), _Handler)
        server.store = self.store
        server.failure_file = str(self._failure_file) if self._failure_file else None
        server.promoting = self._promoting
        server.data_root = self._data_root
        server.miss_ttl, server.misses, server.misses_lock = self._miss_ttl, {}, threading.Lock()
        os.chmod(self.socket_path, 0o666)  # restore_command runs as the PostgreSQL account
        self._server = server
        # stop() waits for the loop to look: every 50 ms rather than socketserver's 0.5 s, on each agent stop
        threading.Thread(target=server.serve_forever, args=(0.05,), name="wal-service", daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()
