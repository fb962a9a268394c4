"""The agent's own HTTPS certificate renewed under a running agent: the kubelet replaces a renewed
Secret's files in place, and the agent serves the new certificate to every new connection within its
check period (10 s), without a restart."""

from __future__ import annotations

import socket
import subprocess
from pathlib import Path

from agent_helpers import MEMBERS, PGHERD, Agent, Certs, make_certs
from cryptography import x509

from pgherd_backup.agent.tls import client_context


def served_serial(port: int, ca: Path) -> int:
    """The serial of the certificate a new TLS connection to the agent sees, verified against `ca`."""
    with (
        socket.create_connection(("127.0.0.1", port), timeout=5) as raw,
        client_context(ca).wrap_socket(raw, server_hostname="localhost") as conn,
    ):
        der = conn.getpeercert(binary_form=True)
    assert der is not None
    return x509.load_der_x509_certificate(der).serial_number


def test_a_renewed_certificate_is_served_to_new_connections_without_a_restart(tmp_path: Path) -> None:
    certs: Certs = make_certs(tmp_path / "certs")  # its own CA and files: other tests keep theirs
    agent = Agent(MEMBERS[0], tmp_path / "volume", certs)  # waits for a seed: no PostgreSQL needed
    try:
        agent.start()
        assert agent.process is not None
        pid = agent.process.pid
        before = served_serial(agent.port, certs.ca)

        # The renewal: a new certificate for the member, signed by the same CA, in place of the old one.
        subprocess.run(
            [
                PGHERD,
                "instance",
                "certs",
                "--cluster",
                "agents",
                "--out",
                str(certs.folder),
                "--member",
                agent.name,
            ],
            check=True,
            capture_output=True,
            timeout=60,
        )
        cert_file, _ = certs.cert(agent.name)
        renewed = x509.load_pem_x509_certificate(cert_file.read_bytes()).serial_number
        assert renewed != before
        agent.wait_until(
            lambda: served_serial(agent.port, certs.ca) == renewed, "the renewed certificate", 30
        )
        assert agent.process.poll() is None and agent.process.pid == pid  # the same process serves it
        assert "serving the renewed certificate" in agent.log
        assert agent.client.probe("healthz") == 200
    finally:
        agent.cleanup()


def test_a_broken_renewal_keeps_the_certificate_served(tmp_path: Path) -> None:
    """A key that does not match its certificate (never written by pgherd; a hand-edited Secret) is
    refused and logged; the certificate in use stays."""
    certs = make_certs(tmp_path / "certs")
    agent = Agent(MEMBERS[1], tmp_path / "volume", certs)
    try:
        agent.start()
        before = served_serial(agent.port, certs.ca)
        _, other_key = certs.cert(MEMBERS[2])
        subprocess.run(
            [
                PGHERD,
                "instance",
                "certs",
                "--cluster",
                "agents",
                "--out",
                str(certs.folder),
                "--member",
                agent.name,
            ],
            check=True,
            capture_output=True,
            timeout=60,
        )
        certs.cert(agent.name)[1].write_bytes(other_key.read_bytes())  # a key of another certificate
        agent.wait_until(lambda: "cannot load the renewed certificate" in agent.log, "the refusal logged", 30)
        assert served_serial(agent.port, certs.ca) == before
        assert agent.client.probe("healthz") == 200
    finally:
        agent.cleanup()
