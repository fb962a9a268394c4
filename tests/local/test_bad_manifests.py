"""Bad input never gets a traceback: every command that reads a manifest (`pgherd validate -f`, its
`--old`, `pgherd sandbox up -f`, `pgherd sandbox apply -f`) answers a file it cannot use with one line on
stderr naming the file and the problem, and a non-zero exit, and changes nothing.

The rule for documents: `validate -f` and `sandbox apply -f` take any number of YAML documents (separated
by `---`), every one read and checked before any is used; `sandbox up -f` and `validate --old` take
exactly one. A document is one object (a mapping) of a pgherd kind; a YAML list is refused, `kind: List`
included (one object per document instead).
"""

from __future__ import annotations

import subprocess
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path

import pytest

from pgherd.cli import main
from pgherd.local.layout import SandboxPaths
from pgherd.local.objects import ObjectStore
from pgherd.local.state import S3Endpoint, SandboxState

CLUSTER = """\
apiVersion: pgherd.io/v1alpha1
kind: PostgresCluster
metadata:
  name: hippo
spec:
  instances: 1
"""
BACKUP = """\
apiVersion: pgherd.io/v1alpha1
kind: Backup
metadata:
  name: nightly
spec:
  cluster:
    name: hippo
"""

# Each bad file: what it holds (None: the file does not exist; b"": bytes as they are; "<dir>": a
# directory), for every command.
BAD: dict[str, str | bytes | None] = {
    "unterminated-quote": 'apiVersion: pgherd.io/v1alpha1\nkind: PostgresCluster\nmetadata:\n  name: "hippo\n',
    "bad-indentation": "kind: PostgresCluster\nmetadata:\n  name: hippo\n spec: {}\n",
    "unclosed-flow": "kind: [PostgresCluster\nmetadata: {name: hippo}\n",
    "empty": "",
    "only-comments": "# nothing here\n---\n",
    "missing": None,
    "a-directory": "<dir>",
    "not-utf8": b"kind: Postgres\xff\xfeCluster\n",
    "yaml-list": "- " + CLUSTER.replace("\n", "\n  ").rstrip() + "\n",
    "kubernetes-list": "apiVersion: v1\nkind: List\nitems:\n- " + BACKUP.replace("\n", "\n  ").rstrip(),
    "a-string": "just a string\n",
    "a-number": "42\n",
    "second-document-a-list": BACKUP + "---\n- a\n- b\n",
    "unknown-kind": CLUSTER.replace("PostgresCluster", "PostgresDatabase"),
    "no-kind": CLUSTER.replace("kind: PostgresCluster\n", ""),
    "kind-not-a-string": CLUSTER.replace("kind: PostgresCluster", "kind: {name: PostgresCluster}"),
}
# Files only some commands refuse: they take exactly one document (of one kind).
ONE_DOCUMENT: dict[str, str] = {
    "two-clusters": CLUSTER + "---\n" + CLUSTER.replace("hippo", "rhino"),
}
NOT_A_CLUSTER: dict[str, str] = {"a-backup": BACKUP}


@dataclass(frozen=True)
class Command:
    name: str
    extra: tuple[str, ...] = ()  # the bad files only this command refuses


COMMANDS = (
    Command("validate"),
    Command("validate --old", tuple(ONE_DOCUMENT)),
    Command("sandbox up", tuple(ONE_DOCUMENT) + tuple(NOT_A_CLUSTER)),
    Command("sandbox apply"),
)
CASES = [
    pytest.param(command.name, case, id=f"{command.name.replace(' ', '-')}:{case}")
    for command in COMMANDS
    for case in (*BAD, *command.extra)
]


def write_case(folder: Path, case: str) -> Path:
    path = folder / f"{case}.yaml"
    content = {**BAD, **ONE_DOCUMENT, **NOT_A_CLUSTER}[case]
    if content is None:
        return path
    if content == "<dir>":
        path.mkdir()
    elif isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    return path


def sandbox_without_members(root: Path) -> Path:
    """A sandbox's files as `sandbox up` leaves them (state, the PostgresCluster), with nothing running:
    enough for `sandbox apply`, which must refuse a bad file before it looks at the sandbox."""
    paths = SandboxPaths(root)
    SandboxState(
        cluster="hippo",
        base_port=15432,
        store_url="s3://pgherd/sandbox",
        s3=S3Endpoint(endpoint="http://127.0.0.1:1", access_key="k", secret_key="s"),
        superuser_password="pw",
        app_user="app",
        app_database="app",
        app_password="app-pw",
        agent_base_port=18008,
    ).save(paths)
    ObjectStore(paths).apply(
        {
            "apiVersion": "pgherd.io/v1alpha1",
            "kind": "PostgresCluster",
            "metadata": {"name": "hippo"},
            "spec": {"instances": 1},
        }
    )
    return root


