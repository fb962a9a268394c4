"""The sandbox runs every member on its own agent: the removed inline mode is refused, with what to do,
before anything is created (`sandbox up --members inline`, PGHERD_SANDBOX_MEMBERS=inline, or a sandbox
directory made by an older pgherd)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pgherd.local.layout import SandboxPaths
from pgherd.local.objects import ObjectStore
from pgherd.local.platform import LocalPlatform
from pgherd.local.sandbox import Sandbox, SandboxError
from pgherd.local.state import S3Endpoint, SandboxState

PGHERD = str(Path(sys.executable).parent / "pgherd")
MANIFEST = {"apiVersion": "pgherd.io/v1alpha1", "kind": "PostgresCluster", "metadata": {"name": "m"}}


def test_up_refuses_the_inline_mode_before_creating_anything(tmp_path: Path) -> None:
    with pytest.raises(SandboxError, match="inline mode was removed"):
        Sandbox(tmp_path / "s").up(MANIFEST, members="inline")
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize("how", ["flag", "environment"])
def test_the_cli_says_what_to_do(tmp_path: Path, how: str) -> None:
    manifest = tmp_path / "c.yaml"
    manifest.write_text("apiVersion: pgherd.io/v1alpha1\nkind: PostgresCluster\nmetadata: {name: m}\n")
    command = [PGHERD, "sandbox", "up", "-f", str(manifest), "--dir", str(tmp_path / "s")]
    env = {"PATH": "/usr/bin:/bin"}
    if how == "flag":
        command += ["--members", "inline"]
    else:
        env["PGHERD_SANDBOX_MEMBERS"] = "inline"
    result = subprocess.run(command, capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode == 1
    assert "inline mode was removed" in result.stderr and "Drop --members" in result.stderr
    assert not (tmp_path / "s").exists()


def test_a_sandbox_made_with_inline_members_is_refused_with_what_to_do(tmp_path: Path) -> None:
    paths = SandboxPaths(tmp_path)
    state = SandboxState(
        cluster="m",
        base_port=20000,
        store_url="s3://b/p",
        s3=S3Endpoint("http://127.0.0.1:1", "a", "s"),
        superuser_password="x",
        app_user="app",
        app_database="app",
        app_password="y",
        members="inline",
    )
    state.save(paths)
    with pytest.raises(RuntimeError, match="sandbox down"):
        LocalPlatform(paths, SandboxState.load(paths), ObjectStore(paths))
