"""The secrets the agent reads from files (Kubernetes mounts Secrets as files): the operator's token
and PostgreSQL passwords. Each is read where it is needed and never written anywhere else; `redact`
removes all of them from any text that leaves the agent (logs, errors), as a second line of defence.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
from pathlib import Path

from pgherd_backup.errors import UsageError

REDACTED = "***"


class SecretFile:
    """A secret read from a file, read again when the file changes (a rotated Kubernetes Secret)."""

    def __init__(self, path: Path, what: str) -> None:
        self.path = path
        self.what = what
        self._stamp: tuple[int, int] | None = None
        self._value = ""
        self._lock = threading.Lock()
        self.value()  # fail at start, not at the first request

    def value(self) -> str:
        try:
            stat = self.path.stat()
            stamp = (stat.st_mtime_ns, stat.st_size)
            with self._lock:
                if stamp != self._stamp:
                    text = self.path.read_text().strip()
                    if not text:
                        raise UsageError(f"the {self.what} file {self.path} is empty")
                    self._value, self._stamp = text, stamp
                return self._value
        except OSError as exc:
            if self._value:
                return self._value  # keep the last good value while a Secret is being swapped
            raise UsageError(
                f"cannot read the {self.what} file {self.path} ({exc.strerror}): mount the Secret or "
                "create it with `pgherd instance certs`"
            ) from None


class Credentials:
    """All secrets of one agent. Passwords may be absent (local trust authentication)."""

    def __init__(
        self,
        token: SecretFile,
        superuser_password: SecretFile | None = None,
        replication_password: SecretFile | None = None,
        app_password: SecretFile | None = None,
    ) -> None:
        self.token = token
        self.superuser_password = superuser_password
        self.replication_password = replication_password or superuser_password
        self.app_password = app_password
        # S3 credentials reach the agent as variables (for archive_command): redacted all the same
        self.environment_secrets = [
            os.environ[name]
            for name in ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")
            if os.environ.get(name)
        ]

    def all_values(self) -> list[str]:
        found = list(self.environment_secrets)
        for secret in (self.token, self.superuser_password, self.replication_password, self.app_password):
            if secret is not None:
                try:
                    found.append(secret.value())
                except UsageError:
                    continue
        return [value for value in found if value]

    def redact(self, text: str) -> str:
        for value in sorted(self.all_values(), key=len, reverse=True):
            text = text.replace(value, REDACTED)
        return text


class RedactingFilter(logging.Filter):
    """A logging filter that removes every secret from a record's final message and its traceback."""

    def __init__(self, credentials: Credentials) -> None:
        super().__init__()
        self.credentials = credentials

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        cleaned = self.credentials.redact(message)
        if cleaned != message:
            record.msg, record.args = cleaned, None
        if record.exc_info and not record.exc_text:
            # Formatted here, once: every formatter then shows this text (logging caches it).
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = self.credentials.redact(record.exc_text)
        return True


def ensure_secret(path: Path, *, nbytes: int = 32) -> bool:
    """Create `path` (0600) with a new random secret unless it exists; True when it was created."""
    if path.exists():
        return False
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(secrets.token_urlsafe(nbytes) + "\n")
    return True
