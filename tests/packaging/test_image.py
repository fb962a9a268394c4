"""The image, built from the Dockerfile without Docker and without a registry (scripts/build-image.sh:
podman on a `debootstrap --variant=minbase bookworm` base), and what it carries.

The first tests read the Dockerfile: it must stay buildable by Debian 12's podman (buildah 1.28) as well
as by `docker build`, and carry the PostgreSQL major the examples ask for. The others build the image
(about 90 s the first time, seconds with the script's cache) and run it: under podman with the
restricted pod's settings (user 999, read-only root, no capability), and through containerd's own
import of the archive, in a throwaway containerd. They need root on Linux (debootstrap, rootful
podman, containerd); PGHERD_IMAGE_TESTS=0 skips them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "Dockerfile"
SCRIPT = REPO / "scripts" / "build-image.sh"
# The majors Debian bookworm packages itself (postgresql-15); the others come from the wheel pins.
DEBIAN_MAJORS = {15}
POSTGRES_UID = 999

pytestmark = pytest.mark.slow


def _instructions() -> list[tuple[str, str]]:
    instructions: list[tuple[str, str]] = []
    lines = iter(DOCKERFILE.read_text().splitlines())
    for line in lines:
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        while line.endswith("\\"):
            line = line[:-1] + " " + next(lines).strip()
        keyword, _, arguments = line.strip().partition(" ")
        instructions.append((keyword.upper(), arguments.strip()))
    return instructions


def _wheel_pins() -> dict[int, str]:
    [pins] = [a for k, a in _instructions() if k == "ARG" and a.startswith("PG_WHEEL_VERSIONS=")]
    return {
        int(major): version
        for major, version in (p.split("=") for p in pins.split("=", 1)[1].strip('"').split())
    }


def _examples_majors() -> set[int]:
    majors = set()
    for example in sorted((REPO / "examples").glob("*.yaml")):
        for document in yaml.safe_load_all(example.read_text()):
            if document and document.get("kind") == "PostgresCluster":
                majors.add(int(document["spec"].get("postgresVersion", 16)))
    return majors


def test_the_base_is_an_argument_whose_default_is_the_official_image() -> None:
    instructions = _instructions()
    froms = [a for k, a in instructions if k == "FROM"]
    assert froms == ["${BASE_IMAGE}"]
    assert ("ARG", "BASE_IMAGE=postgres:${PG_MAJOR}-bookworm") in instructions[
        : instructions.index(("FROM", froms[0]))
    ]


def test_no_here_document() -> None:
    """Debian 12's podman 4.3 (buildah 1.28) reads no here-document: `COPY <<EOF` fails there."""
    assert not [a for k, a in _instructions() if re.search(r"<<-?['\"]?\w", a)]


def test_each_wheel_pin_is_of_its_major() -> None:
    pins = _wheel_pins()
    assert pins
    for major, version in pins.items():
        assert version.split(".")[0] == str(major), (major, version)


def test_the_examples_major_is_carried_and_is_the_script_default() -> None:
    majors = _examples_majors()
    assert majors, "no PostgresCluster in examples/"
    assert majors <= DEBIAN_MAJORS | set(_wheel_pins()), f"no PostgreSQL for {majors} on a Debian base"
    default = re.search(r"^pg_major=(\d+)$", SCRIPT.read_text(), re.MULTILINE)
    assert default and {int(default[1])} == majors, "build-image.sh builds the examples' major by default"


def test_the_script_parses() -> None:
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


# --- the built image -------------------------------------------------------------------------------


def _can_build() -> str | None:
    if os.environ.get("PGHERD_IMAGE_TESTS") == "0":
        return "PGHERD_IMAGE_TESTS=0"
    if os.uname().sysname != "Linux" or os.geteuid() != 0:
        return "needs root on Linux (debootstrap, rootful podman, containerd)"
    if not (shutil.which("podman") and shutil.which("debootstrap")) and not shutil.which("apt-get"):
        return "neither podman and debootstrap nor apt-get to install them"
    return None


@dataclass(frozen=True)
class Built:
    names: list[str]
    archive: Path


@pytest.fixture(scope="module")
def built() -> Built:
    reason = _can_build()
    if reason:
        pytest.skip(reason)
    done = subprocess.run([str(SCRIPT)], capture_output=True, text=True, timeout=540, check=False)
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines() if " " in line)
    return Built(lines["image"].split(), Path(lines["archive"]))


