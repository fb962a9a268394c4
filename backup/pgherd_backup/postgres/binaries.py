"""Find the PostgreSQL programs: $PG_BIN, else the newest /usr/lib/postgresql/<major>/bin, else PATH.

A member may hold programs of several majors (an image made for major upgrades carries the old major's
and the new one's): `PgBinaries.for_major` finds one major's, `data_major` tells which major a data
directory is (its PG_VERSION), so that each data directory is run by its own major's programs.
"""

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

    @classmethod
    def for_major(cls, major: int) -> PgBinaries:
        """The programs of PostgreSQL `major`: $PG_BIN_<major>, else $PG_BIN when it is that major, else
        /usr/lib/postgresql/<major>/bin, else the newest `<major>.*/bin` under $PGHERD_POSTGRES_CACHE, else
        the default programs (`find`) when they are that major."""
        candidates = [
            os.environ.get(f"PG_BIN_{major}"),
            os.environ.get("PG_BIN"),
            f"/usr/lib/postgresql/{major}/bin",
        ]
        cache = os.environ.get("PGHERD_POSTGRES_CACHE")
        if cache:
            # A cache of unpacked builds named by version (the sandbox's fetched wheels: 16.15.0/bin).
            found = sorted(glob.glob(os.path.join(cache, f"{major}.*", "bin")), key=_version_key)
            candidates += reversed(found)
        for candidate in candidates:
            if candidate and Path(candidate, "pg_ctl").exists() and _major_of(candidate) == major:
                return PgBinaries(Path(candidate))
        try:
            default = cls.find()
        except PostgresError:
            default = None
        if default is not None and _major_of(str(default.bindir)) == major:
            return default
        raise PostgresError(
            f"PostgreSQL {major}'s programs are not here (no PG_BIN_{major}, no /usr/lib/postgresql/{major}/bin):"
            f" a member upgraded to or from PostgreSQL {major} needs them beside the other major's (an image"
            " that carries both majors, docs/upgrades.md)"
        )

    @property
    def libdir(self) -> Path | None:
        """A relocatable build's own libraries (its libpq, which the server's WAL receiver loads as a
        module whose search path names the build machine's folder); None for a system package's."""
        candidate = self.bindir.parent / "lib"
        return candidate if (candidate / "libpq.so.5").exists() else None

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


def _version_key(path: str) -> tuple[int, ...]:
    name = Path(path).parent.name
    return tuple(int(part) if part.isdigit() else 0 for part in name.split("."))


def data_major(pgdata: str | os.PathLike[str]) -> int | None:
    """The major version a data directory belongs to (its PG_VERSION); None when it holds none."""
    try:
        text = Path(pgdata, "PG_VERSION").read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


@cache
def _major_of(bindir: str) -> int | None:
    try:
        return PgBinaries(Path(bindir)).major
    except PostgresError:
        return None


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