def tree(root: Path) -> dict[str, bytes | None]:
    """Every file and directory under root, with the files' bytes."""
    if not root.exists():
        return {}
    return {
        str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))
    }


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """`pgherd ARGV` in this process; an exception escaping main() is printed as the console script would
    print it (a traceback), so that the assertions below see it."""
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except Exception:
        traceback.print_exc()
        code = 1
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(("command", "case"), CASES)
def test_a_bad_manifest_gets_one_line_naming_the_file_and_changes_nothing(
    command: str, case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = write_case(tmp_path, case)
    good = tmp_path / "good.yaml"
    good.write_text(CLUSTER)
    sandbox = tmp_path / "sandbox"
    if command == "sandbox apply":
        sandbox_without_members(sandbox)
    before = tree(sandbox)
    argv = {
        "validate": ["validate", "-f", str(bad)],
        "validate --old": ["validate", "--old", str(bad), "-f", str(good)],
        "sandbox up": ["sandbox", "up", "--dir", str(sandbox), "-f", str(bad), "--timeout", "5"],
        "sandbox apply": ["sandbox", "apply", "--dir", str(sandbox), "-f", str(bad)],
    }[command]

    code, out, err = run_cli(argv, capsys)

    assert "Traceback" not in out + err, err
    lines = [line for line in (out + err).splitlines() if line.strip()]
    assert len(lines) == 1, out + err
    assert lines[0] in err.splitlines(), "the error goes to stderr"
    assert str(bad) in lines[0], lines[0]
    assert code != 0
    assert tree(sandbox) == before  # for `sandbox up`: no sandbox directory at all
    if command == "sandbox up":
        assert not sandbox.exists()


def test_the_console_script_answers_malformed_yaml_with_one_line(tmp_path: Path) -> None:
    """The same through the installed `pgherd` command (one case: the in-process test covers the rest)."""
    bad = write_case(tmp_path, "unterminated-quote")
    sandbox = tmp_path / "sandbox"
    pgherd = str(Path(sys.executable).parent / "pgherd")
    for argv in (["sandbox", "up", "--dir", str(sandbox)], ["sandbox", "apply", "--dir", str(sandbox)]):
        result = subprocess.run(
            [pgherd, *argv, "-f", str(bad)], capture_output=True, text=True, timeout=60, check=False
        )
        assert result.returncode != 0
        assert "Traceback" not in result.stderr, result.stderr
        assert result.stdout == ""
        (line,) = result.stderr.splitlines()
        assert str(bad) in line and "YAML" in line, line
        assert not sandbox.exists()


def test_a_reader_that_goes_away_gets_no_traceback() -> None:
    """`pgherd crds | head -1` (or `sandbox status --json | grep -q`): the pipe closes early."""
    pgherd = str(Path(sys.executable).parent / "pgherd")
    command = f"'{pgherd}' crds | true"  # the reader is gone before the first write
    result = subprocess.run(
        ["bash", "-o", "pipefail", "-c", command], capture_output=True, text=True, timeout=60
    )
    assert "Traceback" not in result.stderr and "BrokenPipe" not in result.stderr, result.stderr


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (("instances: 1", "instances: 40"), "spec.instances"),
        (("  instances: 1\n", "  backup: a-string\n"), "spec.backup"),
        (("  instances: 1\n", "  backup: {store: {s3: [a]}}\n"), "spec.backup.store.s3"),
        (("spec:\n  instances: 1\n", "spec: [1]\n"), "spec"),
    ],
    ids=["out-of-range", "backup-a-string", "s3-a-list", "spec-a-list"],
)
def test_a_cluster_refused_at_admission_leaves_no_sandbox_directory(
    change: tuple[str, str], field: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Refused by the schema (a field out of range, or not an object where one is wanted): `sandbox up`
    says which field, names the file, and writes nothing, not even its directory."""
    bad = tmp_path / "hippo.yaml"
    bad.write_text(CLUSTER.replace(*change))
    assert bad.read_text() != CLUSTER
    sandbox = tmp_path / "sandbox"
    code, out, err = run_cli(["sandbox", "up", "--dir", str(sandbox), "-f", str(bad)], capsys)
    assert out == ""
    assert code != 0 and "Traceback" not in err, err
    assert str(bad) in err.splitlines()[0] and f"{field}:" in err, err
    assert not sandbox.exists()


def test_the_reader_knows_every_kind_of_the_api() -> None:
    from pgherd.api.crdgen import KINDS as API_KINDS
    from pgherd.commands.manifests import KINDS

    assert set(KINDS) == {info.kind for info in API_KINDS}
