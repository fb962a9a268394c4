"""Expected failures: each carries one message a person can act on (what failed, on which object,
what to do next). The CLI prints the message and exits non-zero, without a traceback."""

from __future__ import annotations


class BackupError(Exception):
    """An expected failure of a backup, restore, archive or seeding step."""

    exit_code: int = 1

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class StoreError(BackupError):
    """The object store refused or could not serve a request."""


class ObjectMissing(StoreError):
    """A key that should exist in the object store does not."""

    def __init__(self, message: str, key: str) -> None:
        super().__init__(message)
        self.key = key


class IntegrityError(BackupError):
    """Stored bytes do not match their recorded size or checksum."""


class PostgresError(BackupError):
    """A PostgreSQL program failed (initdb, pg_ctl, pg_basebackup, pg_rewind...)."""


class UsageError(BackupError):
    """The request itself is wrong (bad argument, non-empty target directory...)."""

    exit_code = 2
