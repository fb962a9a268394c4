"""Find the PostgreSQL programs: $PG_BIN, else the newest /usr/lib/postgresql/<major>/bin, else PATH."""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from pgherd_backup.errors import PostgresError


@dataclass(frozen=True)
class PgBinaries:
    bindir: Path

    @classmethod
    def find(cls, bindir: str | os.PathLike[str] | None = None) -> PgBinaries:
        return _find(str(bindir) if bindir else os.environ.get("PG_BIN") or None)

    def path(self, program: str) -> str:
        candidate = self.bindir / program
        if not candidate.exists():
            raise PostgresError(
                f"{program} not found in {self.bindir}: install the PostgreSQL server package"
            )
        return str(candidate)

    @property
    def initdb(self) -> str:
        return self.path("initdb")

    @property
    def pg_ctl(self) -> str:
        return self.path("pg_ctl")

    @property
    def postgres(self) -> str:
        return self.path("postgres")

    @property
    def pg_basebackup(self) -> str:
        return self.path("pg_basebackup")

    @property
    def pg_rewind(self) -> str:
        return self.path("pg_rewind")

    @property
    def pg_controldata(self) -> str:
        return self.path("pg_controldata")

    @property
    def pg_waldump(self) -> str:
        return self.path("pg_waldump")

    @property
    def psql(self) -> str:
        return self.path("psql")

    @property
    def pgbench(self) -> str:
        return self.path("pgbench")

    @property
    def major(self) -> int:
        return self.program_major("postgres")

    def program_major(self, program: str) -> int:
        """The major version of one of the programs (`<program> --version`)."""
        try:
            out = subprocess.run(
                [self.path(program), "--version"], capture_output=True, text=True, check=True, timeout=30
            ).stdout
        except (OSError, subprocess.SubprocessError) as exc:
            raise PostgresError(f"cannot run {program} --version ({exc})") from None
        match = re.search(r"(\d+)(?:\.\d+)?", out)
        if not match:
            raise PostgresError(f"cannot tell the PostgreSQL version from {out.strip()!r}")
        return int(match.group(1))


@cache
def _find(bindir: str | None) -> PgBinaries:
    if bindir:
        if not Path(bindir, "pg_ctl").exists():
            raise PostgresError(f"PG_BIN={bindir} holds no pg_ctl: point it at a PostgreSQL bin directory")
        return PgBinaries(Path(bindir))

    def major(path: str) -> float:
        try:
            return float(Path(path).parent.name)
        except ValueError:
            return 0.0

    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"), key=lambda p: major(str(Path(p).parent)))
    if found:
        return PgBinaries(Path(found[-1]).parent)
    on_path = shutil.which("pg_ctl")
    if on_path:
        return PgBinaries(Path(on_path).resolve().parent)
    raise PostgresError(
        "PostgreSQL server programs not found (no PG_BIN, /usr/lib/postgresql/*/bin or pg_ctl on PATH): "
        "run scripts/ensure-postgres.sh or set PG_BIN"
    )