def _run(image: str, *argv: str) -> subprocess.CompletedProcess[str]:
    """podman run with a restricted pod's settings. The ulimits: a host without CAP_SYS_RESOURCE cannot
    raise its limits, and podman's defaults are higher than this machine's."""
    return subprocess.run(
        ["podman", "run", "--rm", "--network", "none", "--read-only", "--tmpfs", "/tmp",
         "--cap-drop", "ALL", "--security-opt", "no-new-privileges",
         "--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024", image, *argv],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


def test_both_names_and_the_archive(built: Built) -> None:
    assert len(built.names) == 2 and built.names[1] == built.names[0] + "-pg16"
    assert built.archive.is_file() and not built.archive.is_relative_to(REPO)


def test_the_commands_run(built: Built) -> None:
    for argv, expected in (
        (["--help"], "usage: pgherd "),
        (["pgherd-backup", "--help"], "usage: pgherd-backup"),
    ):
        done = _run(built.names[1], *argv)
        assert done.returncode == 0 and expected in done.stdout, done


def test_postgres_runs_as_the_postgres_account_on_a_read_only_root(built: Built) -> None:
    script = r"""
set -e
id -u; id -g
for program in postgres initdb pg_ctl pg_basebackup pg_rewind; do command -v "$program"; done
postgres --version
python3 -c 'from pgherd_backup.postgres.binaries import PgBinaries; print(PgBinaries.find().bindir)'
d=$(mktemp -d)
initdb -D "$d/data" -U postgres -A trust --locale=C -E UTF8 >/dev/null
pg_ctl -D "$d/data" -o "-k $d -c listen_addresses=" -l "$d/log" start -w >/dev/null
psql -h "$d" -U postgres -Atc 'select current_user'
pg_ctl -D "$d/data" stop -w >/dev/null
"""
    done = _run(built.names[1], "sh", "-c", script)
    assert done.returncode == 0, done
    lines = done.stdout.split()
    assert lines[:2] == [str(POSTGRES_UID), str(POSTGRES_UID)]
    bindir = "/usr/lib/postgresql/16/bin"
    assert lines[2:7] == [
        f"{bindir}/{p}" for p in ("postgres", "initdb", "pg_ctl", "pg_basebackup", "pg_rewind")
    ]
    assert "(PostgreSQL) 16." in done.stdout
    assert lines[-2:] == [bindir, "postgres"]


def test_the_build_secret_stays_out_of_the_image(built: Built) -> None:
    """pip's CA bundle is a build secret: in no layer, in no variable of the image's configuration."""
    inspected = subprocess.run(
        ["podman", "image", "inspect", built.names[1]], capture_output=True, text=True, check=True
    )
    [config] = json.loads(inspected.stdout)
    assert config["Config"]["User"] == f"{POSTGRES_UID}:{POSTGRES_UID}"
    assert not [e for e in config["Config"].get("Env", []) if e.startswith("PIP_")]
    bundle = Path("/etc/ssl/certs/ca-certificates.crt")
    if not bundle.is_file():
        return
    secret = bundle.read_bytes()
    root = subprocess.run(
        ["podman", "image", "mount", built.names[1]], capture_output=True, text=True, check=True
    )
    try:
        same = [
            path
            for path in Path(root.stdout.strip()).rglob("*")
            if path.is_file() and not path.is_symlink() and path.stat().st_size == len(secret)
            and path.read_bytes() == secret
        ]  # fmt: skip
    finally:
        subprocess.run(["podman", "image", "unmount", built.names[1]], capture_output=True, check=False)
    assert not same


@pytest.fixture
def containerd() -> Iterator[str]:
    """A throwaway containerd (Debian's), its root, state and socket in a temporary folder."""
    if not shutil.which("containerd") or not shutil.which("ctr"):
        pytest.skip("containerd is not installed")
    folder = Path(tempfile.mkdtemp(prefix="pgherd-ctr-", dir="/tmp"))
    socket = folder / "containerd.sock"
    (folder / "config.toml").write_text(
        f"""version = 2
root = "{folder}/root"
state = "{folder}/state"
disabled_plugins = ["io.containerd.grpc.v1.cri", "io.containerd.internal.v1.opt"]
[grpc]
  address = "{socket}"
[ttrpc]
  address = "{socket}.ttrpc"
[debug]
  address = "{folder}/debug.sock"
"""
    )
    with open(folder / "containerd.log", "wb") as log:
        process = subprocess.Popen(
            ["containerd", "--config", str(folder / "config.toml")],
            stdout=log,
            stderr=log,
            stdin=subprocess.DEVNULL,
        )
    try:
        deadline = time.monotonic() + 30
        while subprocess.run(["ctr", "--address", str(socket), "version"], capture_output=True).returncode:
            assert process.poll() is None and time.monotonic() < deadline, (
                folder / "containerd.log"
            ).read_text()
            time.sleep(0.2)
        yield str(socket)
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        subprocess.run(["umount", "-R", str(folder / "root")], capture_output=True, check=False)
        shutil.rmtree(folder, ignore_errors=True)


def test_containerd_imports_the_archive_under_both_names(built: Built, containerd: str) -> None:
    ctr = ["ctr", "--address", containerd, "-n", "k8s.io"]
    subprocess.run(
        [*ctr, "images", "import", str(built.archive)], capture_output=True, check=True, timeout=300
    )
    listed = subprocess.run([*ctr, "images", "check"], capture_output=True, text=True, check=True).stdout
    for name in built.names:
        [line] = [line for line in listed.splitlines() if line.split()[0] == name]
        assert "complete" in line and line.split()[-1] == "true", line  # every blob there, unpacked
